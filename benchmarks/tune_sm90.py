"""Time the SM90 engine's GEMM kernel variants on the operands of real token buckets.

For each model and token count: one fused_moe call fills the bucket (routing, sorted rows, both
GEMMs' inputs; where the bucket's chain gathers, GEMM1's rows are that call's tokens routed as the permute would
write them), then each candidate variant runs GEMM1 and GEMM2 on those buffers, captured alone in
a CUDA graph and timed like the benchmarks (L2 flushed, median). Prints the engine's own choice next
to the fastest candidate; with --forms, each wgmma variant's GEMM1 also in the prefill chain's fused forms
(rows gathered through the routing, the activation in the epilogue, both) and each decode variant's with the
epilogue. Usage: python benchmarks/tune_sm90.py --help
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    Report, Timer, capture, executor_for, gpu_missing, header_line, make_parser, md_row, moe_call, random_weights,
    reason, row_batch, run_models,
)

from cudnn_moe import Nvfp4MoeConfig, SwiGLU  # noqa: E402
from cudnn_moe.engines.base import ActivationEpilogue, GemmOperands, RowGather, TokenOperand  # noqa: E402
from cudnn_moe.engines.sm90.kernels import DecodeVariant, PrefillVariant, WgmmaVariant, grouped_gemm  # noqa: E402

DECODE = [
    DecodeVariant(mt=4, wm=2, wk=1, nt=1, prefetch=2),
    DecodeVariant(mt=4, wm=2, wk=2, nt=1, prefetch=2),
    DecodeVariant(mt=4, wm=2, wk=4, nt=1, prefetch=2),
    DecodeVariant(mt=4, wm=1, wk=4, nt=1, prefetch=2),
    DecodeVariant(mt=1, wm=2, wk=4, nt=1, prefetch=4),
    DecodeVariant(mt=1, wm=2, wk=4, nt=1, prefetch=8),
    DecodeVariant(mt=1, wm=4, wk=2, nt=1, prefetch=4),
    DecodeVariant(mt=1, wm=4, wk=2, nt=1, prefetch=8),
    DecodeVariant(mt=1, wm=1, wk=8, nt=1, prefetch=4),
    DecodeVariant(mt=2, wm=2, wk=2, nt=1, prefetch=4),
    DecodeVariant(mt=1, wm=8, wk=1, nt=1, prefetch=8),
    DecodeVariant(mt=1, wm=4, wk=4, nt=1, prefetch=4),
    DecodeVariant(mt=1, wm=2, wk=4, nt=2, prefetch=4),
    DecodeVariant(mt=1, wm=4, wk=2, nt=2, prefetch=4),
    DecodeVariant(mt=1, wm=2, wk=4, nt=4, prefetch=2),
    DecodeVariant(mt=1, wm=4, wk=2, nt=4, prefetch=2),
    DecodeVariant(mt=2, wm=2, wk=2, nt=4, prefetch=2),
    DecodeVariant(mt=4, wm=2, wk=1, nt=1, prefetch=4),
    DecodeVariant(mt=4, wm=1, wk=2, nt=1, prefetch=4),
    DecodeVariant(mt=2, wm=4, wk=1, nt=1, prefetch=4),
    DecodeVariant(mt=2, wm=2, wk=2, nt=1, prefetch=6),
    DecodeVariant(mt=2, wm=2, wk=4, nt=1, prefetch=4),
    DecodeVariant(mt=4, wm=2, wk=2, nt=1, prefetch=4),
    DecodeVariant(mt=2, wm=1, wk=4, nt=1, prefetch=4),
    DecodeVariant(mt=2, wm=2, wk=2, nt=2, prefetch=4),
    DecodeVariant(mt=4, wm=2, wk=1, nt=4, prefetch=2),
    DecodeVariant(mt=2, wm=4, wk=1, nt=4, prefetch=2),
    DecodeVariant(mt=2, wm=2, wk=2, nt=4, prefetch=3),
    DecodeVariant(mt=4, wm=1, wk=2, nt=4, prefetch=2),
]
PREFILL = [PrefillVariant(stages=s, min_blocks=b) for s in (3, 4) for b in (1, 2)] + [
    # 256 features x 64 token rows: the default's warp tile, less padding on ~128-row segments
    PrefillVariant(4, 2, feature_block=256, tile_rows=64),
    PrefillVariant(3, 2, feature_block=256, tile_rows=64),
    PrefillVariant(4, 1, feature_block=256, tile_rows=64),
    # 128 x 64: 4 warps, up to 4 CTAs per SM
    PrefillVariant(4, 4, feature_block=128, tile_rows=64),
    PrefillVariant(3, 3, feature_block=128, tile_rows=64),
    # 256 x 128 (16 warps, one CTA per SM)
    PrefillVariant(4, 1, feature_block=256, tile_rows=128),
    # weights decoded once per CTA (adec)
    PrefillVariant(3, 2, adec=True),
    PrefillVariant(3, 1, adec=True),
    PrefillVariant(4, 1, adec=True),
    PrefillVariant(3, 1, feature_block=256, adec=True),
]

# wgmma (sm_90a): 128 features x 64 or 128 token rows, ring depth, CTAs per SM. Timed on the bucket's
# fragment-order tokens: the values differ from a natural-order call, the work does not.
WGMMA = [WgmmaVariant(rows, groups, stages, blocks) for rows, groups, stages, blocks in (
    (128, 4, 5, 1), (128, 4, 4, 1), (128, 4, 6, 1), (64, 4, 6, 1), (64, 4, 8, 1),
    (128, 2, 4, 2), (128, 2, 5, 2), (128, 2, 3, 2), (128, 2, 5, 1), (64, 2, 6, 2), (64, 2, 4, 3))]


def routed_rows(source: torch.Tensor, row_to_slot: torch.Tensor, top_k: int) -> torch.Tensor:
    """bfloat16 [R, K] natural rows as the permute would write them: row r holds the token its slot routes,
    source[row_to_slot[r] // top_k] (source: the bucket's BF16 token rows [B, K]), zeros where row_to_slot[r] < 0."""
    slots = row_to_slot.long()
    rows = source[slots.clamp(min=0) // top_k]
    return rows.masked_fill_((slots < 0).unsqueeze(1), 0)


def full_buffers(ops: GemmOperands, source: torch.Tensor | None, row_to_slot: torch.Tensor,
                 top_k: int) -> GemmOperands:
    """``ops`` with R-row token and output buffers where the bucket's fused chain holds none (GEMM1's output with the
    activation epilogue, its tokens with the gather): the call's own tokens ``source`` routed into rows
    (routed_rows), so the tensor cores see real values (zero tokens draw less power and run faster: 419 against 442
    us for Qwen3-30B-A3B T=4096's fused GEMM1, benchmarks/RESULTS.md). ``source`` may be None where the bucket holds
    its permuted token rows (decode buckets)."""
    tokens, out = ops.tokens, ops.out
    if tokens.data.shape[0] != ops.rows:
        if source is None:
            raise ValueError("the bucket holds no token rows and no source rows were given")
        tokens = TokenOperand(routed_rows(source, row_to_slot, top_k), None, tokens.layout)
    if out.shape[0] != ops.rows:
        out = torch.empty(ops.rows, ops.shape.n, dtype=torch.bfloat16, device=ops.offsets.device)
    return replace(ops, tokens=tokens, out=out)


def token_rows(bucket: object) -> torch.Tensor | None:
    """The bucket's BF16 token rows [B, K] (the NVFP4 tokens its stage decoded, or its BF16 tokens), or None where
    the bucket holds permuted rows only (decode buckets)."""
    if bucket.x_rows is not None:
        return bucket.x_rows
    return bucket.x if bucket.x.dtype == torch.bfloat16 else None


def main(argv: list[str] | None = None) -> int:
    parser = make_parser(__doc__.splitlines()[0])
    parser.set_defaults(tokens=[1, 8, 64, 512, 4096])
    parser.add_argument("--forms", action="store_true",
                        help="also time each wgmma variant's GEMM1 gathering its rows, with the activation epilogue, "
                             "and with both (the prefill chain's form), and each decode variant that fits it with the "
                             "epilogue")
    parser.add_argument("--gemms", nargs="+", type=int, choices=(1, 2), default=[1, 2], help="which GEMMs to time")
    parser.add_argument("--only", nargs="+", default=None, metavar="TEXT",
                        help="time only the variants whose repr holds one of these texts (e.g. 'wk=2'), and the "
                             "engine's choice")
    args = parser.parse_args(argv)
    if gpu_missing("tune_sm90"):
        return 2
    report = Report()
    report.emit(header_line())
    report.emit()
    report.table(["model", "T", "GEMM", "variant", "us", "TFLOP/s", "chosen by the engine"], left=4)

    def bench_model(m, gen, timer: Timer) -> None:
        config = Nvfp4MoeConfig(max_num_tokens=max(args.tokens), engine="sm90")
        weights = config.prepare_weights(*random_weights(m, gen), activation=SwiGLU())
        executor = executor_for(m, config, weights)
        for tokens in args.tokens:
            moe_call(config, weights, *row_batch(m, tokens))()
            bucket = executor.bucket(tokens)
            source = token_rows(bucket)
            gemm1 = full_buffers(bucket.gemm1, source, bucket.row_to_slot, m.top_k)
            for index, name, ops in ((1, "gemm1", gemm1), (2, "gemm2", bucket.gemm2)):
                if index not in args.gemms:
                    continue
                chosen = executor.engine.variant(ops.rows, ops.shape, gemm=index)
                candidates = PREFILL if tokens >= 1024 else DECODE + (PREFILL if tokens >= 256 else [])
                # the wgmma kernel reads the bucket's layout: GEMM1 natural rows, GEMM2 the tiled planes
                wgmma = [replace(v, tiled_tokens=index == 2) for v in WGMMA]
                candidates = candidates + (wgmma if tokens >= 256 else [])
                if args.only:
                    candidates = [v for v in candidates if v == chosen or any(t in repr(v) for t in args.only)]
                flops = 2.0 * int(ops.offsets[-1]) * ops.shape.n * ops.shape.k  # rows used, read outside any capture
                w = ops.weights
                # the call's token rows; a bucket without them (a decode chain's) lends its permuted rows (fragment
                # order: other values, the same work)
                rows_in = source if source is not None else ops.tokens.data[: bucket.tokens]
                gather = RowGather(rows_in, bucket.row_to_slot, m.top_k)
                epilogue = ActivationEpilogue(SwiGLU(), bucket.row_to_slot, bucket.gemm2.tokens)
                for variant in candidates:
                    forms = [("", {})]
                    if args.forms and name == "gemm1" and isinstance(variant, WgmmaVariant):
                        forms += [(" gather", {"gather": gather}), (" epilogue", {"epilogue": epilogue}),
                                  (" gather+epilogue", {"gather": gather, "epilogue": epilogue})]
                    elif (args.forms and name == "gemm1" and isinstance(variant, DecodeVariant)
                          and variant.epilogue_problem(SwiGLU()) is None):
                        forms.append((" epilogue", {"epilogue": epilogue}))
                    for label, fused in forms:
                        run = lambda v=variant, f=fused: grouped_gemm(  # noqa: E731
                            w.data, w.scales, w.alpha, None if "gather" in f else ops.tokens.data, ops.offsets,
                            None if "epilogue" in f else ops.out, v, alpha_split=w.alpha_split, **f)
                        try:
                            time_us = timer.median_us(capture(run).replay)
                            us, tflops = f"{time_us:.1f}", f"{flops / time_us / 1e6:.0f}"
                        except Exception as exc:  # noqa: BLE001 - a variant that does not fit is reported, not fatal
                            us, tflops = f"error: {reason(exc)}", ""
                        report.emit(md_row([m.name, str(tokens), name + label, repr(variant), us, tflops,
                                            "yes" if variant == chosen and not fused else ""]))

    run_models(args, bench_model, report)
    report.write(args.markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
