"""OCP Microscaling (MX) formats: one E8M0 (power-of-two) scale per 32 values of the last dim.

Scale rule (OCP MX v1.0, section 6.3): for a block with amax = max |x|,
``shared_exp = floor(log2(amax)) - emax_elem`` where emax_elem is the exponent of the
element format's largest normal (2 for E2M1, whose max is 6 = 1.5 * 2^2; 8 for E4M3,
whose max is 448 = 1.75 * 2^8). The exponent is clamped to E8M0's finite range
[-127, 127] and the scale is ``2^shared_exp``. Elements are ``x / scale`` rounded to
nearest (ties to even) and saturated to the element max (the rule lets amax / scale
reach just under 2^(emax_elem + 1), above the element max). A block whose amax is zero
gets the smallest scale, 2^-127, and zero elements.

E8M0 scales are built from their exponent bits: torch's float -> float8_e8m0fnu cast
rounds up, which is not the floor this rule needs.

Arguments are checked before any work (TypeError / ValueError naming them): values must be a
finite floating tensor of at least one dim (NaN / Inf raise ValueError; the check reads the
data, a device sync on CUDA; ``quantize_mxfp8(x, check_finite=False)`` skips it), codes
uint8 / float8_e4m3fn, scales float8_e8m0fnu of the matching shape, the output dtype float16,
bfloat16, float32 or float64.
"""

from __future__ import annotations

import torch

from .blocks import block_scale_shape, check_codes, check_out_dtype, check_scales, check_values, split_blocks, to_e4m3
from .e2m1 import decode_e2m1, encode_e2m1, pack_codes, unpack_nibbles

MX_BLOCK = 32
E8M0_BIAS = 127
_E2M1_EMAX = 2
_E4M3_EMAX = 8


def _mx_scales(blocks: torch.Tensor, emax_elem: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 blocks [..., nb, 32] -> (E8M0 scales [..., nb], float32 scale values [..., nb, 1])."""
    amax = blocks.abs().amax(dim=-1)
    # frexp gives amax = m * 2^e with m in [0.5, 1), so floor(log2(amax)) = e - 1 exactly.
    _, exponent = torch.frexp(amax)
    shared_exp = (exponent.to(torch.int32) - 1 - emax_elem).clamp(-E8M0_BIAS, E8M0_BIAS)
    shared_exp = torch.where(amax > 0, shared_exp, torch.full_like(shared_exp, -E8M0_BIAS))
    scales = (shared_exp + E8M0_BIAS).to(torch.uint8).view(torch.float8_e8m0fnu)
    return scales, scales.float().unsqueeze(-1)


def quantize_mxfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize x [..., K] (BF16/FP16/FP32, K % 32 == 0) to MXFP4.

    Returns (packed E2M1 codes uint8 [..., K/2], element 2i in the low nibble;
    scales float8_e8m0fnu [..., K/32]).
    """
    check_values("x", x)
    blocks = split_blocks(x, MX_BLOCK)
    scales, scale_values = _mx_scales(blocks, _E2M1_EMAX)
    codes = encode_e2m1(blocks / scale_values)
    return pack_codes(codes.reshape(x.shape)), scales


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of quantize_mxfp4: packed uint8 [..., K/2] + E8M0 scales [..., K/32] -> [..., K] of ``dtype``."""
    check_codes("packed", packed, torch.uint8)
    shape = block_scale_shape(packed.shape, 2 * packed.shape[-1], MX_BLOCK, "packed")
    check_scales("scales", scales, (torch.float8_e8m0fnu,), shape)
    check_out_dtype(dtype)
    codes = unpack_nibbles(packed)
    blocks = split_blocks(decode_e2m1(codes), MX_BLOCK)
    return (blocks * scales.float().unsqueeze(-1)).reshape(codes.shape).to(dtype)


def quantize_mxfp8(x: torch.Tensor, *, check_finite: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize x [..., K] (BF16/FP16/FP32, K % 32 == 0) to MXFP8 (E4M3 elements).

    Per block of 32 values (the module's rule with emax 8): amax = max |x| in FP32, scale =
    2^clamp(floor(log2 amax) - 8, -127, 127) (2^-127 for an all-zero block), elements e4m3(fp32(x / scale)),
    nearest even, saturating at +-448. check_finite: refuse NaN / Inf with ValueError (reads the data, a
    device sync on CUDA); with False nothing is read, so the call can be captured in a CUDA graph, and a block
    holding NaN or Inf gets unspecified elements and scale.
    Returns (elements float8_e4m3fn [..., K], scales float8_e8m0fnu [..., K/32]).
    """
    check_values("x", x, finite=check_finite)
    blocks = split_blocks(x, MX_BLOCK)
    scales, scale_values = _mx_scales(blocks, _E4M3_EMAX)
    return to_e4m3(blocks / scale_values).reshape(x.shape), scales


def dequantize_mxfp8(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of quantize_mxfp8: E4M3 [..., K] + E8M0 scales [..., K/32] -> [..., K] of ``dtype``."""
    check_codes("values", values, torch.float8_e4m3fn)
    shape = block_scale_shape(values.shape, values.shape[-1], MX_BLOCK, "values")
    check_scales("scales", scales, (torch.float8_e8m0fnu,), shape)
    check_out_dtype(dtype)
    blocks = split_blocks(values, MX_BLOCK)
    return (blocks * scales.float().unsqueeze(-1)).reshape(values.shape).to(dtype)
