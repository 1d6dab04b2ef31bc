"""Probe (not committed): BF16-weight decode variants, GEMMs alone, L2 flushed, median us."""
import sys
from pathlib import Path
sys.path.insert(0, str(Path("benchmarks").resolve()))
import torch
from common import Timer, capture
from cudnn_moe.engines.sm90.kernels import DecodeVariant, grouped_gemm

torch.manual_seed(0)
dev = torch.device("cuda")
timer = Timer(20)
MODELS = {"qwen3": (128, 2048, 768), "dsv3": (256, 7168, 2048)}
VARIANTS = [(2, 4, 1, 2), (2, 2, 2, 2), (2, 2, 4, 2), (1, 4, 1, 4), (1, 2, 2, 4), (1, 2, 4, 4), (1, 4, 2, 4),
            (2, 2, 2, 3), (2, 4, 1, 3), (1, 8, 1, 4), (1, 4, 4, 4), (4, 2, 1, 1), (4, 2, 2, 1), (2, 4, 2, 2)]
for name, (E, H, I) in MODELS.items():
    w1 = torch.randn(E, 2 * I * H, device=dev, dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(E, H * I, device=dev, dtype=torch.bfloat16) * 0.02
    alpha = torch.full((E,), 1 / 256, device=dev)
    for T in (1, 8):
        used = torch.randperm(E)[: min(E, 8 * T if T == 1 else 60 if name == "dsv3" else 52)].sort().values
        counts = torch.zeros(E, dtype=torch.int32)
        counts[used] = 8
        offsets = torch.zeros(E + 1, dtype=torch.int32)
        offsets[1:] = counts.cumsum(0)
        rows = int(offsets[-1])
        offsets = offsets.to(dev)
        for g, (w, n, k) in (("gemm1", (w1, 2 * I, H)), ("gemm2", (w2, H, I))):
            x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
            out = torch.empty(rows, n, device=dev, dtype=torch.bfloat16)
            mb = len(used) * n * k * 2 / 1e6
            cells = []
            for mt, wm, wk, p in VARIANTS:
                try:
                    v = DecodeVariant(mt=mt, wm=wm, wk=wk, nt=1, prefetch=p, bf16_weights=True)
                    fn = lambda: grouped_gemm(w, w, alpha, x, offsets, out, v)
                    fn()
                    us = timer.median_us(capture(fn).replay)
                    cells.append(f"({mt},{wm},{wk},{p}) {us:.1f} [{mb / us:.2f}]")
                except Exception as exc:  # noqa
                    cells.append(f"({mt},{wm},{wk},{p}) err {type(exc).__name__}")
            print(f"{name} T={T} {g} {mb:.0f}MB:", "; ".join(cells), flush=True)
