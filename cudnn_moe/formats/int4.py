"""MXINT4: signed 4-bit integers with one BF16 scale per 32 values of the last dim.

Encoding a block with amax = max |x|: ``scale = bf16(amax / 7)`` and
``q = clamp(round_half_even(x / scale), -8, 7)``; a block whose scale is zero (zero
amax, or amax / 7 below BF16's range) stores zero codes. Decoding gives ``q * scale``.
Codes are two's-complement nibbles (-1 -> 0xF, -8 -> 0x8), packed two per byte with
element 2i in the low nibble.

Arguments are checked before any work (TypeError / ValueError naming them): values must be a
finite floating tensor of at least one dim (NaN / Inf raise ValueError; the check reads the
data, a device sync on CUDA), codes uint8, scales bfloat16 of the matching shape, the output
dtype float16, bfloat16, float32 or float64.
"""

from __future__ import annotations

import torch

from .blocks import block_scale_shape, check_codes, check_out_dtype, check_scales, check_values, split_blocks
from .e2m1 import pack_codes, unpack_nibbles

MXINT4_BLOCK = 32
INT4_MIN, INT4_MAX = -8, 7


def quantize_mxint4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize x [..., K] (BF16/FP16/FP32, K % 32 == 0) to MXINT4.

    Returns (packed uint8 [..., K/2], scales bfloat16 [..., K/32]).
    """
    check_values("x", x)
    blocks = split_blocks(x, MXINT4_BLOCK)
    scales = (blocks.abs().amax(dim=-1) / INT4_MAX).to(torch.bfloat16)
    scale_values = scales.float().unsqueeze(-1)
    # A zero scale means amax / 7 rounds to zero in BF16, so dividing by 1 instead still gives zero codes.
    safe = torch.where(scale_values == 0, torch.ones_like(scale_values), scale_values)
    q = torch.round(blocks / safe).clamp(INT4_MIN, INT4_MAX)
    codes = (q.to(torch.int16) & 0xF).to(torch.uint8)
    return pack_codes(codes.reshape(x.shape)), scales


def dequantize_mxint4(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of quantize_mxint4: packed uint8 [..., K/2] + BF16 scales [..., K/32] -> [..., K] of ``dtype``."""
    check_codes("packed", packed, torch.uint8)
    shape = block_scale_shape(packed.shape, 2 * packed.shape[-1], MXINT4_BLOCK, "packed")
    check_scales("scales", scales, (torch.bfloat16,), shape)
    check_out_dtype(dtype)
    codes = unpack_nibbles(packed).to(torch.int16)
    q = torch.where(codes >= 8, codes - 16, codes).float()
    blocks = split_blocks(q, MXINT4_BLOCK)
    return (blocks * scales.float().unsqueeze(-1)).reshape(codes.shape).to(dtype)
