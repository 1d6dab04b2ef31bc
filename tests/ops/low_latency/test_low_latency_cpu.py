"""CPU tests of the low-latency config (contract 004, part 1): supported tables, bit-exact weight
preparation, the float64 references against a plain per-token loop, and bad inputs.

The plain loop decodes every format from its own tables (no cudnn_moe.formats code) and rounds at
the contract's points: preactivation and intermediate to the input dtype (FP32 preactivation for
MXINT4, BF16 for the NVFP4 pair), rows to the output dtype, then an ordered FP32 multiply and add.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cudnn_moe.activations import ACTIVATION_NAMES, GELU, SiLU, SwiGLU, parse_activation
from cudnn_moe.formats import quantize_nvfp4
from cudnn_moe.low_latency import (
    LowLatencyMoeConfig,
    RawReference,
    WeightFormat,
    combine_ordered_fp32,
    reference_bf16,
    reference_low_latency,
    reference_nvfp4_pair,
)
from cudnn_moe.engines.sm90.layout import pack_int4_weight_tiles, pack_mxfp4_weight_tiles, pack_weight_tiles
from cudnn_moe.formats.mxfp4_as_nvfp4 import form_scales, nvfp4_globals
from cudnn_moe.routing import Routing, pack_routing
from cudnn_moe.weights.low_latency import TILED_FORMATS
from tests.support.low_latency import FORMAT_CASES, fp8_codes, fp8_scales  # (format, token dtype) pairs

E, H, I, IP = 3, 128, 96, 128  # I = 96 pads to 128
PAIR_H, PAIR_I = 512, 128
GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
WEIGHT_ONLY = (WeightFormat.NVFP4_WEIGHT_ONLY, WeightFormat.MXFP4_WEIGHT_ONLY, WeightFormat.MXINT4_WEIGHT_ONLY)
FP8_WO = WeightFormat.FP8_WEIGHT_ONLY
FP8_PT = WeightFormat.FP8_PER_TENSOR  # its own CPU tests: test_low_latency_fp8_per_tensor_cpu.py
DS = WeightFormat.DEEPSEEK_FP8  # its own CPU tests: test_low_latency_deepseek_fp8_cpu.py
MX4, MX8 = WeightFormat.MXFP4_W_MXFP8_A, WeightFormat.MXFP8_W_MXFP8_A  # theirs: test_low_latency_mx_pair_cpu.py
ALL_ARCHS = ("sm90", "sm100", "sm103", "sm107", "sm120")


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a tensor, as integers of the same element size."""
    return t.contiguous().view(BITS[t.element_size()])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


# ----------------------------------------------------------------------------- random payloads
def dense_weights(dtype: torch.dtype, gated: bool, seed: int = 0, hidden: int = H, inter: int = I):
    gen = torch.Generator().manual_seed(seed)
    w1 = (torch.randn(E, (2 if gated else 1) * inter, hidden, generator=gen) / hidden**0.5).to(dtype)
    w2 = (torch.randn(E, hidden, inter, generator=gen) / inter**0.5).to(dtype)
    return w1, w2


def _codes(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)


def _scales(fmt: WeightFormat, gen: torch.Generator, *shape: int) -> torch.Tensor:
    if fmt is WeightFormat.NVFP4_WEIGHT_ONLY:
        return (torch.rand(shape, generator=gen) * 0.05 + 0.005).to(torch.float8_e4m3fn)
    if fmt in (WeightFormat.MXFP4_WEIGHT_ONLY, MX4, MX8):  # 2^-9 .. 2^-4
        return torch.randint(118, 124, shape, generator=gen, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    return (torch.rand(shape, generator=gen) * 0.02 + 0.002).to(torch.bfloat16)


def block_payloads(fmt: WeightFormat, gated: bool, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Random caller payloads in the prepare method's argument order."""
    gen = torch.Generator().manual_seed(seed)
    n1 = (2 if gated else 1) * I
    if fmt is FP8_WO:
        return fp8_codes(gen, (E, n1, H)), fp8_scales(gen, E, H), fp8_codes(gen, (E, H, I)), fp8_scales(gen, E, I)
    if fmt is FP8_PT:  # BF16 sources and the two calibration scales
        return (*dense_weights(torch.bfloat16, gated, seed), 0.02, 0.01)
    if fmt is DS:  # E4M3 codes with FP32 128 x 128 block scales (I = 128: DeepSeek FP8 needs I % 128 == 0)
        n1 = (2 if gated else 1) * IP
        return (fp8_codes(gen, (E, n1, H)), torch.rand(E, n1 // 128, H // 128, generator=gen) / 256 + 1e-3,
                fp8_codes(gen, (E, H, IP)), torch.rand(E, H // 128, IP // 128, generator=gen) / 256 + 1e-3)
    if fmt is MX8:  # E4M3 codes with E8M0 scales per 32
        return (fp8_codes(gen, (E, n1, H)), _scales(fmt, gen, E, n1, H // 32), fp8_codes(gen, (E, H, I)),
                _scales(fmt, gen, E, H, I // 32))
    block = 16 if fmt is WeightFormat.NVFP4_WEIGHT_ONLY else 32
    n1 = (2 if gated else 1) * I
    w1 = (_codes(gen, E, n1, H // 2), _scales(fmt, gen, E, n1, H // block))
    w2 = (_codes(gen, E, H, I // 2), _scales(fmt, gen, E, H, I // block))
    if fmt is WeightFormat.NVFP4_WEIGHT_ONLY:
        return (*w1, torch.rand(E, generator=gen) + 0.5, *w2, torch.rand(E, generator=gen) + 0.5)
    return (*w1, *w2)


def prepare(config: LowLatencyMoeConfig, fmt: WeightFormat, payloads: tuple, activation=SwiGLU()):
    method = {
        WeightFormat.BF16: config.prepare_bf16_weights,
        WeightFormat.FP16: config.prepare_fp16_weights,
        WeightFormat.NVFP4_WEIGHT_ONLY: config.prepare_nvfp4_weight_only_weights,
        WeightFormat.MXFP4_WEIGHT_ONLY: config.prepare_mxfp4_weight_only_weights,
        WeightFormat.MXINT4_WEIGHT_ONLY: config.prepare_mxint4_weight_only_weights,
        WeightFormat.NVFP4_W_NVFP4_A: config.prepare_nvfp4_weights,
        FP8_WO: config.prepare_fp8_weight_only_weights,
        FP8_PT: config.prepare_fp8_per_tensor_weights,
        DS: config.prepare_deepseek_fp8_weights,
        MX4: config.prepare_weights,
        MX8: config.prepare_weights,
    }[fmt]
    return method(*payloads, activation=activation)


# ----------------------------------------------------------------------------- plain oracle
def plain_fp4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] -> float64 E2M1 values [..., K], element 2i from the low nibble."""
    nib = torch.stack((codes & 0xF, codes >> 4), dim=-1).flatten(-2).long()
    return GRID[nib & 7] * torch.where(nib >= 8, -1.0, 1.0).double()


def plain_int4(codes: torch.Tensor) -> torch.Tensor:
    nib = torch.stack((codes & 0xF, codes >> 4), dim=-1).flatten(-2).long()
    return torch.where(nib >= 8, nib - 16, nib).double()


def plain_e4m3(codes: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn -> float64 from the bit fields (sign 7, exponent 6..3 biased by 7, mantissa 2..0;
    exponent 0 subnormal), without torch's FP8 conversion; NaN codes are not expected."""
    b = codes.view(torch.uint8).long()
    sign = torch.where(b >= 128, -1.0, 1.0).double()
    exp, man = (b >> 3) & 0xF, (b & 7).double()
    normal = (1 + man / 8) * torch.pow(2.0, (exp - 7).double())
    return sign * torch.where(exp == 0, man / 8 * 2.0**-6, normal)


def plain_decode(fmt: WeightFormat, payloads: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 (w1 [E, N1, H], w2 [E, H, I]) from the caller's payloads."""
    if fmt in (WeightFormat.BF16, WeightFormat.FP16):
        return payloads[0].double(), payloads[1].double()
    if fmt is FP8_WO:
        c1, s1, c2, s2 = payloads
        return plain_e4m3(c1) * s1.double()[:, None, None], plain_e4m3(c2) * s2.double()[:, None, None]
    if fmt in (WeightFormat.NVFP4_WEIGHT_ONLY, WeightFormat.NVFP4_W_NVFP4_A):
        c1, s1, g1, c2, s2, g2 = payloads
        dec = [plain_fp4(c) * s.double().repeat_interleave(16, -1) * g.double()[:, None, None]
               for c, s, g in ((c1, s1, g1), (c2, s2, g2))]
        return dec[0], dec[1]
    c1, s1, c2, s2 = payloads
    if fmt is WeightFormat.MXFP4_WEIGHT_ONLY:
        scale = [2.0 ** (s.view(torch.uint8).double() - 127) for s in (s1, s2)]
        return (plain_fp4(c1) * scale[0].repeat_interleave(32, -1), plain_fp4(c2) * scale[1].repeat_interleave(32, -1))
    return (plain_int4(c1) * s1.double().repeat_interleave(32, -1), plain_int4(c2) * s2.double().repeat_interleave(32, -1))


def plain_moe(x, w1, w2, ids, route_w, act, preact, inter, out_dtype):
    """Per token, per slot. Returns (out [T, H] out_dtype, rows [T, k, H] out_dtype)."""
    act = parse_activation(act)
    num_tokens, top_k = ids.shape
    n = w2.shape[2]
    out = torch.zeros(num_tokens, w2.shape[1], dtype=out_dtype)
    rows = torch.zeros(num_tokens, top_k, w2.shape[1], dtype=out_dtype)
    for t in range(num_tokens):
        acc = torch.zeros(w2.shape[1], dtype=torch.float32)
        for s in range(top_k):
            e = int(ids[t, s])
            if not 0 <= e < w1.shape[0]:
                continue
            h = (w1[e] @ x[t]).float().to(preact).double()
            y = act.apply(h[:n], h[n:]) if act.gated else act.apply(h)
            y = y.float().to(inter).double()
            rows[t, s] = (w2[e] @ y).float().to(out_dtype)
            acc = acc + torch.tensor(float(route_w[t, s]), dtype=torch.float32) * rows[t, s].float()
        out[t] = acc.to(out_dtype)
    return out, rows


def make_routing(num_tokens: int, top_k: int, kind: str, seed: int = 1, experts: int = E):
    """(Routing, ids, weights as the combine sees them)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, experts, (num_tokens, top_k), generator=gen)
    weights = torch.rand(num_tokens, top_k, generator=gen)
    if kind == "packed":
        return Routing.packed(pack_routing(ids, weights)), ids, weights.to(torch.bfloat16).float()
    return Routing.unpacked(ids.to(torch.int32), weights), ids, weights


def numerics(fmt: WeightFormat, x_dtype: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
    """(preactivation, intermediate) rounding dtypes of the contract."""
    if fmt is WeightFormat.MXINT4_WEIGHT_ONLY:
        return torch.float32, x_dtype
    if fmt is WeightFormat.NVFP4_W_NVFP4_A:
        return torch.bfloat16, torch.bfloat16
    return x_dtype, x_dtype


# ----------------------------------------------------------------------------- config and tables
def test_max_num_tokens():
    assert LowLatencyMoeConfig().max_num_tokens == 2
    assert LowLatencyMoeConfig(8).max_num_tokens == 8 and LowLatencyMoeConfig(1).max_num_tokens == 1
    for bad in (0, 9, 64, True, 2.0, "2", None):
        with pytest.raises(ValueError, match="max_num_tokens"):
            LowLatencyMoeConfig(bad)


def test_supported_tables():
    assert LowLatencyMoeConfig.supported_formats("sm80") == (WeightFormat.BF16, WeightFormat.FP16)
    for arch in ALL_ARCHS:
        assert LowLatencyMoeConfig.supported(arch)
        assert set(LowLatencyMoeConfig.supported_formats(arch)) == set(WeightFormat)
    for arch in ("sm89", "sm75", (12, 1)):
        assert not LowLatencyMoeConfig.supported(arch) and LowLatencyMoeConfig.supported_formats(arch) == ()
    with pytest.raises(ValueError, match="sm89"):
        LowLatencyMoeConfig(arch="sm89")
    with pytest.raises(ValueError, match="mxfp4_weight_only.*sm80"):
        LowLatencyMoeConfig.require_format("sm80", WeightFormat.MXFP4_WEIGHT_ONLY)
    LowLatencyMoeConfig.require_format("sm80", WeightFormat.FP16)


@pytest.mark.parametrize("fmt", [f for f in WeightFormat if f not in (WeightFormat.BF16, WeightFormat.FP16)])
def test_sm80_refuses_4bit_formats(fmt):
    payloads = (dense_weights(torch.bfloat16, True, hidden=PAIR_H, inter=PAIR_I)
                if fmt is WeightFormat.NVFP4_W_NVFP4_A else block_payloads(fmt, True))
    with pytest.raises(ValueError, match=f"{fmt.value}.*sm80"):
        prepare(LowLatencyMoeConfig(arch="sm80"), fmt, payloads)


# ----------------------------------------------------------------------------- preparation
@pytest.mark.parametrize("fmt, dtype", [(WeightFormat.BF16, torch.bfloat16), (WeightFormat.FP16, torch.float16)])
@pytest.mark.parametrize("gated", [True, False])
def test_prepare_16bit_bit_exact_and_padded(fmt, dtype, gated):
    w1, w2 = dense_weights(dtype, gated)
    wts = prepare(LowLatencyMoeConfig(arch="sm80"), fmt, (w1, w2), SwiGLU() if gated else GELU())
    assert (wts.format, wts.hidden_size, wts.intermediate_size, wts.padded_intermediate, wts.gated) == (fmt, H, I, IP, gated)
    assert wts.num_experts == E and wts.gemm1_rows == (2 if gated else 1) * I
    assert wts.w1.shape == (E, (2 if gated else 1) * IP, H) and wts.w2.shape == (E, H, IP)
    halves = w1.chunk(2, dim=1) if gated else (w1,)
    for index, half in enumerate(halves):
        assert same_bits(wts.w1[:, index * IP : index * IP + I], half)
        assert not bits(wts.w1[:, index * IP + I : (index + 1) * IP]).any()
    assert same_bits(wts.w2[..., :I], w2) and not bits(wts.w2[..., I:]).any()
    c1, c2 = wts.canonical()
    assert same_bits(c1, w1) and same_bits(c2, w2)


def test_prepare_16bit_no_padding_at_128_and_copies():
    w1, w2 = dense_weights(torch.bfloat16, True, inter=128)
    wts = LowLatencyMoeConfig(arch="sm90").prepare_bf16_weights(w1, w2)
    assert wts.padded_intermediate == 128 and same_bits(wts.w1, w1) and same_bits(wts.w2, w2)
    assert wts.w1.data_ptr() != w1.data_ptr()  # a copy: later edits of the caller's tensor do not leak in


@pytest.mark.parametrize("fmt", WEIGHT_ONLY)
@pytest.mark.parametrize("gated", [True, False])
def test_prepare_weight_only_bit_exact_and_padded(fmt, gated):
    payloads = block_payloads(fmt, gated)
    wts = prepare(LowLatencyMoeConfig(arch="sm90"), fmt, payloads, SwiGLU() if gated else SiLU())
    block = 16 if fmt is WeightFormat.NVFP4_WEIGHT_ONLY else 32
    assert (wts.format, wts.hidden_size, wts.intermediate_size, wts.padded_intermediate, wts.gated) == (fmt, H, I, IP, gated)
    n1p = (2 if gated else 1) * IP
    assert wts.w1_codes.shape == (E, n1p, H // 2) and wts.w1_scales.shape == (E, n1p, H // block)
    assert wts.w2_codes.shape == (E, H, IP // 2) and wts.w2_scales.shape == (E, H, IP // block)
    assert wts.w1_scales.dtype == payloads[1].dtype and wts.w2_codes.dtype == torch.uint8
    assert wts.tiled == (fmt in TILED_FORMATS)  # SM90: NVFP4 and MXINT4 are stored as the tensor cores' tiles
    rows = wts.row_payloads()
    if wts.tiled:  # the stored bytes are exactly the SM90 tiles of the padded row-major payloads
        pack = {WeightFormat.MXINT4_WEIGHT_ONLY: pack_int4_weight_tiles,
                WeightFormat.MXFP4_WEIGHT_ONLY: pack_mxfp4_weight_tiles}.get(fmt, pack_weight_tiles)
        if fmt is WeightFormat.MXFP4_WEIGHT_ONLY:  # tiles of the exact shifted form; the E8M0 scales stay row-major
            shifts1, shifts2 = wts.nvfp4_shifts
            form1, form2 = form_scales(rows[0], rows[1], shifts1), form_scales(rows[2], rows[3], shifts2)
            tile_form = ((rows[0], form1, wts.w1_codes, wts.tile_form[0]), (rows[2], form2, wts.w2_codes, wts.tile_form[2]))
            assert same_bits(wts.tile_form[1], nvfp4_globals(shifts1)) and same_bits(wts.tile_form[3], nvfp4_globals(shifts2))
            assert wts.tile_form[0].dtype == torch.uint8 and wts.tile_form[0].shape == (E, n1p, H // 32)
            assert wts.w1_scales is rows[1] and wts.w2_scales is rows[3]
        else:
            tile_form = ((rows[0], rows[1], wts.w1_codes, wts.w1_scales), (rows[2], rows[3], wts.w2_codes, wts.w2_scales))
        for codes, scales, stored_codes, stored_scales in tile_form:
            tiles, tile_scales = pack(codes, scales)
            assert same_bits(stored_codes.reshape(E, -1), tiles)
            assert same_bits(stored_scales.view(torch.uint8).reshape(E, -1), tile_scales)
    w1_in = (payloads[0], payloads[1])
    w2_in = (payloads[-3], payloads[-2]) if fmt is WeightFormat.NVFP4_WEIGHT_ONLY else (payloads[2], payloads[3])
    for stored, given in zip(rows[:2], w1_in):
        halves = given.chunk(2, dim=1) if gated else (given,)
        for index, half in enumerate(halves):
            assert same_bits(stored[:, index * IP : index * IP + I], half)
            assert not bits(stored[:, index * IP + I : (index + 1) * IP]).any()
    for stored, given in zip(rows[2:], w2_in):
        cols = given.shape[-1]
        assert same_bits(stored[..., :cols], given) and not bits(stored[..., cols:]).any()
    canonical = wts.canonical()
    assert len(canonical) == len(payloads) and all(same_bits(c, p) for c, p in zip(canonical, payloads))
    again = prepare(LowLatencyMoeConfig(arch="sm90"), fmt, canonical, SwiGLU() if gated else SiLU())
    assert all(same_bits(a, b) for a, b in zip(again.canonical(), canonical))
    elsewhere = prepare(LowLatencyMoeConfig(arch="sm100"), fmt, payloads, SwiGLU() if gated else SiLU())
    assert not elsewhere.tiled  # other GPUs read the row-major layout
    assert all(same_bits(a, b) for a, b in zip(elsewhere.row_payloads(), rows))
    assert all(same_bits(a, b) for a, b in zip(elsewhere.canonical(), canonical))


def test_what_is_never_stored_tiled():
    """MXFP4 weight-only layers without an exact shifted form stay row-major (and cannot be tiled); the other formats
    (16-bit, FP8, the MX pairs) are never tiled."""
    w1c, w1s, w2c, w2s = block_payloads(WeightFormat.MXFP4_WEIGHT_ONLY, True)
    w1c[0, 0, :16] = 0x22  # two nonzero blocks of expert 0, 40 binades apart: no E4M3 range holds both
    w1c[0, 1, :16] = 0x22
    w1s.view(torch.uint8)[0, 0, 0], w1s.view(torch.uint8)[0, 1, 0] = 127 + 20, 127 - 20
    wide = LowLatencyMoeConfig(arch="sm90").prepare_mxfp4_weight_only_weights(w1c, w1s, w2c, w2s)
    assert wide.nvfp4_problem is not None and not wide.tiled and wide.tile_form is None
    with pytest.raises(ValueError, match="no exact shifted form"):
        wide.to_tiles()
    bf16 = prepare(LowLatencyMoeConfig(arch="sm90"), WeightFormat.BF16, dense_weights(torch.bfloat16, True))
    assert not bf16.tiled
    with pytest.raises(ValueError, match="bf16 weights are never stored as SM90 tiles"):
        dataclasses.replace(bf16, tiled=True)
    mxfp4 = prepare(LowLatencyMoeConfig(arch="sm90"), WeightFormat.MXFP4_WEIGHT_ONLY,
                    block_payloads(WeightFormat.MXFP4_WEIGHT_ONLY, True))
    with pytest.raises(ValueError, match="tile_form"):
        dataclasses.replace(mxfp4, tile_form=None)


@pytest.mark.parametrize("gated", [True, False])
def test_prepare_fp8_weight_only_bit_exact_and_padded(gated):
    w1, s1, w2, s2 = payloads = block_payloads(FP8_WO, gated)
    wts = prepare(LowLatencyMoeConfig(arch="sm90"), FP8_WO, payloads, SwiGLU() if gated else SiLU())
    assert (wts.format, wts.hidden_size, wts.intermediate_size, wts.padded_intermediate, wts.gated) == (FP8_WO, H, I, IP, gated)
    n1p = (2 if gated else 1) * IP
    assert wts.w1_codes.shape == (E, n1p, H) and wts.w2_codes.shape == (E, H, IP)
    assert wts.w1_codes.dtype == wts.w2_codes.dtype == torch.float8_e4m3fn
    halves = w1.chunk(2, dim=1) if gated else (w1,)
    for index, half in enumerate(halves):
        assert same_bits(wts.w1_codes[:, index * IP : index * IP + I], half)
        assert not bits(wts.w1_codes[:, index * IP + I : (index + 1) * IP]).any()  # +0 codes
    assert same_bits(wts.w2_codes[..., :I], w2) and not bits(wts.w2_codes[..., I:]).any()
    assert same_bits(wts.w1_scale, s1) and same_bits(wts.w2_scale, s2) and wts.w1_scale.data_ptr() != s1.data_ptr()
    canonical = wts.canonical()
    assert len(canonical) == 4 and all(same_bits(c, p) for c, p in zip(canonical, payloads))
    assert (plain_e4m3(w1).abs() < 2.0**-6).any() and (plain_e4m3(w1).abs() == 448).any()  # subnormals, the max


def test_plain_e4m3_decodes_every_finite_code():
    """The test's own E4M3 table: every finite byte against torch's conversion."""
    byte = torch.arange(256, dtype=torch.uint8)
    finite = (byte & 0x7F) != 0x7F
    codes = byte[finite].view(torch.float8_e4m3fn)
    assert torch.equal(plain_e4m3(codes), codes.double())


def test_prepare_nvfp4_pair_quantizes_per_expert():
    w1, w2 = dense_weights(torch.bfloat16, True, hidden=PAIR_H, inter=PAIR_I)
    wts = LowLatencyMoeConfig(arch="sm100").prepare_nvfp4_weights(w1, w2)
    assert wts.format is WeightFormat.NVFP4_W_NVFP4_A and wts.padded_intermediate == PAIR_I
    assert wts.w1_codes.shape == (E, 2 * PAIR_I, PAIR_H // 2) and wts.w1_scales.shape == (E, 2 * PAIR_I, PAIR_H // 16)
    assert wts.w2_codes.shape == (E, PAIR_H, PAIR_I // 2) and wts.w2_scales.dtype == torch.float8_e4m3fn
    for source, glob, codes, scales in ((w1, wts.w1_global, wts.w1_codes, wts.w1_scales),
                                        (w2, wts.w2_global, wts.w2_codes, wts.w2_scales)):
        torch.testing.assert_close(glob, source.float().abs().amax(dim=(1, 2)) / 2688.0)
        want_codes, want_scales = quantize_nvfp4(source, 1.0 / glob)
        assert same_bits(codes, want_codes) and same_bits(scales, want_scales)
        decoded = plain_fp4(codes) * scales.double().repeat_interleave(16, -1) * glob.double()[:, None, None]
        rel = (decoded - source.double()).norm() / source.double().norm()
        assert 0.02 < rel < 0.15


# ----------------------------------------------------------------------------- references
def _inputs(fmt: WeightFormat, x_dtype: torch.dtype, gated: bool, num_tokens: int, seed: int = 3):
    """(weights, payloads, reference input, float64 input values) for one format."""
    config = LowLatencyMoeConfig(8, arch="sm90")
    gen = torch.Generator().manual_seed(seed)
    act = SwiGLU() if gated else SiLU()
    if fmt is WeightFormat.NVFP4_W_NVFP4_A:
        wts = config.prepare_nvfp4_weights(*dense_weights(torch.bfloat16, gated, seed, PAIR_H, PAIR_I), activation=act)
        acts = config.prepare_nvfp4_activations(torch.randn(num_tokens, PAIR_H, generator=gen))
        x64 = plain_fp4(acts.packed) * acts.scales.double().repeat_interleave(16, -1)
        return wts, wts.canonical(), acts, x64
    if fmt in (WeightFormat.BF16, WeightFormat.FP16):
        payloads = dense_weights(x_dtype, gated, seed)
    else:
        payloads = block_payloads(fmt, gated, seed)
    wts = prepare(config, fmt, payloads, act)
    x = torch.randn(num_tokens, H, generator=gen).to(x_dtype)
    return wts, payloads, x, x.double()


# the NVFP4 pair has BF16 expert rows only
OUTPUT_CASES = [(fmt, x_dtype, out_dtype) for fmt, x_dtype in FORMAT_CASES for out_dtype in (torch.bfloat16, torch.float16)
                if fmt is not WeightFormat.NVFP4_W_NVFP4_A or out_dtype is torch.bfloat16]


@pytest.mark.parametrize("fmt, x_dtype, out_dtype", OUTPUT_CASES)
@pytest.mark.parametrize("gated, num_tokens, top_k, kind", [(True, 8, 4, "packed"), (False, 3, 2, "fp32"), (True, 1, 3, "fp32")])
def test_reference_matches_plain_loop(fmt, x_dtype, out_dtype, gated, num_tokens, top_k, kind):
    wts, payloads, inputs, x64 = _inputs(fmt, x_dtype, gated, num_tokens)
    routing, ids, route_w = make_routing(num_tokens, top_k, kind)
    act = SwiGLU() if gated else SiLU()
    preact, inter = numerics(fmt, x_dtype)
    want, want_rows = plain_moe(x64, *plain_decode(fmt, payloads), ids, route_w, act, preact, inter, out_dtype)
    got = reference_low_latency(inputs, wts, routing, act, out_dtype=out_dtype)
    assert got.dtype == out_dtype and torch.equal(got, want)
    raw = reference_low_latency(inputs, wts, routing, act, out_dtype=out_dtype, finalize=False)
    assert isinstance(raw, RawReference) and torch.equal(raw.rows, want_rows) and raw.mask.all()
    assert torch.equal(raw.weights, route_w)
    assert torch.equal(combine_ordered_fp32(raw.rows, raw.weights, raw.mask, out_dtype), got)


@pytest.mark.parametrize("name", ACTIVATION_NAMES)
def test_reference_every_activation(name):
    act = parse_activation(name)
    if name == "swiglu":
        act = SwiGLU(alpha=1.702, beta=1.0, limit=2.0)
    wts, payloads, x, x64 = _inputs(WeightFormat.NVFP4_WEIGHT_ONLY, torch.bfloat16, act.gated, 5)
    routing, ids, route_w = make_routing(5, 3, "packed")
    want, _ = plain_moe(x64, *plain_decode(WeightFormat.NVFP4_WEIGHT_ONLY, payloads), ids, route_w, act,
                        torch.bfloat16, torch.bfloat16, torch.bfloat16)
    assert torch.equal(reference_low_latency(x, wts, routing, act), want)


def test_mxint4_keeps_fp32_preactivation():
    """Rounding MXINT4's preactivation to BF16 would change the result: the reference does not."""
    wts, payloads, x, x64 = _inputs(WeightFormat.MXINT4_WEIGHT_ONLY, torch.bfloat16, True, 8)
    routing, ids, route_w = make_routing(8, 4, "fp32")
    w1, w2 = plain_decode(WeightFormat.MXINT4_WEIGHT_ONLY, payloads)
    fp32, _ = plain_moe(x64, w1, w2, ids, route_w, SwiGLU(), torch.float32, torch.bfloat16, torch.bfloat16)
    bf16, _ = plain_moe(x64, w1, w2, ids, route_w, SwiGLU(), torch.bfloat16, torch.bfloat16, torch.bfloat16)
    got = reference_low_latency(x, wts, routing, SwiGLU())
    assert torch.equal(got, fp32) and not torch.equal(got, bf16)


def test_combine_is_separate_fp32_multiply_then_add():
    """Two slots whose FP32 sum lands on a tie only when the second product is rounded first.

    Rows are 1 and 1 + 2^-7 (BF16); weights a = 0.75 + 2^-9 + 2^-24 - 2^-22 and b = 2^-2 (1 + 2^-20).
    Separate: fp32(b * r1) drops 2^-29, a + it = 1 + 2^-8 + 2^-24 ties down to 1 + 2^-8, which rounds
    to BF16 1.0. Fused (or a float64 sum) keeps 2^-29 and ends at BF16 1 + 2^-7.
    """
    a = 0.75 + 2**-9 + 2**-24 - 2**-22
    b = 2**-2 * (1 + 2**-20)
    r1 = 1 + 2**-7
    assert torch.tensor(a, dtype=torch.float32).item() == a and torch.tensor(b, dtype=torch.float32).item() == b
    fused = torch.tensor(a + b * r1, dtype=torch.float64).float().to(torch.bfloat16).item()
    separate = (torch.tensor(a, dtype=torch.float32) + torch.tensor(b, dtype=torch.float32) * torch.tensor(r1)).to(torch.bfloat16).item()
    assert (fused, separate) == (1 + 2**-7, 1.0)
    # identity layer whose expert e's row is w2[e][:, 0]: x = e_0, w1[e][0, 0] = 1
    hidden, inter = 8, 8
    w1 = torch.zeros(2, inter, hidden, dtype=torch.bfloat16)
    w1[:, 0, 0] = 1.0
    w2 = torch.zeros(2, hidden, inter, dtype=torch.bfloat16)
    w2[0, :, 0], w2[1, :, 0] = 1.0, r1
    wts = LowLatencyMoeConfig(arch="sm90").prepare_bf16_weights(w1, w2, activation="identity")
    x = torch.zeros(1, hidden, dtype=torch.bfloat16)
    x[0, 0] = 1.0
    routing = Routing.unpacked(torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([[a, b]], dtype=torch.float32))
    out = reference_bf16(x, wts, routing, "identity")
    assert torch.all(out == 1.0)
    swapped = Routing.unpacked(torch.tensor([[1, 0]], dtype=torch.int32), torch.tensor([[b, a]], dtype=torch.float32))
    assert torch.all(reference_bf16(x, wts, swapped, "identity") == 1.0)  # p0 = fp32(b r1), then + a: same tie


def test_packed_scores_keep_bf16_rounding_with_fp16_output():
    wts, _, x, _ = _inputs(WeightFormat.FP16, torch.float16, True, 4)
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, E, (4, 2), generator=gen)
    weights = torch.rand(4, 2, generator=gen)
    packed = reference_low_latency(x, wts, Routing.packed(pack_routing(ids, weights)), SwiGLU(), out_dtype=torch.float16)
    rounded = Routing.unpacked(ids, weights.to(torch.bfloat16).float())
    assert torch.equal(packed, reference_low_latency(x, wts, rounded, SwiGLU(), out_dtype=torch.float16))
    exact = reference_low_latency(x, wts, Routing.unpacked(ids, weights), SwiGLU(), out_dtype=torch.float16)
    assert not torch.equal(packed, exact)


@pytest.mark.parametrize("bad_id", [-1, E, 40])
def test_nvfp4_pair_unrouted_slots_ignore_nan_scores(bad_id):
    wts, payloads, acts, x64 = _inputs(WeightFormat.NVFP4_W_NVFP4_A, torch.bfloat16, True, 4)
    ids = torch.tensor([[0, bad_id, 2], [bad_id, 1, 0], [2, 1, bad_id], [bad_id, bad_id, bad_id]], dtype=torch.int32)
    weights = torch.rand(4, 3)
    weights[ids == bad_id] = float("nan")
    routing = Routing.unpacked(ids, weights)
    out = reference_nvfp4_pair(acts, wts, routing, SwiGLU())
    assert torch.isfinite(out).all() and not out[3].any()
    want, want_rows = plain_moe(x64, *plain_decode(WeightFormat.NVFP4_W_NVFP4_A, payloads), ids, weights, SwiGLU(),
                                torch.bfloat16, torch.bfloat16, torch.bfloat16)
    assert torch.equal(out, want)
    raw = reference_nvfp4_pair(acts, wts, routing, SwiGLU(), finalize=False)
    assert torch.equal(raw.mask, ids != bad_id) and not raw.rows[ids == bad_id].any()
    assert torch.equal(raw.rows, want_rows) and torch.isnan(raw.weights[ids == bad_id]).all()


@pytest.mark.parametrize("fmt, x_dtype", FORMAT_CASES[:-1])
def test_other_formats_refuse_out_of_range_ids(fmt, x_dtype):
    wts, _, x, _ = _inputs(fmt, x_dtype, True, 2)
    routing = Routing.unpacked(torch.tensor([[0, -1], [1, 2]], dtype=torch.int32), torch.rand(2, 2))
    with pytest.raises(ValueError, match=r"routing names expert -1, outside \[0, 3\)"):
        reference_low_latency(x, wts, routing, SwiGLU())


# ----------------------------------------------------------------------------- bad inputs
def _bf16_bad(**change):
    w1, w2 = dense_weights(torch.bfloat16, True)
    args = {"w1": w1, "w2": w2, **change}
    return lambda: LowLatencyMoeConfig(arch="sm90").prepare_bf16_weights(args["w1"], args["w2"])


def _wo_bad(fmt: WeightFormat, index: int, value):
    payloads = list(block_payloads(fmt, True))
    payloads[index] = value
    return lambda: prepare(LowLatencyMoeConfig(arch="sm90"), fmt, tuple(payloads))


def _pair_bad(hidden: int = PAIR_H, inter: int = PAIR_I, **change):
    w1, w2 = dense_weights(torch.bfloat16, True, hidden=hidden, inter=inter)
    args = {"w1_bf16": w1, "w2_bf16": w2, **change}
    return lambda: LowLatencyMoeConfig(arch="sm90").prepare_nvfp4_weights(args["w1_bf16"], args["w2_bf16"])


def _ref_bad(fmt=WeightFormat.BF16, x_dtype=torch.bfloat16, tokens=2, top_k=2, **change):
    def call():
        wts, _, x, _ = _inputs(fmt, x_dtype, True, tokens)
        routing, _, _ = make_routing(tokens, top_k, "fp32")
        args = {"x": x, "weights": wts, "routing": routing, "activation": SwiGLU(), "out_dtype": torch.bfloat16, **change}
        return reference_low_latency(args["x"], args["weights"], args["routing"], args["activation"],
                                     out_dtype=args["out_dtype"])
    return call


def _e4m3_scales_with(shape: tuple[int, ...], code: int) -> torch.Tensor:
    """E4M3 block scales of 1.0 (0x38) but one, E4M3 ``code``."""
    scales = torch.full(shape, 0x38, dtype=torch.uint8)
    scales[-1, 1, -1] = code
    return scales.view(torch.float8_e4m3fn)


NVFP4, MXFP4, MXINT4 = WEIGHT_ONLY
BAD_INPUTS = [
    ("w1 fp16 for bf16", _bf16_bad(w1=torch.zeros(E, 2 * I, H, dtype=torch.float16)), TypeError, "w1 must have dtype bfloat16"),
    ("w2 not a tensor", _bf16_bad(w2=[1.0]), TypeError, "w2 must be a torch.Tensor"),
    ("w1 2-D", _bf16_bad(w1=torch.zeros(2 * I, H, dtype=torch.bfloat16)), ValueError, "w1 must have 3 dimensions"),
    ("w1 rows", _bf16_bad(w1=torch.zeros(E, I, H, dtype=torch.bfloat16)), ValueError, "w1 must have 192 rows"),
    ("w1 H", _bf16_bad(w1=torch.zeros(E, 2 * I, H + 2, dtype=torch.bfloat16)), ValueError, "w1 must be"),
    ("w2 experts", _bf16_bad(w2=torch.zeros(E + 1, H, I, dtype=torch.bfloat16)), ValueError, "w2 has 4"),
    ("w2 no columns", _bf16_bad(w1=torch.zeros(E, 0, H, dtype=torch.bfloat16), w2=torch.zeros(E, H, 0, dtype=torch.bfloat16)), ValueError, r"intermediate size \(w2.shape\[2\]\) must be positive, got 0"),
    ("codes dtype", _wo_bad(NVFP4, 0, torch.zeros(E, 2 * I, H // 2, dtype=torch.int8)), TypeError, "w1_codes must have dtype uint8"),
    ("nvfp4 scale dtype", _wo_bad(NVFP4, 1, torch.zeros(E, 2 * I, H // 16, dtype=torch.bfloat16)), TypeError, "w1_scales must have dtype float8_e4m3fn"),
    ("nvfp4 scale shape", _wo_bad(NVFP4, 4, torch.zeros(E, H, I // 32, dtype=torch.float8_e4m3fn)), ValueError, "w2_scales must have shape"),
    ("nvfp4 scale nan", _wo_bad(NVFP4, 1, _e4m3_scales_with((E, 2 * I, H // 16), 0x7F)), ValueError, "w1_scales holds E4M3 NaN block scales"),
    ("nvfp4 scale negative", _wo_bad(NVFP4, 4, _e4m3_scales_with((E, H, I // 16), 0xB8)), ValueError, "w2_scales holds negative E4M3 block scales"),
    ("nvfp4 global dtype", _wo_bad(NVFP4, 2, torch.ones(E, dtype=torch.float64)), TypeError, "w1_global must have dtype float32"),
    ("nvfp4 global shape", _wo_bad(NVFP4, 5, torch.ones(E + 1)), ValueError, "w2_global must have shape"),
    ("nvfp4 global nan", _wo_bad(NVFP4, 5, torch.tensor([1.0, float("nan"), 1.0])), ValueError, "w2_global must be finite"),
    ("mxfp4 scale dtype", _wo_bad(MXFP4, 1, torch.zeros(E, 2 * I, H // 32, dtype=torch.uint8)), TypeError, "w1_scales must have dtype float8_e8m0fnu"),
    ("mxint4 scale dtype", _wo_bad(MXINT4, 3, torch.zeros(E, H, I // 32, dtype=torch.float16)), TypeError, "w2_scales must have dtype bfloat16"),
    ("mxint4 misaligned H", _wo_bad(MXINT4, 2, torch.zeros(E, H + 32, I // 2, dtype=torch.uint8)), ValueError, r"hidden size \(w2_codes.shape\[1\]\) must be a positive multiple of 128"),
    ("mxfp4 misaligned I", _wo_bad(MXFP4, 2, torch.zeros(E, H, 40 // 2, dtype=torch.uint8)), ValueError, r"intermediate size \(2 \* w2_codes.shape\[2\]\) must be a positive multiple of 32"),
    ("fp8 wo w1 dtype", _wo_bad(FP8_WO, 0, torch.zeros(E, 2 * I, H, dtype=torch.uint8)), TypeError, "w1 must have dtype float8_e4m3fn"),
    ("fp8 wo w2 bf16", _wo_bad(FP8_WO, 2, torch.zeros(E, H, I, dtype=torch.bfloat16)), TypeError, "w2 must have dtype float8_e4m3fn"),
    ("fp8 wo w1 2-D", _wo_bad(FP8_WO, 0, torch.zeros(2 * I, H).to(torch.float8_e4m3fn)), ValueError, "w1 must have 3 dimensions"),
    ("fp8 wo w1 rows", _wo_bad(FP8_WO, 0, torch.zeros(E, I, H).to(torch.float8_e4m3fn)), ValueError, "w1 must have 192 rows"),
    ("fp8 wo w1 H", _wo_bad(FP8_WO, 0, torch.zeros(E, 2 * I, H + 128).to(torch.float8_e4m3fn)), ValueError, "w1 must be"),
    ("fp8 wo misaligned H", _wo_bad(FP8_WO, 2, torch.zeros(E, H + 16, I).to(torch.float8_e4m3fn)), ValueError, r"hidden size \(w2.shape\[1\]\) must be a positive multiple of 128"),
    ("fp8 wo misaligned I", _wo_bad(FP8_WO, 2, torch.zeros(E, H, 40).to(torch.float8_e4m3fn)), ValueError, r"intermediate size \(w2.shape\[2\]\) must be a positive multiple of 32"),
    ("fp8 wo nan code", _wo_bad(FP8_WO, 2, torch.full((E, H, I), 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn)), ValueError, "w2 holds E4M3 NaN codes"),
    ("fp8 wo scale dtype", _wo_bad(FP8_WO, 1, torch.ones(E, dtype=torch.float64)), TypeError, "w1_scale must have dtype float32"),
    ("fp8 wo scale shape", _wo_bad(FP8_WO, 3, torch.ones(E, 1)), ValueError, "w2_scale must have 1 dimension"),
    ("fp8 wo scale experts", _wo_bad(FP8_WO, 3, torch.ones(E + 1)), ValueError, "w2_scale must have shape"),
    ("fp8 wo scale inf", _wo_bad(FP8_WO, 1, torch.tensor([1.0, float("inf"), 1.0])), ValueError, "w1_scale must be finite"),
    ("fp8 wo scale zero", _wo_bad(FP8_WO, 3, torch.tensor([1.0, 0.0, 1.0])), ValueError, "w2_scale must be finite and positive"),
    ("fp8 wo x fp32", _ref_bad(FP8_WO, x=torch.zeros(2, H)), TypeError, "x must have dtype"),
    ("pair H % 512", _pair_bad(hidden=256), ValueError, r"hidden size \(w2_bf16.shape\[1\]\) must be a positive multiple of 512"),
    ("pair I % 128", _pair_bad(inter=96), ValueError, r"intermediate size \(w2_bf16.shape\[2\]\) must be a positive multiple of 128"),
    ("pair int source", _pair_bad(w1_bf16=torch.zeros(E, 2 * PAIR_I, PAIR_H, dtype=torch.int32)), TypeError, "w1_bf16 must have dtype"),
    ("pair nan source", _pair_bad(w2_bf16=torch.full((E, PAIR_H, PAIR_I), float("nan"), dtype=torch.bfloat16)), ValueError, "w2_bf16 contains NaN"),
    ("too many tokens", _ref_bad(tokens=9), ValueError, "x has 9 tokens; the low-latency config takes at most 8"),
    ("top-k > 32", _ref_bad(top_k=33), ValueError, "top_k=33; the low-latency config takes top_k <= 32"),
    ("pair top-k > 32", _ref_bad(WeightFormat.NVFP4_W_NVFP4_A, top_k=33), ValueError, "top_k <= 32"),
    ("x dtype vs weights", _ref_bad(x=torch.zeros(2, H, dtype=torch.float16)), TypeError, "x must have dtype bfloat16"),
    ("x fp32 weight-only", _ref_bad(NVFP4, x=torch.zeros(2, H)), TypeError, "x must have dtype"),
    ("x hidden", _ref_bad(x=torch.zeros(2, H + 8, dtype=torch.bfloat16)), ValueError, "x must be"),
    ("routing type", _ref_bad(routing=torch.zeros(2, 2)), TypeError, "routing must be a Routing"),
    ("routing tokens", _ref_bad(routing=make_routing(3, 2, "fp32")[0]), ValueError, "routing has 3 tokens"),
    ("activation gating", _ref_bad(activation=GELU()), ValueError, "activation GELU does not fit the gated weights"),
    ("out dtype", _ref_bad(out_dtype=torch.float32), ValueError, "out_dtype must be"),
    ("pair out fp16", _ref_bad(WeightFormat.NVFP4_W_NVFP4_A, out_dtype=torch.float16), ValueError, "out_dtype must be torch.bfloat16"),
    ("weights of another format", _ref_bad(weights=None), TypeError, "weights must be prepared"),
    ("pair activations", _ref_bad(WeightFormat.NVFP4_W_NVFP4_A, x=torch.zeros(2, PAIR_H)), TypeError, "activations must be Nvfp4Activations"),
    ("pair activations tokens", lambda: LowLatencyMoeConfig(2).prepare_nvfp4_activations(torch.zeros(3, PAIR_H)), ValueError, "hidden_states has 3 tokens"),
    ("pair activations H", lambda: LowLatencyMoeConfig(2).prepare_nvfp4_activations(torch.zeros(1, 128)), ValueError, "hidden size"),
]


@pytest.mark.parametrize("call, error, match", [case[1:] for case in BAD_INPUTS], ids=[case[0] for case in BAD_INPUTS])
def test_bad_inputs(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_reference_weights_format_mismatch():
    wts, _, x, _ = _inputs(WeightFormat.FP16, torch.float16, True, 2)
    routing, _, _ = make_routing(2, 2, "fp32")
    with pytest.raises(TypeError, match="weights must be DenseWeights prepared as bf16"):
        reference_bf16(x, wts, routing, SwiGLU())


def test_tensor_core_path_leaves_layers_past_the_sort_limit_to_the_cuda_cores() -> None:
    from cudnn_moe.engines.base import OP_LOW_LATENCY, Request
    from cudnn_moe.engines.registry import choose
    from cudnn_moe.kernels.codes import SORT_MAX_EXPERTS

    def engine(experts: int) -> str:
        return choose(Request(OP_LOW_LATENCY, (9, 0), WeightFormat.NVFP4_WEIGHT_ONLY.value, num_experts=experts,
                              token_dtype=torch.bfloat16, out_dtype=torch.bfloat16, finalize=True)).name

    assert engine(SORT_MAX_EXPERTS) == "sm90"
    assert engine(SORT_MAX_EXPERTS + 1) == "cuda_cores"


@pytest.mark.parametrize("fmt", WEIGHT_ONLY)
def test_short_prepare_names_are_aliases_of_the_contract_names(fmt):
    """prepare_<fmt>_weight_only (the earlier names) give what prepare_<fmt>_weight_only_weights gives."""
    config = LowLatencyMoeConfig(arch="sm90")
    payloads = block_payloads(fmt, True)
    short = getattr(config, f"prepare_{fmt.value}")(*payloads, activation=SwiGLU())
    full = prepare(config, fmt, payloads)
    assert type(short) is type(full) and short.format is full.format
    assert all(same_bits(a, b) for a, b in zip(short.canonical(), full.canonical()))


def test_mxfp4_weight_only_runs_on_the_tensor_cores_in_its_exact_nvfp4_form() -> None:
    """Preparation decides the exact shifted form (cudnn_moe.formats.mxfp4_as_nvfp4); the registry sends finalized BF16
    calls of such layers to sm90 and the others, with the reason, to the CUDA cores."""
    from cudnn_moe.engines.registry import choose
    from cudnn_moe.low_latency.tactics import layer_request

    config, bf16, fmt = LowLatencyMoeConfig(arch="sm90"), torch.bfloat16, WeightFormat.MXFP4_WEIGHT_ONLY
    gen = torch.Generator().manual_seed(5)  # I = 128: N1 = 2I a multiple of the sm90 kernels' 128 features
    payloads = (_codes(gen, E, 2 * IP, H // 2), _scales(fmt, gen, E, 2 * IP, H // 32), _codes(gen, E, H, IP // 2),
                _scales(fmt, gen, E, H, IP // 32))
    weights = prepare(config, WeightFormat.MXFP4_WEIGHT_ONLY, payloads)
    assert weights.nvfp4_problem is None
    shifts1, shifts2 = weights.nvfp4_shifts
    assert shifts1.tolist() == [0] * E and shifts2.tolist() == [0] * E  # scales 2^-9 .. 2^-4: E4M3's own

    def engine(w, x_dtype=bf16, out_dtype=bf16, finalize=True, name="auto") -> str:
        return choose(layer_request(w, (9, 0), 2, x_dtype, out_dtype, finalize), name).name

    assert engine(weights) == "sm90"
    assert engine(weights, x_dtype=torch.float16) == "cuda_cores"
    assert engine(weights, out_dtype=torch.float16) == "cuda_cores"
    assert engine(weights, finalize=False) == "cuda_cores"
    w1_codes, w1_scales, w2_codes, w2_scales = payloads
    wide = w1_scales.clone()
    wide.view(torch.uint8)[1, 0, 0] = 100  # 2^-27 beside 2^-4: 23 binades
    odd = prepare(config, WeightFormat.MXFP4_WEIGHT_ONLY, (w1_codes, wide, w2_codes, w2_scales))
    assert odd.nvfp4_problem == "w1 scales of expert 1 span 2^-27 .. 2^-4, more than the 17 binades E4M3 holds exactly"
    assert engine(odd) == "cuda_cores"
    with pytest.raises(ValueError, match="exact shifted form, which these lack: w1 scales of expert 1 span"):
        engine(odd, name="sm90")
    with pytest.raises(ValueError, match="no exact shifted form"):
        odd.to_tiles()


def test_mxint4_weight_only_runs_on_the_tensor_cores() -> None:
    """Finalized BF16 calls of MXINT4 weight-only layers go to sm90 on SM90; FP16 tokens or output and raw rows to
    the CUDA cores."""
    from cudnn_moe.engines.registry import choose
    from cudnn_moe.low_latency.tactics import layer_request

    config, bf16, fmt = LowLatencyMoeConfig(arch="sm90"), torch.bfloat16, WeightFormat.MXINT4_WEIGHT_ONLY
    gen = torch.Generator().manual_seed(6)  # I = 128: N1 = 2I a multiple of the sm90 kernels' 128 features
    weights = prepare(config, fmt, (_codes(gen, E, 2 * IP, H // 2), _scales(fmt, gen, E, 2 * IP, H // 32),
                                    _codes(gen, E, H, IP // 2), _scales(fmt, gen, E, H, IP // 32)))

    def engine(x_dtype=bf16, out_dtype=bf16, finalize=True) -> str:
        return choose(layer_request(weights, (9, 0), 2, x_dtype, out_dtype, finalize)).name

    assert engine() == "sm90"
    assert engine(x_dtype=torch.float16) == engine(out_dtype=torch.float16) == engine(finalize=False) == "cuda_cores"
    assert choose(layer_request(weights, (10, 0), 2, bf16, bf16, True)).name == "cuda_cores"
