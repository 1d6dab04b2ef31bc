"""Benchmark the aligned-plan op ``aligned_moe`` against ``fused_moe`` on the same engine, routing and bytes.

Per model and token count T: both ops on the same NVFP4 weight codes (aligned gets them in its
[gate; up] row order, prepared with prepare_aligned_weights; the plan from align_routing, built
outside the timed region), the same uniform random distinct top-k routing and the same NVFP4 tokens;
each op's time, aligned / fused (the issue's target: <= 1.1), and aligned's ratio to the FP4 floor of
bench_moe. Both ops are timed the way bench_moe times ours (common.py): one warm-up call, ONE call
captured in a CUDA graph, median of CUDA-event-timed replays with L2 flushed before each. aligned_moe
ADDS into ``out``; its graph does not reset ``out`` (fused_moe only writes ``out``), so its values grow
over the replays, which does not change the work. A last column compares one aligned call into a
zeroed ``out`` with fused_moe's output (the weight scales are passed so both compute the same layer).
Usage: python benchmarks/bench_aligned.py --help
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    DEFAULT_MODELS,
    DEFAULT_TOKENS,
    FP4_BYTES_PER_WEIGHT,
    MODELS,
    ModelShape,
    Report,
    Roofline,
    Timer,
    capture,
    fmt,
    gpu_missing,
    header_line,
    md_row,
    positive_int,
    progress,
    random_weights,
    row_batch,
    run_models,
    slow_skip,
)

from cudnn_moe import (  # noqa: E402
    AlignedWeights,
    Nvfp4Activations,
    Nvfp4MoeConfig,
    Nvfp4Weights,
    Routing,
    SwiGLU,
    align_routing,
    aligned_moe,
    fused_moe,
    prepare_aligned_weights,
)
from cudnn_moe.engines.base import OP_ALIGNED  # noqa: E402
from cudnn_moe.engines.registry import engine_class_of, engine_names  # noqa: E402

TARGET_RATIO = 1.1  # the bound on aligned_moe time / fused_moe time
UNPACK_CHUNK_WEIGHTS = 1 << 26  # weights per chunk when reading the fused pack back to canonical codes


@dataclass
class Layer:
    """One model's weights for both ops: the fused_moe pack, and the aligned op's raw tensors (which
    every aligned_moe call passes and checks against ``prepared``) with their prepared layout."""

    config: Nvfp4MoeConfig
    fused: Nvfp4Weights
    raw: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # [gate; up] w1 codes, scales, w2, scales
    scales: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # output1 gate, output1 (up), output2: float32 [E]
    prepared: AlignedWeights

    @property
    def engine(self) -> str:
        return self.fused.spec.engine


def swap_halves(t: torch.Tensor) -> torch.Tensor:
    """[E, 2I, X]: rows [a; b] -> [b; a], a new contiguous tensor ([up; gate] <-> [gate; up])."""
    a, b = t.chunk(2, dim=1)
    return torch.cat((b, a), dim=1)


def canonical_chunked(
    weights: Nvfp4Weights, data: torch.Tensor, scales: torch.Tensor, n: int, k: int, swap: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """One matrix of ``weights`` (engine layout, experts leading) -> canonical codes uint8 [E, n, k/2]
    and linear E4M3 scales [E, n, k/16], a few experts at a time (Nvfp4Weights.canonical() unpacks all
    experts at once, and the SM90 unpack holds int64 temporaries of 8 bytes per weight: about 60 GB
    for DeepSeek-V3's w1); ``swap``: w1's [up; gate] halves -> [gate; up]."""
    engine = engine_class_of(weights.spec)
    step = max(1, UNPACK_CHUNK_WEIGHTS // (n * k))
    codes, block_scales = [], []
    for e in range(0, data.shape[0], step):
        c, s = engine.unpack_weights(weights.spec.arch, data[e : e + step], scales[e : e + step], n, k)
        if swap:
            c, s = swap_halves(c), swap_halves(s)
        codes.append(c.contiguous())
        block_scales.append(s.contiguous())
    return torch.cat(codes), torch.cat(block_scales)


def build_layer(m: ModelShape, gen: torch.Generator, engine: str, max_tokens: int,
                in_place: bool | None = None) -> Layer:
    """Random BF16 weights (as bench_moe draws them) quantized ONCE to NVFP4 for fused_moe; the aligned
    op's tensors are the same codes and scales read back from that pack, w1's halves swapped to
    [gate; up], then prepared for the same engine, so both ops stream the same bytes. The output scales
    are fused's per-expert alphas (w1's for gate and up, w2's for down): both ops compute one layer. in_place:
    prepare_aligned_weights' (None: its default, read in place where the engine can; False: the engine's layout)."""
    config = Nvfp4MoeConfig(max_num_tokens=max_tokens, engine=engine)
    w1, w2 = random_weights(m, gen)  # w1 rows [up; gate]
    fused = config.prepare_weights(w1, w2, activation=SwiGLU())
    del w1, w2  # 22.5 GB of BF16 for DeepSeek-V3; nothing below reads them
    hidden, inter = fused.hidden_size, fused.intermediate_size
    raw = (*canonical_chunked(fused, fused.w1, fused.w1_scales, 2 * inter, hidden, swap=True),
           *canonical_chunked(fused, fused.w2, fused.w2_scales, hidden, inter, swap=False))
    prepared = prepare_aligned_weights(*raw, engine=engine, in_place=in_place)
    if prepared.layer.spec.engine != fused.spec.engine:
        raise RuntimeError(f"engine {engine!r} resolved to {fused.spec.engine} for fused_moe but to "
                           f"{prepared.layer.spec.engine} for aligned_moe")
    up_gate = fused.w1_alpha.float().contiguous()
    scales = (up_gate, up_gate, fused.w2_alpha.float().contiguous())
    return Layer(config, fused, raw, scales, prepared)


def resolved_engine(m: ModelShape, engine: str) -> str:
    """The engine ``engine`` picks for model ``m`` on this GPU (for the header)."""
    try:
        return Nvfp4MoeConfig(engine=engine).engine_spec(m.hidden, m.intermediate, m.experts, True).engine
    except Exception as exc:  # noqa: BLE001 - a header field only; the model's rows say what failed
        return f"none ({exc})"


class AlignedBench:
    """One table row per model and T (printed as measured), then the summary against the target."""

    COLUMNS = ["model", "T", "fused_moe (us)", "aligned_moe (us)", "aligned/fused", "FP4 floor (us)",
               "aligned/FP4 floor", "aligned out vs fused out"]

    def __init__(self, args: argparse.Namespace, report: Report) -> None:
        self.args, self.report = args, report
        self.roofline = Roofline(args.bandwidth_tbs, args.peak_tflops)
        self.ratios: list[tuple[float, str]] = []

    def guarded(self, what: str, fn: Callable[[], float]) -> float | str:
        """fn() (a time in us), or 'OOM' / 'error' with the exception noted: one failing cell must
        not lose the rest of the table."""
        try:
            return fn()
        except torch.cuda.OutOfMemoryError as exc:
            self.report.note(f"{what}: out of GPU memory ({str(exc).splitlines()[0]}) ('OOM' cells)")
            torch.cuda.empty_cache()
            return "OOM"
        except Exception as exc:  # noqa: BLE001
            self.report.note(f"{what}: {type(exc).__name__}: {exc} ('error' cells)")
            return "error"

    def time_graph(self, timer: Timer, call: Callable[[], object]) -> float:
        """Median us of graph replays of ONE captured call (capture() makes the warm-up call first)."""
        graph = capture(call)
        try:
            return timer.median_us(graph.replay)
        finally:
            del graph

    def model(self, m: ModelShape, gen: torch.Generator, timer: Timer) -> None:
        args, report = self.args, self.report
        progress(f"{m.name}: random BF16 weights -> NVFP4 for fused_moe ({args.engine}), same codes "
                 "[gate; up] -> prepare_aligned_weights")
        try:
            layer = build_layer(m, gen, args.engine, max(args.tokens), LAYOUTS[args.layout])
        except Exception as exc:  # noqa: BLE001 - the other model may still run
            report.note(f"{m.name}: weights not prepared: {type(exc).__name__}: {exc}; model skipped")
            torch.cuda.empty_cache()
            return
        held = "read in place" if layer.prepared.in_place else "laid out in the engine's layout (a copy)"
        report.note(f"{m.name}: aligned weights {held}")
        progress(f"{m.name}: engine {layer.engine}, aligned weights {held}")
        for tokens in args.tokens:
            self.row(m, layer, tokens, timer)
        del layer

    def row(self, m: ModelShape, layer: Layer, tokens: int, timer: Timer) -> None:
        args, report = self.args, self.report
        x, ids, route_w = row_batch(m, tokens)
        active = int(torch.unique(ids).numel())
        floor = self.roofline.floor_us(m, tokens, active, FP4_BYTES_PER_WEIGHT)
        cells = [m.name, str(tokens)]
        if slow_skip(args.skip_slow_cudnn, m, layer.engine, tokens):
            report.emit(md_row(cells + ["skipped", "skipped", "-", fmt(floor), "-", "-"]))
            progress(f"{m.name} T={tokens}: skipped (--skip-slow-cudnn)")
            return
        acts: Nvfp4Activations = layer.config.prepare_activations(x)  # the same NVFP4 tokens for both ops
        hidden_states, hidden_states_scale = acts.packed.contiguous(), acts.scales.contiguous()
        topk_weights = route_w.float().contiguous()
        routing = Routing.unpacked(ids, topk_weights)
        sorted_token_ids, expert_ids, num_tokens_post_padded = align_routing(ids, args.block_m, m.experts)

        out_fused = torch.empty(tokens, m.hidden, device=x.device, dtype=torch.bfloat16)
        out_aligned = torch.zeros(tokens, m.hidden, device=x.device, dtype=torch.bfloat16)

        def fused_call() -> object:
            return fused_moe(layer.config, acts, routing, layer.fused, out=out_fused)

        def aligned_call() -> None:
            aligned_moe(hidden_states, hidden_states_scale, *layer.raw, *layer.scales, sorted_token_ids,
                        expert_ids, num_tokens_post_padded, topk_weights, out_aligned, m.top_k,
                        block_m=args.block_m, prepared=layer.prepared)

        progress(f"{m.name} T={tokens}: fused_moe")
        fused_us = self.guarded(f"{m.name} T={tokens} fused_moe", lambda: self.time_graph(timer, fused_call))
        progress(f"{m.name} T={tokens}: aligned_moe")
        match = "-"
        try:
            aligned_call()  # into the zeroed out: compared with fused_moe's output below
            if isinstance(fused_us, float):
                match = compare(out_aligned, out_fused)
        except Exception as exc:  # noqa: BLE001 - the timing below notes the error
            report.note(f"{m.name} T={tokens} aligned_moe (eager call): {type(exc).__name__}: {exc}")
        aligned_us = self.guarded(f"{m.name} T={tokens} aligned_moe", lambda: self.time_graph(timer, aligned_call))

        both = isinstance(fused_us, float) and isinstance(aligned_us, float)
        cells += [cell(fused_us), cell(aligned_us)]
        if both:
            ratio = aligned_us / fused_us
            self.ratios.append((ratio, f"{m.name} T={tokens}"))
            cells.append(f"{ratio:.3f}")
        else:
            cells.append("-")
        cells += [fmt(floor), fmt(aligned_us / floor) if isinstance(aligned_us, float) else "-", match]
        report.emit(md_row(cells))
        progress(f"{m.name} T={tokens}: fused {cell(fused_us)} us, aligned {cell(aligned_us)} us"
                 + (f", ratio {aligned_us / fused_us:.3f}" if both else ""))

    def summary(self) -> None:
        """Whether every measured row met aligned/fused <= TARGET_RATIO, and the worst row."""
        report = self.report
        report.emit()
        if not self.ratios:
            report.emit("target aligned/fused <= 1.1: no row measured both ops")
            return
        worst, where = max(self.ratios)
        over = [f"{w} ({r:.3f})" for r, w in self.ratios if r > TARGET_RATIO]
        verdict = "met in every measured row" if not over else f"MISSED in {len(over)} row(s): {', '.join(over)}"
        report.emit(f"target aligned/fused <= {TARGET_RATIO}: {verdict}; worst {worst:.3f} at {where} "
                    f"({len(self.ratios)} rows measured)")


def cell(value: float | str) -> str:
    return fmt(value) if isinstance(value, float) else value


def compare(aligned: torch.Tensor, fused: torch.Tensor) -> str:
    """'bitwise equal', or the largest |aligned - fused| relative to the largest |fused|."""
    if torch.equal(aligned, fused):
        return "bitwise equal"
    diff = (aligned.float() - fused.float()).abs().max().item()
    scale = fused.float().abs().max().item()
    return f"max diff {diff / scale:.1e} of max |out|" if scale > 0 else f"max diff {diff:.1e}"


# --layout -> prepare_aligned_weights(in_place=...)
LAYOUTS: dict[str, bool | None] = {"default": None, "in-place": True, "copy": False}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS), choices=list(MODELS),
                        help="presets of graphs/presets.json (default: %(default)s)")
    parser.add_argument("--tokens", nargs="+", type=positive_int, default=list(DEFAULT_TOKENS),
                        help="token counts T (default: %(default)s)")
    parser.add_argument("--iters", type=positive_int, default=20, help="timed replays per median (default: %(default)s)")
    parser.add_argument("--block-m", type=positive_int, default=64,
                        help="block size of the aligned plan (align_routing; a multiple of 8, default %(default)s). It "
                             "only sets the plan's padding: aligned_moe regroups the slots by expert, so it does not "
                             "shape the GEMMs")
    parser.add_argument("--engine", default="auto", choices=engine_names(OP_ALIGNED),
                        help="GEMM engine of both ops (Nvfp4MoeConfig / prepare_aligned_weights; default %(default)s)")
    parser.add_argument("--layout", choices=list(LAYOUTS), default="default",
                        help="the aligned op's weights: prepare_aligned_weights' default (read in place where the engine "
                             "can), in-place (required), or copy (the engine's layout) (default: %(default)s)")
    parser.add_argument("--skip-slow-cudnn", action=argparse.BooleanOptionalAction, default=True,
                        help="skip DeepSeek-V3 above T=64 when the engine is cudnn (100-170 ms per call on SM90)")
    parser.add_argument("--bandwidth-tbs", type=float, default=4.3, help="HBM bandwidth for the floor (TB/s)")
    parser.add_argument("--peak-tflops", type=float, default=790.0, help="BF16 tensor-core peak for the floor")
    parser.add_argument("--markdown", type=Path, help="also write the header and table here")
    args = parser.parse_args(argv)
    if args.block_m % 8:
        parser.error(f"--block-m must be a multiple of 8, got {args.block_m}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if gpu_missing("bench_aligned"):
        return 2
    report = Report()
    engines = ", ".join(f"{MODELS[key].name}: {resolved_engine(MODELS[key], args.engine)}" for key in args.models)
    report.emit(header_line(f"engine {args.engine} ({engines}) | floor: {args.bandwidth_tbs} TB/s, "
                            f"{args.peak_tflops} TFLOP/s BF16, FP4 {FP4_BYTES_PER_WEIGHT} B/weight"))
    report.emit()
    report.emit(f"aligned_moe (plan from align_routing, block_m={args.block_m}, built outside the timed region; "
                "weights from prepare_aligned_weights, passed as prepared=) vs fused_moe, same engine, same NVFP4 "
                "weight codes, routing and NVFP4 tokens; SwiGLU, uniform random distinct top-k routing. Each op: one "
                f"warm-up call, ONE call captured in a CUDA graph, median of {args.iters} CUDA-event-timed replays, "
                "256 MiB L2 flush before each. aligned_moe adds into out and its graph does NOT reset out (no extra "
                "copy is timed; fused_moe writes out). FP4 floor = max(NVFP4 bytes of the touched experts / "
                "bandwidth, FLOPs / peak), as bench_moe. Last column: one aligned call into a zeroed out vs "
                "fused_moe's out. us = microseconds.")
    report.emit()
    bench = AlignedBench(args, report)
    report.table(AlignedBench.COLUMNS, left=1)
    run_models(args, bench.model, report)
    bench.summary()
    report.write(args.markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
