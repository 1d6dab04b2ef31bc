"""CPU tests of the low-latency DeepSeek FP8 format (contract 004: E4M3 weights with FP32 128 x 128 block scales,
tokens and intermediate quantized per 128 values): the prepared layout and bit-exact payloads and scales, the
prequantized tokens kept as given, the float64 reference against a plain loop written here, the kernels' E4M3
encoder (decode.cuh e4m3_code after e4m3_round, built for the host) against torch's conversion, and the
bad-input rows (prepare, prequantized tokens, reference and the call's checks, all refused before any work).

The plain loop has its own E4M3 tables (values from the bit fields, rounding by nearest table entry with ties
to the even code), quantizes per 128 values itself (scale = fp32(amax) / fp32(448) in FP32) and walks the
128-blocks one at a time: per block the exact code dot product times the FP32 product of the two scales,
summed in float64; FP32 preactivation, FP32 activation, intermediate to E4M3 per 128, rows to BF16, then an
ordered FP32 multiply and add.
"""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
import torch

from cudnn_moe.activations import ACTIVATION_NAMES, SiLU, SwiGLU, parse_activation
from cudnn_moe.formats.fp8 import quantize_fp8_act128
from cudnn_moe.low_latency import (
    DeepSeekFp8Activations,
    DeepSeekFp8Intermediate,
    DeepSeekFp8Weights,
    Fp8PerTensorActivations,
    LowLatencyMoeConfig,
    RawReference,
    WeightFormat,
    deepseek_fp8_intermediate,
    low_latency_moe,
    reference_deepseek_fp8,
    reference_low_latency,
)
from cudnn_moe.routing import Routing, pack_routing
from tests.ops.low_latency.test_low_latency_cpu import plain_e4m3
from tests.ops.low_latency.test_low_latency_fp8_per_tensor_cpu import (
    _VALUES,
    plain_e4m3_round,
)
from tests.support.kernel_sources import CXX, HOST_PRELUDE, host_program
from tests.support.low_latency import fp8_codes


FMT = WeightFormat.DEEPSEEK_FP8
E, H, I = 3, 256, 256  # two 128-blocks along each of H and I


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def payloads(gated: bool = True, seed: int = 0, hidden: int = H, inter: int = I):
    """(w1 codes [E, N1, H], w1_scale [E, N1/128, H/128], w2 codes [E, H, I], w2_scale [E, H/128, I/128]): E4M3
    codes of N(0, 16^2) values with 3% wild bytes, block scales putting each dot product near unit size."""
    gen = torch.Generator().manual_seed(seed)
    n1 = (2 if gated else 1) * inter
    w1 = fp8_codes(gen, (E, n1, hidden))
    w2 = fp8_codes(gen, (E, hidden, inter))
    s1 = (torch.rand(E, -(-n1 // 128), -(-hidden // 128), generator=gen) + 0.5) / (16 * hidden**0.5)
    s2 = (torch.rand(E, -(-hidden // 128), -(-inter // 128), generator=gen) + 0.5) / (16 * inter**0.5)
    return w1, s1, w2, s2


def prepare(gated: bool = True, seed: int = 0, config: LowLatencyMoeConfig | None = None, activation=None, **change):
    w1, s1, w2, s2 = payloads(gated, seed)
    args = {"w1": w1, "w1_scale": s1, "w2": w2, "w2_scale": s2, **change}
    config = config or LowLatencyMoeConfig(8, arch="sm90")
    act = activation or (SwiGLU() if gated else SiLU())
    return config.prepare_deepseek_fp8_weights(args["w1"], args["w1_scale"], args["w2"], args["w2_scale"],
                                               activation=act)


# ----------------------------------------------------------------------------- preparation
@pytest.mark.parametrize("gated", [True, False])
def test_prepare_layout_and_bit_exact_payloads(gated):
    w1, s1, w2, s2 = payloads(gated)
    wts = prepare(gated)
    assert isinstance(wts, DeepSeekFp8Weights)
    assert (wts.format, wts.hidden_size, wts.intermediate_size, wts.padded_intermediate, wts.gated) == (FMT, H, I, I, gated)
    assert wts.num_experts == E and wts.gemm1_rows == (2 if gated else 1) * I
    for given, kept in zip((w1, s1, w2, s2), (wts.w1_codes, wts.w1_scales, wts.w2_codes, wts.w2_scales)):
        assert kept.dtype == given.dtype and kept.shape == given.shape and kept.is_contiguous()
        assert torch.equal(bits(kept), bits(given))  # bit for bit: never requantized
        assert kept.data_ptr() != given.data_ptr()  # a copy: later changes to the caller's tensor do not leak in
    for given, kept in zip((w1, s1, w2, s2), wts.canonical()):
        assert torch.equal(bits(kept), bits(given))


def test_prepare_keeps_subnormal_and_extreme_scales_and_codes():
    w1, s1, _, _ = payloads()
    s1 = s1.clone()
    s1[0, 0, 0], s1[1, 1, 1], s1[2, 0, 1] = 1e-40, 3.0e38, float(torch.tensor(0.1, dtype=torch.float32))
    w1 = w1.clone()
    w1.view(torch.uint8)[0, 0, :4] = torch.tensor([0x00, 0x80, 0x7E, 0x01], dtype=torch.uint8)
    wts = prepare(w1=w1, w1_scale=s1)
    assert torch.equal(bits(wts.w1_scales), bits(s1)) and torch.equal(bits(wts.w1_codes), bits(w1))


def test_prequantized_tokens_are_kept_as_given():
    config = LowLatencyMoeConfig(4, arch="sm90")
    x = torch.randn(3, H).bfloat16()
    codes, scales = quantize_fp8_act128(x)
    acts = config.prepare_deepseek_fp8_activations(codes, scales, prepare())
    assert isinstance(acts, DeepSeekFp8Activations)
    assert acts.codes is codes and acts.scales is scales  # the same tensors: a captured call reads them live
    assert (acts.num_tokens, acts.hidden_size) == (3, H)


# ----------------------------------------------------------------------------- the plain loop
def plain_quant128(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """v [N] (values exact in FP32) -> (E4M3 values float64 [N], FP32 scales [N / 128]) by the test's own tables."""
    blocks = v.float().reshape(-1, 128)
    amax = blocks.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / torch.tensor(448.0, dtype=torch.float32), torch.ones_like(amax))
    q = plain_e4m3_round((blocks / scale[:, None]).double())
    return q.reshape(-1), scale


def plain_block_dot(w: torch.Tensor, v: torch.Tensor, w_scales: torch.Tensor, v_scales: torch.Tensor) -> torch.Tensor:
    """w [N, K] and v [K] code values (float64), w_scales FP32 [ceil(N/128), K/128], v_scales FP32 [K/128] ->
    float32 [N]: fp32(sum over 128-blocks b of (w[:, b] . v[b]) * fp32(v_scale[b] * w_scale[n // 128, b]))."""
    n, k = w.shape
    total = torch.zeros(n, dtype=torch.float64)
    for b in range(k // 128):
        part = w[:, 128 * b : 128 * (b + 1)] @ v[128 * b : 128 * (b + 1)]
        factor = (v_scales[b] * w_scales[torch.arange(n) // 128, b]).float().double()
        total += part * factor
    return total.float()


def plain_moe(x_codes, x_scales, wts_payload, ids, route_w, act, intermediate=None):
    """Per token and slot: (BF16 out [T, H], rows [T, k, H], E4M3 intermediate values [T, k, I], its scales)."""
    c1, s1, c2, s2 = wts_payload
    act = parse_activation(act)
    x, w1, w2 = plain_e4m3(x_codes), plain_e4m3(c1), plain_e4m3(c2)
    n = w2.shape[2]
    tokens, top_k = ids.shape
    out = torch.zeros(tokens, w2.shape[1], dtype=torch.bfloat16)
    rows = torch.zeros(tokens, top_k, w2.shape[1], dtype=torch.bfloat16)
    inter_q = torch.zeros(tokens, top_k, n, dtype=torch.float64)
    inter_s = torch.zeros(tokens, top_k, n // 128, dtype=torch.float32)
    for t in range(tokens):
        acc = torch.zeros(w2.shape[1], dtype=torch.float32)
        for s in range(top_k):
            e = int(ids[t, s])
            h = plain_block_dot(w1[e], x[t], s1[e], x_scales[t]).double()  # FP32 preactivation, not rounded further
            y = (act.apply(h[:n], h[n:]) if act.gated else act.apply(h)).float()
            q, qs = plain_quant128(y)
            inter_q[t, s], inter_s[t, s] = q, qs
            if intermediate is not None:
                q, qs = intermediate[0][t, s].double(), intermediate[1][t, s]
            rows[t, s] = plain_block_dot(w2[e], q, s2[e], qs).bfloat16()
            acc = acc + torch.tensor(float(route_w[t, s]), dtype=torch.float32) * rows[t, s].float()
        out[t] = acc.bfloat16()
    return out, rows, inter_q, inter_s


def _routing(gen, tokens, top_k, kind):
    ids = torch.stack([torch.randperm(E, generator=gen)[:top_k] for _ in range(tokens)]).int()
    if top_k > E:
        ids = torch.randint(0, E, (tokens, top_k), generator=gen, dtype=torch.int32)
    w = torch.rand(tokens, top_k, generator=gen).bfloat16().float()
    if kind == "packed":
        return Routing.packed(pack_routing(ids, w)), ids, w
    return Routing.unpacked(ids, w), ids, w


@pytest.mark.parametrize("gated, tokens, top_k, kind, prequantized", [
    (True, 8, 4, "packed", False), (False, 3, 2, "fp32", False), (True, 1, 3, "fp32", True), (True, 5, 2, "packed", True),
])
def test_reference_matches_plain_loop(gated, tokens, top_k, kind, prequantized):
    gen = torch.Generator().manual_seed(tokens * 10 + top_k)
    pl = payloads(gated, seed=tokens)
    wts = prepare(gated, seed=tokens)
    x = (torch.randn(tokens, H, generator=gen) * torch.rand(tokens, 1, generator=gen) * 3).bfloat16()
    x[0, :128] = 0  # an all-zero block: scale 1.0
    routing, ids, route_w = _routing(gen, tokens, top_k, kind)
    act = SwiGLU() if gated else SiLU()
    # the test's own token quantization, checked against the library's (the call's BF16 path quantizes so)
    rows_q = [plain_quant128(x[t].float()) for t in range(tokens)]
    x_vals = torch.stack([q for q, _ in rows_q])
    x_scales = torch.stack([s for _, s in rows_q])
    codes, scales = quantize_fp8_act128(x)
    assert torch.equal(codes.double(), x_vals) and torch.equal(bits(scales), bits(x_scales))
    assert float(scales[0, 0]) == 1.0
    inputs = DeepSeekFp8Activations(codes, scales) if prequantized else x
    want_out, want_rows, want_q, want_s = plain_moe(codes, scales, pl, ids, route_w, act)
    out = reference_deepseek_fp8(inputs, wts, routing, act)
    assert out.dtype == torch.bfloat16 and torch.equal(bits(out), bits(want_out))
    raw = reference_deepseek_fp8(inputs, wts, routing, act, finalize=False)
    assert isinstance(raw, RawReference) and torch.equal(bits(raw.rows), bits(want_rows))
    assert torch.equal(raw.scores, route_w) and bool(raw.mask.all())
    step2 = deepseek_fp8_intermediate(inputs, wts, routing, act)
    assert isinstance(step2, DeepSeekFp8Intermediate)
    assert torch.equal(step2.codes.double(), want_q) and torch.equal(bits(step2.scales), bits(want_s))
    assert torch.equal(reference_low_latency(inputs, wts, routing, act), out)


def test_reference_on_a_given_intermediate():
    """intermediate= replaces step 2 (codes and scales) for every routed slot: steps 3-4 follow it."""
    gen = torch.Generator().manual_seed(5)
    pl, wts = payloads(True, seed=1), prepare(True, seed=1)
    x = torch.randn(4, H, generator=gen).bfloat16()
    routing, ids, route_w = _routing(gen, 4, 2, "fp32")
    step2 = deepseek_fp8_intermediate(x, wts, routing, SwiGLU())
    codes = step2.codes.view(torch.uint8).clone()
    codes[0, 0, :7] ^= 1  # one E4M3 step away at a few places
    codes = codes.view(torch.float8_e4m3fn)
    scales = step2.scales * 1.5
    got = reference_deepseek_fp8(x, wts, routing, SwiGLU(), intermediate=(codes, scales))
    want, *_ = plain_moe(*quantize_fp8_act128(x), pl, ids, route_w, SwiGLU(), intermediate=(codes, scales))
    assert torch.equal(bits(got), bits(want))
    same = reference_deepseek_fp8(x, wts, routing, SwiGLU(), intermediate=step2)
    assert torch.equal(same, reference_deepseek_fp8(x, wts, routing, SwiGLU()))


@pytest.mark.parametrize("name", ACTIVATION_NAMES)
def test_reference_every_activation(name):
    act = parse_activation(name)
    gen = torch.Generator().manual_seed(3)
    pl, wts = payloads(act.gated, seed=2), prepare(act.gated, seed=2, activation=act)
    x = torch.randn(2, H, generator=gen).bfloat16()
    routing, ids, route_w = _routing(gen, 2, 2, "fp32")
    want, *_ = plain_moe(*quantize_fp8_act128(x), pl, ids, route_w, act)
    assert torch.equal(bits(reference_deepseek_fp8(x, wts, routing, act)), bits(want))


def test_no_preactivation_rounding():
    """The preactivation stays FP32: with Identity, the row is the FP32 intermediate quantized per 128, so a
    value BF16 would round differently shows up in the intermediate's codes."""
    act = parse_activation("identity")
    w1 = torch.zeros(1, I, H, dtype=torch.float8_e4m3fn)
    w1.view(torch.uint8)[0, :, 0] = 0x38  # 1.0 on column 0
    s1 = torch.ones(1, I // 128, H // 128)
    s1[0, 0, 0] = 1 + 2.0**-12  # not a BF16 value (7 mantissa bits)
    w2 = torch.zeros(1, H, I, dtype=torch.float8_e4m3fn)
    s2 = torch.ones(1, H // 128, I // 128)
    wts = LowLatencyMoeConfig(8, arch="sm90").prepare_deepseek_fp8_weights(w1, s1, w2, s2, activation=act)
    x = torch.zeros(1, H, dtype=torch.bfloat16)
    x[0, 0] = 1.0
    routing = Routing.unpacked(torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, 1))
    step2 = deepseek_fp8_intermediate(x, wts, routing, act)
    # x quantizes to 448 * (1/448); h = 448 * fp32(1/448 * s1) in FP32, kept, not rounded to BF16
    xs = torch.tensor(1.0, dtype=torch.float32) / 448
    want = (torch.tensor(448.0, dtype=torch.float64) * (xs * torch.tensor(1 + 2.0**-12, dtype=torch.float32)).double()).float()
    assert float(step2.activation[0, 0, 0]) == float(want) and float(want) != float(want.bfloat16())


# ----------------------------------------------------------------------------- the kernels' E4M3 encoder
_CODE_DRIVER = HOST_PRELUDE + r"""
#include "low_latency/decode.cuh"
using namespace ll;

// argv[1]: float32 values; argv[2]: one byte per value, e4m3_code(e4m3_round(v)).
int main(int argc, char** argv) {
  if (argc != 3) return 2;
  std::FILE* in = std::fopen(argv[1], "rb");
  std::FILE* out = std::fopen(argv[2], "wb");
  if (!in || !out) return 3;
  float v;
  while (std::fread(&v, 4, 1, in) == 1) {
    const unsigned char b = static_cast<unsigned char>(e4m3_code(e4m3_round(v)));
    std::fwrite(&b, 1, 1, out);
  }
  return std::fclose(out) != 0 || std::fclose(in) != 0;
}
"""


@pytest.mark.skipif(CXX is None, reason="no C++ compiler")
def test_kernel_e4m3_encoder_matches_torch(tmp_path):
    """ll_quant128's encoder (e4m3_code of e4m3_round, integer work, the same on every arch) built for the host:
    every E4M3 value, midpoints and their neighbours, subnormals, saturation, signed zeros, Inf and random values
    give torch's float8_e4m3fn byte; NaN gives 0x7F."""
    program = host_program(tmp_path, "code", _CODE_DRIVER)
    gen = torch.Generator().manual_seed(0)
    mid = ((_VALUES[1:] + _VALUES[:-1]) / 2).float()
    up, down = (torch.nextafter(mid, torch.full_like(mid, d)) for d in (1e9, -1e9))
    randoms = torch.cat([torch.randn(20000, generator=gen) * s for s in (1e-3, 0.05, 1.0, 30.0, 400.0)])
    special = torch.tensor([0.0, 448.0, 449.0, 464.0, 1e30, float("inf"), 2.0**-9, 2.0**-10, 1e-40, 2.0**-6])
    probe = torch.cat([_VALUES.float(), mid, up, down, randoms, special])
    probe = torch.cat([probe, -probe]).float()
    np.asarray(probe.numpy(), dtype=np.float32).tofile(tmp_path / "in.bin")
    subprocess.run([str(program), str(tmp_path / "in.bin"), str(tmp_path / "out.bin")], check=True)
    got = torch.from_numpy(np.fromfile(tmp_path / "out.bin", dtype=np.uint8).copy())
    want = probe.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(got, want), f"e4m3_code differs at {(got != want).nonzero()[:5].flatten().tolist()}"
    np.asarray([float("nan")], dtype=np.float32).tofile(tmp_path / "nan.bin")
    subprocess.run([str(program), str(tmp_path / "nan.bin"), str(tmp_path / "nan.out")], check=True)
    assert np.fromfile(tmp_path / "nan.out", dtype=np.uint8)[0] & 0x7F == 0x7F


# ----------------------------------------------------------------------------- bad inputs
_W1, _S1, _W2, _S2 = payloads(True)
F8 = torch.float8_e4m3fn


def _acts(**change):
    def call():
        config = LowLatencyMoeConfig(2, arch="sm90")
        codes, scales = quantize_fp8_act128(torch.ones(2, H, dtype=torch.bfloat16))
        args = {"codes": codes, "scales": scales, "weights": None, **change}
        return config.prepare_deepseek_fp8_activations(args["codes"], args["scales"], args["weights"])
    return call


def _ref(**change):
    def call():
        wts = prepare()
        args = {"inputs": torch.ones(2, H, dtype=torch.bfloat16), "out_dtype": torch.bfloat16, "intermediate": None,
                **change}
        routing = Routing.unpacked(torch.zeros(2, 2, dtype=torch.int32), torch.ones(2, 2))
        return reference_deepseek_fp8(args["inputs"], wts, routing, SwiGLU(), out_dtype=args["out_dtype"],
                                      intermediate=args["intermediate"])
    return call


def _op(**change):
    """The GPU call on CPU tensors: its argument checks run (and must refuse) before the device check."""
    def call():
        config, wts = LowLatencyMoeConfig(8, arch="sm90"), prepare()
        args = {"inputs": torch.ones(2, H, dtype=torch.bfloat16), "out_dtype": torch.bfloat16, **change}
        routing = Routing.unpacked(torch.zeros(2, 2, dtype=torch.int32), torch.ones(2, 2))
        return low_latency_moe(config, args["inputs"], wts, routing, out_dtype=args["out_dtype"])
    return call


def _codes(t, h=H):
    return torch.zeros(t, h, dtype=F8)


def _nan(t: torch.Tensor, index, value) -> torch.Tensor:
    t = t.clone()
    t[index] = value
    return t


BAD = [
    ("w1 uint8", lambda: prepare(w1=_W1.view(torch.uint8)), TypeError, "w1 must have dtype float8_e4m3fn"),
    ("w2 bf16", lambda: prepare(w2=_W2.float().bfloat16()), TypeError, "w2 must have dtype float8_e4m3fn"),
    ("w1 not a tensor", lambda: prepare(w1=[1.0]), TypeError, "w1 must be a torch.Tensor"),
    ("w1 2-D", lambda: prepare(w1=_W1[0]), ValueError, "w1 must have 3 dimensions"),
    ("w1 rows", lambda: prepare(w1=_W1[:, :I]), ValueError, "w1 must have 512 rows"),
    ("w1 rows non-gated", lambda: prepare(activation=SiLU()), ValueError, "w1 must have 256 rows"),
    ("w1 H", lambda: prepare(w1=torch.zeros(E, 2 * I, H + 128, dtype=F8)), ValueError, "w1 must be"),
    ("w2 experts", lambda: prepare(w2=torch.zeros(E + 1, H, I, dtype=F8)), ValueError, "w2 has 4"),
    ("H not a multiple of 128", lambda: prepare(w1=torch.zeros(E, 2 * I, 192, dtype=F8), w2=torch.zeros(E, 192, I, dtype=F8)),
     ValueError, r"hidden size \(w2.shape\[1\]\) must be a positive multiple of 128"),
    ("I not a multiple of 128", lambda: prepare(w1=torch.zeros(E, 192, H, dtype=F8), w2=torch.zeros(E, H, 96, dtype=F8)),
     ValueError, r"intermediate size \(w2.shape\[2\]\) must be a positive multiple of 128"),
    ("nan code w1", lambda: prepare(w1=_nan(_W1.view(torch.uint8), (1, 2, 3), 0x7F).view(F8)), ValueError,
     "w1 holds E4M3 NaN codes"),
    ("nan code w2", lambda: prepare(w2=_nan(_W2.view(torch.uint8), (0, 0, 0), 0xFF).view(F8)), ValueError,
     "w2 holds E4M3 NaN codes"),
    ("w1_scale float64", lambda: prepare(w1_scale=_S1.double()), TypeError, "w1_scale must have dtype float32"),
    ("w2_scale bf16", lambda: prepare(w2_scale=_S2.bfloat16()), TypeError, "w2_scale must have dtype float32"),
    ("w1_scale not a tensor", lambda: prepare(w1_scale=1.0), TypeError, "w1_scale must be a torch.Tensor"),
    ("w1_scale 2-D", lambda: prepare(w1_scale=_S1[0]), ValueError, "w1_scale must have 3 dimensions"),
    ("w1_scale per row", lambda: prepare(w1_scale=torch.ones(E, 2 * I, H // 128)), ValueError,
     r"w1_scale must have shape \(3, 4, 2\)"),
    ("w2_scale transposed", lambda: prepare(w2_scale=torch.ones(E, I // 128 + 1, H // 128)), ValueError,
     r"w2_scale must have shape \(3, 2, 2\)"),
    ("w2_scale experts", lambda: prepare(w2_scale=torch.ones(E + 1, H // 128, I // 128)), ValueError, "w2_scale must have shape"),
    ("w1_scale nan", lambda: prepare(w1_scale=_nan(_S1, (0, 1, 1), float("nan"))), ValueError, "w1_scale must be finite and positive"),
    ("w1_scale inf", lambda: prepare(w1_scale=_nan(_S1, (2, 0, 0), float("inf"))), ValueError, "w1_scale must be finite and positive"),
    ("w2_scale zero", lambda: prepare(w2_scale=_nan(_S2, (1, 1, 0), 0.0)), ValueError, "w2_scale must be finite and positive"),
    ("w2_scale negative", lambda: prepare(w2_scale=_nan(_S2, (0, 0, 1), -0.5)), ValueError, "w2_scale must be finite and positive"),
    ("sm80", lambda: prepare(config=LowLatencyMoeConfig(8, arch="sm80")), ValueError, "deepseek_fp8.*sm80"),
    ("acts codes bf16", _acts(codes=torch.zeros(2, H, dtype=torch.bfloat16)), TypeError, "codes must have dtype float8_e4m3fn"),
    ("acts scales float64", _acts(scales=torch.ones(2, H // 128, dtype=torch.float64)), TypeError, "scales must have dtype float32"),
    ("acts codes 1-D", _acts(codes=torch.zeros(H, dtype=F8)), ValueError, "codes must have 2 dimensions"),
    ("acts H 192", _acts(codes=_codes(2, 192)), ValueError, r"hidden size \(codes.shape\[1\]\) must be a positive multiple of 128"),
    ("acts tokens", _acts(codes=_codes(3), scales=torch.ones(3, H // 128)), ValueError, "codes hold 3 tokens"),
    ("acts scales shape", _acts(scales=torch.ones(2, H // 32)), ValueError, r"scales must be \[2, 2\]"),
    ("acts scales nan", _acts(scales=torch.tensor([[1.0, float("nan")], [1.0, 1.0]])), ValueError, "scales must be finite and positive"),
    ("acts scales zero", _acts(scales=torch.tensor([[1.0, 0.0], [1.0, 1.0]])), ValueError, "scales must be finite and positive"),
    ("acts scales negative", _acts(scales=-torch.ones(2, 2)), ValueError, "scales must be finite and positive"),
    ("acts nan code", _acts(codes=torch.full((2, H), 0x7F, dtype=torch.uint8).view(F8)), ValueError, "codes holds E4M3 NaN codes"),
    ("acts codes strided", _acts(codes=torch.zeros(H, 2, dtype=F8).t()), ValueError, "codes must be contiguous"),
    ("acts weights type", _acts(weights=object()), TypeError, "weights must be DeepSeekFp8Weights"),
    ("acts weights H", _acts(codes=_codes(2, 2 * H), scales=torch.ones(2, 4), weights=prepare()), ValueError,
     r"codes must be \[T, 256\]"),
    ("ref out fp16", _ref(out_dtype=torch.float16), ValueError, "out_dtype must be torch.bfloat16 for DeepSeek FP8"),
    ("ref fp16 x", _ref(inputs=torch.ones(2, H, dtype=torch.float16)), TypeError, "hidden_states must have dtype"),
    ("ref per-tensor acts", _ref(inputs=Fp8PerTensorActivations(_codes(2), 1.0)), TypeError,
     "inputs must be a BF16 tensor or DeepSeekFp8Activations"),
    ("ref codes uint8", _ref(inputs=DeepSeekFp8Activations(torch.zeros(2, H, dtype=torch.uint8), torch.ones(2, 2))),
     TypeError, "inputs.codes must have dtype float8_e4m3fn"),
    ("ref scales nan", _ref(inputs=DeepSeekFp8Activations(_codes(2), torch.full((2, 2), float("nan")))), ValueError,
     "inputs.scales must be finite and positive"),
    ("ref x H", _ref(inputs=torch.ones(2, 2 * H, dtype=torch.bfloat16)), ValueError, r"hidden_states must be \[T, 256\]"),
    ("ref intermediate shape", _ref(intermediate=(torch.zeros(2, 2, 128, dtype=F8), torch.ones(2, 2, 1))), ValueError,
     "intermediate must be codes"),
    ("ref intermediate dtype", _ref(intermediate=(torch.zeros(2, 2, I), torch.ones(2, 2, 2))), TypeError,
     "intermediate codes must have dtype float8_e4m3fn"),
    ("op fp16 x", _op(inputs=torch.ones(2, H, dtype=torch.float16)), TypeError, "hidden_states must be torch.bfloat16"),
    ("op int x", _op(inputs=torch.ones(2, H, dtype=torch.int32)), TypeError, "hidden_states must be torch.bfloat16"),
    ("op list x", _op(inputs=[[1.0]]), TypeError, "inputs must be a BF16 tensor"),
    ("op out fp16", _op(out_dtype=torch.float16), ValueError, "out_dtype must be torch.bfloat16 for DeepSeek FP8"),
    ("op x H", _op(inputs=torch.ones(2, 2 * H, dtype=torch.bfloat16)), ValueError, r"hidden_states must be \[T, 256\]"),
    ("op x strided", _op(inputs=torch.ones(H, 2, dtype=torch.bfloat16).t()), ValueError, "hidden_states must be contiguous"),
    ("op per-tensor acts", _op(inputs=Fp8PerTensorActivations(_codes(2), 1.0)), TypeError, "inputs must be a BF16 tensor"),
    ("op codes uint8", _op(inputs=DeepSeekFp8Activations(torch.zeros(2, H, dtype=torch.uint8), torch.ones(2, 2))),
     TypeError, "inputs.codes must have dtype float8_e4m3fn"),
    ("op scales float64", _op(inputs=DeepSeekFp8Activations(_codes(2), torch.ones(2, 2, dtype=torch.float64))),
     TypeError, "inputs.scales must have dtype float32"),
    ("op codes H", _op(inputs=DeepSeekFp8Activations(_codes(2, 2 * H), torch.ones(2, 4))), ValueError,
     r"inputs.codes must be \[T, 256\]"),
    ("op scales shape", _op(inputs=DeepSeekFp8Activations(_codes(2), torch.ones(2, 8))), ValueError,
     r"inputs.scales must be \[2, 2\]"),
    ("op scales strided", _op(inputs=DeepSeekFp8Activations(_codes(2), torch.ones(2, 2).t())), ValueError,
     "inputs.scales must be contiguous"),
]


@pytest.mark.parametrize("call, error, match", [case[1:] for case in BAD], ids=[case[0] for case in BAD])
def test_bad_inputs(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_other_formats_refuse_deepseek_activations():
    config = LowLatencyMoeConfig(8, arch="sm90")
    dense = config.prepare_bf16_weights(torch.zeros(E, 2 * I, H, dtype=torch.bfloat16), torch.zeros(E, H, I, dtype=torch.bfloat16))
    acts = DeepSeekFp8Activations(_codes(2), torch.ones(2, 2))
    routing = Routing.unpacked(torch.zeros(2, 2, dtype=torch.int32), torch.ones(2, 2))
    with pytest.raises(TypeError, match="DeepSeekFp8Activations are for DeepSeek FP8 weights"):
        low_latency_moe(config, acts, dense, routing)


def test_supported_everywhere_the_other_fp8_formats_run():
    for arch in ("sm90", "sm100", "sm103", "sm107", "sm120"):
        formats = LowLatencyMoeConfig.supported_formats(arch)
        assert FMT in formats and WeightFormat.FP8_PER_TENSOR in formats
    assert FMT not in LowLatencyMoeConfig.supported_formats("sm80")
