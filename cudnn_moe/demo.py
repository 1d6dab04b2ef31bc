"""The demo job: quantize a random MoE layer, run the float reference, and the GPU op when possible."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .activations import parse_activation
from .formats import dequantize_nvfp4
from .fused.config import Nvfp4MoeConfig
from .fused.reference import reference_for_prepared
from .routing import Routing


@dataclass(frozen=True)
class DemoShape:
    """Sizes of the demo layer."""

    experts: int = 8
    hidden: int = 256
    intermediate: int = 256
    top_k: int = 2
    tokens: int = 16
    seed: int = 0
    activation: str = "swiglu"


def random_layer(shape: DemoShape, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Routing]:
    """Random BF16 x [T, H], w1 [E, N1, H], w2 [E, H, I] and a distinct-expert top-k routing."""
    gen = torch.Generator().manual_seed(shape.seed)
    rows1 = parse_activation(shape.activation).gemm1_columns(shape.intermediate)
    x = torch.randn(shape.tokens, shape.hidden, generator=gen)
    w1 = torch.randn(shape.experts, rows1, shape.hidden, generator=gen) / shape.hidden**0.5
    w2 = torch.randn(shape.experts, shape.hidden, shape.intermediate, generator=gen) / shape.intermediate**0.5
    ids = torch.rand(shape.tokens, shape.experts, generator=gen).argsort(dim=1)[:, : shape.top_k].to(torch.int32)
    weights = torch.softmax(torch.randn(shape.tokens, shape.top_k, generator=gen), dim=1)
    to = dict(device=device, dtype=torch.bfloat16)
    return x.to(**to), w1.to(**to), w2.to(**to), Routing.unpacked(ids.to(device), weights.to(device))


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def run_demo(shape: DemoShape = DemoShape()) -> None:
    """Print a short report: quantization error, reference output, and the GPU op's error."""
    if shape.tokens < 1 or shape.experts < 1 or not 1 <= shape.top_k <= shape.experts:
        raise ValueError(f"the demo needs tokens >= 1 and 1 <= top_k <= experts, got {shape}")
    gpu = torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    act = parse_activation(shape.activation)
    config = Nvfp4MoeConfig(max_num_tokens=max(shape.tokens, 1))
    x, w1, w2, routing = random_layer(shape, device)
    weights = config.prepare_weights(w1, w2, activation=act)
    acts = config.prepare_activations(x)
    w1_codes, w1_scales, w2_codes, w2_scales = weights.canonical()
    print(f"layer: E={shape.experts} H={shape.hidden} I={shape.intermediate} top-{shape.top_k} "
          f"T={shape.tokens} activation={type(act).__name__} device={device}")
    print(f"NVFP4 round-trip error: activations {_rel_err(dequantize_nvfp4(acts.packed, acts.scales), x):.4f}  "
          f"w1 {_rel_err(dequantize_nvfp4(w1_codes, w1_scales) * weights.w1_alpha[:, None, None], w1):.4f}  "
          f"w2 {_rel_err(dequantize_nvfp4(w2_codes, w2_scales) * weights.w2_alpha[:, None, None], w2):.4f}")
    start = time.perf_counter()
    ref = reference_for_prepared(acts, weights, routing, act)
    print(f"float64 reference: output [{ref.shape[0]}, {ref.shape[1]}], rms {float(ref.pow(2).mean().sqrt()):.4f}, "
          f"computed in {(time.perf_counter() - start) * 1e3:.1f} ms on {device}")
    if not gpu:
        print("no CUDA GPU: the fused GPU op was not run")
        return
    from .fused.op import fused_moe

    out = fused_moe(config, acts, routing, weights, activation=act)
    torch.cuda.synchronize()
    start = time.perf_counter()
    repeats = 20
    for _ in range(repeats):
        fused_moe(config, acts, routing, weights, activation=act, out=out)
    torch.cuda.synchronize()
    per_call = (time.perf_counter() - start) / repeats * 1e6
    print(f"fused_moe ({weights.spec.engine} engine) on {torch.cuda.get_device_name()}: relative error vs reference {_rel_err(out, ref):.2e}, "
          f"{per_call:.0f} us per call (graph replay, wall clock)")
