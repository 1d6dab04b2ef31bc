"""CPU tests of the low-latency MX pairs (contract 004: MXFP4 or MXFP8 weights with E8M0 scales per 32 K values,
MXFP8 tokens and intermediate): the prepared layouts and bit-exact payloads (padding, copies, canonical round
trip, uint8 or float8_e8m0fnu scales), the MXFP8 token quantizer, the float64 reference against a plain loop
written here, the kernels' MXFP8 block encoder (decode.cuh, built for the host) against the project's quantizer,
and the bad-input rows (prepare, token quantization, the call's checks and the reference, all refused before
any work).

The plain loop has its own tables (E2M1 grid, E4M3 values from the bit fields, E8M0 = 2^(byte - 127), E4M3
rounding by the nearest table entry with ties to the even code), quantizes per 32 values itself (scale exponent
from math.frexp of the block's amax) and walks the 32-blocks one at a time: per block the exact code dot product
times the FP32 product of the two scales, summed in float64 and rounded to FP32; BF16 preactivation, FP32
activation, intermediate to MXFP8 per 32, rows to the output dtype, then an ordered FP32 multiply and add over
the routed slots (ids outside [0, E) skipped).
"""

from __future__ import annotations

import math
import subprocess

import numpy as np
import pytest
import torch

from cudnn_moe.activations import ACTIVATION_NAMES, GELU, SiLU, SwiGLU, parse_activation
from cudnn_moe.formats import quantize_mxfp8
from cudnn_moe.low_latency import (
    DeepSeekFp8Activations,
    LowLatencyMoeConfig,
    Mxfp4PairWeights,
    Mxfp4WeightOnlyWeights,
    Mxfp8Activations,
    Mxfp8PairWeights,
    MxPairIntermediate,
    RawReference,
    WeightFormat,
    low_latency_moe,
    mx_pair_intermediate,
    reference_low_latency,
    reference_mx_pair,
)
from cudnn_moe.routing import Routing
from cudnn_moe.weights.nvfp4 import Nvfp4Activations
from tests.ops.low_latency.test_low_latency_cpu import plain_e4m3, plain_fp4
from tests.ops.low_latency.test_low_latency_fp8_per_tensor_cpu import plain_e4m3_round
from tests.support.kernel_sources import CXX, HOST_PRELUDE, host_program
from tests.support.low_latency import mx_payloads

MX4, MX8 = WeightFormat.MXFP4_W_MXFP8_A, WeightFormat.MXFP8_W_MXFP8_A
KINDS = {"mxfp4": MX4, "mxfp8": MX8}
E, H, I, IP = 3, 256, 96, 128  # 8 blocks of 32 along H; I = 96 (3 blocks) pads to 128
F8, E8 = torch.float8_e4m3fn, torch.float8_e8m0fnu


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(bits(a), bits(b))


def payloads(kind: str, gated: bool = True, seed: int = 0, scale_dtype: torch.dtype = E8, inter: int = I):
    """(w1, w1_scale, w2, w2_scale) of the caller (tests.support.low_latency.mx_payloads), the scales as
    ``scale_dtype``."""
    w1, s1, w2, s2 = mx_payloads(kind, gated, E, H, inter, seed)
    return w1, s1.view(scale_dtype), w2, s2.view(scale_dtype)


def prepare(kind: str, gated: bool = True, seed: int = 0, config: LowLatencyMoeConfig | None = None, activation=None,
            **change):
    w1, s1, w2, s2 = payloads(kind, gated, seed)
    args = {"w1": w1, "w1_scale": s1, "w2": w2, "w2_scale": s2, **change}
    config = config or LowLatencyMoeConfig(8, arch="sm90")
    act = activation or (SwiGLU() if gated else SiLU())
    return config.prepare_weights(args["w1"], args["w1_scale"], args["w2"], args["w2_scale"], activation=act)


# ----------------------------------------------------------------------------- preparation
@pytest.mark.parametrize("arch", ["sm90", "sm100"])
@pytest.mark.parametrize("scale_dtype", [E8, torch.uint8], ids=["e8m0", "uint8"])
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("kind", KINDS)
def test_prepare_layout_and_bit_exact_payloads(kind, gated, scale_dtype, arch):
    """The caller's codes and scale bytes, copied bit for bit; I padded to 128 with zero bytes ([up, 0, gate, 0] rows
    gated, zero columns of w2 and its scales); scales stored as float8_e8m0fnu; canonical() gives the payloads back.
    An MXFP4 pair prepared for SM90 stores its codes as the SM90 tiles of its exact shifted form instead (its E8M0
    scales as given): the row-major codes come back through canonical()."""
    w1, s1, w2, s2 = payloads(kind, gated, scale_dtype=scale_dtype)
    config = LowLatencyMoeConfig(8, arch=arch)
    wts = config.prepare_weights(w1, s1, w2, s2, activation=SwiGLU() if gated else GELU())
    cls, per_byte = (Mxfp4PairWeights, 2) if kind == "mxfp4" else (Mxfp8PairWeights, 1)
    assert type(wts) is cls and wts.format is KINDS[kind] and wts.codes_per_byte == per_byte and wts.block == 32
    assert wts.tiled == (arch == "sm90" and kind == "mxfp4")
    codes = wts.row_payloads() if wts.tiled else (wts.w1_codes, wts.w1_scales, wts.w2_codes, wts.w2_scales)
    assert (wts.hidden_size, wts.intermediate_size, wts.padded_intermediate, wts.gated) == (H, I, IP, gated)
    assert wts.num_experts == E and wts.gemm1_rows == (2 if gated else 1) * I
    halves = 2 if gated else 1
    assert wts.w1_codes.dtype == w1.dtype and wts.w1_codes.shape == (E, halves * IP, H // per_byte)
    assert wts.w1_scales.dtype == E8 and wts.w1_scales.shape == (E, halves * IP, H // 32)
    assert wts.w2_codes.shape == (E, H, IP // per_byte) and wts.w2_scales.shape == (E, H, IP // 32)
    w1_codes, w1_scales, w2_codes, w2_scales = codes
    for given, kept in ((w1, w1_codes), (s1, w1_scales)):
        for half, rows in enumerate(given.chunk(halves, dim=1)):
            assert same_bits(kept[:, half * IP : half * IP + I], rows)
            assert not bits(kept[:, half * IP + I : (half + 1) * IP]).any()
    assert same_bits(w2_codes[..., : I // per_byte], w2) and not bits(w2_codes[..., I // per_byte :]).any()
    assert same_bits(w2_scales[..., : I // 32], s2) and not bits(w2_scales[..., I // 32 :]).any()
    canon = wts.canonical()
    for given, back in zip((w1, s1, w2, s2), canon):
        assert same_bits(back, given)
    assert canon[1].dtype == E8 and canon[3].dtype == E8
    assert wts.w1_codes.data_ptr() != w1.data_ptr() and wts.w1_scales.data_ptr() != s1.data_ptr()


@pytest.mark.parametrize("kind", KINDS)
def test_prepare_keeps_extreme_scales_and_codes(kind):
    """Scale bytes 0 (2^-127) and 254 (2^127), E4M3 subnormals, -0 and +-448 are kept as given."""
    w1, s1, w2, s2 = payloads(kind)
    s1 = s1.view(torch.uint8).clone()
    s1[0, 0, :3] = torch.tensor([0, 254, 1], dtype=torch.uint8)
    w1 = w1.clone()
    w1.view(torch.uint8)[0, 0, :4] = torch.tensor([0x00, 0x80, 0x7E, 0x01], dtype=torch.uint8)
    wts = LowLatencyMoeConfig(8, arch="sm90").prepare_weights(w1, s1, w2, s2)
    assert same_bits(wts.canonical()[0], w1) and same_bits(wts.canonical()[1], s1)


def test_no_padding_at_i_128():
    w1, s1, w2, s2 = payloads("mxfp8", inter=128)
    wts = LowLatencyMoeConfig(8, arch="sm90").prepare_weights(w1, s1, w2, s2)
    assert wts.padded_intermediate == 128 and same_bits(wts.w1_codes, w1) and same_bits(wts.w2_scales, s2)


def test_supported_where_the_fp8_formats_run():
    for arch in ("sm90", "sm100", "sm103", "sm107", "sm120"):
        formats = LowLatencyMoeConfig.supported_formats(arch)
        assert MX4 in formats and MX8 in formats
    assert MX4 not in LowLatencyMoeConfig.supported_formats("sm80")
    assert MX8 not in LowLatencyMoeConfig.supported_formats("sm80")


# ----------------------------------------------------------------------------- the plain loop
def plain_e8m0(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes (uint8 or float8_e8m0fnu) -> float64 2^(byte - 127)."""
    return torch.pow(2.0, scales.view(torch.uint8).double() - 127)


def plain_mx_quant(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """v [..., K] (values exact in FP32) -> (E4M3 values float64 [..., K], scale bytes uint8 [..., K/32]): per 32 values
    shared = clamp(floor(log2 amax) - 8, -127, 127) (-127 for amax 0), values e4m3(v / 2^shared)."""
    blocks = v.double().reshape(-1, 32)
    out = torch.zeros_like(blocks)
    exps = []
    for b, block in enumerate(blocks):
        amax = float(block.abs().max())
        shared = -127 if amax == 0 else max(-127, min(127, math.frexp(amax)[1] - 1 - 8))
        exps.append(shared + 127)
        out[b] = plain_e4m3_round(block / 2.0**shared)
    return out.reshape(v.shape), torch.tensor(exps, dtype=torch.uint8).reshape(*v.shape[:-1], v.shape[-1] // 32)


def plain_block_dot(w: torch.Tensor, w_scale: torch.Tensor, v: torch.Tensor, v_scale: torch.Tensor) -> torch.Tensor:
    """w [N, K], v [K] code values (float64), w_scale [N, K/32], v_scale [K/32] (float64 powers of two) -> float32 [N]:
    fp32(sum over blocks b of (w[:, b] . v[b]) * fp32(v_scale[b] * w_scale[:, b]))."""
    total = torch.zeros(w.shape[0], dtype=torch.float64)
    for b in range(w.shape[1] // 32):
        part = w[:, 32 * b : 32 * (b + 1)] @ v[32 * b : 32 * (b + 1)]
        factor = (torch.tensor(float(v_scale[b]), dtype=torch.float32) * w_scale[:, b].float()).double()
        total += part * factor
    return total.float()


def plain_moe(kind, x_codes, x_scales, payload, ids, route_w, act, out_dtype, intermediate=None):
    """(out [T, H], rows [T, k, H], intermediate values [T, k, I], its scale bytes [T, k, I/32]); unrouted slots
    (ids outside [0, E)) are skipped: zero rows, nothing in the sum."""
    c1, s1, c2, s2 = payload
    decode = plain_fp4 if kind == "mxfp4" else plain_e4m3
    w1, w2, x = decode(c1), decode(c2), plain_e4m3(x_codes)
    w1s, w2s, xs = plain_e8m0(s1), plain_e8m0(s2), plain_e8m0(x_scales)
    act = parse_activation(act)
    n = w2.shape[2]
    tokens, top_k = ids.shape
    out = torch.zeros(tokens, H, dtype=out_dtype)
    rows = torch.zeros(tokens, top_k, H, dtype=out_dtype)
    inter_q = torch.zeros(tokens, top_k, n, dtype=torch.float64)
    inter_s = torch.zeros(tokens, top_k, n // 32, dtype=torch.uint8)
    for t in range(tokens):
        acc = torch.zeros(H, dtype=torch.float32)
        for s in range(top_k):
            e = int(ids[t, s])
            if not 0 <= e < E:
                continue
            h = plain_block_dot(w1[e], w1s[e], x[t], xs[t]).bfloat16().double()
            y = (act.apply(h[:n], h[n:]) if act.gated else act.apply(h)).float()
            q, qs = plain_mx_quant(y)
            inter_q[t, s], inter_s[t, s] = q, qs
            if intermediate is not None:
                q, qs = plain_e4m3(intermediate[0][t, s]), intermediate[1][t, s]
            rows[t, s] = plain_block_dot(w2[e], w2s[e], q, plain_e8m0(qs)).to(out_dtype)
            acc = acc + torch.tensor(float(route_w[t, s]), dtype=torch.float32) * rows[t, s].float()
        out[t] = acc.to(out_dtype)
    return out, rows, inter_q, inter_s


def tokens_float(tokens: int, seed: int) -> torch.Tensor:
    """BF16 tokens of per-token magnitudes 0.25 .. 3.25, with an all-zero block and a block of tiny values."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=gen) * (torch.rand(tokens, 1, generator=gen) * 3 + 0.25)
    x[0, :32] = 0
    x[-1, 32:64] *= 2.0**-125  # amax below 2^-119: the scale clamps at 2^-127
    return x.bfloat16()


def routing_of(gen, tokens, top_k, kind, unrouted: bool):
    ids = torch.stack([torch.randperm(E, generator=gen)[:top_k] for _ in range(tokens)]).int()
    if unrouted:
        ids[0, -1], ids[-1, 0] = -1, E  # outside [0, E): unrouted slots
    w = torch.rand(tokens, top_k, generator=gen).bfloat16().float()
    if unrouted:
        w[0, -1] = float("nan")
        w[-1, 0] = float("inf")
    if kind == "packed":  # packed by hand: pack_routing refuses NaN / Inf scores
        packed = ids * (1 << 16) + (w.bfloat16().view(torch.int16).to(torch.int32) & 0xFFFF)
        assert torch.equal(Routing.packed(packed).ids_and_weights()[0], ids) or not unrouted
        return Routing.packed(packed), ids, w
    return Routing.unpacked(ids, w), ids, w


@pytest.mark.parametrize("kind, gated, tokens, top_k, routing_kind, out_dtype", [
    ("mxfp4", True, 4, 2, "packed", torch.bfloat16),
    ("mxfp4", False, 3, 3, "fp32", torch.float16),
    ("mxfp8", True, 5, 2, "fp32", torch.float16),
    ("mxfp8", False, 2, 3, "packed", torch.bfloat16),
])
def test_reference_matches_plain_loop(kind, gated, tokens, top_k, routing_kind, out_dtype):
    """reference_mx_pair (finalized, raw, step 2) equals the plain loop bit for bit, unrouted slots with NaN / Inf
    scores included."""
    gen = torch.Generator().manual_seed(tokens * 10 + top_k)
    pl, wts = payloads(kind, gated, seed=tokens), prepare(kind, gated, seed=tokens)
    config = LowLatencyMoeConfig(8, arch="sm90")
    acts = config.prepare_mxfp8_activations(tokens_float(tokens, tokens))
    routing, ids, route_w = routing_of(gen, tokens, top_k, routing_kind, unrouted=True)
    act = SwiGLU(alpha=1.702, beta=1.0, limit=7.0) if gated else SiLU()
    want_out, want_rows, want_q, want_s = plain_moe(kind, acts.codes, acts.scales, pl, ids, route_w, act, out_dtype)
    out = reference_mx_pair(acts, wts, routing, act, out_dtype=out_dtype)
    assert out.dtype == out_dtype and same_bits(out, want_out) and not bool(out.isnan().any())
    assert float(want_out.abs().max()) > 0.01  # real numbers, not zeros
    raw = reference_mx_pair(acts, wts, routing, act, out_dtype=out_dtype, finalize=False)
    assert isinstance(raw, RawReference) and same_bits(raw.rows, want_rows)
    unrouted = (ids < 0) | (ids >= E)
    assert torch.equal(raw.mask, ~unrouted) and not bits(raw.rows[unrouted]).any()
    assert torch.equal(raw.scores.isnan(), route_w.isnan()) and torch.equal(raw.scores[~unrouted], route_w[~unrouted])
    step2 = mx_pair_intermediate(acts, wts, routing, act)
    assert isinstance(step2, MxPairIntermediate) and step2.scales.dtype == E8
    assert torch.equal(step2.codes.double(), want_q) and torch.equal(step2.scales.view(torch.uint8), want_s)
    assert same_bits(reference_low_latency(acts, wts, routing, act, out_dtype=out_dtype), out)


def test_reference_on_a_given_intermediate():
    """intermediate= replaces step 2 (codes and scales) for every routed slot: steps 3-4 follow it."""
    gen = torch.Generator().manual_seed(5)
    pl, wts = payloads("mxfp4", seed=1), prepare("mxfp4", seed=1)
    acts = LowLatencyMoeConfig(8, arch="sm90").prepare_mxfp8_activations(tokens_float(4, 7))
    routing, ids, route_w = routing_of(gen, 4, 2, "fp32", unrouted=False)
    step2 = mx_pair_intermediate(acts, wts, routing, SwiGLU())
    codes = step2.codes.view(torch.uint8).clone()
    codes[0, 0, :7] ^= 1  # one E4M3 step away at a few places
    scales = step2.scales.view(torch.uint8).clone()
    scales[1, 1, 0] += 1
    given = (codes.view(F8), scales.view(E8))
    got = reference_mx_pair(acts, wts, routing, SwiGLU(), intermediate=given)
    want, *_ = plain_moe("mxfp4", acts.codes, acts.scales, pl, ids, route_w, SwiGLU(), torch.bfloat16, given)
    assert same_bits(got, want)
    assert same_bits(reference_mx_pair(acts, wts, routing, SwiGLU(), intermediate=step2),
                     reference_mx_pair(acts, wts, routing, SwiGLU()))


@pytest.mark.parametrize("name", ACTIVATION_NAMES)
def test_reference_every_activation(name):
    act = parse_activation(name)
    gen = torch.Generator().manual_seed(3)
    kind = "mxfp8" if act.gated else "mxfp4"
    pl, wts = payloads(kind, act.gated, seed=2), prepare(kind, act.gated, seed=2, activation=act)
    acts = LowLatencyMoeConfig(8, arch="sm90").prepare_mxfp8_activations(tokens_float(2, 4))
    routing, ids, route_w = routing_of(gen, 2, 2, "fp32", unrouted=False)
    want, *_ = plain_moe(kind, acts.codes, acts.scales, pl, ids, route_w, act, torch.bfloat16)
    assert same_bits(reference_mx_pair(acts, wts, routing, act), want)


def test_preactivation_rounds_to_bf16():
    """With Identity, weights 1.0 on columns 0 and 1 and token codes 448 and 2^-9 there (all scales 1), the FP32
    preactivation 448 + 2^-9 (exact in FP32, not in BF16) is rounded to BF16 before the activation: 448."""
    act = parse_activation("identity")
    w1 = torch.zeros(1, I, H, dtype=F8)
    w1.view(torch.uint8)[0, 0, :2] = 0x38  # 1.0 on columns 0 and 1
    s1 = torch.full((1, I, H // 32), 127, dtype=torch.uint8)
    w2 = torch.zeros(1, H, I, dtype=F8)
    s2 = torch.full((1, H, I // 32), 127, dtype=torch.uint8)
    wts = LowLatencyMoeConfig(8, arch="sm90").prepare_weights(w1, s1, w2, s2, activation=act)
    codes = torch.zeros(1, H, dtype=torch.uint8)
    codes[0, 0], codes[0, 1] = 0x7E, 0x01  # 448 and 2^-9: with scale 1, h = 448 + 2^-9, not a BF16 value
    acts = Mxfp8Activations(codes.view(F8), torch.full((1, H // 32), 127, dtype=torch.uint8).view(E8))
    routing = Routing.unpacked(torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, 1))
    step2 = mx_pair_intermediate(acts, wts, routing, act)
    assert float(step2.activation[0, 0, 0]) == 448.0  # bf16(448 + 2^-9) = 448, where FP32 would keep 448.001953125


# ----------------------------------------------------------------------------- token quantization
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_prepare_mxfp8_activations_matches_plain_quantization(dtype):
    """Codes and scales of the plain per-32 rule, bit for bit (zero block: scale byte 0; tiny values: the scale
    clamps at 2^-127; values whose quotient reaches past 448 saturate)."""
    x = tokens_float(6, 9).to(dtype)
    x[2, 64:96] = torch.linspace(-480, 500, 32)  # amax 500: scale 2^0, 480 and 500 saturate to 448
    x[3, 96] = 2.0**-130 if dtype is not torch.float16 else 2.0**-24  # subnormal amax
    acts = LowLatencyMoeConfig(8, arch="sm90").prepare_mxfp8_activations(x)
    assert isinstance(acts, Mxfp8Activations) and (acts.num_tokens, acts.hidden_size) == (6, H)
    assert acts.codes.dtype == F8 and acts.scales.dtype == E8 and acts.scales.shape == (6, H // 32)
    assert acts.codes.is_contiguous() and acts.scales.is_contiguous()
    want_q, want_s = plain_mx_quant(x.float())
    assert torch.equal(acts.codes.double(), want_q) and torch.equal(acts.scales.view(torch.uint8), want_s)
    assert int(acts.scales.view(torch.uint8)[0, 0]) == 0 and float(acts.codes[2, 64:96].double().abs().max()) == 448


def test_prepare_mxfp8_activations_reads_no_data():
    """NaN / Inf tokens are not refused (the quantizer reads nothing, so it can be captured in a CUDA graph)."""
    x = torch.ones(2, H)
    x[0, 0], x[1, 40] = float("nan"), float("inf")
    acts = LowLatencyMoeConfig(2, arch="sm90").prepare_mxfp8_activations(x)
    # the blocks without NaN / Inf are quantized as usual: 1.0 = 256 * 2^-8 (scale byte 119)
    assert torch.equal(acts.codes[:, 64:].double(), torch.full((2, H - 64), 256.0, dtype=torch.float64))
    assert bool((acts.scales.view(torch.uint8)[:, 2:] == 119).all())


# ----------------------------------------------------------------------------- the kernels' MXFP8 block encoder
_MX_DRIVER = HOST_PRELUDE + r"""
#include "low_latency/decode.cuh"
using namespace ll;

// argv[1]: float32 blocks of 32 values; argv[2]: per block its 32 E4M3 bytes, then its E8M0 scale byte.
int main(int argc, char** argv) {
  if (argc != 3) return 2;
  std::FILE* in = std::fopen(argv[1], "rb");
  std::FILE* out = std::fopen(argv[2], "wb");
  if (!in || !out) return 3;
  float v[32];
  while (std::fread(v, 4, 32, in) == 32) {
    float amax = 0.0f;
    for (int j = 0; j < 32; ++j) amax = fmaxf(amax, fabsf(v[j]));
    const unsigned int scale = mx_e4m3_scale_byte(amax);
    unsigned char b[33];
    for (int j = 0; j < 32; ++j) b[j] = static_cast<unsigned char>(mx_e4m3_code(v[j], scale));
    b[32] = static_cast<unsigned char>(scale);
    std::fwrite(b, 1, 33, out);
  }
  return std::fclose(out) != 0 || std::fclose(in) != 0;
}
"""


@pytest.mark.skipif(CXX is None, reason="no C++ compiler")
def test_kernel_mxfp8_encoder_matches_quantize_mxfp8(tmp_path):
    """ll_gemm1's quantization of its intermediate (mx_e4m3_scale_byte of the block's amax, mx_e4m3_code per value;
    integer and FP32 work, the same on every arch) built for the host: blocks of every scale exponent (amax 2^-149 ..
    3e38: every scale byte 0 .. 246), amax exactly at and around 448 * 2^k and 2^k, E4M3 midpoints after scaling
    (ties), subnormal values, all-zero blocks and signed zeros give quantize_mxfp8's codes and scale bit for bit."""
    program = host_program(tmp_path, "mx", _MX_DRIVER)
    gen = torch.Generator().manual_seed(0)
    blocks = [torch.randn(300, 32, generator=gen) * torch.pow(2.0, torch.randint(-140, 124, (300, 1), generator=gen).float())]
    for k in range(-134, 119):  # amax at 448 * 2^k, just above it, at 2^(k + 8) and just below 2^(k + 9)
        for amax in (448 * 2.0**k, 2.0 ** (k + 8), 2.0 ** (k + 9) * (1 - 2.0**-24), 448 * 2.0**k * (1 + 2.0**-23)):
            block = torch.randn(32, generator=gen).clamp(-1, 1) * amax
            block[0] = amax
            blocks.append(block[None])
    values = plain_e4m3(torch.arange(256, dtype=torch.uint8)[(torch.arange(256) & 0x7F) != 0x7F].view(F8)).float()
    mid = ((values.sort().values[1:] + values.sort().values[:-1]) / 2).unique()
    mid = torch.cat([mid, torch.zeros(-mid.numel() % 31)]).reshape(-1, 31)
    ties = torch.cat([torch.full((mid.shape[0], 1), 448.0), mid], dim=1)  # amax 448: scale 2^0, every midpoint a tie
    blocks += [ties, ties * 2.0**-20, torch.zeros(1, 32), -torch.zeros(1, 32), torch.full((1, 32), 2.0**-149),
               torch.full((1, 32), 3.0e38)]
    x = torch.cat([b.float() for b in blocks])
    x = torch.cat([x, -x])
    np.asarray(x.numpy(), dtype=np.float32).tofile(tmp_path / "in.bin")
    subprocess.run([str(program), str(tmp_path / "in.bin"), str(tmp_path / "out.bin")], check=True)
    got = torch.from_numpy(np.fromfile(tmp_path / "out.bin", dtype=np.uint8).copy()).reshape(-1, 33)
    want_codes, want_scales = quantize_mxfp8(x)
    assert torch.equal(got[:, 32], want_scales.view(torch.uint8).flatten()), "scale bytes differ"
    assert set(got[:, 32].tolist()) >= set(range(0, 247)), "not every finite scale byte was probed"
    same = got[:, :32] == want_codes.view(torch.uint8)
    assert bool(same.all()), f"codes differ in {int((~same).sum())} places, first block {int((~same).any(1).nonzero()[0])}"


# ----------------------------------------------------------------------------- bad inputs
_PL4, _PL8 = payloads("mxfp4"), payloads("mxfp8")


def _prep(kind: str = "mxfp4", config=None, **change):
    return lambda: prepare(kind, config=config, **change)


def _replace(t: torch.Tensor, index, value) -> torch.Tensor:
    t = t.view(torch.uint8).clone()
    t[index] = value
    return t


def _acts(x=None, config=None):
    def call():
        cfg = config or LowLatencyMoeConfig(2, arch="sm90")
        return cfg.prepare_mxfp8_activations(torch.ones(2, H) if x is None else x)
    return call


def _mx(t: int = 2, h: int = H, codes=None, scales=None) -> Mxfp8Activations:
    return Mxfp8Activations(torch.zeros(t, h, dtype=F8) if codes is None else codes,
                            torch.zeros(t, h // 32, dtype=torch.uint8).view(E8) if scales is None else scales)


def _op(kind: str = "mxfp4", **change):
    """The GPU call on CPU tensors: its argument checks run (and must refuse) before the device check."""
    def call():
        config, wts = LowLatencyMoeConfig(8, arch="sm90"), prepare(kind)
        args = {"inputs": _mx(), "out_dtype": torch.bfloat16, "activation": SwiGLU(), **change}
        routing = Routing.unpacked(torch.zeros(2, 2, dtype=torch.int32), torch.ones(2, 2))
        return low_latency_moe(config, args["inputs"], wts, routing, out_dtype=args["out_dtype"],
                               activation=args["activation"])
    return call


def _ref(**change):
    def call():
        args = {"inputs": _mx(), "weights": prepare("mxfp8"), "out_dtype": torch.bfloat16, "intermediate": None, **change}
        routing = Routing.unpacked(torch.zeros(2, 2, dtype=torch.int32), torch.ones(2, 2))
        return reference_mx_pair(args["inputs"], args["weights"], routing, SwiGLU(), out_dtype=args["out_dtype"],
                                 intermediate=args["intermediate"])
    return call


_MXFP4_WO = LowLatencyMoeConfig(8, arch="sm90").prepare_mxfp4_weight_only_weights(
    _PL4[0], _PL4[1], _PL4[2], _PL4[3])

BAD = [
    ("w1 not a tensor", _prep(w1=[1]), TypeError, "w1 must be a torch.Tensor"),
    ("w1 bf16", _prep(w1=torch.zeros(E, 2 * I, H, dtype=torch.bfloat16)), TypeError,
     "w1 must have dtype uint8 or float8_e4m3fn"),
    ("w2 other kind", _prep(w2=_PL8[2]), TypeError, "w2 must have dtype uint8 like w1"),
    ("w2 other kind fp8", _prep("mxfp8", w2=_PL4[2]), TypeError, "w2 must have dtype float8_e4m3fn like w1"),
    ("w2 int8", _prep(w2=_PL4[2].view(torch.int8)), TypeError, "w2 must have dtype uint8"),
    ("w1 2-D", _prep(w1=_PL4[0][0]), ValueError, "w1 must have 3 dimensions"),
    ("w2 experts", _prep(w2=torch.zeros(E + 1, H, I // 2, dtype=torch.uint8)), ValueError, "w1 has 3 experts but w2 has 4"),
    ("H not a multiple of 128", _prep(w1=torch.zeros(E, 2 * I, 96, dtype=torch.uint8),
                                      w2=torch.zeros(E, 192, I // 2, dtype=torch.uint8)),
     ValueError, r"hidden size \(w2.shape\[1\]\) must be a positive multiple of 128"),
    ("I not a multiple of 32 (mxfp4)", _prep(w2=torch.zeros(E, H, 40 // 2, dtype=torch.uint8)), ValueError,
     r"intermediate size \(2 \* w2.shape\[2\]\) must be a positive multiple of 32"),
    ("I not a multiple of 32 (mxfp8)", _prep("mxfp8", w2=torch.zeros(E, H, 40, dtype=F8)), ValueError,
     r"intermediate size \(w2.shape\[2\]\) must be a positive multiple of 32"),
    ("w1 K (mxfp4)", _prep(w1=torch.zeros(E, 2 * I, H, dtype=torch.uint8)), ValueError, r"w1 must be \[E, N1, H/2\]"),
    ("w1 K (mxfp8)", _prep("mxfp8", w1=torch.zeros(E, 2 * I, H // 2, dtype=F8)), ValueError, r"w1 must be \[E, N1, H\]"),
    ("gated rows", _prep(w1=_PL4[0][:, :I]), ValueError, "w1 must have 192 rows per expert for the gated"),
    ("non-gated with gate rows", _prep(activation=GELU()), ValueError, "w1 must have 96 rows per expert for the non-gated"),
    ("scale float32", _prep(w1_scale=torch.ones(E, 2 * I, H // 32)), TypeError,
     "w1_scale must have dtype float8_e8m0fnu or uint8"),
    ("scale not a tensor", _prep(w2_scale=1.0), TypeError, "w2_scale must be a torch.Tensor"),
    ("w1_scale shape", _prep(w1_scale=torch.zeros(E, 2 * I, H // 16, dtype=torch.uint8)), ValueError,
     r"w1_scale must have shape \(3, 192, 8\)"),
    ("w2_scale shape", _prep(w2_scale=torch.zeros(E, H, IP // 32, dtype=torch.uint8)), ValueError,
     r"w2_scale must have shape \(3, 256, 3\)"),
    ("w1 nan code", _prep("mxfp8", w1=_replace(_PL8[0], (1, 2, 3), 0x7F).view(F8)), ValueError, "w1 holds E4M3 NaN codes"),
    ("w2 nan code", _prep("mxfp8", w2=_replace(_PL8[2], (0, 0, 0), 0xFF).view(F8)), ValueError, "w2 holds E4M3 NaN codes"),
    ("w1_scale nan", _prep(w1_scale=_replace(_PL4[1], (2, 5, 1), 255)), ValueError,
     "w1_scale holds E8M0 NaN scale bytes"),
    ("w2_scale nan", _prep("mxfp8", w2_scale=_replace(_PL8[3], (0, 0, 2), 255).view(E8)), ValueError,
     "w2_scale holds E8M0 NaN scale bytes"),
    ("sm80 mxfp4", _prep(config=LowLatencyMoeConfig(8, arch="sm80")), ValueError, "mxfp4_w_mxfp8_a.*sm80"),
    ("sm80 mxfp8", _prep("mxfp8", config=LowLatencyMoeConfig(8, arch="sm80")), ValueError, "mxfp8_w_mxfp8_a.*sm80"),
    ("acts not a tensor", _acts(x=[[1.0]]), TypeError, "hidden_states must be a torch.Tensor"),
    ("acts float64", _acts(x=torch.ones(2, H, dtype=torch.float64)), TypeError, "hidden_states must have dtype"),
    ("acts int", _acts(x=torch.ones(2, H, dtype=torch.int32)), TypeError, "hidden_states must have dtype"),
    ("acts 1-D", _acts(x=torch.ones(H)), ValueError, "hidden_states must have 2 dimensions"),
    ("acts tokens", _acts(x=torch.ones(3, H)), ValueError, "hidden_states has 3 tokens, more than max_num_tokens=2"),
    ("acts H", _acts(x=torch.ones(2, 96)), ValueError, r"hidden size \(hidden_states.shape\[1\]\) must be a positive multiple of 128"),
    ("op bf16 tokens", _op(inputs=torch.ones(2, H, dtype=torch.bfloat16)), TypeError,
     "inputs must be the Mxfp8Activations.*BF16/FP16 tokens are not taken"),
    ("op nvfp4 tokens", _op("mxfp8", inputs=Nvfp4Activations(torch.zeros(2, H // 2, dtype=torch.uint8),
                                                            torch.zeros(2, H // 16, dtype=F8))),
     TypeError, "inputs must be the Mxfp8Activations"),
    ("op deepseek tokens", _op(inputs=DeepSeekFp8Activations(torch.zeros(2, H, dtype=F8), torch.ones(2, 2))),
     TypeError, "inputs must be the Mxfp8Activations"),
    ("op codes uint8", _op(inputs=_mx(codes=torch.zeros(2, H, dtype=torch.uint8))), TypeError,
     "inputs.codes must have dtype float8_e4m3fn"),
    ("op scales uint8", _op(inputs=_mx(scales=torch.zeros(2, H // 32, dtype=torch.uint8))), TypeError,
     "inputs.scales must have dtype float8_e8m0fnu"),
    ("op codes H", _op(inputs=_mx(h=2 * H)), ValueError, r"inputs.codes must be \[T, 256\]"),
    ("op scales shape", _op(inputs=_mx(scales=torch.zeros(2, H // 16, dtype=torch.uint8).view(E8))), ValueError,
     r"inputs.scales must be \[2, 8\]"),
    ("op codes strided", _op(inputs=_mx(codes=torch.zeros(H, 2, dtype=F8).t())), ValueError,
     "inputs.codes must be contiguous"),
    ("op scales strided", _op(inputs=_mx(scales=torch.zeros(H // 32, 2, dtype=torch.uint8).view(E8).t())), ValueError,
     "inputs.scales must be contiguous"),
    ("op codes misaligned", _op(inputs=_mx(codes=torch.zeros(2 * H + 1, dtype=F8)[1:].view(2, H))), ValueError,
     "inputs.codes must start at a 16-byte aligned address"),
    ("op out fp32", _op(out_dtype=torch.float32), ValueError, "out_dtype must be torch.bfloat16 or torch.float16"),
    ("op gating", _op(activation=SiLU()), ValueError, "non-gated but the weights were prepared for a gated"),
    ("op valid (reaches the device check)", _op("mxfp8", out_dtype=torch.float16), ValueError, "CUDA device"),
    ("ref bf16 tokens", _ref(inputs=torch.ones(2, H, dtype=torch.bfloat16)), TypeError,
     "activations must be the Mxfp8Activations"),
    ("ref weight-only weights", _ref(weights=_MXFP4_WO), TypeError, "weights must be the Mxfp4PairWeights or Mxfp8PairWeights"),
    ("ref out fp32", _ref(out_dtype=torch.float32), ValueError, "out_dtype must be torch.bfloat16 or torch.float16"),
    ("ref codes H", _ref(inputs=_mx(h=2 * H)), ValueError, r"activations must be codes \[T, 256\]"),
    ("ref scales uint8", _ref(inputs=_mx(scales=torch.zeros(2, H // 32, dtype=torch.uint8))), TypeError,
     "activations.scales must have dtype float8_e8m0fnu"),
    ("ref intermediate shape", _ref(intermediate=(torch.zeros(2, 2, 64, dtype=F8), torch.zeros(2, 2, 2, dtype=torch.uint8).view(E8))),
     ValueError, "intermediate must be codes"),
    ("ref intermediate dtype", _ref(intermediate=(torch.zeros(2, 2, I), torch.zeros(2, 2, 3, dtype=torch.uint8).view(E8))),
     TypeError, "intermediate codes must have dtype float8_e4m3fn"),
    ("ref intermediate scales float", _ref(intermediate=(torch.zeros(2, 2, I, dtype=F8), torch.ones(2, 2, 3))),
     TypeError, "intermediate scales must have dtype float8_e8m0fnu"),
]


@pytest.mark.parametrize("call, error, match", [case[1:] for case in BAD], ids=[case[0] for case in BAD])
def test_bad_inputs(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_other_formats_refuse_mxfp8_activations():
    config = LowLatencyMoeConfig(8, arch="sm90")
    routing = Routing.unpacked(torch.zeros(2, 2, dtype=torch.int32), torch.ones(2, 2))
    dense = config.prepare_bf16_weights(torch.zeros(E, 2 * I, H, dtype=torch.bfloat16),
                                        torch.zeros(E, H, I, dtype=torch.bfloat16))
    for weights in (dense, _MXFP4_WO):
        with pytest.raises(TypeError, match="Mxfp8Activations are for the MX weight"):
            low_latency_moe(config, _mx(), weights, routing)
    assert isinstance(_MXFP4_WO, Mxfp4WeightOnlyWeights) and not isinstance(_MXFP4_WO, Mxfp4PairWeights)
