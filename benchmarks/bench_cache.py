"""Time to the first finished fused_moe call in a fresh process: empty cache vs a prebuilt one.

For a preset's layer shape (graphs/presets.json) at T tokens (default 1):
1. ``python -m cudnn_moe prebuild --preset NAME --buckets <bucket of T>`` into a temporary cache dir.
2. A fresh process with an EMPTY cache dir (cold), then a fresh process with the prebuilt one (warm),
   each: torch imported, CUDA initialized and the seeded float weights and input made first; then the
   clock starts, ``import cudnn_moe``, prepare weights and activations, one ``fused_moe`` call, sync.
3. Prints both side by side (import / prepare / first call / total), how many cache entries the warm
   process loaded from disk and built, and whether the two outputs are bitwise equal.

Target: warm first call <= 100 ms after import. ``--profile N`` also prints the N functions with the most
cumulative time in the warm process's first call (cProfile), to say where its time goes.
Usage: python benchmarks/bench_cache.py --preset qwen3-30b-a3b [--engine cudnn] [--profile 25] [--markdown PATH]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from checkout import ROOT, add_checkout  # the script's folder is first on sys.path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--preset", default="qwen3-30b-a3b", help="a preset of graphs/presets.json")
    parser.add_argument("--engine", default="auto", help="GEMM engine: auto, sm90 or cudnn (default auto)")
    parser.add_argument("--tokens", type=int, default=1, help="T of the timed call (default 1)")
    parser.add_argument("--markdown", type=Path, default=None, metavar="PATH", help="also write the report here")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="profile the warm first call and print its N costliest functions (cumulative)")
    parser.add_argument("--child", type=Path, default=None, help=argparse.SUPPRESS)  # internal: run one timed process
    return parser.parse_args(argv)


def _env(cache: Path) -> dict[str, str]:
    add_checkout()
    return {**os.environ, "CUDNN_MOE_CACHE_DIR": str(cache), "PYTHONPATH": os.pathsep.join(sys.path)}


def child(args: argparse.Namespace) -> int:
    """One timed fresh process; writes its output tensor and a JSON report next to args.child."""
    import torch

    add_checkout()
    presets = json.loads((ROOT / "graphs" / "presets.json").read_text())
    p = presets[args.preset]
    e, h, i, k, t = p["experts"], p["hidden"], p["intermediate"], p["top_k"], args.tokens
    torch.cuda.init()
    gen = torch.Generator(device="cuda").manual_seed(1234)
    like = dict(device="cuda", dtype=torch.bfloat16, generator=gen)
    w1 = torch.randn(e, 2 * i, h, **like) / h**0.5
    w2 = torch.randn(e, h, i, **like) / i**0.5
    x = torch.randn(t, h, **like)
    ids = torch.rand(t, e, device="cuda", generator=gen).argsort(1)[:, :k].to(torch.int32)
    route = torch.rand(t, k, device="cuda", generator=gen) + 0.1
    torch.cuda.synchronize()

    start = time.perf_counter()
    import cudnn_moe
    from cudnn_moe.cache import stats

    imported = time.perf_counter()
    config = cudnn_moe.Nvfp4MoeConfig(max_num_tokens=t, engine=args.engine)
    weights = config.prepare_weights(w1, w2)
    acts = config.prepare_activations(x)
    torch.cuda.synchronize()
    routing = cudnn_moe.Routing.unpacked(ids, route)
    profiler = cProfile.Profile() if args.profile else None
    prepared = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    out = cudnn_moe.fused_moe(config, acts, routing, weights)
    torch.cuda.synchronize()
    done = time.perf_counter()
    profile_text = ""
    if profiler is not None:
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(args.profile)
        profile_text = text.getvalue()

    torch.save(out.cpu(), args.child.with_suffix(".pt"))
    counts = stats()
    report = {
        "import_ms": (imported - start) * 1e3,
        "prepare_ms": (prepared - imported) * 1e3,
        "first_call_ms": (done - prepared) * 1e3,
        "total_ms": (done - start) * 1e3,
        "engine": weights.spec.engine,
        "loaded": sum(v for (_, source), v in counts.items() if source == "disk"),
        "built": sum(v for (_, source), v in counts.items() if source == "built"),
        "by_kind": {f"{kind} {source}": v for (kind, source), v in sorted(counts.items())},
        "profile": profile_text,
    }
    args.child.write_text(json.dumps(report))
    return 0


def _timed_process(args: argparse.Namespace, cache: Path, report: Path, profile: int = 0) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(report), "--preset", args.preset,
           "--engine", args.engine, "--tokens", str(args.tokens), "--profile", str(profile)]
    subprocess.run(cmd, env=_env(cache), check=True)
    return json.loads(report.read_text())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child is not None:
        return child(args)
    import torch

    if not torch.cuda.is_available():
        print("bench_cache needs a CUDA GPU", file=sys.stderr)
        return 1
    bucket = 1 << max(0, (args.tokens - 1).bit_length())
    with tempfile.TemporaryDirectory(prefix="cudnn_moe_bench_cache_") as tmp:
        root = Path(tmp)
        prebuilt, empty = root / "prebuilt", root / "empty"
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "cudnn_moe", "prebuild", "--preset", args.preset, "--buckets", str(bucket),
                        "--engine", args.engine, "--cache-dir", str(prebuilt), "--quiet"],
                       env=_env(prebuilt), check=True)
        prebuild_s = time.perf_counter() - start
        cold = _timed_process(args, empty, root / "cold.json")
        warm = _timed_process(args, prebuilt, root / "warm.json")
        profiled = _timed_process(args, prebuilt, root / "profiled.json", args.profile) if args.profile else None
        a, b = torch.load(root / "cold.pt"), torch.load(root / "warm.pt")
        equal = a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))
    lines = [
        f"First fused_moe call in a fresh process: preset {args.preset}, T={args.tokens}, engine {cold['engine']} "
        f"({torch.cuda.get_device_name()}); prebuild of bucket {bucket} took {prebuild_s:.1f} s",
        "",
        "| cache | import ms | prepare ms | first call ms | total ms | entries loaded | entries built |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        *(f"| {name} | {r['import_ms']:.1f} | {r['prepare_ms']:.1f} | {r['first_call_ms']:.1f} | {r['total_ms']:.1f} | "
          f"{r['loaded']} | {r['built']} |" for name, r in (("empty (cold)", cold), ("prebuilt (warm)", warm))),
        "",
        f"warm entries by kind: {warm['by_kind']}",
        f"outputs bitwise equal (cold vs warm): {equal}",
        f"target: warm first call <= 100 ms: {'met' if warm['first_call_ms'] <= 100 else 'NOT met'} "
        f"({warm['first_call_ms']:.1f} ms; import to result {warm['total_ms']:.1f} ms)",
    ]
    if profiled is not None:
        lines += ["", f"profile of a warm first call ({profiled['first_call_ms']:.1f} ms under cProfile):", "```",
                  profiled["profile"].strip(), "```"]
    text = "\n".join(lines)
    print(text)
    if args.markdown is not None:
        args.markdown.write_text(text + "\n")
    return 0 if equal else 1


if __name__ == "__main__":
    raise SystemExit(main())
