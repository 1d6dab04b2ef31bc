"""CPU tests of the low-latency per-tensor FP8 format (contract 004: E4M3 weights and tokens with static
calibration scales): the prepared layout and bit-exact payloads, the tokens' quantization, the float64
reference against a plain loop written here, the kernels' E4M3 rounding (decode.cuh e4m3_round, built for the
host) against torch's, and the bad-input rows (prepare, activations, reference and the call's checks, all
refused before any work).

The plain loop has its own E4M3 tables (values from the bit fields, rounding by nearest table entry with ties
to the even code) and its own factors (FP32 products computed here), and rounds at the points the reference
states: preactivation to BF16, the activation's FP32 value times the FP32 multiplier to E4M3, rows to BF16,
then an ordered FP32 multiply and add.
"""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
import torch

from cudnn_moe.activations import ACTIVATION_NAMES, SiLU, SwiGLU, parse_activation
from cudnn_moe.formats import quantize_fp8_per_tensor
from cudnn_moe.low_latency import (
    Fp8PerTensorActivations,
    Fp8PerTensorWeights,
    LowLatencyMoeConfig,
    RawReference,
    WeightFormat,
    fp8_per_tensor_intermediate,
    low_latency_moe,
    reference_fp8_per_tensor,
    reference_low_latency,
)
from cudnn_moe.routing import Routing, pack_routing
from tests.ops.low_latency.test_low_latency_cpu import plain_e4m3
from tests.support.kernel_sources import CXX, HOST_PRELUDE, host_program


FMT = WeightFormat.FP8_PER_TENSOR
E, H, I, IP = 3, 128, 96, 128  # I = 96 pads to 128
IN_SCALE, MID_SCALE = 0.02, 0.01


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def sources(gated: bool, seed: int = 0, hidden: int = H, inter: int = I) -> tuple[torch.Tensor, torch.Tensor]:
    """BF16 w1 [E, N1, H], w2 [E, H, I]; expert 1 of w2 is all zero (its scale must be 1.0)."""
    gen = torch.Generator().manual_seed(seed)
    w1 = (torch.randn(E, (2 if gated else 1) * inter, hidden, generator=gen) / hidden**0.5).bfloat16()
    w2 = (torch.randn(E, hidden, inter, generator=gen) / inter**0.5).bfloat16()
    w2[1] = 0
    return w1, w2


def prepare(gated: bool = True, seed: int = 0, config: LowLatencyMoeConfig | None = None, **change):
    w1, w2 = sources(gated, seed)
    args = {"w1_bf16": w1, "w2_bf16": w2, "input_scale": IN_SCALE, "intermediate_scale": MID_SCALE, **change}
    config = config or LowLatencyMoeConfig(8, arch="sm90")
    return config.prepare_fp8_per_tensor_weights(args["w1_bf16"], args["w2_bf16"], args["input_scale"],
                                                 args["intermediate_scale"],
                                                 activation=SwiGLU() if gated else SiLU())


# ----------------------------------------------------------------------------- the test's own E4M3 rounding
_FINITE = torch.arange(0, 0x7F, dtype=torch.uint8)  # non-negative finite codes 0..126, increasing in value
_VALUES = plain_e4m3(_FINITE.view(torch.float8_e4m3fn))


def plain_e4m3_round(v: torch.Tensor) -> torch.Tensor:
    """float64 values -> the nearest E4M3 value (ties to the even code), saturating at +-448, in float64."""
    a = v.abs().clamp(max=448.0)
    dist = (a[..., None] - _VALUES).abs()
    best = dist.min(dim=-1, keepdim=True).values
    tied = dist == best
    even = tied & (_FINITE % 2 == 0)
    index = torch.where(even.any(-1), even.long().argmax(-1), tied.long().argmax(-1))
    return torch.where(v < 0, -1.0, 1.0).double() * _VALUES[index]


def test_plain_e4m3_round_agrees_with_torch_on_ties_and_edges():
    """The test's rounding and torch's conversion (after the saturating clamp) agree, ties included."""
    mid = (_VALUES[1:] + _VALUES[:-1]) / 2
    probe = torch.cat([_VALUES, mid, mid * (1 + 2.0**-20), mid * (1 - 2.0**-20), torch.tensor([447.9, 464.0, 500.0, 1e6])])
    probe = torch.cat([probe, -probe]).float().double()
    want = probe.float().clamp(-448, 448).to(torch.float8_e4m3fn).double()
    assert torch.equal(plain_e4m3_round(probe), want)


# ----------------------------------------------------------------------------- preparation
@pytest.mark.parametrize("gated", [True, False])
def test_prepare_layout_and_bit_exact_quantization(gated):
    w1, w2 = sources(gated)
    wts = prepare(gated)
    assert isinstance(wts, Fp8PerTensorWeights)
    assert (wts.format, wts.hidden_size, wts.intermediate_size, wts.padded_intermediate, wts.gated) == (FMT, H, I, IP, gated)
    n1p = (2 if gated else 1) * IP
    assert wts.w1_codes.shape == (E, n1p, H) and wts.w2_codes.shape == (E, H, IP)
    assert wts.w1_codes.dtype == wts.w2_codes.dtype == torch.float8_e4m3fn
    for source, codes, scale in ((w1, wts.canonical()[0], wts.w1_scale), (w2, wts.canonical()[2], wts.w2_scale)):
        assert scale.dtype == torch.float32 and scale.shape == (E,)
        for e in range(E):  # each expert exactly as quantize_fp8_per_tensor quantizes it alone
            want_codes, want_scale = quantize_fp8_per_tensor(source[e])
            assert torch.equal(bits(codes[e]), bits(want_codes)) and float(scale[e]) == float(want_scale)
    assert float(wts.w2_scale[1]) == 1.0 and not bits(wts.w2_codes[1]).any()  # the all-zero expert
    halves = wts.w1_codes.chunk(2, dim=1) if gated else (wts.w1_codes,)
    for half in halves:  # padding rows and columns are +0 codes
        assert not bits(half[:, I:]).any()
    assert not bits(wts.w2_codes[..., I:]).any()
    # the plain decode of the codes times the scale stays close to the source
    dec = plain_e4m3(wts.canonical()[0]) * wts.w1_scale.double()[:, None, None]
    assert float((dec - w1.double()).norm() / w1.double().norm()) < 0.05
    # calibration scales, multipliers and factors: FP32 operations on the FP32 values
    f32 = lambda v: torch.tensor(v, dtype=torch.float32)
    assert wts.input_scale == float(f32(IN_SCALE)) and wts.intermediate_scale == float(f32(MID_SCALE))
    assert wts.input_multiplier == float(f32(1.0) / f32(IN_SCALE))
    assert wts.inter_multiplier.dtype == torch.float32 and wts.inter_multiplier.shape == (1,)
    assert float(wts.inter_multiplier) == float(f32(1.0) / f32(MID_SCALE))
    assert torch.equal(wts.fc1_factor, wts.w1_scale * f32(IN_SCALE))
    assert torch.equal(wts.fc2_factor, wts.w2_scale * f32(MID_SCALE))


def test_calibration_scales_as_tensors():
    a = prepare(input_scale=torch.tensor(IN_SCALE), intermediate_scale=torch.tensor([MID_SCALE], dtype=torch.float64))
    b = prepare()
    assert (a.input_scale, a.intermediate_scale) == (b.input_scale, b.intermediate_scale)
    assert torch.equal(a.fc1_factor, b.fc1_factor) and torch.equal(a.inter_multiplier, b.inter_multiplier)


def test_activations_quantize_with_the_one_multiplier():
    config, wts = LowLatencyMoeConfig(8, arch="sm90"), prepare()
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(5, H, generator=gen) * 3).bfloat16()
    x[0, :4] = torch.tensor([20.0, -1e4, 0.0, -0.0])  # saturates at +-448, zeros keep their sign
    acts = config.prepare_fp8_per_tensor_activations(x, wts)
    assert isinstance(acts, Fp8PerTensorActivations) and acts.input_scale == wts.input_scale
    assert acts.codes.dtype == torch.float8_e4m3fn and acts.codes.shape == (5, H)
    scaled = (x.float() * torch.tensor(wts.input_multiplier, dtype=torch.float32)).double()  # one FP32 product
    assert torch.equal(plain_e4m3(acts.codes), plain_e4m3_round(scaled))
    assert bits(acts.codes)[0, :4].tolist() == [0x7E, 0xFE, 0x00, 0x80]  # 20 * 50 -> 448, -448, +0, -0


# ----------------------------------------------------------------------------- reference vs a plain loop
def plain_moe(x_codes, wts_payload, ids, route_w, act):
    """Per token and slot, from the codes, the test's own E4M3 decode and rounding, and FP32 factors made here."""
    w1c, s1, w2c, s2, in_scale, mid_scale = wts_payload
    act = parse_activation(act)
    f32 = lambda v: torch.tensor(v, dtype=torch.float32)
    f1 = (s1 * f32(in_scale)).double()
    f2 = (s2 * f32(mid_scale)).double()
    mult = (f32(1.0) / f32(mid_scale))
    x, w1, w2 = plain_e4m3(x_codes), plain_e4m3(w1c), plain_e4m3(w2c)
    n = w2.shape[2]
    tokens, top_k = ids.shape
    out = torch.zeros(tokens, w2.shape[1], dtype=torch.bfloat16)
    rows = torch.zeros(tokens, top_k, w2.shape[1], dtype=torch.bfloat16)
    for t in range(tokens):
        acc = torch.zeros(w2.shape[1], dtype=torch.float32)
        for s in range(top_k):
            e = int(ids[t, s])
            h = ((w1[e] @ x[t]) * f1[e]).float().bfloat16().double()
            y = act.apply(h[:n], h[n:]) if act.gated else act.apply(h)
            q = plain_e4m3_round((y.float() * mult).double())
            rows[t, s] = ((w2[e] @ q) * f2[e]).float().bfloat16()
            acc = acc + torch.tensor(float(route_w[t, s]), dtype=torch.float32) * rows[t, s].float()
        out[t] = acc.bfloat16()
    return out, rows


@pytest.mark.parametrize("gated, tokens, top_k, kind", [(True, 8, 4, "packed"), (False, 3, 2, "fp32"), (True, 1, 3, "fp32")])
def test_reference_matches_plain_loop(gated, tokens, top_k, kind):
    config = LowLatencyMoeConfig(8, arch="sm90")
    w1, w2 = sources(gated, seed=2)
    wts = config.prepare_fp8_per_tensor_weights(w1, w2, 0.03, 0.004, activation=SwiGLU() if gated else SiLU())
    gen = torch.Generator().manual_seed(3)
    acts = config.prepare_fp8_per_tensor_activations(torch.randn(tokens, H, generator=gen).bfloat16(), wts)
    ids = torch.randint(0, E, (tokens, top_k), generator=gen)
    weights = torch.rand(tokens, top_k, generator=gen)
    if kind == "packed":
        routing, route_w = Routing.packed(pack_routing(ids, weights)), weights.bfloat16().float()
    else:
        routing, route_w = Routing.unpacked(ids.to(torch.int32), weights), weights
    act = SwiGLU() if gated else SiLU()
    w1c, s1, w2c, s2 = wts.canonical()
    want, want_rows = plain_moe(acts.codes, (w1c, s1, w2c, s2, 0.03, 0.004), ids, route_w, act)
    got = reference_low_latency(acts, wts, routing, act)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    raw = reference_fp8_per_tensor(acts, wts, routing, act, finalize=False)
    assert isinstance(raw, RawReference) and torch.equal(raw.rows, want_rows) and torch.equal(raw.weights, route_w)
    assert float(want.abs().max()) > 0


def test_reference_on_a_given_intermediate():
    """fp8_per_tensor_intermediate is the reference's step 2 (the plain loop's E4M3 values); handing it back as
    ``intermediate`` changes nothing, and moving one value by one E4M3 step changes only that slot's row (what
    the GPU tests use to check GEMM2 apart from a rare flip of step 2)."""
    config, wts = LowLatencyMoeConfig(8, arch="sm90"), prepare(seed=5)
    gen = torch.Generator().manual_seed(9)
    acts = config.prepare_fp8_per_tensor_activations(torch.randn(3, H, generator=gen).bfloat16(), wts)
    ids, weights = torch.tensor([[0, 1], [2, 0], [1, 2]]), torch.rand(3, 2, generator=gen)
    routing = Routing.unpacked(ids, weights)
    q = fp8_per_tensor_intermediate(acts, wts, routing, SwiGLU())
    assert q.shape == (3, 2, I) and q.dtype == torch.float64
    assert torch.equal(q, q.float().to(torch.float8_e4m3fn).double()) and bool((q != 0).any())
    base = reference_fp8_per_tensor(acts, wts, routing, SwiGLU(), finalize=False)
    same = reference_fp8_per_tensor(acts, wts, routing, SwiGLU(), finalize=False, intermediate=q.bfloat16())
    assert torch.equal(base.rows, same.rows)
    moved = q.clone()
    index = int(moved[1, 0].abs().argmax())
    code = moved[1, 0, index].float().to(torch.float8_e4m3fn).view(torch.uint8)
    moved[1, 0, index] = (code - 1).view(torch.float8_e4m3fn).double()  # one step towards zero
    other = reference_fp8_per_tensor(acts, wts, routing, SwiGLU(), finalize=False, intermediate=moved)
    changed = (other.rows != base.rows).any(dim=-1)
    assert changed.tolist() == [[False, False], [True, False], [False, False]]
    with pytest.raises(ValueError, match="intermediate must be"):
        reference_fp8_per_tensor(acts, wts, routing, SwiGLU(), intermediate=q[:, :1])


@pytest.mark.parametrize("name", ACTIVATION_NAMES)
def test_reference_every_activation(name):
    """All ten activations run through the reference and match the plain loop (2 tokens, top-2)."""
    act = parse_activation(name)
    config = LowLatencyMoeConfig(8, arch="sm90")
    w1, w2 = sources(act.gated, seed=4)
    wts = config.prepare_fp8_per_tensor_weights(w1, w2, 0.03, 0.004, activation=act)
    gen = torch.Generator().manual_seed(6)
    acts = config.prepare_fp8_per_tensor_activations(torch.randn(2, H, generator=gen).bfloat16(), wts)
    ids, weights = torch.tensor([[0, 2], [1, 0]]), torch.rand(2, 2, generator=gen)
    want, _ = plain_moe(acts.codes, (*wts.canonical(), 0.03, 0.004), ids, weights, act)
    assert torch.equal(reference_low_latency(acts, wts, Routing.unpacked(ids, weights), act), want)


def test_intermediate_saturates_at_448():
    """A tiny intermediate scale pushes the quantized intermediate to +-448 (saturation, never NaN)."""
    config = LowLatencyMoeConfig(8, arch="sm90")
    w1, w2 = sources(True, seed=7)
    wts = config.prepare_fp8_per_tensor_weights(w1, w2, 0.03, 1e-6)
    gen = torch.Generator().manual_seed(8)
    acts = config.prepare_fp8_per_tensor_activations(torch.randn(2, H, generator=gen).bfloat16(), wts)
    ids, weights = torch.tensor([[0, 2], [1, 0]]), torch.rand(2, 2, generator=gen)
    want, _ = plain_moe(acts.codes, (*wts.canonical(), 0.03, 1e-6), ids, weights, SwiGLU())
    got = reference_low_latency(acts, wts, Routing.unpacked(ids, weights), SwiGLU())
    assert torch.equal(got, want) and bool(got.isfinite().all())


# ----------------------------------------------------------------------------- the kernels' E4M3 rounding
_ROUND_DRIVER = HOST_PRELUDE + r"""
#include "low_latency/decode.cuh"
// argv[1]: float32 values; argv[2]: e4m3_round of each (float32).
int main(int, char** argv) {
  FILE* in = std::fopen(argv[1], "rb");
  FILE* out = std::fopen(argv[2], "wb");
  float v;
  while (std::fread(&v, 4, 1, in) == 1) {
    const float r = ll::e4m3_round(v);
    std::fwrite(&r, 4, 1, out);
  }
  return std::fclose(out) != 0 || std::fclose(in) != 0;
}
"""


@pytest.mark.skipif(CXX is None, reason="no C++ compiler")
def test_kernel_e4m3_rounding_matches_torch(tmp_path):
    """decode.cuh's e4m3_round (the intermediate quantizer of the GEMM1 kernel, plain FP32 arithmetic) built for
    the host: every E4M3 value, the midpoints between neighbours (ties to even) and their FP32 neighbours,
    subnormals, saturation, +-Inf, signed zeros and random FP32 values give torch's to_e4m3 bit for bit; NaN
    stays NaN."""
    program = host_program(tmp_path, "round", _ROUND_DRIVER)
    gen = torch.Generator().manual_seed(0)
    mid = ((_VALUES[1:] + _VALUES[:-1]) / 2).float()
    up, down = (torch.nextafter(mid, torch.full_like(mid, d)) for d in (1e9, -1e9))
    randoms = torch.cat([torch.randn(20000, generator=gen) * s for s in (1e-3, 0.05, 1.0, 30.0, 400.0)])
    special = torch.tensor([0.0, 448.0, 449.0, 463.99, 464.0, 480.0, 1e30, 3.4e38, float("inf"), 2.0**-10, 2.0**-9,
                            3 * 2.0**-11, 1e-40, 2.0**-6, 2.0**-6 - 2.0**-12])
    probe = torch.cat([_VALUES.float(), mid, up, down, randoms, special])
    probe = torch.cat([probe, -probe, torch.tensor([float("nan")])]).float()
    np.asarray(probe.numpy(), dtype=np.float32).tofile(tmp_path / "in.bin")
    subprocess.run([str(program), str(tmp_path / "in.bin"), str(tmp_path / "out.bin")], check=True)
    got = torch.from_numpy(np.fromfile(tmp_path / "out.bin", dtype=np.float32).copy())
    want = probe.clamp(-448, 448).to(torch.float8_e4m3fn).float()
    assert bool(got[-1].isnan())
    assert torch.equal(got[:-1].view(torch.int32), want[:-1].view(torch.int32)), (
        f"e4m3_round differs at {(got[:-1].view(torch.int32) != want[:-1].view(torch.int32)).nonzero()[:5].flatten().tolist()}")


# ----------------------------------------------------------------------------- bad inputs
def _acts(**change):
    def call():
        config, wts = LowLatencyMoeConfig(2, arch="sm90"), prepare()
        args = {"hidden_states": torch.zeros(2, H, dtype=torch.bfloat16), "weights": wts, **change}
        return config.prepare_fp8_per_tensor_activations(args["hidden_states"], args["weights"])
    return call


def _ref(**change):
    def call():
        config, wts = LowLatencyMoeConfig(8, arch="sm90"), prepare()
        acts = config.prepare_fp8_per_tensor_activations(torch.ones(2, H, dtype=torch.bfloat16), wts)
        args = {"activations": acts, "weights": wts, "out_dtype": torch.bfloat16, **change}
        routing = Routing.unpacked(torch.zeros(2, 2, dtype=torch.int32), torch.ones(2, 2))
        return reference_low_latency(args["activations"], args["weights"], routing, SwiGLU(), out_dtype=args["out_dtype"])
    return call


def _op(**change):
    """The GPU call on CPU tensors: its argument checks run (and must refuse) before the device check."""
    def call():
        config, wts = LowLatencyMoeConfig(8, arch="sm90"), prepare()
        acts = config.prepare_fp8_per_tensor_activations(torch.ones(2, H, dtype=torch.bfloat16), wts)
        args = {"inputs": acts, "out_dtype": torch.bfloat16, **change}
        routing = Routing.unpacked(torch.zeros(2, 2, dtype=torch.int32), torch.ones(2, 2))
        return low_latency_moe(config, args["inputs"], wts, routing, out_dtype=args["out_dtype"])
    return call


_W1, _W2 = sources(True)
BAD = [
    ("w1 int", lambda: prepare(w1_bf16=torch.zeros(E, 2 * I, H, dtype=torch.int32)), TypeError, "w1_bf16 must have dtype"),
    ("w2 e4m3", lambda: prepare(w2_bf16=_W2.to(torch.float8_e4m3fn)), TypeError, "w2_bf16 must have dtype"),
    ("w1 not a tensor", lambda: prepare(w1_bf16=[1.0]), TypeError, "w1_bf16 must be a torch.Tensor"),
    ("w1 2-D", lambda: prepare(w1_bf16=_W1[0]), ValueError, "w1_bf16 must have 3 dimensions"),
    ("w1 rows", lambda: prepare(w1_bf16=_W1[:, :I]), ValueError, "w1_bf16 must have 192 rows"),
    ("w1 H", lambda: prepare(w1_bf16=torch.zeros(E, 2 * I, H + 128, dtype=torch.bfloat16)), ValueError, "w1_bf16 must be"),
    ("w2 experts", lambda: prepare(w2_bf16=torch.zeros(E + 1, H, I, dtype=torch.bfloat16)), ValueError, "w2_bf16 has 4"),
    ("misaligned H", lambda: prepare(w1_bf16=torch.zeros(E, 2 * I, H + 16, dtype=torch.bfloat16),
                                     w2_bf16=torch.zeros(E, H + 16, I, dtype=torch.bfloat16)), ValueError,
     r"hidden size \(w2_bf16.shape\[1\]\) must be a positive multiple of 128"),
    ("misaligned I", lambda: prepare(w1_bf16=torch.zeros(E, 80, H, dtype=torch.bfloat16),
                                     w2_bf16=torch.zeros(E, H, 40, dtype=torch.bfloat16)), ValueError,
     r"intermediate size \(w2_bf16.shape\[2\]\) must be a positive multiple of 32"),
    ("nan source", lambda: prepare(w2_bf16=torch.full((E, H, I), float("nan"), dtype=torch.bfloat16)), ValueError,
     "w2_bf16 contains NaN"),
    ("inf source", lambda: prepare(w1_bf16=torch.full((E, 2 * I, H), float("inf"), dtype=torch.bfloat16)), ValueError,
     "w1_bf16 contains"),
    ("input_scale nan", lambda: prepare(input_scale=float("nan")), ValueError, "input_scale must be finite"),
    ("input_scale inf", lambda: prepare(input_scale=float("inf")), ValueError, "input_scale must be finite"),
    ("input_scale zero", lambda: prepare(input_scale=0.0), ValueError, "input_scale must be positive"),
    ("input_scale negative", lambda: prepare(input_scale=-0.5), ValueError, "input_scale must be positive"),
    ("input_scale 1e39", lambda: prepare(input_scale=1e39), ValueError, "input_scale must be finite in float32"),
    ("input_scale 1e-300", lambda: prepare(input_scale=1e-300), ValueError, "input_scale must be positive in float32"),
    ("input_scale string", lambda: prepare(input_scale="0.1"), TypeError, "input_scale must be a number"),
    ("input_scale bool", lambda: prepare(input_scale=True), TypeError, "input_scale must be a number"),
    ("input_scale 2 elements", lambda: prepare(input_scale=torch.ones(2)), TypeError, "input_scale must be a number"),
    ("input_scale nan tensor", lambda: prepare(input_scale=torch.tensor(float("nan"))), ValueError, "input_scale must be finite"),
    ("intermediate_scale nan", lambda: prepare(intermediate_scale=float("nan")), ValueError, "intermediate_scale must be finite"),
    ("intermediate_scale -inf", lambda: prepare(intermediate_scale=float("-inf")), ValueError, "intermediate_scale must be finite"),
    ("intermediate_scale zero", lambda: prepare(intermediate_scale=0), ValueError, "intermediate_scale must be positive"),
    ("intermediate_scale tiny", lambda: prepare(intermediate_scale=1e-39), ValueError, "intermediate_scale must be at least"),
    ("factor underflow", lambda: prepare(w1_bf16=_W1 * 1e-30, input_scale=1e-20), ValueError,
     "input_scale times the weights' per-expert scales"),
    ("factor overflow", lambda: prepare(w2_bf16=_W2 * 1e30, intermediate_scale=1e20), ValueError,
     "intermediate_scale times the weights' per-expert scales"),
    ("sm80", lambda: prepare(config=LowLatencyMoeConfig(8, arch="sm80")), ValueError, "fp8_per_tensor.*sm80"),
    ("acts weights type", _acts(weights=None), TypeError, "weights must be the Fp8PerTensorWeights"),
    ("acts int tokens", _acts(hidden_states=torch.zeros(2, H, dtype=torch.int32)), TypeError, "hidden_states must have dtype"),
    ("acts e4m3 tokens", _acts(hidden_states=torch.zeros(2, H).to(torch.float8_e4m3fn)), TypeError, "hidden_states must have dtype"),
    ("acts 1-D", _acts(hidden_states=torch.zeros(H, dtype=torch.bfloat16)), ValueError, "hidden_states must have 2 dimensions"),
    ("acts tokens", _acts(hidden_states=torch.zeros(3, H, dtype=torch.bfloat16)), ValueError, "hidden_states has 3 tokens"),
    ("acts H", _acts(hidden_states=torch.zeros(2, H + 128, dtype=torch.bfloat16)), ValueError, "hidden_states must be"),
    ("ref out fp16", _ref(out_dtype=torch.float16), ValueError, "out_dtype must be torch.bfloat16 for per-tensor FP8"),
    ("ref plain x", _ref(activations=torch.zeros(2, H, dtype=torch.bfloat16)), TypeError, "activations must be Fp8PerTensorActivations"),
    ("ref codes dtype", _ref(activations=Fp8PerTensorActivations(torch.zeros(2, H, dtype=torch.uint8), float(torch.tensor(IN_SCALE)))),
     TypeError, "activations.codes must have dtype float8_e4m3fn"),
    ("ref other scale", _ref(activations=Fp8PerTensorActivations(torch.zeros(2, H).to(torch.float8_e4m3fn), 1.0)),
     ValueError, "another input_scale"),
    ("op plain x", _op(inputs=torch.zeros(2, H, dtype=torch.bfloat16)), TypeError, "Fp8PerTensorActivations"),
    ("op out fp16", _op(out_dtype=torch.float16), ValueError, "out_dtype must be torch.bfloat16 for per-tensor FP8"),
    ("op codes dtype", _op(inputs=Fp8PerTensorActivations(torch.zeros(2, H, dtype=torch.uint8), float(torch.tensor(IN_SCALE)))),
     TypeError, "inputs.codes must have dtype float8_e4m3fn"),
    ("op codes H", _op(inputs=Fp8PerTensorActivations(torch.zeros(2, H + 128).to(torch.float8_e4m3fn), float(torch.tensor(IN_SCALE)))),
     ValueError, "inputs.codes must be"),
    ("op other scale", _op(inputs=Fp8PerTensorActivations(torch.zeros(2, H).to(torch.float8_e4m3fn), 0.5)),
     ValueError, "quantized with input_scale=0.5"),
]


@pytest.mark.parametrize("call, error, match", [case[1:] for case in BAD], ids=[case[0] for case in BAD])
def test_bad_inputs(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_other_formats_refuse_fp8_activations():
    config = LowLatencyMoeConfig(8, arch="sm90")
    dense = config.prepare_bf16_weights(torch.zeros(E, 2 * I, H, dtype=torch.bfloat16), torch.zeros(E, H, I, dtype=torch.bfloat16))
    acts = config.prepare_fp8_per_tensor_activations(torch.ones(2, H, dtype=torch.bfloat16), prepare())
    routing = Routing.unpacked(torch.zeros(2, 2, dtype=torch.int32), torch.ones(2, 2))
    with pytest.raises(TypeError, match="Fp8PerTensorActivations are for per-tensor FP8 weights"):
        low_latency_moe(config, acts, dense, routing)
