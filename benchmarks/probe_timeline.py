"""Timeline of one fused_moe call: when each of its launches starts and ends inside the call's CUDA graph.

bench_stages.py says what each launch adds to the chain; this probe says where in the call it runs, which is what
programmatic dependent launch changes: a kernel starts (its CTAs resident, waiting) while the one before it still
runs. The call is captured in one CUDA graph and replayed --iters times, 256 MiB L2 flush before each, under
torch.profiler (CUPTI kernel records, ns). Per launch: the median over replays of its start and end, in us from
the start of the call's first kernel. The whole call is also timed as the other benchmarks time it (CUDA events
around the replay, L2 flushed, median), and so is a graph of one tiny kernel: the replay's fixed cost.
Usage: python benchmarks/probe_timeline.py --help
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    Report, Timer, capture, gpu_missing, header_line, kernel_launches, make_parser, md_row, measure_engine, moe_call,
    prepare_engines, progress, random_weights, row_batch, run_models,
)

Kernel = tuple[str, int, int]  # name, start and end in ns (CUPTI's clock)


def split_replays(kernels: Iterable[Kernel], is_flush: Callable[[str], bool], launches: int) -> list[list[Kernel]]:
    """The kernels after each flush kernel, up to the next one, in start order: one list per replay. A replay that
    does not hold exactly ``launches`` kernels (the graph's kernel nodes) raises RuntimeError."""
    replays: list[list[Kernel]] = []
    for kernel in sorted(kernels, key=lambda k: k[1]):
        if is_flush(kernel[0]):
            replays.append([])
        elif replays:
            replays[-1].append(kernel)
    wrong = sorted({len(r) for r in replays if len(r) != launches})
    if not replays or wrong:
        raise RuntimeError(f"expected {launches} kernels after each of the flushes, found {wrong or 'no flush'}")
    return replays


def spans(replays: Sequence[Sequence[Kernel]]) -> list[tuple[str, float, float]]:
    """Per launch of the call (the replays' i-th kernels): its name and the medians over replays of its start and end,
    in us from the replay's first start."""
    rows = []
    for i, (name, _, _) in enumerate(replays[0]):
        start = statistics.median((r[i][1] - r[0][1]) / 1e3 for r in replays)
        end = statistics.median((r[i][2] - r[0][1]) / 1e3 for r in replays)
        rows.append((name, start, end))
    return rows


def profiled_replays(graph: torch.cuda.CUDAGraph, flush: torch.Tensor, iters: int) -> list[list[Kernel]]:
    """``iters`` replays of ``graph``, each after zeroing ``flush``, under torch.profiler: split_replays of their
    kernels."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            flush.zero_()
            graph.replay()
        torch.cuda.synchronize()
    kernels = [(e.name(), e.start_ns(), e.start_ns() + e.duration_ns()) for e in prof.profiler.kineto_results.events()
               if e.device_type() == torch.autograd.DeviceType.CUDA and "memcpy" not in e.name().lower()
               and "memset" not in e.name().lower()]
    return split_replays(kernels, lambda name: "fill" in name.lower(), kernel_launches(graph))


def main(argv: list[str] | None = None) -> int:
    parser = make_parser(__doc__.splitlines()[0])
    parser.set_defaults(engines=["sm90"], tokens=[1, 8])
    args = parser.parse_args(argv)
    if gpu_missing("probe_timeline"):
        return 2
    report = Report()
    report.emit(header_line())
    report.emit()
    timer = Timer(args.iters)
    one = torch.zeros(1, device="cuda")
    tiny = timer.median_us(capture(lambda: one.add_(1)).replay)
    report.emit(f"A graph of one tiny kernel, timed like the calls: {tiny:.1f} us. Launches: start .. end, us from the "
                f"call's first kernel start (median of {args.iters} profiled replays, L2 flushed).")
    report.emit()
    report.table(["model", "T", "engine", "whole call (us)", "launches: start .. end (us)"], left=5)

    def bench_model(m, gen, timer: Timer) -> None:
        progress(f"{m.name}: random BF16 weights, NVFP4 weights for {', '.join(args.engines)}")
        prepared = prepare_engines(m, *random_weights(m, gen), args.engines, max(args.tokens), report)
        for tokens in args.tokens:
            batch = row_batch(m, tokens)
            for engine in args.engines:
                def measure(config, weights):  # noqa: ANN001, ANN202
                    graph = capture(moe_call(config, weights, *batch), keep_graph=True)  # noqa: B023
                    whole = timer.median_us(graph.replay)
                    timeline = spans(profiled_replays(graph, timer.flush, args.iters))
                    return whole, ", ".join(f"{name} {start:.1f} .. {end:.1f}" for name, start, end in timeline)

                result = measure_engine(report, args.skip_slow_cudnn, m, tokens, engine, prepared, measure)
                cells = [result, result] if isinstance(result, str) else [f"{result[0]:.1f}", result[1]]
                report.emit(md_row([m.name, str(tokens), engine, *cells]))

    run_models(args, bench_model, report)
    report.write(args.markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
