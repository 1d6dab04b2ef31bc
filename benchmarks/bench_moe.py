"""Benchmark the fused NVFP4 MoE layer, per engine, against its roofline floor and a torch BF16 layer.

Per model and token count T: each engine's time (SwiGLU, top-k of the preset, uniform random
distinct routing) and its ratio to the FP4 floor = max(NVFP4 weight bytes incl. E4M3 scales of the
experts the routing touches / HBM bandwidth, FLOPs / BF16 peak); a BF16 layer on torch._grouped_mm
over the same routing, its ratio to the BF16 floor (2 bytes per weight); where flag_gems imports, the Triton BF16
layer of FlagGems (vLLM's fused_moe kernels; triton_peer.py) and a W4A16 layer on FlagGems' INT4 Triton kernel
(int4_peer.py); best peer / best engine.
Every contender is timed the same way (common.py): ONE call captured in a CUDA graph, median of
CUDA-event-timed replays with L2 flushed before each. Then the SM90 kernel variant per GEMM (where
the engine exposes its choice) and the host time per fused_moe call at T=1.
Usage: python benchmarks/bench_moe.py --help
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    BF16_BYTES_PER_WEIGHT,
    FP4_BYTES_PER_WEIGHT,
    ModelShape,
    Report,
    Roofline,
    Timer,
    capture,
    executor_for,
    fmt,
    gpu_missing,
    header_line,
    host_us_back_to_back,
    host_us_idle_gpu,
    kernel_launches,
    make_parser,
    measure_engine,
    md_row,
    call_inputs,
    moe_call,
    positive_int,
    prepare_engines,
    progress,
    random_weights,
    row_batch,
    run_models,
)

from int4_peer import Int4Peer  # noqa: E402
from triton_peer import TritonPeer  # noqa: E402

from cudnn_moe import Nvfp4MoeConfig, Nvfp4Weights  # noqa: E402

GPU_BOUND = 1.1  # a back-to-back host time under this x the call's GPU time measured the GPU instead


def grouped_mm_layer(
    x: torch.Tensor, ids: torch.Tensor, route_w: torch.Tensor, w1_t: torch.Tensor, w2_t: torch.Tensor, inter: int
) -> torch.Tensor:
    """BF16 MoE layer on torch._grouped_mm: sort slots by expert, GEMM1, SwiGLU, GEMM2, weighted sum.

    x [T, H] bf16; ids int64 [T, k]; route_w float32 [T, k]; w1_t [E, H, 2I] and w2_t [E, I, H]
    (transposed views of [E, 2I, H] rows [up; gate] / [E, H, I]). Nothing waits for the GPU (no
    bincount, item, nonzero or boolean mask), so the layer can be captured in a CUDA graph.
    """
    tokens, top_k = ids.shape
    sorted_ids, order = torch.sort(ids.reshape(-1), stable=True)
    experts = torch.arange(w1_t.shape[0], device=ids.device, dtype=ids.dtype)
    offs = torch.searchsorted(sorted_ids, experts, right=True, out_int32=True)  # int32 cumulative segment ends
    h = torch._grouped_mm(x[order // top_k], w1_t, offs=offs)
    up, gate = h[:, :inter], h[:, inter:]
    y = torch._grouped_mm(torch.nn.functional.silu(gate) * up, w2_t, offs=offs)
    out = torch.zeros(tokens * top_k, x.shape[1], dtype=torch.float32, device=x.device)
    out[order] = y.float()
    return (out.view(tokens, top_k, -1) * route_w.unsqueeze(-1)).sum(1).to(torch.bfloat16)


def host_cells(call: Callable[[], object], graph: torch.cuda.CUDAGraph, gpu_us: float, calls: int) -> list[str]:
    """Host us per call of fused_moe and of a bare replay of its graph: back to back, then to an idle GPU;
    and the call's GPU time. A back-to-back time the GPU bounds reads '<= x (GPU-bound)'."""
    def bounded(us: float) -> str:
        return f"<= {us:.1f} (GPU-bound)" if us <= GPU_BOUND * gpu_us else fmt(us)

    cells = []
    for fn in (call, graph.replay):
        cells += [bounded(host_us_back_to_back(fn, calls)), fmt(host_us_idle_gpu(fn, calls))]
    return [*cells, fmt(gpu_us)]


def describe_launches(launches: list[str], count: int) -> str:
    """The launches of a captured call: ``count`` kernel nodes, and the launches the executor makes for such a call
    (MoeExecutor.call_launches: the op's stage and the finalize where the chain does not fold them in); a stage
    holding both GEMMs (a tile handoff) is two launches."""
    both = [name for name in launches if "gemm1" in name and "gemm2" in name]
    named = len(launches) + len(both)
    if named != count:
        return f"{count}: {', '.join(launches)} and {count - named} more"
    return f"{count}: {', '.join(name + ' (two)' if name in both else name for name in launches)}"


class Bf16Peer:
    """The torch BF16 layer, captured in a CUDA graph; where this torch cannot capture it, timed eagerly
    and labeled so (said once)."""

    def __init__(self, report: Report) -> None:
        self.report = report
        self.eager = False

    def time_us(self, timer: Timer, fn: Callable[[], object]) -> tuple[float, str]:
        """(median us, cell text)."""
        fn()  # outside any capture: an error here is the layer's own and propagates
        if not self.eager:
            try:
                graph = capture(fn)
            except RuntimeError as exc:
                self.eager = True
                self.report.note(f"the torch BF16 layer cannot be captured in a CUDA graph on torch "
                                 f"{torch.__version__} ({exc}); it is timed eagerly, cells marked 'eager'")
            else:
                us = timer.median_us(graph.replay)
                return us, fmt(us)
        us = timer.median_us(fn)
        return us, f"{fmt(us)} (eager)"


class MoeBench:
    """The whole-layer table (rows as they are measured), then the SM90 variant and T=1 host-time tables."""

    def __init__(self, args: argparse.Namespace, report: Report) -> None:
        self.args, self.report = args, report
        self.roofline = Roofline(args.bandwidth_tbs, args.peak_tflops)
        self.peer = Bf16Peer(report)
        self.triton = TritonPeer(report) if args.triton_peer else None
        self.int4 = Int4Peer(report) if args.int4_peer else None
        self.host_rows: list[list[str]] = []
        self.variant_rows: list[list[str]] = []

    def columns(self) -> list[str]:
        engines = [c for e in self.args.engines for c in (f"{e} (us)", f"{e}/FP4 floor")]
        return ["model", "T", *engines, "FP4 floor (us)", "torch BF16 layer (graph) (us)", "BF16 floor (us)",
                "torch BF16/BF16 floor", "Triton BF16 layer (graph) (us)", "Triton INT4 W4A16 layer (graph) (us)",
                "best peer / best engine"]

    def time_ours(
        self, m: ModelShape, engine: str, config: Nvfp4MoeConfig, weights: Nvfp4Weights,
        batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor], timer: Timer,
    ) -> float:
        """Median us of one captured fused_moe call; at T=1 also its host-time row."""
        tokens = batch[0].shape[0]
        call = moe_call(config, weights, *batch)
        graph = capture(call, keep_graph=True)
        us = timer.median_us(graph.replay)
        if tokens == 1:
            self.host_rows.append([m.name, engine, *host_cells(call, graph, us, self.args.host_calls)])
        if weights.spec.engine == "sm90":
            executor = executor_for(m, config, weights)
            bucket = executor.bucket(tokens)
            variants = [repr(executor.engine.variant(gemm.rows, gemm.shape, gemm=index))
                        for index, gemm in ((1, bucket.gemm1), (2, bucket.gemm2))]
            names = [name for name, _ in executor.call_launches(bucket, call_inputs(config, weights, *batch))]
            launches = describe_launches(names, kernel_launches(graph))
            self.variant_rows.append([m.name, str(tokens), engine, str(bucket.rows), *variants, launches])
        return us

    def model(self, m: ModelShape, gen: torch.Generator, timer: Timer) -> None:
        """One row per token count for model ``m``."""
        args, report = self.args, self.report
        progress(f"{m.name}: random BF16 weights, NVFP4 weights for {', '.join(args.engines)}")
        w1, w2 = random_weights(m, gen)  # kept: the BF16 peer reads them
        prepared = prepare_engines(m, w1, w2, args.engines, max(args.tokens), report)
        if self.int4 is not None:
            self.int4.prepare(w1, w2)
        w1_t, w2_t = w1.transpose(1, 2), w2.transpose(1, 2)
        for tokens in args.tokens:
            batch = row_batch(m, tokens)
            x, ids, route_w = batch
            active = int(torch.unique(ids).numel())
            fp4_floor = self.roofline.floor_us(m, tokens, active, FP4_BYTES_PER_WEIGHT)
            bf16_floor = self.roofline.floor_us(m, tokens, active, BF16_BYTES_PER_WEIGHT)
            cells, times = [m.name, str(tokens)], []
            for engine in args.engines:
                result = measure_engine(
                    report, args.skip_slow_cudnn, m, tokens, engine, prepared,
                    lambda config, weights: self.time_ours(m, engine, config, weights, batch, timer),  # noqa: B023
                )
                if isinstance(result, str):
                    cells += [result, "-"]
                else:
                    cells += [fmt(result), fmt(result / fp4_floor)]
                    times.append(result)
            ids_long = ids.long()
            try:
                peer_us, peer_cell = self.peer.time_us(
                    timer, lambda: grouped_mm_layer(x, ids_long, route_w, w1_t, w2_t, m.intermediate)  # noqa: B023
                )
            except Exception as exc:  # noqa: BLE001 - the peer failing must not lose our rows
                report.note(f"{m.name}: torch BF16 layer: {type(exc).__name__}: {exc}")
                peer_us, peer_cell = None, "error"
            cells += [fmt(fp4_floor), peer_cell, fmt(bf16_floor)]
            cells.append("-" if peer_us is None else fmt(peer_us / bf16_floor))
            triton_us, triton_cell = (None, "-") if self.triton is None else self.triton.time_us(
                timer, x, ids, route_w, w1, w2)
            cells.append(triton_cell)
            int4_us, int4_cell = (None, "-") if self.int4 is None else self.int4.time_us(timer, x, ids, route_w)
            cells.append(int4_cell)
            peers = [us for us in (peer_us, triton_us, int4_us) if us is not None]
            cells.append(f"{min(peers) / min(times):.2f}x" if peers and times else "-")
            report.emit(md_row(cells))

    def variant_table(self) -> None:
        """The SM90 kernel variant of each GEMM per model, T and engine that ran on the sm90 engine."""
        report = self.report
        if not self.variant_rows:
            return
        report.emit()
        report.emit("SM90 kernel variant per GEMM (the SM90 engine's choice for the bucket's row capacity; behind a "
                    "tile handoff GEMM1 may launch its persistent form and GEMM2 its split-K form) and the launches of "
                    "one call")
        report.emit()
        report.table(["model", "T", "engine", "bucket rows", "GEMM1 variant", "GEMM2 variant", "launches per call"],
                     left=3)
        for row in self.variant_rows:
            report.emit(md_row(row))

    def host_table(self) -> None:
        """The T=1 host-time table."""
        report, calls = self.report, self.args.host_calls
        report.emit()
        if not self.host_rows:
            report.emit("host us per fused_moe call (T=1): not measured (needs T=1 in --tokens and an engine that ran)")
            return
        report.emit(f"host us per fused_moe call (T=1): {calls} calls back to back without a sync (loop time / "
                    f"{calls}, median of 3 loops) and one call at a time to an idle GPU (median of {calls}), next "
                    "to a bare CUDAGraph.replay() of the same call's graph; '<= x (GPU-bound)': the GPU was the "
                    "slower side, so that loop measured GPU time")
        report.emit()
        report.table(["model", "engine", "fused_moe back to back", "fused_moe to idle GPU",
                      "graph replay back to back", "graph replay to idle GPU", "GPU us per call (graph, L2 flushed)"],
                     left=2)
        for row in self.host_rows:
            report.emit(md_row(row))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = make_parser(__doc__.splitlines()[0])
    parser.add_argument("--bandwidth-tbs", type=float, default=4.3, help="HBM bandwidth for the floors (TB/s)")
    parser.add_argument("--peak-tflops", type=float, default=790.0, help="BF16 tensor-core peak for the floors")
    parser.add_argument("--host-calls", type=positive_int, default=300, help="calls per host-time loop at T=1")
    parser.add_argument("--triton-peer", action=argparse.BooleanOptionalAction, default=True,
                        help="time FlagGems' Triton BF16 layer where flag_gems imports (default: %(default)s)")
    parser.add_argument("--int4-peer", action=argparse.BooleanOptionalAction, default=True,
                        help="time a W4A16 layer on FlagGems' INT4 Triton kernel where flag_gems imports (default: "
                             "%(default)s)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if gpu_missing("bench_moe"):
        return 2
    report = Report()
    report.emit(header_line(f"floor: {args.bandwidth_tbs} TB/s, {args.peak_tflops} TFLOP/s BF16, "
                            f"FP4 {FP4_BYTES_PER_WEIGHT} B/weight, BF16 {BF16_BYTES_PER_WEIGHT:g} B/weight"))
    report.emit()
    report.emit(f"Whole layer, SwiGLU, uniform random distinct routing; each contender: one warm-up call, ONE call "
                f"captured in a CUDA graph, median of {args.iters} CUDA-event-timed replays, 256 MiB L2 flush "
                "before each. us = microseconds; ratios are time / floor.")
    report.emit()
    bench = MoeBench(args, report)
    report.table(bench.columns(), left=1)
    run_models(args, bench.model, report)
    bench.variant_table()
    bench.host_table()
    report.write(args.markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
