"""One fused_moe call per model and token count inside a CUDA profiler range, for Nsight Compute.

Warms every call up first (buckets, plans, kernels and the call's graphs), then runs each once more between
``torch.cuda.profiler.start()`` and ``stop()``, so that ``ncu --profile-from-start off`` sees exactly the
kernels of those calls, in order (the SwiGLU random layers of bench_moe.py). For example:

    ncu --profile-from-start off --clock-control none --metrics gpu__time_duration.sum,dram__bytes_read.sum \\
        --csv python3 benchmarks/profile_call.py --models qwen3-30b-a3b --tokens 1 4096

ncu runs each kernel alone (no launch overlaps), so its times are per kernel, not the chain's.
Usage: python benchmarks/profile_call.py --help
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    MODELS,
    OP_FUSED,
    Report,
    engine_names,
    gpu_missing,
    moe_call,
    positive_int,
    prepare_engines,
    progress,
    random_weights,
    row_batch,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["qwen3-30b-a3b"], choices=list(MODELS),
                        help="presets of graphs/presets.json (default: %(default)s)")
    parser.add_argument("--tokens", nargs="+", type=positive_int, default=[1, 4096],
                        help="token counts T (default: %(default)s)")
    parser.add_argument("--engines", nargs="+", default=["sm90"], choices=engine_names(OP_FUSED),
                        help="Nvfp4MoeConfig engines (default: %(default)s)")
    args = parser.parse_args(argv)
    if gpu_missing("profile_call"):
        return 2
    calls = []
    for name in args.models:
        m = MODELS[name]
        gen = torch.Generator(device="cuda").manual_seed(0)
        progress(f"{m.name}: random BF16 weights, NVFP4 weights for {', '.join(args.engines)}")
        prepared = prepare_engines(m, *random_weights(m, gen), args.engines, max(args.tokens), Report())
        for tokens in args.tokens:
            batch = row_batch(m, tokens)
            for engine, (config, weights) in prepared.items():
                call = moe_call(config, weights, *batch)
                for _ in range(3):  # the eager call, then the full-call graph's capture and replay
                    call()
                calls.append((f"{m.name} T={tokens} {engine}", call))
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for label, call in calls:
        progress(f"profiled: {label}")
        call()
        torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
