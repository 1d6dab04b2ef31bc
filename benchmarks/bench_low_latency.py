"""Benchmark the low-latency MoE call (contract 004) per weight format against its weight-bytes floor and peers.

Per model (top-8 presets) and T in {1, 2, 4, 8}: uniform random distinct routing (common.random_batch), the
distinct experts it touches, and per weight format the time of ``low_latency_moe`` (SwiGLU, finalized BF16
output, or FP16 for FP16 weights; the path column says whether the call ran on the CUDA-core kernels or,
on SM90 for the NVFP4 formats, the tensor-core pipeline; --cuda-cores forces the former, --engine names one, e.g.
ll_mma for the FP8 formats on tensor cores), the format's floor = touched experts' weight bytes (payload + block scales)
/ HBM bandwidth (4.3 TB/s), and the ratio, with the issue's target where there is one. Then, per (model, T),
the torch BF16 layer (torch._grouped_mm, captured in one CUDA graph; bench_moe.grouped_mm_layer) and
``cudnn_moe.fused_moe`` with the NVFP4 config on the same routing. Every contender is timed the same way
(common.py): one warm-up call, ONE call captured in a CUDA graph, median of --iters replays, each after a
256 MiB L2 flush. The weights are random (the kernels' speed does not depend on the values); the 4-bit
formats get random codes and scales directly, the NVFP4 pair is built from random codes too (quantizing a
DeepSeek-V3 float layer would take minutes and tens of GB), and so is the per-tensor FP8 record (random E4M3
codes and scales; its tokens are quantized to E4M3 once, outside the timed call, as the NVFP4 pair's are) and
the DeepSeek FP8 record (random E4M3 codes, FP32 block scales; its BF16 tokens are quantized per 128 values
inside the timed call, which is part of that format's call).
Usage: python benchmarks/bench_low_latency.py --help
"""

from __future__ import annotations

import argparse
import gc
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_moe import Bf16Peer, grouped_mm_layer  # noqa: E402
from common import (  # noqa: E402
    ModelShape,
    Report,
    Timer,
    capture,
    fmt,
    gpu_missing,
    header_line,
    make_parser,
    md_row,
    measure_engine,
    moe_call,
    prepare_engines,
    progress,
    random_batch,
    random_weights,
    run_models,
)

from cudnn_moe import Routing, SwiGLU  # noqa: E402
from cudnn_moe.arch import device_arch  # noqa: E402
from cudnn_moe.low_latency import LowLatencyMoeConfig, LowLatencyWeights, WeightFormat, low_latency_moe  # noqa: E402
from cudnn_moe.engines.base import OP_LOW_LATENCY, Request  # noqa: E402
from cudnn_moe.engines.registry import choose, engine_names  # noqa: E402
from cudnn_moe.weights.low_latency import DeepSeekFp8Weights, Fp8PerTensorWeights, Nvfp4PairWeights  # noqa: E402

DEFAULT_TOKENS = (1, 2, 4, 8)
FORMATS = tuple(f.value for f in WeightFormat)
# Bytes per weight as stored: payload + block scales (the NVFP4 FP32 globals per expert are negligible).
BYTES_PER_WEIGHT = {
    WeightFormat.BF16: 2.0,
    WeightFormat.FP16: 2.0,
    WeightFormat.NVFP4_WEIGHT_ONLY: 0.5 + 1 / 16,
    WeightFormat.MXFP4_WEIGHT_ONLY: 0.5 + 1 / 32,
    WeightFormat.MXINT4_WEIGHT_ONLY: 0.5 + 2 / 32,
    WeightFormat.NVFP4_W_NVFP4_A: 0.5 + 1 / 16,
    WeightFormat.FP8_WEIGHT_ONLY: 1.0,  # E4M3 codes; the FP32 scale per expert is negligible
    WeightFormat.FP8_PER_TENSOR: 1.0,  # E4M3 codes; the per-expert FP32 factors are negligible
    WeightFormat.DEEPSEEK_FP8: 1.0 + 4 / (128 * 128),  # E4M3 codes + one FP32 scale per 128 x 128 block
}
FP8_FORMATS = (WeightFormat.FP8_WEIGHT_ONLY, WeightFormat.FP8_PER_TENSOR, WeightFormat.DEEPSEEK_FP8)
WEIGHT_ONLY_4BIT = (WeightFormat.NVFP4_WEIGHT_ONLY, WeightFormat.MXFP4_WEIGHT_ONLY, WeightFormat.MXINT4_WEIGHT_ONLY)


def floor_us(m: ModelShape, touched: int, fmt_: WeightFormat, bandwidth_tbs: float) -> float:
    """Weight bytes of the touched experts (w1 [2I, H] + w2 [H, I], with block scales) / bandwidth, in us."""
    return touched * m.weights_per_expert * BYTES_PER_WEIGHT[fmt_] / (bandwidth_tbs * 1e12) * 1e6


def target(m: ModelShape, tokens: int, fmt_: WeightFormat) -> tuple[str, Callable[[float, float], bool]] | None:
    """The issue's target for this cell: (text, test(us, floor_us)), or None."""
    if fmt_ in WEIGHT_ONLY_4BIT:
        if m.key == "qwen3-30b-a3b" and tokens == 1:
            return "<= 20 us", lambda us, floor: us <= 20.0
        if m.key == "qwen3-30b-a3b" and tokens == 8:
            return "<= 1.5x floor", lambda us, floor: us <= 1.5 * floor
        if m.key == "deepseek-v3":
            return "<= 1.6x floor", lambda us, floor: us <= 1.6 * floor
    if fmt_ in FP8_FORMATS:  # issue 19: every FP8 format
        if m.key == "qwen3-30b-a3b" and tokens == 1:
            return "<= 20 us", lambda us, floor: us <= 20.0
        if m.key == "deepseek-v3" and tokens == 8:
            return "<= 1.3x floor", lambda us, floor: us <= 1.3 * floor
        if m.key == "deepseek-v3" and tokens == 1:
            return "<= 1.6x floor", lambda us, floor: us <= 1.6 * floor
    if fmt_ in (WeightFormat.BF16, WeightFormat.FP16) and m.key == "deepseek-v3":
        return "<= 1.1x floor", lambda us, floor: us <= 1.1 * floor
    return None


def _random_codes(shape: tuple[int, ...], device: torch.device, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 256, shape, dtype=torch.uint8, device=device, generator=gen)


def prepare_format(
    config: LowLatencyMoeConfig, fmt_: WeightFormat, m: ModelShape, w1: torch.Tensor | None, w2: torch.Tensor | None,
    gen: torch.Generator,
) -> LowLatencyWeights:
    """SwiGLU weights of one format: the BF16 source (cast for FP16), or random codes and scales for 4 and 8 bits."""
    dev = gen.device
    e, h, i = m.experts, m.hidden, m.intermediate
    if fmt_ is WeightFormat.BF16:
        return config.prepare_bf16_weights(w1, w2)
    if fmt_ is WeightFormat.FP16:
        return config.prepare_fp16_weights(w1.half(), w2.half())
    if fmt_ is WeightFormat.FP8_WEIGHT_ONLY:  # random finite E4M3 codes (no 0x7F / 0xFF), scales near 1/(16 sqrt K)
        f1, f2 = _random_codes((e, 2 * i, h), dev, gen), _random_codes((e, h, i), dev, gen)
        f1, f2 = (torch.where((f & 0x7F) == 0x7F, f - 1, f).view(torch.float8_e4m3fn) for f in (f1, f2))
        return config.prepare_fp8_weight_only_weights(f1, torch.full((e,), 1 / (16 * h**0.5), device=dev), f2,
                                                      torch.full((e,), 1 / (16 * i**0.5), device=dev))
    if fmt_ is WeightFormat.FP8_PER_TENSOR:  # the record itself, from random finite codes (I % 128 == 0: no padding)
        f1, f2 = _random_codes((e, 2 * i, h), dev, gen), _random_codes((e, h, i), dev, gen)
        f1, f2 = (torch.where((f & 0x7F) == 0x7F, f - 1, f).view(torch.float8_e4m3fn) for f in (f1, f2))
        s1, s2 = torch.full((e,), 1 / (16 * h**0.5), device=dev), torch.full((e,), 1 / (16 * i**0.5), device=dev)
        return Fp8PerTensorWeights(
            format=fmt_, hidden_size=h, intermediate_size=i, padded_intermediate=i, gated=True, w1_codes=f1,
            w1_scale=s1, w2_codes=f2, w2_scale=s2, input_scale=1 / 32, intermediate_scale=1 / 64, input_multiplier=32.0,
            fc1_factor=s1 / 32, fc2_factor=s2 / 64, inter_multiplier=torch.full((1,), 64.0, device=dev))
    if fmt_ is WeightFormat.DEEPSEEK_FP8:  # the record itself (no copy of a DeepSeek-V3 layer), random finite codes
        f1, f2 = _random_codes((e, 2 * i, h), dev, gen), _random_codes((e, h, i), dev, gen)
        f1, f2 = (torch.where((f & 0x7F) == 0x7F, f - 1, f).view(torch.float8_e4m3fn) for f in (f1, f2))
        s1 = torch.full((e, 2 * i // 128, h // 128), 1 / (16 * h**0.5), device=dev)
        s2 = torch.full((e, h // 128, i // 128), 1 / (16 * i**0.5), device=dev)
        return DeepSeekFp8Weights(format=fmt_, hidden_size=h, intermediate_size=i, padded_intermediate=i, gated=True,
                                  w1_codes=f1, w1_scales=s1, w2_codes=f2, w2_scales=s2)
    c1, c2 = _random_codes((e, 2 * i, h // 2), dev, gen), _random_codes((e, h, i // 2), dev, gen)
    if fmt_ in (WeightFormat.NVFP4_WEIGHT_ONLY, WeightFormat.NVFP4_W_NVFP4_A):
        s1 = (torch.rand(e, 2 * i, h // 16, device=dev, generator=gen) * 0.05 + 0.01).to(torch.float8_e4m3fn)
        s2 = (torch.rand(e, h, i // 16, device=dev, generator=gen) * 0.05 + 0.01).to(torch.float8_e4m3fn)
        g1, g2 = torch.full((e,), 0.5, device=dev), torch.full((e,), 0.5, device=dev)
        if fmt_ is WeightFormat.NVFP4_WEIGHT_ONLY:
            return config.prepare_nvfp4_weight_only_weights(c1, s1, g1, c2, s2, g2)
        return Nvfp4PairWeights(format=fmt_, hidden_size=h, intermediate_size=i, padded_intermediate=i, gated=True,
                                w1_codes=c1, w1_scales=s1, w2_codes=c2, w2_scales=s2, w1_global=g1, w2_global=g2)
    if fmt_ is WeightFormat.MXFP4_WEIGHT_ONLY:
        s1 = torch.randint(118, 124, (e, 2 * i, h // 32), dtype=torch.uint8, device=dev, generator=gen)
        s2 = torch.randint(118, 124, (e, h, i // 32), dtype=torch.uint8, device=dev, generator=gen)
        return config.prepare_mxfp4_weight_only_weights(c1, s1.view(torch.float8_e8m0fnu), c2, s2.view(torch.float8_e8m0fnu))
    s1 = (torch.rand(e, 2 * i, h // 32, device=dev, generator=gen) * 0.02 + 0.002).to(torch.bfloat16)
    s2 = (torch.rand(e, h, i // 32, device=dev, generator=gen) * 0.02 + 0.002).to(torch.bfloat16)
    return config.prepare_mxint4_weight_only_weights(c1, s1, c2, s2)


def path_of(config: LowLatencyMoeConfig, weights: LowLatencyWeights, x_dtype: torch.dtype | None,
            out_dtype: torch.dtype) -> str:
    """Which kernels a finalized call runs: 'tensor cores' (the SM90 engine's pipeline, or ll_mma's) or 'CUDA cores';
    'none' where the config's engine does not run the format (the timed call then reports the error)."""
    request = Request(OP_LOW_LATENCY, device_arch(), weights.format.value, num_experts=weights.num_experts,
                      token_dtype=x_dtype, out_dtype=out_dtype, finalize=True)
    try:
        engine = choose(request, config.engine)
    except ValueError:
        return "none"
    return "CUDA cores" if engine.name == "cuda_cores" else "tensor cores"


def ll_call(
    config: LowLatencyMoeConfig, weights: LowLatencyWeights, x: torch.Tensor, ids: torch.Tensor, route_w: torch.Tensor
) -> Callable[[], object]:
    """One finalized SwiGLU low_latency_moe call on this batch, inputs prepared and output allocated."""
    fmt_ = weights.format
    if fmt_ is WeightFormat.NVFP4_W_NVFP4_A:
        inputs = config.prepare_nvfp4_activations(x)
    elif fmt_ is WeightFormat.FP8_PER_TENSOR:
        inputs = config.prepare_fp8_per_tensor_activations(x, weights)
    else:
        inputs = x.half() if fmt_ is WeightFormat.FP16 else x
    out_dtype = torch.float16 if fmt_ is WeightFormat.FP16 else torch.bfloat16
    routing = Routing.unpacked(ids, route_w)
    out = torch.empty(x.shape[0], weights.hidden_size, dtype=out_dtype, device=x.device)
    return lambda: low_latency_moe(config, inputs, weights, routing, activation=SwiGLU(), out_dtype=out_dtype, out=out)


class LowLatencyBench:
    """The per-format table (rows as they are measured), then the peers table."""

    def __init__(self, args: argparse.Namespace, report: Report) -> None:
        self.args, self.report = args, report
        self.peer = Bf16Peer(report)
        self.peer_rows: list[list[str]] = []
        self.best_4bit: dict[tuple[str, int], float] = {}

    def model(self, m: ModelShape, gen: torch.Generator, timer: Timer) -> None:
        args, report = self.args, self.report
        formats = [WeightFormat(f) for f in args.formats]
        config = LowLatencyMoeConfig(max(args.tokens), engine=args.engine)
        batches = {t: random_batch(m, t, gen) for t in args.tokens}
        touched = {t: int(torch.unique(ids).numel()) for t, (_, ids, _) in batches.items()}
        needs_source = args.peers or any(f in (WeightFormat.BF16, WeightFormat.FP16) for f in formats)
        w1 = w2 = None
        if needs_source:
            progress(f"{m.name}: random BF16 weights")
            w1, w2 = random_weights(m, gen)
        if args.peers:
            self.peers(m, w1, w2, batches, timer)
        for fmt_ in formats:
            progress(f"{m.name}: {fmt_.value} weights")
            try:
                weights = prepare_format(config, fmt_, m, w1, w2, gen)
            except Exception as exc:  # noqa: BLE001 - one format failing must not lose the others
                report.note(f"{m.name} {fmt_.value}: preparation failed: {type(exc).__name__}: {exc}")
                continue
            for tokens, (x, ids, route_w) in batches.items():
                floor = floor_us(m, touched[tokens], fmt_, args.bandwidth_tbs)
                x_dtype = None if fmt_ is WeightFormat.NVFP4_W_NVFP4_A else (
                    torch.float8_e4m3fn if fmt_ is WeightFormat.FP8_PER_TENSOR else
                    torch.float16 if fmt_ is WeightFormat.FP16 else torch.bfloat16)
                path = path_of(config, weights, x_dtype, torch.float16 if fmt_ is WeightFormat.FP16 else torch.bfloat16)
                goal = target(m, tokens, fmt_)
                try:
                    us = timer.median_us(capture(ll_call(config, weights, x, ids, route_w)).replay)
                except Exception as exc:  # noqa: BLE001
                    report.note(f"{m.name} {fmt_.value} T={tokens}: {type(exc).__name__}: {exc} ('error' cells)")
                    report.emit(md_row([m.name, str(tokens), fmt_.value, path, str(touched[tokens]), "error", fmt(floor),
                                        "-", goal[0] if goal else "-", "-"]))
                    continue
                if fmt_ in WEIGHT_ONLY_4BIT:
                    key = (m.name, tokens)
                    self.best_4bit[key] = min(us, self.best_4bit.get(key, float("inf")))
                met = "-" if goal is None else ("yes" if goal[1](us, floor) else "NO")
                report.emit(md_row([m.name, str(tokens), fmt_.value, path, str(touched[tokens]), fmt(us), fmt(floor),
                                    f"{us / floor:.2f}", goal[0] if goal else "-", met]))
            del weights
            gc.collect()
            torch.cuda.empty_cache()

    def peers(self, m: ModelShape, w1: torch.Tensor, w2: torch.Tensor, batches: dict, timer: Timer) -> None:
        """The torch BF16 layer and fused_moe (NVFP4 config, one column per --engines) on each batch."""
        report, args = self.report, self.args
        prepared = prepare_engines(m, w1, w2, args.engines, max(batches), report)
        w1_t, w2_t = w1.transpose(1, 2), w2.transpose(1, 2)
        for tokens, (x, ids, route_w) in batches.items():
            ids_long = ids.long()
            try:
                _, torch_cell = self.peer.time_us(
                    timer, lambda: grouped_mm_layer(x, ids_long, route_w, w1_t, w2_t, m.intermediate)  # noqa: B023
                )
            except Exception as exc:  # noqa: BLE001
                report.note(f"{m.name}: torch BF16 layer: {type(exc).__name__}: {exc}")
                torch_cell = "error"
            fused_cells = []
            for engine in args.engines:
                result = measure_engine(
                    report, args.skip_slow_cudnn, m, tokens, engine, prepared,
                    lambda config, weights: timer.median_us(  # noqa: B023
                        capture(moe_call(config, weights, x, ids, route_w)).replay),  # noqa: B023
                )
                fused_cells.append(result if isinstance(result, str) else fmt(result))
            self.peer_rows.append([m.name, str(tokens), torch_cell, *fused_cells])
        del prepared
        gc.collect()
        torch.cuda.empty_cache()

    def peer_table(self) -> None:
        report = self.report
        if not self.peer_rows:
            return
        report.emit()
        report.emit("Peers on the same routing (SwiGLU, BF16 output), timed the same way, next to the best 4-bit "
                    "weight-only low_latency_moe")
        report.emit()
        report.table(["model", "T", "torch BF16 layer (graph) (us)",
                      *(f"fused_moe NVFP4 {engine} (us)" for engine in self.args.engines),
                      "best 4-bit low_latency_moe (us)"], left=1)
        for row in self.peer_rows:
            best = self.best_4bit.get((row[0], int(row[1])))
            report.emit(md_row([*row, fmt(best) if best is not None else "-"]))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = make_parser(__doc__.splitlines()[0])
    parser.set_defaults(tokens=list(DEFAULT_TOKENS), engines=["sm90"])
    parser.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS,
                        help="weight formats, one row each (default: all)")
    parser.add_argument("--bandwidth-tbs", type=float, default=4.3, help="HBM bandwidth of the floors (TB/s)")
    parser.add_argument("--peers", action=argparse.BooleanOptionalAction, default=True,
                        help="also time the torch BF16 layer and fused_moe (NVFP4) on the same routing")
    parser.add_argument("--cuda-cores", action="store_true",
                        help="run every format on the CUDA-core kernels (no tensor-core dispatch on SM90): --engine cuda_cores")
    parser.add_argument("--engine", default="auto", choices=engine_names(OP_LOW_LATENCY),
                        help="the low-latency engine of every call (default: the registry's choice; ll_mma: the FP8 "
                             "formats on tensor cores, other formats then fail)")
    args = parser.parse_args(argv)
    if args.cuda_cores:
        if args.engine not in ("auto", "cuda_cores"):
            parser.error(f"--cuda-cores and --engine {args.engine} contradict each other")
        args.engine = "cuda_cores"
    if max(args.tokens) > 8:
        parser.error(f"--tokens: the low-latency config takes at most 8 tokens, got {max(args.tokens)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if gpu_missing("bench_low_latency"):
        return 2
    report = Report()
    report.emit(header_line(f"floor: touched experts' weight bytes / {args.bandwidth_tbs} TB/s"))
    report.emit()
    report.emit(f"low_latency_moe, SwiGLU, top-k of the preset, uniform random distinct routing; ONE call captured in a "
                f"CUDA graph, median of {args.iters} replays, 256 MiB L2 flush before each. us = microseconds; ratio = "
                "time / floor; target: the issue's goal for that cell.")
    report.emit()
    if args.engine != "auto":
        report.note(f"--engine {args.engine}: every call runs on that engine")
    bench = LowLatencyBench(args, report)
    report.table(["model", "T", "format", "path", "touched experts", "us", "floor (us)", "ratio", "target", "met"],
                 left=4)
    run_models(args, bench.model)
    bench.peer_table()
    report.write(args.markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
