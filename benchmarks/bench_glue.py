"""GPU time and achieved bandwidth of each glue kernel of one fused NVFP4 MoE call.

Per model, token count and engine: a real bucket (random SwiGLU layer, uniform top-k routing, one
fused_moe call to fill it), then each glue launch of the call captured alone in a CUDA graph and timed
(median of CUDA-event-timed replays, 256 MiB L2 flush before each, common.py): stage (the caller's
tokens and routing into the bucket), the glue stages the engine's chain holds (executor.stages(): sort, permute or
the two in one launch, the activation unless GEMM1 runs it)
and finalize. Each
row gives the DRAM bytes the launch has to move at least (what it reads once and writes; the live slot
and row counts of this routing), the achieved GB/s, the share of --bandwidth and that floor in us.
The first time includes the graph launch (about 2.5 us on an H200); the second is the kernel's cost inside a
chain of launches of it. Uses only the executor's public stages,
so it runs unchanged on older revisions (before/after comparisons).
Usage: python benchmarks/bench_glue.py --help
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    ModelShape,
    Report,
    Timer,
    capture,
    executor_for,
    fmt,
    gpu_missing,
    header_line,
    make_parser,
    md_row,
    moe_call,
    prepare_engines,
    progress,
    random_weights,
    row_batch,
    run_models,
)

from cudnn_moe import Nvfp4MoeConfig, Nvfp4Weights, Routing, kernels  # noqa: E402
from cudnn_moe.kernels import TokenLayout  # noqa: E402

GLUE = ("stage", "sort", "permute", "sort+permute", "activation", "finalize")


def token_bytes(width: int, layout: TokenLayout) -> int:
    """Bytes of one token row of ``width`` values in ``layout``: BF16, or E2M1 codes + E4M3 scales."""
    return 2 * width if layout.is_bf16 else width // 2 + width // 16


def glue_launches(
    m: ModelShape, config: Nvfp4MoeConfig, weights: Nvfp4Weights, batch: tuple[torch.Tensor, ...]
) -> list[tuple[str, object, int]]:
    """(name, launch, minimum DRAM bytes) of each glue kernel on the bucket one call of ``batch`` filled."""
    x, ids, route_w = batch
    tokens, hidden, inter, k = x.shape[0], m.hidden, m.intermediate, m.top_k
    moe_call(config, weights, *batch)()  # fills the bucket: staged inputs, sorted routing, GEMM rows
    torch.cuda.synchronize()
    executor = executor_for(m, config, weights)
    bucket = executor.bucket(tokens)
    acts, routing = config.prepare_activations(x), Routing.unpacked(ids, route_w)
    ids_k, weights_k, routing_format = routing.kernel_operands()
    out = torch.empty(tokens, hidden, device=x.device, dtype=torch.bfloat16)

    slots = bucket.tokens * k
    live_slots = int((bucket.slot_to_row[:slots] >= 0).sum())
    live_tokens = int((bucket.slot_to_row[:slots].view(bucket.tokens, k) >= 0).any(1).sum())
    rows_used = int(bucket.offsets[-1])
    fp4_row = hidden // 2 + hidden // 16
    staged_routing = tokens * k * (ids_k.element_size() + (0 if weights_k is None else weights_k.element_size()))
    bytes_moved = {
        # tokens and routing read once and written once (the tokens as BF16 rows where GEMM1 gathers them); the
        # bucket's routing tail (-1 / 0) written
        "stage": tokens * (fp4_row + (fp4_row if bucket.x_rows is None else 2 * hidden)) + staged_routing
                 + bucket.tokens * k * 8,
        # ids read; slot_to_row, row_to_slot, row_expert written
        "sort": slots * 4 + slots * 4 + 2 * bucket.rows * 4,
        # each live token read once, each live slot's row written
        "permute": live_tokens * fp4_row + live_slots * token_bytes(hidden, bucket.gemm1.tokens.layout),
        # the used GEMM1 rows read ([up | gate]), the second GEMM's token rows written
        "activation": rows_used * 2 * (2 * inter) + rows_used * token_bytes(inter, bucket.gemm2.tokens.layout),
        # each live slot's GEMM2 row and the routing read, the output written
        "finalize": live_slots * 2 * hidden + tokens * k * 8 + tokens * 2 * hidden,
    }
    bytes_moved["sort+permute"] = bytes_moved["sort"] + bytes_moved["permute"]
    stages = dict(executor.stages(bucket))
    launches = {
        "stage": lambda: executor.stage(bucket, acts, routing),
        **{name: stages[name] for name in GLUE if name in stages},
        "finalize": lambda: kernels.finalize(bucket.gemm2.out, bucket.slot_to_row, bucket.route_weights, k, out),
    }
    return [(name, launches[name], bytes_moved[name]) for name in GLUE if name in launches]


CHAIN_LAUNCHES = 4  # back-to-back launches of one kernel in the chain column's graph


def chained(launch: Callable[[], object], times: int) -> Callable[[], None]:
    """``times`` back-to-back launches of ``launch`` (the glue launches are idempotent: each rewrites its outputs)."""

    def run() -> None:
        for _ in range(times):
            launch()

    return run


def per_launch_in_chain(one_us: float, chain_us: float, launches: int = CHAIN_LAUNCHES) -> float:
    """us one more launch adds to a graph of ``launches`` back-to-back launches of the kernel (``chain_us``) over
    its graph of one (``one_us``): its cost inside a PDL chain, without the graph's start."""
    return (chain_us - one_us) / (launches - 1)


def bench_model(args: argparse.Namespace, report: Report, m: ModelShape, gen: torch.Generator, timer: Timer) -> None:
    """Rows per token count, engine and glue kernel of model ``m``."""
    progress(f"{m.name}: random BF16 weights, NVFP4 weights for {', '.join(args.engines)}")
    prepared = prepare_engines(m, *random_weights(m, gen), args.engines, max(args.tokens), report)
    for tokens in args.tokens:
        batch = row_batch(m, tokens)
        for engine in args.engines:
            if engine not in prepared:
                continue
            config, weights = prepared[engine]
            for name, launch, moved in glue_launches(m, config, weights, batch):
                us = timer.median_us(capture(launch).replay)
                in_chain = per_launch_in_chain(us, timer.median_us(capture(chained(launch, CHAIN_LAUNCHES)).replay))
                gbs = moved / (us * 1e-6) / 1e9
                floor = moved / (args.bandwidth * 1e12) * 1e6
                report.emit(md_row([m.name, str(tokens), engine, name, fmt(us), fmt(in_chain), f"{moved / 1e6:.2f}",
                                    f"{gbs:.0f}", f"{100 * gbs / (args.bandwidth * 1e3):.0f}%", fmt(floor)]))


def main(argv: list[str] | None = None) -> int:
    parser = make_parser(__doc__.splitlines()[0])
    parser.set_defaults(engines=["sm90"])
    parser.add_argument("--bandwidth", type=float, default=4.3, help="HBM TB/s for the %% column (default: %(default)s)")
    args = parser.parse_args(argv)
    if gpu_missing("bench_glue"):
        return 2
    report = Report()
    report.emit(header_line())
    report.emit()
    report.emit(f"GPU us per glue launch, each captured alone in a CUDA graph (launch included); median of "
                f"{args.iters} CUDA-event-timed replays, 256 MiB L2 flush before each. In a chain: what each more "
                f"launch adds to a graph of {CHAIN_LAUNCHES} back-to-back launches of it (its cost inside the "
                f"call's PDL chain, without the graph's start). MB: the DRAM bytes it must move; GB/s and % of "
                f"{args.bandwidth} TB/s achieved (from the first us column); floor: MB at that bandwidth.")
    report.emit()
    report.table(["model", "T", "engine", "kernel", "us", "in a chain (us)", "MB", "GB/s", "% of HBM", "floor us"],
                 left=4)
    run_models(args, lambda m, gen, timer: bench_model(args, report, m, gen, timer), report)
    report.write(args.markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
