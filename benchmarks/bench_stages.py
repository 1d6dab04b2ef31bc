"""Where the time of one fused NVFP4 MoE call goes: per-stage GPU time and host time per call.

Prints, per model and token count: the GPU time of each bucket-static stage (sort, permute,
GEMM1, activation, GEMM2; each captured alone in a CUDA graph, so launch overhead is excluded),
the whole call (stage + graph replay + finalize) on the GPU, and the host time to submit one
call to an idle GPU. Usage: python benchmarks/bench_stages.py --help
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_moe import MODELS, ModelShape, emit, random_batch, random_weights, run_table, time_us  # noqa: E402

from cudnn_moe import Nvfp4MoeConfig, Routing, SwiGLU, fused_moe  # noqa: E402
from cudnn_moe.ops import get_executor  # noqa: E402


def host_us_per_call(fn, calls: int = 50) -> float:
    """Median host time to submit fn() to an idle GPU, in microseconds."""
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def graphed_us(launch, iters: int, repeats: int = 10) -> float:
    """GPU time of one launch(), from a CUDA graph holding ``repeats`` of them."""
    launch()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            launch()
    return time_us(graph.replay, 2, iters) / repeats


def bench_model(m: ModelShape, args: argparse.Namespace, gen: torch.Generator, lines: list[str]) -> None:
    """One table row per token count for model ``m``: stage times, whole call, host time."""
    config = Nvfp4MoeConfig(max_num_tokens=max(args.tokens))
    weights = config.prepare_weights(*random_weights(m, gen))
    executor = get_executor(config, weights, top_k=m.top_k, activation=SwiGLU(), local_expert_start=0)
    for tokens in args.tokens:
        x, ids, route_w = random_batch(m, tokens, gen)
        routing = Routing.unpacked(ids, route_w)
        acts = config.prepare_activations(x)
        out = torch.empty(tokens, m.hidden, device=x.device, dtype=torch.bfloat16)
        call = lambda: fused_moe(config, acts, routing, weights, out=out)  # noqa: E731
        whole = time_us(call, 3, args.iters)
        stages = [graphed_us(launch, args.iters) for _, launch in executor.stages(executor.bucket(tokens))]
        host = host_us_per_call(call)
        emit(lines, f"| {m.name} | {tokens} | " + " | ".join(f"{t:.1f}" for t in stages)
             + f" | {whole:.1f} | {host:.1f} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 8, 64, 512, 4096])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--markdown", type=Path, help="also write the table here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_stages needs a CUDA GPU", file=sys.stderr)
        return 2
    stage_names = ["sort", "permute", "gemm1", "activation", "gemm2"]
    lines = [f"{torch.cuda.get_device_name()}: GPU us per stage (graphed alone), whole call; host us to submit one call", "",
             "| model | T | " + " | ".join(stage_names) + " | whole call (GPU) | host per call |",
             "| --- | ---: |" + " ---: |" * (len(stage_names) + 2)]
    return run_table(args, lines, bench_model)


if __name__ == "__main__":
    raise SystemExit(main())
