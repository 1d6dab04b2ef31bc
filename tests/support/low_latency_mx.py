"""The MX pairs' GPU test material (MXFP4 / MXFP8 weights with MXFP8 tokens), shared by the op's tests
(tests/ops/low_latency/test_low_latency_mx_pair_gpu.py, whose docstring states the comparisons) and the ll_mma
engine's: random layers, tokens, and the checks of a call against ``reference_mx_pair`` through the intermediate
the engine left in its workspace."""

from __future__ import annotations

import functools

import torch

from cudnn_moe.activations import Activation, SiLU, SwiGLU
from cudnn_moe.low_latency import LowLatencyMoeConfig, Mxfp8Activations, mx_pair_intermediate, reference_mx_pair
from cudnn_moe.routing import Routing
from tests.support.low_latency import DEV, E, assert_close_to_reference, mx_payloads
from tests.support.low_latency_fp8 import engine_workspace

HIDDEN, INTER = 256, 96  # I = 96 pads to 128: GEMM1's last 32-feature block is padding
KINDS = ("mxfp4", "mxfp8")
OUT_DTYPES = (torch.bfloat16, torch.float16)


@functools.cache
def layer(kind: str, gated: bool, experts: int = E, shape: tuple[int, int] = (HIDDEN, INTER), seed: int = 0,
          engine: str = "cuda_cores"):
    """(config, prepared weights) of random MX payloads (tests.support.low_latency.mx_payloads); the config runs its
    calls on ``engine``, the CUDA cores by default, whose workspace check_call reads (the MXFP4 pair's SM90 chain,
    which "auto" takes where the shapes allow, has its own tests: tests/engines/sm90/test_mx_pair_sm90_gpu.py). On
    SM90 an MXFP4 pair is stored as tiles for the CUDA cores, row-major for ll_mma."""
    hidden, inter = shape
    w1, s1, w2, s2 = mx_payloads(kind, gated, experts, hidden, inter, seed)
    config = LowLatencyMoeConfig(8, engine=engine)
    weights = config.prepare_weights(w1.to(DEV), s1.view(torch.float8_e8m0fnu).to(DEV), w2.to(DEV), s2.to(DEV),
                                     activation=SwiGLU() if gated else SiLU())
    return config, weights


def tokens_bf16(tokens: int, hidden: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    scale = torch.rand(tokens, 1, generator=gen) * 3 + 0.25
    return (torch.randn(tokens, hidden, generator=gen) * scale).bfloat16().to(DEV)


def _dequantize(codes: torch.Tensor, scale_bytes: torch.Tensor) -> torch.Tensor:
    """E4M3 codes [..., I] and their E8M0 scale bytes as integers [..., I/32] -> float64 values."""
    return codes.double() * torch.pow(2.0, scale_bytes.double() - 127).repeat_interleave(32, dim=-1)


def check_intermediate(buffers, acts: Mxfp8Activations, weights, routing: Routing, act: Activation, what: str):
    """Check (1) of the module docstring; returns the GPU's intermediate (codes, scales) of the logical I features."""
    tokens, top_k = acts.num_tokens, routing.top_k
    inter, ip, slots = weights.intermediate_size, weights.padded_intermediate, acts.num_tokens * routing.top_k
    codes = buffers["inter_codes"][:slots].reshape(tokens, top_k, ip)
    scales = buffers["inter_scales"][:slots].reshape(tokens, top_k, ip // 32)
    ids, _ = routing.ids_and_weights()
    routed = ((ids >= 0) & (ids < weights.num_experts)).to(DEV)
    assert not bool(codes[routed][:, inter:].any()) and not bool(scales[routed][:, inter // 32 :].any()), \
        f"{what}: padding features must hold zero codes and zero scale bytes"
    q = codes[..., :inter].contiguous().view(torch.float8_e4m3fn)
    s = scales[..., : inter // 32].contiguous().view(torch.float8_e8m0fnu)
    want = mx_pair_intermediate(acts, weights, routing, act)
    gq, gs = q[routed], s[routed].view(torch.uint8).long()
    wq, ws = want.codes[routed], want.scales[routed].view(torch.uint8).long()
    assert not bool(gq.view(torch.uint8).eq(0x7F).any() | gq.view(torch.uint8).eq(0xFF).any()), f"{what}: NaN codes"
    scale_steps = (gs - ws).abs()
    assert bool((scale_steps <= 1).all()), f"{what}: a block scale is {int(scale_steps.max())} binades from the reference"
    assert float((scale_steps > 0).double().mean()) <= 0.01, f"{what}: {int((scale_steps > 0).sum())} block scales differ"
    flips = gq.view(torch.uint8) != wq.view(torch.uint8)
    assert float(flips.double().mean()) <= 0.01, f"{what}: {int(flips.sum())} of {flips.numel()} codes differ"
    got_v, want_v = _dequantize(gq, gs), _dequantize(wq, ws)
    coarse = torch.pow(2.0, torch.maximum(gs, ws).double() - 127).repeat_interleave(32, dim=-1)
    bound = 2.0**-3 * want_v.abs() + 2.0**-9 * coarse + 2.0**-7 * want_v.abs()
    err = (got_v - want_v).abs()
    assert bool((err <= bound).all()), f"{what}: an intermediate value is off by {float((err - bound).max()):.3g} over the bound"
    assert float(want_v.abs().max()) > 0, f"{what}: the reference intermediate is all zero, the test proves nothing"
    return q, s


def check_call(config, weights, acts, routing, act, got: torch.Tensor, out_dtype, finalize: bool, what: str,
               engine: str = "cuda_cores") -> None:
    """The checks of the module docstring, on a call that has just run on ``engine`` (nothing else since on these
    weights): the intermediate it left in its workspace, then the rows or output on that intermediate."""
    torch.cuda.synchronize()
    buffers = engine_workspace(config, weights, routing.top_k, engine)
    q, s = check_intermediate(buffers, acts, weights, routing, act, what)
    ref = reference_mx_pair(acts, weights, routing, act, out_dtype=out_dtype, finalize=finalize, intermediate=(q, s))
    if finalize:
        assert_close_to_reference(got, ref, what)
        return
    unrouted = ~ref.mask
    assert bool((got[unrouted].view(torch.int16) == 0).all()), f"{what}: raw rows of unrouted slots must be +0"
    assert_close_to_reference(got[~unrouted], ref.rows[~unrouted], what)
