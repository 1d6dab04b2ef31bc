"""Benchmark the fused NVFP4 MoE layer (CUDA-graph replay) against its roofline floor and a BF16 peer.

For each model shape and token count it prints: our time, the floor (max of FP4 weight bytes of
the experts the routing touches / HBM bandwidth and FLOPs / BF16 tensor-core peak), their ratio,
and a BF16 layer built on torch._grouped_mm over the same routing, timed in the same process.
Times are medians of CUDA-event-timed runs. Usage: python benchmarks/bench_moe.py --help
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cudnn_moe import Nvfp4MoeConfig, Routing, SwiGLU, fused_moe  # noqa: E402
from cudnn_moe.engines.cudnn import backend_version  # noqa: E402


@dataclass(frozen=True)
class ModelShape:
    """One MoE layer shape from graphs/presets.json."""

    name: str
    experts: int
    hidden: int
    intermediate: int
    top_k: int


PRESETS = Path(__file__).resolve().parent.parent / "graphs" / "presets.json"
MODELS = {key: ModelShape(**shape) for key, shape in json.loads(PRESETS.read_text()).items()}


def time_us(fn, warmup: int, iters: int) -> float:
    """Median time of fn() in microseconds, each run between its own pair of CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def grouped_mm_layer(x, ids, route_w, w1_t, w2_t, inter):
    """BF16 MoE layer on torch._grouped_mm: sort slots by expert, GEMM1, SwiGLU, GEMM2, weighted sum.

    x [T, H] bf16; w1_t [E, H, 2I] and w2_t [E, I, H] (transposed views of [E, 2I, H] / [E, H, I]).
    """
    tokens, top_k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w1_t.shape[0])
    offs = torch.cumsum(counts, 0).to(torch.int32)
    rows = x[order // top_k]
    h = torch._grouped_mm(rows, w1_t, offs=offs)
    up, gate = h[:, :inter], h[:, inter:]
    a = torch.nn.functional.silu(gate) * up
    y = torch._grouped_mm(a, w2_t, offs=offs)
    out = torch.zeros(tokens * top_k, x.shape[1], dtype=torch.float32, device=x.device)
    out[order] = y.float()
    return (out.view(tokens, top_k, -1) * route_w.unsqueeze(-1)).sum(1).to(torch.bfloat16)


def random_weights(m: ModelShape, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """BF16 w1 [E, 2I, H] (rows [up; gate]) and w2 [E, H, I] on the GPU, scaled by 1/sqrt(fan-in)."""
    dev = gen.device
    w1 = torch.randn(m.experts, 2 * m.intermediate, m.hidden, device=dev, dtype=torch.bfloat16, generator=gen)
    w2 = torch.randn(m.experts, m.hidden, m.intermediate, device=dev, dtype=torch.bfloat16, generator=gen)
    return w1.div_(m.hidden**0.5), w2.div_(m.intermediate**0.5)


def random_batch(m: ModelShape, tokens: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """BF16 x [T, H], distinct uniform top-k ids int32 [T, k], softmax route weights FP32 [T, k]."""
    dev = gen.device
    x = torch.randn(tokens, m.hidden, device=dev, dtype=torch.bfloat16, generator=gen)
    ids = torch.rand(tokens, m.experts, device=dev, generator=gen).argsort(1)[:, : m.top_k].to(torch.int32)
    return x, ids, torch.softmax(torch.randn(tokens, m.top_k, device=dev, generator=gen), 1)


def emit(lines: list[str], row: str) -> None:
    """Print a table row now and keep it for the markdown file."""
    lines.append(row)
    print(row, flush=True)


def run_table(args: argparse.Namespace, lines: list[str], bench_model: Callable[..., None]) -> int:
    """Print the column header (lines[2]), add bench_model's rows per model, write --markdown."""
    print(lines[2], flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for key in args.models:
        bench_model(MODELS[key], args, gen, lines)
        torch.cuda.empty_cache()
    if args.markdown:
        args.markdown.write_text("\n".join(lines) + "\n")
    return 0


def bench_model(m: ModelShape, args: argparse.Namespace, gen: torch.Generator, lines: list[str]) -> None:
    """One table row per token count for model ``m`` (ours, floor, ratio, BF16 peer and its floor)."""
    config = Nvfp4MoeConfig(max_num_tokens=max(args.tokens))
    w1, w2 = random_weights(m, gen)
    weights = config.prepare_weights(w1, w2, activation=SwiGLU())
    w1_t, w2_t = w1.transpose(1, 2), w2.transpose(1, 2)
    per_expert = 3 * m.hidden * m.intermediate  # weight elements of one expert (w1 2I x H, w2 H x I)
    for tokens in args.tokens:
        x, ids, route_w = random_batch(m, tokens, gen)
        routing = Routing.unpacked(ids, route_w)
        acts = config.prepare_activations(x)
        out = torch.empty(tokens, m.hidden, device=x.device, dtype=torch.bfloat16)
        ours = time_us(lambda: fused_moe(config, acts, routing, weights, out=out), 3, args.iters)
        peer = time_us(lambda: grouped_mm_layer(x, ids.long(), route_w, w1_t, w2_t, m.intermediate), 3, args.iters)
        active = int(torch.unique(ids).numel())
        compute_floor = 2 * tokens * m.top_k * per_expert / (args.peak_tflops * 1e12) * 1e6
        fp4_floor = max(active * per_expert * (0.5 + 1 / 16) / (args.bandwidth_tbs * 1e12) * 1e6, compute_floor)
        bf16_floor = max(active * per_expert * 2 / (args.bandwidth_tbs * 1e12) * 1e6, compute_floor)
        emit(lines, f"| {m.name} | {tokens} | {ours:.1f} | {fp4_floor:.1f} | {ours / fp4_floor:.1f} | "
                    f"{peer:.1f} | {bf16_floor:.1f} | {peer / bf16_floor:.1f} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 8, 64, 512, 4096])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--bandwidth-tbs", type=float, default=4.3, help="HBM bandwidth for the floor (TB/s)")
    parser.add_argument("--peak-tflops", type=float, default=790.0, help="BF16 tensor-core peak for the floor")
    parser.add_argument("--markdown", type=Path, help="also write the table here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_moe needs a CUDA GPU", file=sys.stderr)
        return 2
    header = (f"{datetime.date.today()} | {torch.cuda.get_device_name()} | cuDNN backend {backend_version()} | "
              f"torch {torch.__version__} | floor: {args.bandwidth_tbs} TB/s, {args.peak_tflops} TFLOP/s BF16")
    lines = [header, "",
             "| model | T | ours (us) | floor (us) | ours/floor | grouped_mm BF16 (us) | BF16 floor (us) | grouped_mm/BF16 floor |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    print(header, flush=True)
    return run_table(args, lines, bench_model)


if __name__ == "__main__":
    raise SystemExit(main())
