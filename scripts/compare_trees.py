"""Run the three ops on fixed seeds under two package trees and compare their outputs bit for bit.

For a reshape that must not change behaviour: the same public calls (fused_moe finalized and unfinalized,
aligned_moe with and without ``prepared``, low_latency_moe in every format, finalized and raw, several T)
run in one fresh process per tree, each saving its outputs; then every output is compared bitwise. With
--memory the worker also reports the weight memory each op holds for a DeepSeek-V3 layer (E=256, H=7168,
I=2048): bytes allocated by preparing its weights, and more after its first call (layouts made on first
use).

Usage (GPU): python scripts/compare_trees.py OLD_TREE NEW_TREE [--memory] [--out DIR]
  where each tree is a folder holding a cudnn_moe package (e.g. `git archive <commit> cudnn_moe kernels_cuda
  graphs | tar -x -C OLD_TREE`). Exit status 0 when every output is bitwise equal.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

SEED = 20261201


def _bits(t):  # noqa: ANN001, ANN202
    import torch

    return t.detach().contiguous().view(torch.uint8).cpu()


def _fused(results: dict) -> None:
    import torch

    import cudnn_moe as cm

    gen = torch.Generator(device="cuda").manual_seed(SEED)
    e, h, i, k = 16, 512, 256, 4
    config = cm.Nvfp4MoeConfig(max_num_tokens=256)
    weights = config.prepare_weights(torch.randn(e, 2 * i, h, device="cuda", generator=gen) * h**-0.5,
                                     torch.randn(e, h, i, device="cuda", generator=gen) * i**-0.5)
    for t in (1, 3, 8, 64, 200):
        x = torch.randn(t, h, device="cuda", generator=gen)
        ids = torch.rand(t, e, device="cuda", generator=gen).argsort(1)[:, :k].to(torch.int32)
        routing = cm.Routing.unpacked(ids, torch.rand(t, k, device="cuda", generator=gen) + 0.1)
        acts = config.prepare_activations(x)
        out = torch.empty(t, h, dtype=torch.bfloat16, device="cuda")
        for _ in range(3):  # eager, cached signature, full-call graph
            cm.fused_moe(config, acts, routing, weights, out=out)
            results[f"fused T{t}"] = _bits(out)
        raw = cm.fused_moe(config, acts, routing, weights, finalize=False)
        results[f"fused raw rows T{t}"] = _bits(raw.rows)
        results[f"fused raw map T{t}"] = _bits(raw.token_to_row)


def _aligned(results: dict) -> None:
    import torch

    import cudnn_moe as cm
    from cudnn_moe.formats import quantize_nvfp4

    gen = torch.Generator(device="cuda").manual_seed(SEED + 1)
    e, k_dim, n, top_k = 16, 512, 512, 4
    w1, w1s = quantize_nvfp4(torch.randn(e, n, k_dim, device="cuda", generator=gen) * k_dim**-0.5)
    w2, w2s = quantize_nvfp4(torch.randn(e, k_dim, n // 2, device="cuda", generator=gen) * (n // 2) ** -0.5)
    scales = [(0.5 + torch.rand(e, device="cuda", generator=gen)) for _ in range(3)]
    prepared = cm.prepare_aligned_weights(w1, w1s, w2, w2s)
    for m in (1, 5, 40, 300):
        x, xs = quantize_nvfp4(torch.randn(m, k_dim, device="cuda", generator=gen))
        ids = torch.rand(m, e, device="cuda", generator=gen).argsort(1)[:, :top_k].to(torch.int32)
        topk_w = torch.rand(m, top_k, device="cuda", generator=gen) + 0.1
        out0 = torch.randn(m, k_dim, device="cuda", generator=gen).to(torch.bfloat16)
        plan = cm.align_routing(ids, 16, e)
        for label, ready in (("prepared", prepared), ("on the fly", None)):
            out = out0.clone()
            for _ in range(3):
                out.copy_(out0)
                cm.aligned_moe(x, xs, w1, w1s, w2, w2s, *scales, *plan, topk_w, out, top_k, 16, 1.5, prepared=ready)
            results[f"aligned {label} M{m}"] = _bits(out)


def _prepare(config: object, fmt: str):
    """config's weight-only prepare of ``fmt``: the contract's name, or the earlier short one (older trees)."""
    return getattr(config, f"prepare_{fmt}_weight_only_weights", None) or getattr(config, f"prepare_{fmt}_weight_only")


def _low_latency(results: dict) -> None:
    import torch

    import cudnn_moe as cm
    from cudnn_moe.formats import quantize_mxfp4, quantize_mxint4, quantize_nvfp4

    gen = torch.Generator(device="cuda").manual_seed(SEED + 2)
    e, h, i, k = 8, 512, 256, 4
    config = cm.LowLatencyMoeConfig(max_num_tokens=8)
    w1 = (torch.randn(e, 2 * i, h, device="cuda", generator=gen) * h**-0.5).to(torch.bfloat16)
    w2 = (torch.randn(e, h, i, device="cuda", generator=gen) * i**-0.5).to(torch.bfloat16)
    g1, g2 = (0.5 + torch.rand(e, device="cuda", generator=gen) for _ in range(2))
    c1, s1 = quantize_nvfp4(w1.float())
    c2, s2 = quantize_nvfp4(w2.float())
    m1, ms1 = quantize_mxfp4(w1.float())
    m2, ms2 = quantize_mxfp4(w2.float())
    n1, ns1 = quantize_mxint4(w1.float())
    n2, ns2 = quantize_mxint4(w2.float())
    layers = {
        "bf16": (config.prepare_bf16_weights(w1, w2), torch.bfloat16),
        "fp16": (config.prepare_fp16_weights(w1.half(), w2.half()), torch.float16),
        "nvfp4 weight-only": (_prepare(config, "nvfp4")(c1, s1, g1, c2, s2, g2), torch.bfloat16),
        "nvfp4 weight-only fp16": (_prepare(config, "nvfp4")(c1, s1, g1, c2, s2, g2), torch.float16),
        "mxfp4": (_prepare(config, "mxfp4")(m1, ms1, m2, ms2), torch.bfloat16),
        "mxint4": (_prepare(config, "mxint4")(n1, ns1, n2, ns2), torch.bfloat16),
        "nvfp4 pair": (config.prepare_nvfp4_weights(w1, w2), None),
    }
    for t in (1, 2, 5, 8):
        x = torch.randn(t, h, device="cuda", generator=gen)
        ids = torch.rand(t, e, device="cuda", generator=gen).argsort(1)[:, :k].to(torch.int32)
        routing = cm.Routing.unpacked(ids, torch.rand(t, k, device="cuda", generator=gen) + 0.1)
        for name, (weights, dtype) in layers.items():
            inputs = config.prepare_nvfp4_activations(x) if dtype is None else x.to(dtype)
            out_dtype = torch.float16 if dtype is torch.float16 else torch.bfloat16
            out = torch.empty(t, h, dtype=out_dtype, device="cuda")
            for _ in range(3):
                cm.low_latency_moe(config, inputs, weights, routing, out=out, out_dtype=out_dtype)
            results[f"low_latency {name} T{t}"] = _bits(out)
            raw = cm.low_latency_moe(config, inputs, weights, routing, finalize=False, out_dtype=out_dtype)
            results[f"low_latency {name} raw T{t}"] = _bits(raw)


def _memory() -> dict:
    """Bytes of GPU memory each op holds for one DeepSeek-V3 layer, after preparing and after a first call."""
    import gc

    import torch

    import cudnn_moe as cm
    from cudnn_moe.formats import quantize_nvfp4

    e, h, i, k = 256, 7168, 2048, 8
    gen = torch.Generator(device="cuda").manual_seed(SEED + 3)
    report = {}

    def release() -> None:
        """Free what earlier steps dropped (a tree with deferred release keeps it until the next call)."""
        gc.collect()
        try:
            from cudnn_moe.pipeline.lifetime import release_deferred
        except ImportError:  # a tree that frees at once
            return
        release_deferred()

    def held(make):  # noqa: ANN001, ANN202
        release()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        state = make()
        torch.cuda.synchronize()
        prepared = torch.cuda.memory_allocated() - base
        return state, base, prepared

    w1 = (torch.randn(e, 2 * i, h, device="cuda", generator=gen) * h**-0.5).to(torch.bfloat16)
    w2 = (torch.randn(e, h, i, device="cuda", generator=gen) * i**-0.5).to(torch.bfloat16)
    x = torch.randn(8, h, device="cuda", generator=gen)
    ids = torch.rand(8, e, device="cuda", generator=gen).argsort(1)[:, :k].to(torch.int32)
    routing = cm.Routing.unpacked(ids, torch.rand(8, k, device="cuda", generator=gen) + 0.1)

    config = cm.Nvfp4MoeConfig(max_num_tokens=8)
    weights, base, prepared = held(lambda: config.prepare_weights(w1, w2))
    cm.fused_moe(config, config.prepare_activations(x), routing, weights)
    torch.cuda.synchronize()
    report["fused_moe"] = (prepared, torch.cuda.memory_allocated() - base)
    del weights

    def quantize(w):  # noqa: ANN001, ANN202 -- a few experts at a time, so the float32 copies stay small
        parts = [quantize_nvfp4(w[j : j + 16].float()) for j in range(0, w.shape[0], 16)]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

    (a1, a1s), (a2, a2s) = quantize(w1), quantize(w2)
    caller_bytes = sum(t.numel() * t.element_size() for t in (a1, a1s, a2, a2s))
    prepared_w, base, prepared = held(lambda: cm.prepare_aligned_weights(a1, a1s, a2, a2s))
    report["aligned_moe (caller's raw tensors not counted)"] = (prepared, prepared)
    report["aligned_moe caller's raw tensors"] = (caller_bytes, caller_bytes)
    del prepared_w

    ll = cm.LowLatencyMoeConfig(max_num_tokens=8)
    c1, s1, c2, s2 = a1, a1s, a2, a2s  # the same canonical NVFP4 payloads
    g1, g2 = torch.ones(e, device="cuda"), torch.ones(e, device="cuda")
    weights, base, prepared = held(lambda: _prepare(ll, "nvfp4")(c1, s1, g1, c2, s2, g2))
    cm.low_latency_moe(ll, x.to(torch.bfloat16), weights, routing)
    torch.cuda.synchronize()
    report["low_latency_moe nvfp4 weight-only"] = (prepared, torch.cuda.memory_allocated() - base)
    return report


def worker(out_path: Path, memory: bool) -> int:
    import torch

    import cudnn_moe

    out_path.with_suffix(".from").write_text(str(Path(cudnn_moe.__file__).resolve().parent.parent))
    results: dict = {}
    _fused(results)
    _aligned(results)
    _low_latency(results)
    torch.save(results, out_path)
    if memory:
        out_path.with_suffix(".json").write_text(json.dumps(_memory()))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("old", type=Path, help="a folder holding the old cudnn_moe package")
    parser.add_argument("new", type=Path, help="a folder holding the new cudnn_moe package")
    parser.add_argument("--memory", action="store_true", help="also report each op's weight memory (DeepSeek-V3)")
    parser.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        return worker(args.worker, args.memory)
    import torch

    with tempfile.TemporaryDirectory(prefix="cudnn_moe_compare_") as tmp:
        saved = {}
        for label, tree in (("old", args.old), ("new", args.new)):
            path = Path(tmp) / f"{label}.pt"
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree.resolve()), *sys.path]),
                   "CUDNN_MOE_CACHE_DIR": str(Path(tmp) / f"cache-{label}")}
            cmd = [sys.executable, str(Path(__file__).resolve()), str(args.old), str(args.new), "--worker", str(path)]
            subprocess.run(cmd + (["--memory"] if args.memory else []), env=env, check=True, cwd=tmp)
            imported = path.with_suffix(".from").read_text()
            if imported != str(tree.resolve()):
                raise SystemExit(f"compare_trees: the {label} worker imported cudnn_moe from {imported}, not {tree}")
            saved[label] = (torch.load(path), json.loads(path.with_suffix(".json").read_text()) if args.memory else {})
        (old, old_mem), (new, new_mem) = saved["old"], saved["new"]
    differ = [name for name in old if name not in new or not torch.equal(old[name], new[name])]
    print(f"{len(old)} outputs compared: {len(old) - len(differ)} bitwise equal, {len(differ)} differ")
    for name in differ:
        print(f"  DIFFERS: {name}")
    if args.memory:
        print("\n| op (DeepSeek-V3 layer) | old: prepared / after first call (GB) | new: prepared / after first call (GB) |")
        print("| --- | ---: | ---: |")
        for name in new_mem:
            o, n = old_mem.get(name, (float("nan"),) * 2), new_mem[name]
            print(f"| {name} | {o[0] / 1e9:.3f} / {o[1] / 1e9:.3f} | {n[0] / 1e9:.3f} / {n[1] / 1e9:.3f} |")
    return 1 if differ else 0


if __name__ == "__main__":
    raise SystemExit(main())
