"""Host time per fused_moe call on a tiny layer (device time negligible): what the Python path costs.

Layer E=8, H=256, I=256, top-2 SwiGLU, T=1 (sizes adjustable). Each row: CALLS calls issued without a
sync between them, host time per call = wall time of the loop / CALLS, median over REPEATS loops:

- eager launches (use_cuda_graph=False, fresh out each call: no signature reuse)
- graph replay path (stage + bucket graph replay + finalize; out=None, so no full-call graph)
- repeated-signature full-call graph (same tensors and out every call: one graph replay)
- bare torch.cuda.CUDAGraph.replay() of the same full call, for reference

Usage: python benchmarks/bench_host.py [--calls 300] [--markdown PATH]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=256)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=1)
    parser.add_argument("--calls", type=int, default=300, help="calls per timed loop (default 300)")
    parser.add_argument("--repeats", type=int, default=5, help="timed loops per row; the median is reported")
    parser.add_argument("--engine", default="auto", help="GEMM engine: auto, sm90 or cudnn")
    parser.add_argument("--markdown", type=Path, default=None, metavar="PATH", help="also write the table here")
    return parser.parse_args(argv)


def host_us(step: Callable[[], object], calls: int, repeats: int) -> float:
    """Median over ``repeats`` loops of (wall time of ``calls`` unsynchronized calls) / calls, in us."""
    import torch

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            step()
        samples.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(samples)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench_host needs a CUDA GPU", file=sys.stderr)
        return 1
    from cudnn_moe import Nvfp4MoeConfig, Routing, SwiGLU, fused_moe

    gen = torch.Generator().manual_seed(0)
    e, h, i, k, t = args.experts, args.hidden, args.intermediate, args.top_k, args.tokens
    w1 = (torch.randn(e, 2 * i, h, generator=gen) / h**0.5).to("cuda", torch.bfloat16)
    w2 = (torch.randn(e, h, i, generator=gen) / i**0.5).to("cuda", torch.bfloat16)
    x = torch.randn(t, h, generator=gen).to("cuda", torch.bfloat16)
    ids = torch.rand(t, e, generator=gen).argsort(1)[:, :k].to("cuda", torch.int32)
    route = (torch.rand(t, k, generator=gen) + 0.1).cuda()
    config = Nvfp4MoeConfig(max_num_tokens=max(t, 1), engine=args.engine)
    weights = config.prepare_weights(w1, w2)
    acts = config.prepare_activations(x)
    routing = Routing.unpacked(ids, route)
    act = SwiGLU()
    out = torch.empty(t, h, dtype=torch.bfloat16, device="cuda")

    def eager() -> object:
        return fused_moe(config, acts, routing, weights, activation=act, use_cuda_graph=False,
                         out=torch.empty(t, h, dtype=torch.bfloat16, device="cuda"))

    def replay() -> object:
        return fused_moe(config, acts, routing, weights, activation=act)

    def full_graph() -> object:
        return fused_moe(config, acts, routing, weights, activation=act, out=out)

    full_graph()
    full_graph()  # the second call with this signature captures the full-call graph
    bare = torch.cuda.CUDAGraph()
    with torch.cuda.graph(bare):
        fused_moe(config, acts, routing, weights, activation=act, out=out)  # recorded into our graph

    rows = [
        ("eager launches (use_cuda_graph=False)", host_us(eager, args.calls, args.repeats)),
        ("graph replay path (stage + replay + finalize)", host_us(replay, args.calls, args.repeats)),
        ("repeated signature, full-call graph", host_us(full_graph, args.calls, args.repeats)),
        ("bare torch.cuda.CUDAGraph.replay()", host_us(bare.replay, args.calls, args.repeats)),
    ]
    torch.cuda.synchronize()
    lines = [
        f"Host time per call, E={e} H={h} I={i} top-{k} T={t}, engine {weights.spec.engine}, "
        f"{args.calls} calls without sync, median of {args.repeats} ({torch.cuda.get_device_name()})",
        "",
        "| path | host us / call |",
        "| --- | ---: |",
        *(f"| {name} | {us:.1f} |" for name, us in rows),
    ]
    text = "\n".join(lines)
    print(text)
    if args.markdown is not None:
        args.markdown.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
