"""The low-latency op's test material, shared by tests/ops/low_latency/ (CPU and GPU modules): the (format, token
dtype) cases, random layers, tokens and routing on the GPU, NaN-filled outputs, and the comparison with the
float64 references of cudnn_moe.low_latency.reference.

Tolerances. The kernels round at exactly the reference's points (preactivation, intermediate, expert rows,
final sum: see the reference's module docstring); inside each GEMM they sum exact products in FP32 in another
order than the reference's float64 sum rounded to FP32. The two FP32 sums differ by a few FP32 ulps of the
sum of |terms| (far below a 16-bit ulp), so a rounding to BF16/FP16 can only differ where a value lies that
close to a rounding boundary: one 16-bit ulp at that point. A flipped intermediate moves a row by about
2^-8 |w2 y| / sqrt(I) (one of I terms), and a flipped row moves the output by one ulp of the output dtype. So
each output element must be within 2 ulps of the output dtype of the reference (relative) plus 2^-9 of the
largest |reference| (absolute, for the flips propagated through GEMM2 and the combine), the relative L2 error
must stay below 2^-8, and most elements must be bitwise equal (the rounding points are the same).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from cudnn_moe.activations import (
    GELU,
    Activation,
    GeGLU,
    GeGLUTanh,
    Identity,
    ReLU,
    ReLU2,
    SiLU,
    SiTU,
    SwiGLU,
    SwiGLUStep,
)
from cudnn_moe.low_latency import LowLatencyMoeConfig, WeightFormat, low_latency_moe
from cudnn_moe.routing import Routing, pack_routing
from cudnn_moe.weights.nvfp4 import Nvfp4Activations

# The ten activations of the contract, with non-default parameters where they have some.
ACTIVATIONS: tuple[Activation, ...] = (
    Identity(), ReLU(), GELU(), SiLU(), ReLU2(),
    SwiGLU(alpha=1.702, beta=1.0, limit=7.0), GeGLU(), GeGLUTanh(), SwiGLUStep(limit=2.0), SiTU(a=2.0, b=3.0),
)

FORMAT_CASES = [
    (WeightFormat.BF16, torch.bfloat16),
    (WeightFormat.FP16, torch.float16),
    (WeightFormat.NVFP4_WEIGHT_ONLY, torch.bfloat16),
    (WeightFormat.NVFP4_WEIGHT_ONLY, torch.float16),
    (WeightFormat.MXFP4_WEIGHT_ONLY, torch.bfloat16),
    (WeightFormat.MXFP4_WEIGHT_ONLY, torch.float16),
    (WeightFormat.MXINT4_WEIGHT_ONLY, torch.bfloat16),
    (WeightFormat.MXINT4_WEIGHT_ONLY, torch.float16),
    (WeightFormat.FP8_WEIGHT_ONLY, torch.bfloat16),
    (WeightFormat.FP8_WEIGHT_ONLY, torch.float16),
    (WeightFormat.NVFP4_W_NVFP4_A, torch.bfloat16),  # the pair stays last (tests index it as FORMAT_CASES[-1])
]

DEV = torch.device("cuda")
E, TOP_K = 8, 4
SHAPES = {  # (H, I): dense takes any H % 8 == 0 (here 25 chunks of 16 bytes a row), 4-bit H % 128 (pair % 512)
    "dense": (200, 72),
    "weight_only": (256, 96),
    "pair": (512, 128),
}
ROUTING_KINDS = ("packed", "fp32", "bf16", "int64")
ULP = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def _shape(fmt: WeightFormat) -> tuple[int, int]:
    if fmt in (WeightFormat.BF16, WeightFormat.FP16):
        return SHAPES["dense"]
    return SHAPES["pair" if fmt is WeightFormat.NVFP4_W_NVFP4_A else "weight_only"]


# ----------------------------------------------------------------------------- layers and inputs
def fp8_codes(gen: torch.Generator, shape: tuple[int, ...]) -> torch.Tensor:
    """float8_e4m3fn codes of N(0, 16^2) values (|code| up to 448: saturated), 3% replaced by random finite bytes
    (subnormals, the extremes, both zeros): no NaN code (0x7F / 0xFF)."""
    codes = (torch.randn(shape, generator=gen) * 16).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    wild = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
    wild = torch.where((wild & 0x7F) == 0x7F, wild - 1, wild)
    pick = torch.rand(shape, generator=gen) < 0.03
    return torch.where(pick, wild, codes).view(torch.float8_e4m3fn)


def mx_payloads(kind: str, gated: bool, experts: int, hidden: int, inter: int,
                seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(w1, w1 scale bytes, w2, w2 scale bytes) of random canonical MX weights on the CPU: "mxfp4" random packed
    E2M1 bytes uint8 [E, N1, H/2] / [E, H, I/2] with scales 2^-9 .. 2^-4, or "mxfp8" codes of fp8_codes [E, N1, H] /
    [E, H, I] with scales 2^-12 .. 2^-8 (dot products near unit size); scale bytes uint8 [E, N1, H/32] /
    [E, H, I/32] (E8M0: 2^(byte - 127)). N1 = 2I gated, else I."""
    gen = torch.Generator().manual_seed(seed)
    n1 = (2 if gated else 1) * inter
    if kind == "mxfp4":
        w1 = torch.randint(0, 256, (experts, n1, hidden // 2), generator=gen, dtype=torch.uint8)
        w2 = torch.randint(0, 256, (experts, hidden, inter // 2), generator=gen, dtype=torch.uint8)
        low, high = 118, 124
    else:
        w1, w2 = fp8_codes(gen, (experts, n1, hidden)), fp8_codes(gen, (experts, hidden, inter))
        low, high = 115, 120
    s1 = torch.randint(low, high, (experts, n1, hidden // 32), generator=gen, dtype=torch.uint8)
    s2 = torch.randint(low, high, (experts, hidden, inter // 32), generator=gen, dtype=torch.uint8)
    return w1, s1, w2, s2


def fp8_scales(gen: torch.Generator, experts: int, k: int) -> torch.Tensor:
    """float32 [E] per-expert scales putting the N(0, 16^2) codes' dot products of length k near unit size."""
    return (torch.rand(experts, generator=gen) * 0.5 + 0.75) / (16 * k**0.5)


def _scales(fmt: WeightFormat, gen: torch.Generator, shape: tuple[int, ...]) -> torch.Tensor:
    if fmt is WeightFormat.NVFP4_WEIGHT_ONLY:
        s = (torch.rand(shape, generator=gen) * 0.05 + 0.005).to(torch.float8_e4m3fn)
        sub = torch.rand(shape, generator=gen) < 0.05  # a few E4M3 subnormal scales
        return torch.where(sub, torch.randint(1, 8, shape, generator=gen, dtype=torch.uint8),
                           s.view(torch.uint8)).view(torch.float8_e4m3fn)
    if fmt is WeightFormat.MXFP4_WEIGHT_ONLY:  # 2^-9 .. 2^-4
        return torch.randint(118, 124, shape, generator=gen, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    return (torch.rand(shape, generator=gen) * 0.02 + 0.002).to(torch.bfloat16)


def make_layer(fmt: WeightFormat, gated: bool, experts: int = E, shape: tuple[int, int] | None = None, seed: int = 0):
    """(config, prepared weights) of one random layer on the GPU (activation SwiGLU when gated, else SiLU:
    only gatedness matters to the weights)."""
    hidden, inter = shape or _shape(fmt)
    config = LowLatencyMoeConfig(8)
    act = SwiGLU() if gated else SiLU()
    gen = torch.Generator().manual_seed(seed)
    n1 = act.gemm1_columns(inter)
    if fmt in (WeightFormat.BF16, WeightFormat.FP16, WeightFormat.NVFP4_W_NVFP4_A):
        dtype = torch.float16 if fmt is WeightFormat.FP16 else torch.bfloat16
        w1 = (torch.randn(experts, n1, hidden, generator=gen) / hidden**0.5).to(dtype).to(DEV)
        w2 = (torch.randn(experts, hidden, inter, generator=gen) / inter**0.5).to(dtype).to(DEV)
        method = {WeightFormat.BF16: config.prepare_bf16_weights, WeightFormat.FP16: config.prepare_fp16_weights,
                  WeightFormat.NVFP4_W_NVFP4_A: config.prepare_nvfp4_weights}[fmt]
        return config, method(w1, w2, activation=act)
    if fmt is WeightFormat.FP8_WEIGHT_ONLY:
        w1, w2 = fp8_codes(gen, (experts, n1, hidden)), fp8_codes(gen, (experts, hidden, inter))
        s1, s2 = fp8_scales(gen, experts, hidden), fp8_scales(gen, experts, inter)
        return config, config.prepare_fp8_weight_only_weights(w1.to(DEV), s1.to(DEV), w2.to(DEV), s2.to(DEV),
                                                              activation=act)
    block = 16 if fmt is WeightFormat.NVFP4_WEIGHT_ONLY else 32
    c1 = torch.randint(0, 256, (experts, n1, hidden // 2), generator=gen, dtype=torch.uint8)
    s1 = _scales(fmt, gen, (experts, n1, hidden // block))
    c2 = torch.randint(0, 256, (experts, hidden, inter // 2), generator=gen, dtype=torch.uint8)
    s2 = _scales(fmt, gen, (experts, hidden, inter // block))
    c1, s1, c2, s2 = (t.to(DEV) for t in (c1, s1, c2, s2))
    if fmt is WeightFormat.NVFP4_WEIGHT_ONLY:
        g1, g2 = ((torch.rand(experts, generator=gen) + 0.5).to(DEV) for _ in range(2))
        return config, config.prepare_nvfp4_weight_only_weights(c1, s1, g1, c2, s2, g2, activation=act)
    method = config.prepare_mxfp4_weight_only_weights if fmt is WeightFormat.MXFP4_WEIGHT_ONLY else config.prepare_mxint4_weight_only_weights
    return config, method(c1, s1, c2, s2, activation=act)


def make_inputs(config: LowLatencyMoeConfig, fmt: WeightFormat, x_dtype: torch.dtype, tokens: int, hidden: int,
                seed: int = 1) -> torch.Tensor | Nvfp4Activations:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(DEV)
    if fmt is WeightFormat.NVFP4_W_NVFP4_A:
        return config.prepare_nvfp4_activations(x)
    return x.to(x_dtype)


def random_ids(tokens: int, top_k: int, experts: int, seed: int) -> torch.Tensor:
    """int64 [T, k]: distinct experts per token."""
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]) if tokens else \
        torch.zeros(0, top_k, dtype=torch.int64)


def shared_expert_ids() -> torch.Tensor:
    """int64 [8, TOP_K]: every token names expert 5 (8 tokens on one expert: the widest token loop), token 2
    names an expert twice more, token 4 once more."""
    ids = random_ids(8, TOP_K, E, 11)
    ids[:, 0] = 5
    ids[2, 1] = ids[2, 3] = 5 if ids[2, 2] != 5 else 6
    ids[4, 2] = ids[4, 3]
    return ids


def make_routing(ids: torch.Tensor, kind: str, seed: int = 2, weights: torch.Tensor | None = None) -> Routing:
    """Routing of ids [T, k] (int64, CPU) with random positive weights (or ``weights``), in one of ROUTING_KINDS."""
    gen = torch.Generator().manual_seed(seed)
    w = weights if weights is not None else torch.rand(ids.shape, generator=gen) + 0.05
    if kind == "packed":
        return Routing.packed(pack_routing(ids, w).to(DEV))
    if kind == "int64":
        return Routing.unpacked(ids.to(DEV), w.float().to(DEV))
    dtype = torch.float32 if kind == "fp32" else torch.bfloat16
    return Routing.unpacked(ids.to(torch.int32).to(DEV), w.to(dtype).to(DEV))


def nan_out(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.full(shape, math.nan, dtype=dtype, device=DEV)


# ----------------------------------------------------------------------------- calls and CUDA graphs
def run_low_latency(config: LowLatencyMoeConfig, x: Any, weights: Any, routing: Routing, out: torch.Tensor,
                    scores: torch.Tensor, finalize: bool, **options: Any) -> None:
    """One low_latency_moe call: finalized into out [T, H], or the raw rows into out [T, k, H] with their routing
    scores into scores [T, k]."""
    if finalize:
        low_latency_moe(config, x, weights, routing, out=out, **options)
    else:
        low_latency_moe(config, x, weights, routing, finalize=False, out=out, return_scores=True, scores_out=scores,
                        **options)


@dataclass
class ReplayedCall:
    """What replay_equals_eager saw: the eager call's outputs (equal to the replay's, bit for bit) and the values
    ``call`` returned inside the capture and in the eager run."""

    out: torch.Tensor
    scores: torch.Tensor
    captured: Any
    eager: Any


def replay_equals_eager(call: Callable[[torch.Tensor, torch.Tensor], Any], shape: tuple[int, ...], top_k: int,
                        out_dtype: torch.dtype, finalize: bool, change_inputs: Callable[[], None]) -> ReplayedCall:
    """``call(out, scores)`` warmed up, captured in one CUDA graph, then replayed into NaN-poisoned outputs after
    ``change_inputs()`` rewrote its inputs in place; an eager call on the new inputs into fresh poisoned outputs.
    Asserts that the replay wrote every output and equals the eager call bit for bit (the raw calls' scores too)."""
    captured, captured_scores = nan_out(shape, out_dtype), nan_out((shape[0], top_k), torch.float32)
    call(captured, captured_scores)  # warm-up: kernels and workspace
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        in_graph = call(captured, captured_scores)
    change_inputs()
    captured.fill_(math.nan)
    captured_scores.fill_(math.nan)
    graph.replay()
    eager, eager_scores = nan_out(shape, out_dtype), nan_out((shape[0], top_k), torch.float32)
    result = call(eager, eager_scores)
    torch.cuda.synchronize()
    assert not bool(captured.isnan().any()), "the replay left outputs unwritten"
    same = captured.view(torch.int16) == eager.view(torch.int16)
    assert bool(same.all()), f"replay differs from eager at {int((~same).sum())} of {same.numel()} elements"
    if not finalize:
        assert torch.equal(captured_scores.view(torch.int32), eager_scores.view(torch.int32)), "replayed scores"
    return ReplayedCall(eager, eager_scores, in_graph, result)


# ----------------------------------------------------------------------------- comparison
def assert_close_to_reference(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """got and want of one 16-bit dtype; the bounds of the module docstring."""
    assert got.dtype == want.dtype and got.shape == want.shape, f"{what}: got {got.dtype} {tuple(got.shape)}, want {want.dtype} {tuple(want.shape)}"
    nan = got.isnan()
    assert not bool(want.isnan().any()), f"{what}: the reference has NaN (test inputs are wrong)"
    assert not bool(nan.any()), f"{what}: {int(nan.sum())} of {got.numel()} outputs are NaN (not written, or NaN leaked), first at {nan.nonzero()[0].tolist()}"
    g, w = got.double(), want.double()
    scale = float(w.abs().max())
    assert scale > 0, f"{what}: the reference is all zero, the test proves nothing"
    ulp = ULP[want.dtype]
    err = (g - w).abs()
    bound = 2 * ulp * w.abs() + 2.0**-9 * scale
    worst = int((err - bound).argmax())
    assert bool((err <= bound).all()), (
        f"{what}: element {worst} (flat) got {float(g.flatten()[worst])} want {float(w.flatten()[worst])}, "
        f"|diff| {float(err.flatten()[worst]):.3g} > bound {float(bound.flatten()[worst]):.3g}; "
        f"{int((err > bound).sum())} of {err.numel()} elements out of bounds; max |ref| {scale:.3g}")
    rel_l2 = float((g - w).norm() / w.norm())
    assert rel_l2 <= 2.0**-8, f"{what}: relative L2 error {rel_l2:.3g} > 2^-8"
    equal = float((got.view(torch.int16) == want.view(torch.int16)).double().mean())
    assert equal >= 0.5, f"{what}: only {equal:.1%} of elements are bitwise equal to the reference (expected most)"


class NullWorkspace:
    """Stands in for an engine's workspace in CPU tests of the op's call path (no buffers, no stream order)."""

    buffers = None

    class order:
        @staticmethod
        def use() -> contextlib.AbstractContextManager:
            return contextlib.nullcontext()
