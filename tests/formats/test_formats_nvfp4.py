"""E2M1 element codec and NVFP4 block quantization, checked against tables and plain-Python references."""

from __future__ import annotations

import pytest
import torch

from cudnn_moe.formats import (
    NVFP4_MAX,
    decode_e2m1,
    dequantize_nvfp4,
    encode_e2m1,
    pack_nibbles,
    quantize_nvfp4,
    unpack_nibbles,
)
import cudnn_moe.formats.nvfp4 as nvfp4_format
from cudnn_moe.formats.nvfp4 import require_unsigned_scales

# Written out from the E2M1 definition (1 sign, 2 exponent bits with bias 1, 1 mantissa bit):
# codes 0..7 are +0, 0.5 (subnormal), 1, 1.5, 2, 3, 4, 6; codes 8..15 are their negatives.
MAGNITUDES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
DECODE_TABLE = MAGNITUDES + [-m for m in MAGNITUDES]


def nearest_magnitude_index(v: float) -> int:
    """Index into MAGNITUDES nearest to |v|, ties to the even index, saturating at 6."""
    return min(range(8), key=lambda i: (abs(abs(v) - MAGNITUDES[i]), i % 2))


def reference_code(v: float) -> int:
    index = nearest_magnitude_index(v)
    return index | (8 if v < 0 and index else 0)


def e4m3_value(v: float) -> float:
    return torch.tensor(v, dtype=torch.float32).to(torch.float8_e4m3fn).item()


def reference_nvfp4(x: torch.Tensor, g: float) -> tuple[list[float], list[int]]:
    """Plain-Python NVFP4 of a 1-D tensor: (block scale values, element codes)."""
    values = x.tolist()
    scales, codes = [], []
    for start in range(0, len(values), 16):
        block = values[start : start + 16]
        s = e4m3_value(max(abs(v) for v in block) / 6 * g)
        scales.append(s)
        codes += [reference_code(v * g / s) if s else 0 for v in block]
    return scales, codes


def test_decode_every_code():
    codes = torch.arange(16, dtype=torch.uint8)
    assert decode_e2m1(codes).tolist() == DECODE_TABLE


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_encode_grid_values(sign):
    x = torch.tensor([sign * m for m in MAGNITUDES])
    expected = [i | (8 if sign < 0 and i else 0) for i in range(8)]
    assert encode_e2m1(x).tolist() == expected


@pytest.mark.parametrize(
    ("midpoint", "rounded"),
    [(0.25, 0.0), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0), (3.5, 4.0), (5.0, 4.0)],
)
def test_encode_midpoints_round_to_even(midpoint, rounded):
    x = torch.tensor([midpoint, -midpoint])
    assert decode_e2m1(encode_e2m1(x)).tolist() == [rounded, -rounded]


def test_encode_matches_nearest_on_dense_sweep():
    x = torch.linspace(-7.0, 7.0, 2801)  # step 0.005 hits every midpoint exactly
    assert encode_e2m1(x).tolist() == [reference_code(v) for v in x.tolist()]


def test_encode_saturates():
    x = torch.tensor([7.0, 100.0, 1e30, float("inf"), -7.0, -1e30, float("-inf")])
    assert decode_e2m1(encode_e2m1(x)).tolist() == [6.0] * 4 + [-6.0] * 3


def test_encode_bf16_input_and_no_negative_zero():
    x = torch.tensor([-0.1, -0.0, 0.0, -0.25], dtype=torch.bfloat16)
    assert encode_e2m1(x).tolist() == [0, 0, 0, 0]


def test_pack_nibble_order():
    assert pack_nibbles(torch.tensor([1, 2], dtype=torch.uint8)).tolist() == [0x21]
    assert unpack_nibbles(torch.tensor([0x21, 0xF0], dtype=torch.uint8)).tolist() == [1, 2, 0, 15]


def test_pack_unpack_round_trip_and_odd_length():
    codes = torch.randint(0, 16, (3, 8, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    packed = pack_nibbles(codes)
    assert packed.shape == (3, 8, 32)
    assert packed[0, 0, 0].item() == codes[0, 0, 0].item() | (codes[0, 0, 1].item() << 4)
    assert torch.equal(unpack_nibbles(packed), codes)
    with pytest.raises(ValueError):
        pack_nibbles(torch.zeros(5, dtype=torch.uint8))


@pytest.mark.parametrize("g", [1.0, 0.37, 64.0])
def test_quantize_matches_python_reference(g):
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(1)) * torch.tensor([[0.01], [30.0]])
    packed, scales = quantize_nvfp4(x, g)
    assert packed.shape == (2, 32) and packed.dtype == torch.uint8
    assert scales.shape == (2, 4) and scales.dtype == torch.float8_e4m3fn
    for row in range(2):
        ref_scales, ref_codes = reference_nvfp4(x[row], g)
        assert scales[row].float().tolist() == ref_scales
        assert unpack_nibbles(packed[row]).tolist() == ref_codes
        expected = [DECODE_TABLE[c] * ref_scales[i // 16] / g for i, c in enumerate(ref_codes)]
        torch.testing.assert_close(dequantize_nvfp4(packed[row], scales[row], g), torch.tensor(expected))


def test_round_trip_error_bound():
    x = torch.randn(16, 256, generator=torch.Generator().manual_seed(2)) * 3.0
    g = 5.0
    packed, scales = quantize_nvfp4(x, g)
    y = dequantize_nvfp4(packed, scales, g)
    # Per element: half the E2M1 spacing at |x| * g / s (0.5 below 2, 1 below 4, 2 above),
    # in units of s / g; saturation above 6 stays within that since s >= amax * g / 6 / (1 + 1/16).
    unit = scales.float().repeat_interleave(16, dim=-1) / g
    v = x.abs() / unit
    half_spacing = torch.where(v < 2, 0.25, torch.where(v < 4, 0.5, 1.0))
    assert bool(((x - y).abs() <= half_spacing * unit * (1 + 1e-6)).all())
    assert ((x - y).norm() / x.norm()).item() < 0.12


def test_zero_block_gives_zero_scale_and_codes():
    x = torch.zeros(1, 32)
    x[0, 16:] = torch.linspace(-1, 1, 16)
    packed, scales = quantize_nvfp4(x)
    assert scales.float().tolist() == [[0.0, e4m3_value(1 / 6)]]
    assert unpack_nibbles(packed)[0, :16].tolist() == [0] * 16


def test_underflowing_scale_gives_zero_block():
    # amax / 6 = 2^-11 lies below half the smallest E4M3 subnormal (2^-9), so the scale rounds to zero.
    x = torch.full((1, 16), 6 * 2.0**-11)
    x[0, 1] = -x[0, 1]
    packed, scales = quantize_nvfp4(x)
    assert scales.float().tolist() == [[0.0]]
    assert packed.tolist() == [[0] * 8]
    assert dequantize_nvfp4(packed, scales).abs().max().item() == 0.0


def test_saturation_at_2688_with_unit_global_scale():
    assert NVFP4_MAX == 2688.0
    x = torch.zeros(2, 16)
    x[0, :3] = torch.tensor([2688.0, -2688.0, 1344.0])
    x[1, :3] = torch.tensor([1e6, -1e6, 10.0])
    packed, scales = quantize_nvfp4(x)
    assert scales.float().tolist() == [[448.0], [448.0]]
    y = dequantize_nvfp4(packed, scales)
    assert y[0, :3].tolist() == [2688.0, -2688.0, 1344.0]
    assert y[1, :3].tolist() == [2688.0, -2688.0, 0.0]


def test_per_expert_global_scales():
    g = [1.0, 448.0 * 6 / 50.0, 0.125]
    x = torch.randn(3, 2, 32, generator=torch.Generator().manual_seed(3)) * 10
    packed, scales = quantize_nvfp4(x, torch.tensor(g))
    y = dequantize_nvfp4(packed, scales, torch.tensor(g))
    for e in range(3):
        for row in range(2):
            ref_scales, ref_codes = reference_nvfp4(x[e, row], g[e])
            assert scales[e, row].float().tolist() == ref_scales
            assert unpack_nibbles(packed[e, row]).tolist() == ref_codes
            expected = [DECODE_TABLE[c] * ref_scales[i // 16] / g[e] for i, c in enumerate(ref_codes)]
            torch.testing.assert_close(y[e, row], torch.tensor(expected))


def test_every_e2m1_times_e4m3_product_is_exact_in_bf16():
    e4m3 = torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).double()  # 0x00..0x7E: finite, >= 0
    assert e4m3.max().item() == 448.0 and e4m3[1].item() == 2.0**-9
    products = torch.tensor(MAGNITUDES, dtype=torch.float64)[:, None] * e4m3[None, :]
    assert products.shape == (8, 127)
    assert torch.equal(products.to(torch.bfloat16).double(), products)


def test_bf16_dequant_equals_fp32_dequant():
    x = torch.randn(8, 128, generator=torch.Generator().manual_seed(4)) * 100
    packed, scales = quantize_nvfp4(x)
    y32 = dequantize_nvfp4(packed, scales)
    y16 = dequantize_nvfp4(packed, scales, dtype=torch.bfloat16)
    assert y16.dtype == torch.bfloat16
    assert torch.equal(y16.float(), y32)


def test_rejects_k_not_multiple_of_16():
    with pytest.raises(ValueError):
        quantize_nvfp4(torch.ones(2, 24))


def test_unsigned_scales_take_every_finite_non_negative_code_and_negative_zero() -> None:
    """require_unsigned_scales passes E4M3 codes 0x00-0x7E and 0x80 and refuses each NaN and each negative code,
    naming the tensor."""
    accepted = torch.cat((torch.arange(0x7F), torch.tensor([0x80]))).to(torch.uint8)
    require_unsigned_scales("w1_scales", accepted.reshape(2, -1).view(torch.float8_e4m3fn))
    for code in (0x7F, 0xFF):
        with pytest.raises(ValueError, match=r"w1_scales holds E4M3 NaN block scales"):
            require_unsigned_scales("w1_scales", torch.cat((accepted, torch.tensor([code], dtype=torch.uint8))))
    for code in range(0x81, 0xFF):
        scales = torch.tensor([0x38, code], dtype=torch.uint8).view(torch.float8_e4m3fn)
        with pytest.raises(ValueError, match=r"w2_scales holds negative E4M3 block scales"):
            require_unsigned_scales("w2_scales", scales)


def test_unsigned_scales_are_read_in_chunks_to_the_last_byte(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bad code in the last of several chunks is still found (chunks of 7 bytes over 3 x 5 x 4 scales)."""
    monkeypatch.setattr(nvfp4_format, "_SCALE_CHECK_CHUNK", 7)
    scales = torch.full((3, 5, 4), 0x38, dtype=torch.uint8)
    require_unsigned_scales("w1_scales", scales.view(torch.float8_e4m3fn))
    scales[-1, -1, -1] = 0xC0
    with pytest.raises(ValueError, match="w1_scales holds negative"):
        require_unsigned_scales("w1_scales", scales.view(torch.float8_e4m3fn))
