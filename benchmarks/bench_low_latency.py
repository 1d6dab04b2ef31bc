"""Benchmark the low-latency MoE call (contract 004) per weight format against its weight-bytes floor and peers.

Per model (top-8 presets) and T in {1, 2, 4, 8}: uniform random distinct routing (common.row_batch), the
distinct experts it touches, and per weight format the time of ``low_latency_moe`` (SwiGLU, finalized BF16
output, or FP16 for FP16 weights) with the engine it ran on (engine="auto": the tuned choice where
``LowLatencyMoeConfig.tune`` stored one, else the registry's fixed rule; --engine names one for every call,
e.g. cuda_cores, or ll_mma for the FP8 formats and MX pairs on tensor cores; --cuda-cores is --engine
cuda_cores), the kernel launches of one call (the kernel nodes of its captured graph), the format's floor =
touched experts' weight bytes (payload + block scales) / HBM bandwidth (4.3 TB/s), the ratio, the achieved
weight GB/s, and the issue's target where there is one. With --tune, ``config.tune`` runs first for each
format (storing its choice in the persistent cache) and every engine that supports the call is also timed on
its own, beside the tuned call. For the FP8 formats, the torch FP8 layer (fp8_peer.py: torch._scaled_grouped_mm,
else torch._scaled_mm per touched expert; E4M3 weights with per-expert scales, BF16 output) on the same codes
and routing. Then, per (model, T), the torch BF16 layer (torch._grouped_mm; bench_moe.grouped_mm_layer) and
``cudnn_moe.fused_moe`` with the NVFP4 config on the same routing. Every contender is timed the same way
(common.py): one warm-up call, ONE call captured in a CUDA graph, median of --iters replays, each after a
256 MiB L2 flush. The weights are random (the kernels' speed does not depend on the values):
cudnn_moe.low_latency.stand_in gives each format random codes and scales (the NVFP4 pair and per-tensor FP8
records are built from random codes directly: quantizing a DeepSeek-V3 float layer would take minutes and
tens of GB); the per-tensor FP8 tokens are quantized to E4M3 once, outside the timed call, as the NVFP4 pair's
are; the DeepSeek FP8 BF16 tokens are quantized per 128 values inside the timed call (part of that format's
call); the MX pairs' tokens are quantized to MXFP8 once, outside the timed call. Per-stage times are not
split out here (the CUDA-core engine's launches are internal to its run; see bench_stages.py for the fused
pipeline's stages).
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
    kernel_launches,
    make_parser,
    md_row,
    measure_engine,
    moe_call,
    prepare_engines,
    progress,
    random_weights,
    row_batch,
    run_models,
)

from fp8_peer import Fp8Peer  # noqa: E402

from cudnn_moe import Routing, SwiGLU  # noqa: E402
from cudnn_moe.arch import Arch, device_arch  # noqa: E402
from cudnn_moe.engines.base import OP_LOW_LATENCY  # noqa: E402
from cudnn_moe.engines.registry import engine_names, supporting  # noqa: E402
from cudnn_moe.low_latency import LowLatencyMoeConfig, LowLatencyWeights, WeightFormat, low_latency_moe  # noqa: E402
from cudnn_moe.low_latency.checks import token_dtypes  # noqa: E402
from cudnn_moe.low_latency.stand_in import stand_in_weights  # noqa: E402
from cudnn_moe.low_latency.tactics import TacticKey, layer_request, select  # noqa: E402
from cudnn_moe.low_latency.tuning import call_inputs, request_token_dtype  # noqa: E402

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
    WeightFormat.MXFP4_W_MXFP8_A: 0.5 + 1 / 32,  # E2M1 codes + one E8M0 byte per 32
    WeightFormat.MXFP8_W_MXFP8_A: 1.0 + 1 / 32,  # E4M3 codes + one E8M0 byte per 32
}
FP8_FORMATS = (WeightFormat.FP8_WEIGHT_ONLY, WeightFormat.FP8_PER_TENSOR, WeightFormat.DEEPSEEK_FP8)
WEIGHT_ONLY_4BIT = (WeightFormat.NVFP4_WEIGHT_ONLY, WeightFormat.MXFP4_WEIGHT_ONLY, WeightFormat.MXINT4_WEIGHT_ONLY)


def floor_us(m: ModelShape, touched: int, fmt_: WeightFormat, bandwidth_tbs: float) -> float:
    """Weight bytes of the touched experts (w1 [2I, H] + w2 [H, I], with block scales) / bandwidth, in us."""
    return touched * m.weights_per_expert * BYTES_PER_WEIGHT[fmt_] / (bandwidth_tbs * 1e12) * 1e6


def target(m: ModelShape, tokens: int, fmt_: WeightFormat) -> tuple[str, Callable[[float, float], bool]] | None:
    """The issue's target for this cell: (text, test(us, floor_us)), or None."""
    if fmt_ in WEIGHT_ONLY_4BIT:  # issue 17: every 4-bit format
        if m.key == "qwen3-30b-a3b" and tokens == 1:
            return "<= 15 us", lambda us, floor: us <= 15.0
        if tokens in (1, 8):
            return "<= 1.3x floor", lambda us, floor: us <= 1.3 * floor
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


def prepare_format(
    config: LowLatencyMoeConfig, fmt_: WeightFormat, m: ModelShape, w1: torch.Tensor | None, w2: torch.Tensor | None,
    gen: torch.Generator,
) -> LowLatencyWeights:
    """SwiGLU weights of one format: the BF16 source (cast for FP16), or random stand-in codes and scales."""
    if fmt_ is WeightFormat.BF16:
        return config.prepare_bf16_weights(w1, w2)
    if fmt_ is WeightFormat.FP16:
        return config.prepare_fp16_weights(w1.half(), w2.half())
    return stand_in_weights(config, fmt_, m.experts, m.hidden, m.intermediate, gen)


def out_dtype_of(fmt_: WeightFormat) -> torch.dtype:
    """The output dtype of the format's rows: FP16 for FP16 weights, else BF16."""
    return torch.float16 if fmt_ is WeightFormat.FP16 else torch.bfloat16


def tactic_key(weights: LowLatencyWeights, tokens: int, top_k: int, arch: Arch, device: int | None) -> TacticKey:
    """What the rows' calls (``ll_call``: the format's usual token values, finalized) ask the tactic table."""
    x_dtype = token_dtypes(weights.format)[0]
    request = layer_request(weights, arch, tokens, request_token_dtype(weights.format, x_dtype),
                            out_dtype_of(weights.format), True)
    return TacticKey(request, top_k, weights.gated, x_dtype, device)


def weight_gbps(m: ModelShape, touched: int, fmt_: WeightFormat, us: float) -> float:
    """The touched experts' weight bytes (as floor_us counts them) per second of ``us``, in GB/s."""
    return touched * m.weights_per_expert * BYTES_PER_WEIGHT[fmt_] / (us * 1e-6) / 1e9


def engine_times_cell(times: dict[str, float | str]) -> str:
    """'sm90 12.3, cuda_cores 14.1': each engine's own time (or why none), in registry order."""
    return ", ".join(f"{name} {fmt(us) if isinstance(us, float) else us}" for name, us in times.items())


def engine_cell(config: LowLatencyMoeConfig, key: TacticKey) -> str:
    """The name of the engine the call of ``key`` runs on, or 'none' where the config's engine does not run it
    (the timed call then reports the error)."""
    try:
        return select(config.engine, key).name
    except ValueError:
        return "none"


def ll_call(
    config: LowLatencyMoeConfig, weights: LowLatencyWeights, x: torch.Tensor, ids: torch.Tensor, route_w: torch.Tensor
) -> Callable[[], object]:
    """One finalized SwiGLU low_latency_moe call on this batch, inputs prepared and output allocated."""
    inputs = call_inputs(config, weights, x, token_dtypes(weights.format)[0])
    out_dtype = out_dtype_of(weights.format)
    routing = Routing.unpacked(ids, route_w)
    out = torch.empty(x.shape[0], weights.hidden_size, dtype=out_dtype, device=x.device)
    return lambda: low_latency_moe(config, inputs, weights, routing, activation=SwiGLU(), out_dtype=out_dtype, out=out)


class LowLatencyBench:
    """The per-format table (rows as they are measured), then the peers table."""

    def __init__(self, args: argparse.Namespace, report: Report) -> None:
        self.args, self.report = args, report
        self.peer = Bf16Peer(report)
        self.fp8_peer = Fp8Peer(report)
        self.peer_rows: list[list[str]] = []
        self.best_4bit: dict[tuple[str, int], float] = {}

    def model(self, m: ModelShape, gen: torch.Generator, timer: Timer) -> None:
        args, report = self.args, self.report
        formats = [WeightFormat(f) for f in args.formats]
        config = LowLatencyMoeConfig(max(args.tokens), engine=args.engine)
        batches = {t: row_batch(m, t) for t in args.tokens}
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
            if args.tune:
                self.tune(config, weights, m, args.tokens)
            for tokens, (x, ids, route_w) in batches.items():
                self.row(m, config, weights, tokens, x, ids, route_w, touched[tokens], timer)
            del weights
            gc.collect()
            torch.cuda.empty_cache()

    def tune(self, config: LowLatencyMoeConfig, weights: LowLatencyWeights, m: ModelShape, tokens: list[int]) -> None:
        """config.tune for these weights and token counts (stored in the persistent cache; progress on stderr)."""
        fmt_ = weights.format
        try:
            config.tune(weights, top_k=m.top_k, out_dtype=out_dtype_of(fmt_), tokens=tokens, iters=self.args.iters,
                        progress=lambda line: progress(f"{m.name}: tuned {line}"))
        except Exception as exc:  # noqa: BLE001 - the rows then run the fixed rule, and say which engine
            self.report.note(f"{m.name} {fmt_.value}: tuning failed: {type(exc).__name__}: {exc}")

    def row(self, m: ModelShape, config: LowLatencyMoeConfig, weights: LowLatencyWeights, tokens: int,
            x: torch.Tensor, ids: torch.Tensor, route_w: torch.Tensor, touched: int, timer: Timer) -> None:
        """One (model, T, format) row: the call (its engine, launches, time, floor, ratio, GB/s, target), the torch
        FP8 layer for the FP8 formats, and with --tune each supporting engine's own time."""
        args, report, fmt_ = self.args, self.report, weights.format
        floor = floor_us(m, touched, fmt_, args.bandwidth_tbs)
        goal = target(m, tokens, fmt_)
        key = tactic_key(weights, tokens, m.top_k, device_arch(), torch.cuda.current_device())
        head = [m.name, str(tokens), fmt_.value, engine_cell(config, key)]
        fp8_cell = "-"
        if args.peers and fmt_ in FP8_FORMATS:
            fp8_cell = self.fp8_peer.cell(timer, weights, x, ids, route_w)
        each = []
        if args.tune:
            times: dict[str, float | str] = {}
            for engine in supporting(key.request):
                named = LowLatencyMoeConfig(config.max_num_tokens, engine=engine.name)
                try:
                    times[engine.name] = timer.median_us(capture(ll_call(named, weights, x, ids, route_w)).replay)
                except Exception as exc:  # noqa: BLE001
                    report.note(f"{m.name} {fmt_.value} T={tokens} engine {engine.name}: {type(exc).__name__}: {exc}")
                    times[engine.name] = "error"
            each = [engine_times_cell(times)]
        try:
            graph = capture(ll_call(config, weights, x, ids, route_w), keep_graph=True)
            us = timer.median_us(graph.replay)
        except Exception as exc:  # noqa: BLE001
            report.note(f"{m.name} {fmt_.value} T={tokens}: {type(exc).__name__}: {exc} ('error' cells)")
            report.emit(md_row([*head, "-", str(touched), "error", fmt(floor), "-", "-", goal[0] if goal else "-", "-",
                                fp8_cell, *each]))
            return
        try:
            launches = str(kernel_launches(graph))
        except Exception as exc:  # noqa: BLE001 - the count is a side column: its failure costs only that cell
            report.note(f"launches not counted: {type(exc).__name__}: {exc}")
            launches = "-"
        if fmt_ in WEIGHT_ONLY_4BIT:
            self.best_4bit[(m.name, tokens)] = min(us, self.best_4bit.get((m.name, tokens), float("inf")))
        met = "-" if goal is None else ("yes" if goal[1](us, floor) else "NO")
        report.emit(md_row([*head, launches, str(touched), fmt(us), fmt(floor), f"{us / floor:.2f}",
                            f"{weight_gbps(m, touched, fmt_, us):.0f}", goal[0] if goal else "-", met, fp8_cell, *each]))

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
                        help="also time the torch BF16 layer and fused_moe (NVFP4) on the same routing, and the torch "
                             "FP8 layer beside the FP8 formats")
    parser.add_argument("--cuda-cores", action="store_true",
                        help="run every format on the CUDA-core kernels (no tensor-core dispatch on SM90): "
                             "--engine cuda_cores")
    parser.add_argument("--engine", default="auto", choices=engine_names(OP_LOW_LATENCY),
                        help="the low-latency engine of every call (default: the tuned choice, else the registry's; "
                             "ll_mma: the FP8 formats on tensor cores, other formats then fail)")
    parser.add_argument("--tune", action="store_true",
                        help="run LowLatencyMoeConfig.tune per format first (stored in the persistent cache), and "
                             "time each supporting engine on its own beside the tuned call")
    args = parser.parse_args(argv)
    if args.cuda_cores:
        if args.engine not in ("auto", "cuda_cores"):
            parser.error(f"--cuda-cores and --engine {args.engine} contradict each other")
        args.engine = "cuda_cores"
    if max(args.tokens) > 8:
        parser.error(f"--tokens: the low-latency config takes at most 8 tokens, got {max(args.tokens)}")
    if args.tune and args.engine != "auto":
        parser.error(f"--tune measures which engine runs each call; --engine {args.engine} names one: give one of them")
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
                "time / floor; weights GB/s = touched experts' weight bytes / time; launches = kernel nodes of the "
                "captured call; engine = what engine=\"auto\" ran (the tuned choice, else the registry's rule); "
                "torch FP8 layer: fp8_peer.py (grouped: torch._scaled_grouped_mm, per expert: torch._scaled_mm); "
                "target: the issue's goal for that cell.")
    report.emit()
    if args.engine != "auto":
        report.note(f"--engine {args.engine}: every call runs on that engine")
    if args.tune:
        report.note("--tune: engine = the tuned choice (config.tune, stored in the persistent cache); 'each engine' "
                    "times every engine that supports the call on its own, the same way")
    bench = LowLatencyBench(args, report)
    report.table(["model", "T", "format", "engine", "launches", "touched experts", "us", "floor (us)", "ratio",
                  "weights GB/s", "target", "met", "torch FP8 layer (graph) (us)",
                  *(["each engine (us)"] if args.tune else [])], left=4)
    run_models(args, bench.model, report)
    bench.peer_table()
    report.write(args.markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
