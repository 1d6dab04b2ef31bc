"""MXFP4, MXFP8, FP8 (per tensor, 128x128 blocks, 1x128 blocks) and MXINT4 against hand and Python references."""

from __future__ import annotations

import math
import struct

import pytest
import torch

from cudnn_moe.formats import (
    dequantize_fp8_act128,
    dequantize_fp8_block128,
    dequantize_fp8_per_tensor,
    dequantize_mxfp4,
    dequantize_mxfp8,
    dequantize_mxint4,
    quantize_fp8_act128,
    quantize_fp8_block128,
    quantize_fp8_per_tensor,
    quantize_mxfp4,
    quantize_mxfp8,
    quantize_mxint4,
    unpack_nibbles,
)

E2M1_MAGNITUDES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def e4m3_magnitudes() -> list[float]:
    """All finite non-negative E4M3 values from the bit layout (bias 7, 3 mantissa bits, 0x7F is NaN)."""
    values = []
    for bits in range(0x7F):
        exponent, mantissa = bits >> 3, bits & 7
        if exponent == 0:
            values.append(mantissa / 8 * 2.0**-6)
        else:
            values.append((1 + mantissa / 8) * 2.0 ** (exponent - 7))
    return values


E4M3_MAGNITUDES = e4m3_magnitudes()


def round_to_grid(v: float, grid: list[float]) -> float:
    """Nearest grid magnitude to |v| with the sign of v; ties go to the even index; saturates at the top."""
    index = min(range(len(grid)), key=lambda i: (abs(abs(v) - grid[i]), i % 2))
    return math.copysign(grid[index], v)


def floor_log2(v: float) -> int:
    return math.frexp(v)[1] - 1


def e4m3_half_ulp(v: torch.Tensor) -> torch.Tensor:
    """Half the E4M3 spacing at magnitude v: 2^(e - 4) for v in [2^e, 2^(e+1)), e >= -6; 2^-10 below."""
    exponent = torch.frexp(v)[1] - 1
    return torch.ldexp(torch.ones_like(v), exponent.clamp(min=-6) - 4)


def e8m0_bits(scales: torch.Tensor) -> list:
    assert scales.dtype == torch.float8_e8m0fnu
    return scales.view(torch.uint8).tolist()


def to_bf16_by_bits(v: float) -> float:
    """float32 -> bfloat16 rounding done on the bit pattern (nearest, ties to even)."""
    bits = struct.unpack("<I", struct.pack("<f", v))[0]
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return struct.unpack("<f", struct.pack("<I", bits << 16))[0]


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ----------------------------------------------------------------------------- MXFP4


@pytest.mark.parametrize(
    ("amax", "scale_exp"),
    [
        (6.0, 0),  # floor(log2 6) = 2 = emax(E2M1)
        (7.9, 0),
        (8.0, 1),
        (4.0, 0),
        (3.9999998, -1),  # the float32 just below 4
        (2.0**24 - 1, 21),  # floor(log2) is 23, though float32 log2 rounds up to 24.0
        (1.0, -2),
        (0.1, -6),
        (1.5 * 2.0**120, 118),
        (2.0**-140, -127),  # clamped to E8M0's smallest scale
    ],
)
def test_mxfp4_scale_exponent(amax, scale_exp):
    x = torch.zeros(1, 32)
    x[0, 5] = -amax
    x[0, 9] = amax / 3
    _, scales = quantize_mxfp4(x)
    assert e8m0_bits(scales) == [[scale_exp + 127]]
    assert scales.float().item() == 2.0**scale_exp


def test_mxfp4_hand_block():
    x = torch.zeros(1, 64)
    x[0, :8] = torch.tensor([6.0, -6.0, 7.9, 0.25, 0.75, 2.5, -5.0, 3.5])
    x[0, 32:36] = torch.tensor([1.0, 0.375, -0.125, 0.0625])  # amax 1 -> scale 2^-2
    packed, scales = quantize_mxfp4(x)
    assert packed.shape == (1, 32) and scales.shape == (1, 2)
    assert e8m0_bits(scales) == [[127, 125]]
    codes = unpack_nibbles(packed)[0]
    assert codes[:8].tolist() == [7, 15, 7, 0, 2, 4, 14, 6]
    assert codes[32:36].tolist() == [6, 3, 9, 0]  # 4, 1.5, -0.5, 0.25 -> 0 (tie to even)
    y = dequantize_mxfp4(packed, scales)
    assert y[0, :8].tolist() == [6.0, -6.0, 6.0, 0.0, 1.0, 2.0, -4.0, 4.0]
    assert y[0, 32:36].tolist() == [1.0, 0.375, -0.125, 0.0]


def test_mxfp4_matches_python_reference_and_bound():
    x = torch.randn(3, 96, generator=seeded(0)) * torch.tensor([[1e-3], [1.0], [500.0]])
    packed, scales = quantize_mxfp4(x)
    y = dequantize_mxfp4(packed, scales)
    for row in range(3):
        values = x[row].tolist()
        for b in range(3):
            block = values[32 * b : 32 * b + 32]
            scale = 2.0 ** (floor_log2(max(abs(v) for v in block)) - 2)
            assert scales[row, b].float().item() == scale
            expected = [round_to_grid(v / scale, E2M1_MAGNITUDES) * scale for v in block]
            assert y[row, 32 * b : 32 * b + 32].tolist() == expected
    # Bound from the format: half the E2M1 spacing below 6, and saturation above (|x| / scale < 8).
    unit = scales.float().repeat_interleave(32, dim=-1)
    v = x.abs() / unit
    bound = torch.where(v < 2, 0.25, torch.where(v < 4, 0.5, torch.clamp(v - 6, min=1.0)))
    assert bool(((x - y).abs() <= bound * unit).all())


def test_mxfp4_zero_block_and_bf16_input():
    x = torch.zeros(2, 32, dtype=torch.bfloat16)
    x[1, 0] = 3.0
    packed, scales = quantize_mxfp4(x)
    assert e8m0_bits(scales) == [[0], [126]]  # zero block: 2^-127; amax 3: 2^(floor(log2 3) - 2) = 2^-1
    assert packed[0].tolist() == [0] * 16
    y = dequantize_mxfp4(packed, scales, dtype=torch.bfloat16)
    assert y.dtype == torch.bfloat16 and y[1, 0].item() == 3.0 and y[0].abs().max().item() == 0.0


def test_mx_scales_are_powers_of_two():
    x = torch.randn(4, 256, generator=seeded(1)) * torch.logspace(-8, 8, 256)
    for quantize in (quantize_mxfp4, quantize_mxfp8):
        mantissa, _ = torch.frexp(quantize(x)[1].float())
        assert bool((mantissa == 0.5).all())


# ----------------------------------------------------------------------------- MXFP8


@pytest.mark.parametrize(
    ("amax", "scale_exp"),
    [(448.0, 0), (500.0, 0), (511.0, 0), (512.0, 1), (256.0, 0), (255.0, -1), (1.0, -8), (2.0**-130, -127)],
)
def test_mxfp8_scale_exponent(amax, scale_exp):
    x = torch.zeros(1, 32)
    x[0, 31] = amax
    _, scales = quantize_mxfp8(x)
    assert e8m0_bits(scales) == [[scale_exp + 127]]


def test_mxfp8_hand_block_and_saturation():
    x = torch.zeros(1, 32)
    x[0, :5] = torch.tensor([448.0, -500.0, 1.0, 17.0, 0.001])
    values, scales = quantize_mxfp8(x)
    assert values.dtype == torch.float8_e4m3fn and values.shape == (1, 32)
    assert e8m0_bits(scales) == [[127]]
    # 17 lies halfway between 16 and 18 (spacing 2 in [16, 32)): ties to the even mantissa, 16.
    # 0.001 is above 2^-10, half the smallest subnormal 2^-9, so it rounds up to 2^-9.
    assert values.float()[0, :5].tolist() == [448.0, -448.0, 1.0, 16.0, 2.0**-9]


def test_mxfp8_matches_python_reference_and_bound():
    x = torch.randn(2, 64, generator=seeded(2)) * torch.tensor([[0.02], [3000.0]])
    values, scales = quantize_mxfp8(x)
    y = dequantize_mxfp8(values, scales)
    for row in range(2):
        for b in range(2):
            block = x[row, 32 * b : 32 * b + 32].tolist()
            scale = 2.0 ** (floor_log2(max(abs(v) for v in block)) - 8)
            assert scales[row, b].float().item() == scale
            expected = [round_to_grid(v / scale, E4M3_MAGNITUDES) * scale for v in block]
            assert y[row, 32 * b : 32 * b + 32].tolist() == expected
    unit = scales.float().repeat_interleave(32, dim=-1)
    v = x.abs() / unit
    bound = torch.maximum(e4m3_half_ulp(v), v - 448)
    assert bool(((x - y).abs() <= bound * unit).all())


def test_mxfp8_zero_block():
    values, scales = quantize_mxfp8(torch.zeros(3, 32))
    assert e8m0_bits(scales) == [[0]] * 3
    assert values.float().abs().max().item() == 0.0
    assert dequantize_mxfp8(values, scales).abs().max().item() == 0.0


# ----------------------------------------------------------------------------- FP8 per tensor


def test_fp8_per_tensor_hand_values():
    x = torch.tensor([896.0, -448.0, 1.0, 0.0, 17.0])
    q, scale = quantize_fp8_per_tensor(x)
    assert scale.dtype == torch.float32 and scale.dim() == 0 and scale.item() == 2.0
    assert q.dtype == torch.float8_e4m3fn
    # 17 / 2 = 8.5 is halfway between 8 and 9 (spacing 1 in [8, 16)): ties to the even mantissa, 8.
    assert q.float().tolist() == [448.0, -224.0, 0.5, 0.0, 8.0]
    assert dequantize_fp8_per_tensor(q, scale).tolist() == [896.0, -448.0, 1.0, 0.0, 16.0]


def test_fp8_per_tensor_given_scale_saturates():
    q, scale = quantize_fp8_per_tensor(torch.tensor([1000.0, -1e9, 3.0]), scale=0.5)
    assert scale.item() == 0.5
    assert q.float().tolist() == [448.0, -448.0, 6.0]
    assert dequantize_fp8_per_tensor(q, 0.5).tolist() == [224.0, -224.0, 3.0]


def test_fp8_per_tensor_zero_tensor():
    q, scale = quantize_fp8_per_tensor(torch.zeros(4, 4))
    assert scale.item() == 1.0
    assert q.float().abs().max().item() == 0.0


def test_fp8_per_tensor_round_trip_bound():
    x = torch.randn(64, 64, generator=seeded(3)) * 7
    q, scale = quantize_fp8_per_tensor(x.to(torch.bfloat16))
    assert scale.item() == pytest.approx(x.to(torch.bfloat16).float().abs().max().item() / 448, rel=1e-7)
    xb = x.to(torch.bfloat16).float()
    y = dequantize_fp8_per_tensor(q, scale)
    bound = e4m3_half_ulp(xb.abs() / scale) * scale
    assert bool(((xb - y).abs() <= bound * (1 + 1e-6)).all())


# ----------------------------------------------------------------------------- FP8 128x128 weight blocks


def test_fp8_block128_scales_per_tile_with_partial_edges():
    w = torch.randn(2, 200, 300, generator=seeded(4))
    w[0, 130, 260] = 1000.0  # tile (1, 2) of expert 0
    w[1, 128:, 256:] = 0.0  # tile (1, 2) of expert 1 is all zero
    q, scales = quantize_fp8_block128(w)
    assert q.shape == (2, 200, 300) and q.dtype == torch.float8_e4m3fn
    assert scales.shape == (2, 2, 3) and scales.dtype == torch.float32
    for e in range(2):
        for i in range(2):
            for j in range(3):
                tile = w[e, 128 * i : 128 * i + 128, 128 * j : 128 * j + 128]
                amax = tile.abs().max().item()
                expected = torch.tensor(amax, dtype=torch.float32) / 448 if amax else torch.tensor(1.0)
                assert scales[e, i, j].item() == expected.item()
    assert scales[0, 1, 2].item() == pytest.approx(1000 / 448)
    assert scales[1, 1, 2].item() == 1.0
    assert q[1, 128:, 256:].float().abs().max().item() == 0.0
    assert q[0, 130, 260].float().item() == 448.0


def test_fp8_block128_round_trip_bound():
    w = torch.randn(130, 260, generator=seeded(5)) * torch.logspace(-2, 2, 260)
    q, scales = quantize_fp8_block128(w)
    y = dequantize_fp8_block128(q, scales, dtype=torch.float32)
    unit = torch.empty_like(w)
    for i in range(2):
        for j in range(3):
            unit[128 * i : 128 * i + 128, 128 * j : 128 * j + 128] = scales[i, j]
    bound = e4m3_half_ulp(w.abs() / unit) * unit
    assert bool(((w - y).abs() <= bound * (1 + 1e-6)).all())
    assert dequantize_fp8_block128(q, scales, dtype=torch.bfloat16).dtype == torch.bfloat16


# ----------------------------------------------------------------------------- FP8 1x128 activation blocks


def test_fp8_act128_scales_and_round_trip():
    x = torch.randn(3, 256, generator=seeded(6))
    x[1, :128] = 0.0
    x[2, 200] = -900.0
    q, scales = quantize_fp8_act128(x)
    assert q.shape == (3, 256) and scales.shape == (3, 2) and scales.dtype == torch.float32
    for row in range(3):
        for b in range(2):
            amax = x[row, 128 * b : 128 * b + 128].abs().max()
            assert scales[row, b].item() == ((amax / 448).item() if amax.item() else 1.0)
    assert q[2, 200].float().item() == -448.0
    y = dequantize_fp8_act128(q, scales)
    unit = scales.repeat_interleave(128, dim=-1)
    bound = e4m3_half_ulp(x.abs() / unit) * unit
    assert bool(((x - y).abs() <= bound * (1 + 1e-6)).all())
    assert y[1, :128].abs().max().item() == 0.0


def test_fp8_act128_rejects_partial_block():
    with pytest.raises(ValueError):
        quantize_fp8_act128(torch.ones(2, 192))


# ----------------------------------------------------------------------------- MXINT4


def test_mxint4_hand_block_and_twos_complement_nibbles():
    x = torch.zeros(1, 32)
    x[0, :10] = torch.tensor([-1.0, 1.0, 7.0, -7.0, 3.5, 0.5, 1.5, 2.5, -0.5, -2.5])
    packed, scales = quantize_mxint4(x)
    assert scales.dtype == torch.bfloat16 and scales.tolist() == [[1.0]]
    assert packed[0, 0].item() == 0x1F  # element 0 = -1 -> 0xF (low), element 1 = 1 (high)
    assert unpack_nibbles(packed)[0, :10].tolist() == [0xF, 1, 7, 0x9, 4, 0, 2, 2, 0, 0xE]
    y = dequantize_mxint4(packed, scales)
    assert y[0, :10].tolist() == [-1.0, 1.0, 7.0, -7.0, 4.0, 0.0, 2.0, 2.0, 0.0, -2.0]


def test_mxint4_dequantizes_minus_eight():
    packed = torch.zeros(1, 16, dtype=torch.uint8)
    packed[0, 0] = 0xF8  # element 0 = 0x8 = -8, element 1 = 0xF = -1
    y = dequantize_mxint4(packed, torch.tensor([[0.5]], dtype=torch.bfloat16))
    assert y[0, :3].tolist() == [-4.0, -0.5, 0.0]


def test_mxint4_matches_python_reference_and_bound():
    x = torch.randn(2, 96, generator=seeded(7)) * torch.tensor([[0.003], [40.0]])
    packed, scales = quantize_mxint4(x)
    y = dequantize_mxint4(packed, scales)
    codes = unpack_nibbles(packed)
    for row in range(2):
        for b in range(3):
            block = x[row, 32 * b : 32 * b + 32].tolist()
            scale = to_bf16_by_bits(max(abs(v) for v in block) / 7)
            assert scales[row, b].float().item() == scale
            q = [max(-8, min(7, round(v / scale))) for v in block]  # Python's round: half to even
            assert codes[row, 32 * b : 32 * b + 32].tolist() == [c & 0xF for c in q]
            assert y[row, 32 * b : 32 * b + 32].tolist() == [c * scale for c in q]
    unit = scales.float().repeat_interleave(32, dim=-1)
    assert bool(((x - y).abs() <= 0.5 * unit * (1 + 1e-6)).all())


def test_mxint4_zero_and_underflowing_blocks():
    x = torch.zeros(1, 96)
    x[0, 40] = -3.0
    x[0, 64:] = 2.0**-140  # amax / 7 is below BF16's smallest subnormal half-way point (2^-134)
    packed, scales = quantize_mxint4(x)
    assert scales.float().tolist() == [[0.0, to_bf16_by_bits(3.0 / 7), 0.0]]
    assert packed[0, :16].tolist() == [0] * 16 and packed[0, 32:].tolist() == [0] * 16
    y = dequantize_mxint4(packed, scales)
    assert y[0, :32].abs().max().item() == 0.0 and y[0, 64:].abs().max().item() == 0.0
