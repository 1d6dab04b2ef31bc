"""The exact shifted form of MXFP4 weights (cudnn_moe.formats.mxfp4_as_nvfp4): every element decodes to the MXFP4
value (the recoded scales times the global against dequantize_mxfp4, in float64, bit for bit), every recoded scale
is a power of two E4M3 holds (so the form is an exact NVFP4 one too), the shift is the one nearest 0, and the layers
it cannot hold say why."""

from __future__ import annotations

import pytest
import torch

from cudnn_moe.formats import dequantize_mxfp4, dequantize_nvfp4
from cudnn_moe.formats.mxfp4_as_nvfp4 import E4M3_POW2_SPAN, form_scales, nvfp4_globals, nvfp4_shifts

E, R, K = 4, 6, 256
BIAS = 127


def random_layer(lo: int, hi: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random packed E2M1 codes uint8 [E, R, K/2] and E8M0 scales [E, R, K/32] with exponent bytes in [lo, hi],
    one all-zero block (+-0 codes) per row carrying scale byte 0 (as the zero padding of I does)."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (E, R, K // 2), generator=gen, dtype=torch.uint8)
    codes[:, :, 16:32] = torch.tensor([0x00, 0x88, 0x08, 0x80], dtype=torch.uint8).repeat(4)  # block 1: +-0 only
    scales = torch.randint(lo, hi + 1, (E, R, K // 32), generator=gen, dtype=torch.uint8)
    scales[:, :, 1] = 0
    return codes, scales.view(torch.float8_e8m0fnu)


def form_values(codes: torch.Tensor, scales: torch.Tensor, shifts: torch.Tensor) -> torch.Tensor:
    """The form's values, float64, two ways that must agree: its E8M0 scales, and the same powers of two as the E4M3
    scales of NVFP4 (each block's two halves), each times the global."""
    recoded = form_scales(codes, scales, shifts)
    byte = recoded.view(torch.uint8)
    assert bool(((byte == 0) | ((byte >= BIAS - 9) & (byte <= BIAS + 8))).all())  # E4M3's powers of two, or zero
    as_e4m3 = torch.where(byte == 0, 0.0, torch.exp2(byte.double() - BIAS)).to(torch.float8_e4m3fn)
    nvfp4 = dequantize_nvfp4(codes, as_e4m3.repeat_interleave(2, dim=-1), dtype=torch.float64)
    mxfp4 = dequantize_mxfp4(codes, recoded, dtype=torch.float64)
    assert torch.equal(nvfp4, mxfp4)
    return mxfp4 * nvfp4_globals(shifts).double()[:, None, None]


@pytest.mark.parametrize("lo, hi, shift", [
    (BIAS - 9, BIAS + 8, 0),  # E4M3's own powers of two: no shift
    (BIAS - 20, BIAS - 5, -11),  # small weights: the shift nearest 0 that fits 2^-20
    (BIAS + 3, BIAS + 20, 12),  # large weights
    (0, E4M3_POW2_SPAN, -118),  # E8M0's smallest scales (FP32 subnormal values)
    (BIAS + 125 - E4M3_POW2_SPAN, BIAS + 125, 117),  # the largest that FP32 holds
])
def test_every_element_keeps_its_mxfp4_value(lo: int, hi: int, shift: int) -> None:
    codes, scales = random_layer(lo, hi, seed=lo)
    scales.view(torch.uint8)[:, 0, 0] = lo  # both ends present in every expert
    scales.view(torch.uint8)[:, 0, 2] = hi
    shifts = nvfp4_shifts(codes, scales)
    assert isinstance(shifts, torch.Tensor) and shifts.dtype == torch.int32
    assert shifts.tolist() == [shift] * E
    assert torch.equal(form_values(codes, scales, shifts), dequantize_mxfp4(codes, scales, dtype=torch.float64))


def test_zero_blocks_get_scale_byte_zero_and_do_not_count() -> None:
    codes, scales = random_layer(BIAS - 4, BIAS - 2, seed=1)
    scales.view(torch.uint8)[2, 3, 1] = 255 - 1  # a huge scale over zero codes: outside the span, but harmless
    shifts = nvfp4_shifts(codes, scales)
    assert shifts.tolist() == [0] * E
    recoded = form_scales(codes, scales, shifts).view(torch.uint8)
    assert recoded.shape == (E, R, K // 32)
    assert bool((recoded[:, :, 1] == 0).all()) and bool((recoded[:, :, 0] != 0).all())
    assert torch.equal(form_values(codes, scales, shifts), dequantize_mxfp4(codes, scales, dtype=torch.float64))


def test_an_all_zero_expert_takes_shift_zero() -> None:
    codes, scales = random_layer(BIAS - 30, BIAS - 28, seed=2)
    codes[1] = 0x80
    shifts = nvfp4_shifts(codes, scales)
    assert shifts[1].item() == 0 and shifts[0].item() == -30 + 9  # the largest shift that keeps 2^-30
    assert torch.equal(form_values(codes, scales, shifts), dequantize_mxfp4(codes, scales, dtype=torch.float64))


def test_layers_without_an_exact_form_say_why() -> None:
    codes, scales = random_layer(BIAS - 5, BIAS - 5, seed=3)
    wide = scales.clone()
    wide.view(torch.uint8)[2, 4, 5] = BIAS - 5 - E4M3_POW2_SPAN - 1
    assert nvfp4_shifts(codes, wide, "w1") == (
        f"w1 scales of expert 2 span 2^{-5 - E4M3_POW2_SPAN - 1} .. 2^-5, more than the 17 binades E4M3 holds exactly")
    edge = scales.clone()
    edge.view(torch.uint8)[0, 0, 0] = BIAS - 5 - E4M3_POW2_SPAN  # exactly 17 binades: converts
    assert isinstance(nvfp4_shifts(codes, edge), torch.Tensor)
    nan = scales.clone()
    nan.view(torch.uint8)[3, 0, 1] = 255  # NaN over zero codes is still NaN in the format
    assert nvfp4_shifts(codes, nan, "w2") == "w2 scales of expert 3 hold an E8M0 NaN byte (255)"
    big = torch.full_like(scales.view(torch.uint8), BIAS + 126).view(torch.float8_e8m0fnu)
    assert "above 2^125" in nvfp4_shifts(codes, big)


def test_bad_arguments_are_named() -> None:
    codes, scales = random_layer(BIAS, BIAS, seed=4)
    with pytest.raises(TypeError, match="w1 codes"):
        nvfp4_shifts(codes.view(torch.int8), scales, "w1")
    with pytest.raises(ValueError, match="w1 scales"):
        nvfp4_shifts(codes, scales[..., :-1], "w1")
    with pytest.raises(ValueError, match=r"\[E, R, K/2\]"):
        nvfp4_shifts(codes[0], scales[0], "w1")
