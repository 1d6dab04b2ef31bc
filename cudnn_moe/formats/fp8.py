"""FP8 E4M3 with FP32 dequantization scales: per tensor, per 128x128 weight block, per 1x128 activation block.

Every variant stores ``q = e4m3(x / s)`` (round to nearest even, saturating at +-448) and
decodes ``q * s``. A computed scale is ``amax / 448`` over its group, so the largest
magnitude maps to 448. A group whose amax is zero gets scale 1.0 (its codes are zero
either way; a positive scale keeps every stored scale a valid divisor).

Arguments are checked before any work (TypeError / ValueError naming them): values to quantize
must be a finite floating tensor (NaN / Inf raise ValueError; the check reads the data, a
device sync on CUDA), a given scale a positive number or one-element tensor that is finite and
nonzero in float32, where the math runs (quantizing divides by it, so its reciprocal must be
finite there too: 1e-300, 1e39 and scales below about 2.94e-39 are refused), encoded values
float8_e4m3fn and block scales floating tensors of the matching shape; the output dtype
float16, bfloat16, float32 or float64.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..validate import FLOAT_DTYPES, require_float32_scalar
from .blocks import (
    E4M3_MAX,
    block_scale_shape,
    check_codes,
    check_out_dtype,
    check_scales,
    check_values,
    split_blocks,
    to_e4m3,
)

FP8_BLOCK = 128


def scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """float32 amax -> float32 dequantization scale amax / 448 (1.0 where amax is zero), an IEEE division on
    every device (torch on CUDA turns a division by a Python scalar into a multiply by its rounded reciprocal,
    one ulp off at times: the divisor is a tensor here)."""
    return torch.where(amax > 0, amax / torch.full_like(amax, E4M3_MAX), torch.ones_like(amax))


def quantize_fp8_per_tensor(
    x: torch.Tensor, scale: float | torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x (any shape, 0-d included, floating) -> (float8_e4m3fn, same shape; float32 0-dim
    dequantization scale).

    scale: the dequantization scale to use (positive; it and its reciprocal finite in float32); by
    default amax(|x|) / 448, which needs at least one value: an empty x without a scale raises
    ValueError (with one, it gives an empty result).
    """
    check_values("x", x, min_rank=0)
    if scale is not None:
        require_float32_scalar("scale", scale, reciprocal=True)
    elif x.numel() == 0:
        raise ValueError("x is empty: its amax (the default scale) is undefined; pass scale")
    x = x.float()
    if scale is None:
        scale = scale_from_amax(x.abs().amax())
    scale = torch.as_tensor(scale, dtype=torch.float32, device=x.device).reshape(())
    return to_e4m3(x / scale), scale


def dequantize_fp8_per_tensor(
    values: torch.Tensor, scale: float | torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """E4M3 tensor (any shape, 0-d included) + scalar dequantization scale (positive, finite and
    nonzero in float32) -> values * scale computed in float32, as ``dtype`` (float16, bfloat16,
    float32 or float64). Products past the float32 (or float16) range become inf."""
    check_codes("values", values, torch.float8_e4m3fn, min_rank=0)
    require_float32_scalar("scale", scale, positive=True)
    check_out_dtype(dtype)
    scale = torch.as_tensor(scale, dtype=torch.float32, device=values.device).reshape(())
    return (values.float() * scale).to(dtype)


def _expand_block_scales(scales: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Block scales [..., ceil(rows/128), ceil(cols/128)] -> float32 per element [..., rows, cols]."""
    full = scales.float().repeat_interleave(FP8_BLOCK, dim=-2).repeat_interleave(FP8_BLOCK, dim=-1)
    return full[..., :rows, :cols]


def quantize_fp8_block128(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights w [..., N, K] (floating) -> (float8_e4m3fn [..., N, K], float32 scales [..., ceil(N/128), ceil(K/128)]).

    Each 128x128 tile (partial at the bottom and right edges when N or K is not a
    multiple of 128) has its own dequantization scale amax / 448.
    """
    check_values("w", w, min_rank=2)
    *lead, rows, cols = w.shape
    w = w.float()
    pad_rows, pad_cols = -rows % FP8_BLOCK, -cols % FP8_BLOCK
    tiles = F.pad(w.abs(), (0, pad_cols, 0, pad_rows)).reshape(
        *lead, (rows + pad_rows) // FP8_BLOCK, FP8_BLOCK, (cols + pad_cols) // FP8_BLOCK, FP8_BLOCK
    )
    scales = scale_from_amax(tiles.amax(dim=(-3, -1)))
    return to_e4m3(w / _expand_block_scales(scales, rows, cols)), scales


def dequantize_fp8_block128(
    values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of quantize_fp8_block128: E4M3 [..., N, K] + scales [..., ceil(N/128), ceil(K/128)] -> [..., N, K]."""
    check_codes("values", values, torch.float8_e4m3fn, min_rank=2)
    *lead, rows, cols = values.shape
    check_scales("scales", scales, FLOAT_DTYPES, (*lead, -(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK)))
    check_out_dtype(dtype)
    return (values.float() * _expand_block_scales(scales, rows, cols)).to(dtype)


def quantize_fp8_act128(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations x [..., K] (K % 128 == 0) -> (float8_e4m3fn [..., K], float32 scales [..., K/128]).

    One dequantization scale amax / 448 per 128 consecutive values of the last dim.
    """
    check_values("x", x)
    blocks = split_blocks(x, FP8_BLOCK)
    scales = scale_from_amax(blocks.abs().amax(dim=-1))
    return to_e4m3(blocks / scales.unsqueeze(-1)).reshape(x.shape), scales


def dequantize_fp8_act128(
    values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of quantize_fp8_act128: E4M3 [..., K] + scales [..., K/128] -> [..., K] of ``dtype``."""
    check_codes("values", values, torch.float8_e4m3fn)
    check_scales("scales", scales, FLOAT_DTYPES, block_scale_shape(values.shape, values.shape[-1], FP8_BLOCK, "values"))
    check_out_dtype(dtype)
    blocks = split_blocks(values, FP8_BLOCK)
    return (blocks * scales.float().unsqueeze(-1)).reshape(values.shape).to(dtype)
