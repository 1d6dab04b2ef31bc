"""Where the GPU time of one fused NVFP4 MoE call goes, per engine: each stage alone and the whole call.

Per model, token count and engine: the GPU time of each bucket-static stage of the executor (sort,
permute or the two in one launch, GEMM1, activation, GEMM2, or the fused stages that replace some), each
captured alone in a CUDA graph, their
sum, the launches of one call, the whole call (the op's stage, which decode buckets of the sm90 engine fold into
the sort + permute, those stages, the finalize) captured in one graph, and the GB/s
each GEMM streams (NVFP4 bytes of the touched experts / its time). A second table gives each stage's cost
inside the chain, where the launches overlap (programmatic dependent launch): the first i stages captured in
one graph, minus the first i - 1. A note per row names the whole call's graph nodes other than kernels and times the
whole call again after everything else. Every time is the median of CUDA-event-timed replays with L2 flushed before
each (common.py). Host time per call: bench_moe.py.
Usage: python benchmarks/bench_stages.py --help
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    FP4_BYTES_PER_WEIGHT,
    ModelShape,
    Report,
    Timer,
    call_inputs,
    capture,
    executor_for,
    fmt,
    gpu_missing,
    header_line,
    graph_nodes,
    make_parser,
    measure_engine,
    md_row,
    moe_call,
    prepare_engines,
    progress,
    random_weights,
    row_batch,
    run_models,
)

from cudnn_moe import Nvfp4MoeConfig, Nvfp4Weights  # noqa: E402
from cudnn_moe.pipeline.executor import MoeExecutor  # noqa: E402

# Every stage an engine chain may hold (executor.stages()), in order; a chain holds "sort+permute" (one
# launch, decode buckets of the sm90 engine), "sort" and "permute", or "sort" alone (the sm90 engine's wgmma buckets,
# whose GEMM1 gathers the rows the op's stage decoded); "gemm1" + "activation" or "gemm1+activation" (GEMM1
# with the activation in its epilogue; on wgmma buckets it also gathers its rows through the routing), "gemm2", or
# "gemm1+activation+gemm2" (the two launches of a tile handoff, which only run together).
STAGES = ("sort", "permute", "sort+permute", "gemm1", "gemm1+activation", "activation", "gemm2",
          "gemm1+activation+gemm2")


def stage_times(
    m: ModelShape, config: Nvfp4MoeConfig, weights: Nvfp4Weights,
    batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor], timer: Timer,
) -> tuple[list[float | int | None], list[tuple[str, float]], list[tuple[str, float, float, float | None]], str]:
    """(cells, in-chain costs, call chain, note). cells: GPU us of each of STAGES (captured alone, on the buffers the
    call staged; None where the chain lacks it), their sum, the launches of the whole call (the kernel nodes of its
    graph: the chain, the op's stage unless the chain's first launch does it, and the finish), its time, the GB/s
    each GEMM streams (NVFP4 bytes of the experts the batch touches / its time) and its TFLOP/s (the routed
    slots' multiply-adds, GEMM1 2I x H and GEMM2 H x I per slot, / its time; a fused GEMM1's time holds its
    epilogue). In-chain costs: in_chain of the stages; call chain: call_chain; note: the whole call's graph nodes
    other than kernels, and its time again after everything else."""
    call = moe_call(config, weights, *batch)
    graph = capture(call, keep_graph=True)
    whole = timer.median_us(graph.replay)
    executor = executor_for(m, config, weights)
    stages = executor.stages(executor.bucket(batch[0].shape[0]))
    unknown = [name for name, _ in stages if name not in STAGES]
    if unknown:
        raise RuntimeError(f"the executor's stages hold {unknown}; this script tabulates {STAGES}")
    times = {name: timer.median_us(capture(launch).replay) for name, launch in stages}
    chain = in_chain(stages, timer)
    touched = int(torch.unique(batch[1]).numel())
    gemm1_bytes = touched * 2 * m.intermediate * m.hidden * FP4_BYTES_PER_WEIGHT
    gemm_bytes = {"gemm1": gemm1_bytes, "gemm2": gemm1_bytes / 2}
    gemm2_flops = 2 * batch[0].shape[0] * m.top_k * m.hidden * m.intermediate
    gemm_flops = {"gemm1": 2 * gemm2_flops, "gemm2": gemm2_flops}
    # per GEMM column: the stage holding that GEMM, over the bytes and FLOPs of every GEMM that stage holds (both, for
    # the two in one stage)
    rates, tflops = [], []
    for gemm in gemm_bytes:
        name, t = next((name, t) for name, t in times.items() if gemm in name)
        held = [g for g in gemm_bytes if g in name]
        rates.append(sum(gemm_bytes[g] for g in held) / t / 1e3)  # bytes / us / 1e3 = GB/s
        tflops.append(sum(gemm_flops[g] for g in held) / t / 1e6)  # FLOP / us / 1e6 = TFLOP/s
    nodes = graph_nodes(graph)
    cells = [*(times.get(name) for name in STAGES), sum(times.values()), nodes["kernel"], whole, *rates, *tflops]
    calls = call_chain(config, weights, executor, batch, timer, gemm_bytes)
    # The whole call again, after every other graph of this row: a whole call that reads far above its launches'
    # sum (DeepSeek-V3 T=8 on the H100 and H200) either moves between these two medians or comes with the graph.
    again = timer.median_us(graph.replay)
    others = ", ".join(f"{count} {name}" for name, count in sorted(nodes.items()) if name != "kernel")
    note = (f"its graph holds {nodes['kernel']} kernel nodes and {others or 'no other node'}; the whole call "
            f"timed again after the stages: {fmt(again)} us (first {fmt(whole)})")
    return cells, chain, calls, note


def in_chain(stages: list, timer: Timer) -> list[tuple[str, float]]:
    """Each launch's cost inside ``stages``: the first i captured in one graph, minus the first i - 1 (the first's is
    its time alone in a graph)."""
    prefixes = [timer.median_us(capture(lambda n=n: [launch() for _, launch in stages[:n]]).replay)
                for n in range(1, len(stages) + 1)]
    return [(name, t - (prefixes[i - 1] if i else 0.0)) for i, ((name, _), t) in enumerate(zip(stages, prefixes))]


def call_chain(config: Nvfp4MoeConfig, weights: Nvfp4Weights, executor: MoeExecutor,
               batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor], timer: Timer,
               gemm_bytes: dict[str, float]) -> list[tuple[str, float, float, float | None]]:
    """Every launch of a call whose launches know its inputs and output (an eager call, one recorded into the caller's
    graph, a full-call graph; MoeExecutor.call_launches: the op's stage and the finalize folded into the chain where
    the engine does so, else launches of their own); each launch's time alone, its cost inside the call (in_chain), and
    for a launch holding a GEMM the GB/s that GEMM's weight bytes (``gemm_bytes``: "gemm1", "gemm2"; both for a launch
    holding both) stream over its time alone (else None)."""
    stages = executor.call_launches(executor.bucket(batch[0].shape[0]), call_inputs(config, weights, *batch))
    alone = [timer.median_us(capture(launch).replay) for _, launch in stages]
    rows = []
    for t, (name, added) in zip(alone, in_chain(stages, timer)):
        held = sum(gemm_bytes[g] for g in gemm_bytes if g in name)
        rows.append((name, t, added, held / t / 1e3 if held else None))  # bytes / us / 1e3 = GB/s
    return rows


def bench_model(args: argparse.Namespace, report: Report, m: ModelShape, gen: torch.Generator, timer: Timer,
                chains: list[str], calls: list[str]) -> None:
    """One row per token count and engine for model ``m``; the in-chain row of each goes to ``chains``, the call
    chain's to ``calls``."""
    progress(f"{m.name}: random BF16 weights, NVFP4 weights for {', '.join(args.engines)}")
    prepared = prepare_engines(m, *random_weights(m, gen), args.engines, max(args.tokens), report)
    for tokens in args.tokens:
        batch = row_batch(m, tokens)
        for engine in args.engines:
            result = measure_engine(
                report, args.skip_slow_cudnn, m, tokens, engine, prepared,
                lambda config, weights: stage_times(m, config, weights, batch, timer),  # noqa: B023
            )
            if isinstance(result, str):
                cells, chain, call = [result] * (len(STAGES) + 7), result, result
            else:
                cells = ["-" if t is None else str(t) if isinstance(t, int) else fmt(t) for t in result[0]]
                chain = ", ".join(f"{name} {fmt(t)}" for name, t in result[1])
                call = ", ".join(f"{name} {fmt(alone)} / {fmt(added)}" + ("" if rate is None else f" ({fmt(rate)} GB/s)")
                                 for name, alone, added, rate in result[2])
                report.note(f"{m.name} T={tokens} {engine}, the whole call: {result[3]}")
            report.emit(md_row([m.name, str(tokens), engine, *cells]))
            chains.append(md_row([m.name, str(tokens), engine, chain]))
            calls.append(md_row([m.name, str(tokens), engine, call]))


def main(argv: list[str] | None = None) -> int:
    args = make_parser(__doc__.splitlines()[0]).parse_args(argv)
    if gpu_missing("bench_stages"):
        return 2
    report = Report()
    report.emit(header_line())
    report.emit()
    report.emit(f"GPU us per stage, each captured alone in a CUDA graph, and of the whole call captured in one "
                f"graph; median of {args.iters} CUDA-event-timed replays, 256 MiB L2 flush before each. Where GEMM1 "
                f"and GEMM2 run as one stage (a tile handoff), both GEMM columns give that stage's rate over both "
                f"GEMMs' bytes and FLOPs.")
    report.emit()
    report.table(["model", "T", "engine", *STAGES, "sum of stages", "launches", "whole call", "GEMM1 GB/s",
                  "GEMM2 GB/s", "GEMM1 TFLOP/s", "GEMM2 TFLOP/s"], left=3)
    chains: list[str] = []
    calls: list[str] = []
    run_models(args, lambda m, gen, timer: bench_model(args, report, m, gen, timer, chains, calls), report)
    report.emit()
    report.emit("Each stage's cost inside the chain: the first i stages captured in one graph, minus the first i - 1 "
                "(us; the first stage's is its time alone in a graph)")
    report.emit()
    report.table(["model", "T", "engine", "stage: added us"], left=4)
    for row in chains:
        report.emit(row)
    report.emit()
    report.emit("Every launch of a call that knows its inputs and output (eager, recorded into a caller's graph, a "
                "full-call graph): the op's stage and the finalize folded into the chain where the engine does so, else "
                "launches of their own; each alone / its cost inside the call (us), and for a launch holding a GEMM "
                "the GB/s its NVFP4 weight bytes stream over its time alone")
    report.emit()
    report.table(["model", "T", "engine", "launch: alone / added us"], left=4)
    for row in calls:
        report.emit(row)
    report.write(args.markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
