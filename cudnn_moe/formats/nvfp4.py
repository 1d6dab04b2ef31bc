"""NVFP4: E2M1 values with one float8_e4m3fn scale per 16 values and an FP32 global scale.

Encoding a tensor x with global scale g: each block of 16 gets
``s = e4m3(amax(|x_block|) / 6 * g)`` and codes ``e2m1(x * g / s)`` (zero codes when
``s == 0``). Decoding gives ``e2m1_value * s / g``. Every product of an E2M1 value and
an E4M3 scale is exact in BF16.

Arguments are checked before any work (TypeError / ValueError naming them): values must be a
floating tensor of at least one dim, finite unless ``check_finite=False``; the global scale a
positive number or a positive tensor over the leading dims, finite with a finite reciprocal in
float32 (the math runs in float32: about 2.94e-39 to 3.4e38; 1e-300 and 1e39 are refused); packed
codes uint8 and scales float8_e4m3fn of the matching shape; the output dtype float16, bfloat16,
float32 or float64.
"""

from __future__ import annotations

import torch

from .blocks import (
    E4M3_MAX,
    block_scale_shape,
    broadcast_per_lead,
    check_codes,
    check_global_scale,
    check_out_dtype,
    check_scales,
    check_values,
    split_blocks,
    to_e4m3,
)
from .e2m1 import E2M1_MAX, decode_e2m1, encode_e2m1, pack_codes, unpack_nibbles

NVFP4_BLOCK = 16
NVFP4_MAX = E2M1_MAX * E4M3_MAX  # 2688: the largest magnitude a block can hold with global scale one
_E4M3_NEGATIVE_ZERO = 0x80
_SCALE_CHECK_CHUNK = 1 << 24  # scale bytes read at a time: bounded temporaries for a whole layer's scales


def require_unsigned_scales(name: str, scales: torch.Tensor) -> None:
    """Prepared NVFP4 weights' block scales must be what NVIDIA's block-scaled tensor cores read, unsigned E4M3
    (UE4M3): codes 0x00-0x7E, or 0x80 (negative zero, read as zero). The SM90 kernels decode only a scale's seven
    low bits, so a NaN (0x7F, 0xFF) or negative code would be misread there: ValueError naming ``name``. Reads the
    scales 16 MB at a time, with one device sync (preparation only, not the serving path)."""
    found = torch.zeros(2, dtype=torch.bool, device=scales.device)  # (a NaN code, a negative code)
    for part in scales.view(torch.uint8).reshape(-1).split(_SCALE_CHECK_CHUNK):
        found |= torch.stack((((part & 0x7F) == 0x7F).any(), (part > _E4M3_NEGATIVE_ZERO).any()))
    nan, negative = found.tolist()
    if nan:
        raise ValueError(f"{name} holds E4M3 NaN block scales (0x7F / 0xFF); block scales must be finite")
    if negative:
        raise ValueError(f"{name} holds negative E4M3 block scales; NVFP4 weight block scales are unsigned (UE4M3, "
                         f"codes 0x00-0x7E; negative zero 0x80 reads as zero)")


def quantize_nvfp4(
    x: torch.Tensor, global_scale: float | torch.Tensor = 1.0, *, check_finite: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize x [..., K] (BF16/FP16/FP32/FP64, K % 16 == 0) to NVFP4.

    global_scale: a positive float, or a tensor over x's leading dims (e.g. [E] for x [E, N, K];
    read to check it), finite and with a finite reciprocal in float32 (so that dequantize_nvfp4,
    which divides by it, accepts it too). check_finite: refuse NaN / Inf in x with ValueError (reads
    x, a device sync on CUDA). With False, a block holding NaN gets a NaN scale and all-zero
    codes, and a block holding Inf gets scale 448 with the Inf saturated to +-6.
    Returns (packed uint8 [..., K/2], scales float8_e4m3fn [..., K/16]) with linear scales.
    """
    check_values("x", x, finite=check_finite)
    check_global_scale("global_scale", global_scale, x)
    blocks = split_blocks(x, NVFP4_BLOCK)
    g = broadcast_per_lead(global_scale, blocks)
    amax = blocks.abs().amax(dim=-1)
    scales = to_e4m3(amax / E2M1_MAX * g.squeeze(-1))
    scale_values = scales.float().unsqueeze(-1)
    safe = torch.where(scale_values == 0, torch.ones_like(scale_values), scale_values)
    codes = encode_e2m1(blocks * g / safe)
    return pack_codes(codes.reshape(x.shape)), scales


def dequantize_nvfp4(
    packed: torch.Tensor,
    scales: torch.Tensor,
    global_scale: float | torch.Tensor = 1.0,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Inverse of quantize_nvfp4: packed [..., K/2] + linear scales [..., K/16] -> [..., K] of ``dtype``.

    global_scale: as quantize_nvfp4 takes it (decoding divides by it in float32). dtype: float16,
    bfloat16, float32 or float64 (TypeError otherwise: float8 dtypes would clip the values; with
    float16, magnitudes above 65504 become inf). A NaN scale (E4M3 code 0x7F) decodes its block to
    NaN; the data is not read to check.
    """
    check_codes("packed", packed, torch.uint8)
    shape = block_scale_shape(packed.shape, 2 * packed.shape[-1], NVFP4_BLOCK, "packed")
    check_scales("scales", scales, (torch.float8_e4m3fn,), shape)
    check_global_scale("global_scale", global_scale, packed)
    check_out_dtype(dtype)
    codes = unpack_nibbles(packed)
    blocks = split_blocks(decode_e2m1(codes), NVFP4_BLOCK)
    g = broadcast_per_lead(global_scale, blocks)
    values = blocks * scales.float().unsqueeze(-1) / g
    return values.reshape(codes.shape).to(dtype)
