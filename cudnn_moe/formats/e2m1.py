"""FP4 E2M1 element codec: value <-> 4-bit code, and two-codes-per-byte packing.

A code is ``sign << 3 | magnitude_index``; magnitude_index picks from
``E2M1_GRID = (0, 0.5, 1, 1.5, 2, 3, 4, 6)``. Packed bytes hold element ``2i`` in
the low nibble and element ``2i + 1`` in the high nibble (the order cuDNN and
``torch.float4_e2m1fn_x2`` use).
"""

from __future__ import annotations

import torch

from ..validate import FLOAT_DTYPES, require_tensor

E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0

# Midpoints between neighbouring grid values, and whether a tie there rounds up
# (it does when the upper neighbour has the even magnitude index).
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_TIE_ROUNDS_UP = (False, True, False, True, False, True, False)


def encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round float values to E2M1 codes (nearest, ties to even; saturate at +-6).

    x: any shape, float16/bfloat16/float32/float64 (TypeError otherwise). The data is not read
    to check it: NaN encodes as code 0 (+0) and +-Inf saturate to +-6 like any large value.
    Returns uint8 codes of the same shape. Values that round to zero get code 0
    (no negative zero), so equal values always get equal codes.
    """
    require_tensor("x", x, FLOAT_DTYPES)
    mag = x.abs().float()
    index = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for midpoint, tie_up in zip(_MIDPOINTS, _TIE_ROUNDS_UP):
        above = mag >= midpoint if tie_up else mag > midpoint
        index += above.to(torch.uint8)
    negative = (x < 0) & (index > 0)
    return index | (negative.to(torch.uint8) << 3)


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, low 4 bits used) -> float32 values, same shape."""
    require_tensor("codes", codes, torch.uint8)
    grid = torch.tensor(E2M1_GRID, dtype=torch.float32, device=codes.device)
    codes = codes.to(torch.int64)
    value = grid[codes & 7]
    return torch.where((codes & 8) != 0, -value, value)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., K] (K even, every code in 0..15) -> packed bytes [..., K/2]; element 2i is
    the low nibble.

    A code above 15 raises ValueError rather than losing its high bits; the check reads the codes
    (a device sync for CUDA tensors). The quantize_* functions pack the codes they computed
    themselves (always 4-bit) with ``pack_codes``, which reads nothing.
    """
    require_tensor("codes", codes, torch.uint8)
    if codes.dim() < 1:
        raise ValueError("codes must have at least 1 dimension, got a 0-d tensor")
    if codes.shape[-1] % 2:
        raise ValueError(f"the last dimension must be even to pack two codes per byte, got {codes.shape[-1]}")
    if codes.numel() and (largest := int(codes.max())) > 0xF:
        raise ValueError(f"codes must lie in 0..15 (4 bits each), got a code of {largest}")
    return pack_codes(codes)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """pack_nibbles for codes known to be 4-bit uint8 [..., K], K even (not checked, not read)."""
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Packed bytes [..., K/2] (uint8) -> codes [..., K] (uint8); inverse of pack_nibbles."""
    require_tensor("packed", packed, torch.uint8)
    if packed.dim() < 1:
        raise ValueError("packed must have at least 1 dimension, got a 0-d tensor")
    low = packed & 0xF
    high = packed >> 4
    return torch.stack((low, high), dim=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])
