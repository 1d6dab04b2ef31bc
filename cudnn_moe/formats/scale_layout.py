"""Block-scale layouts: linear (row-major [rows, cols]) and the 128x4 swizzle.

The 128x4 swizzle (cuDNN's ``F8_128x4`` reordering, used by Blackwell block-scaled
MMA) stores a scale matrix of R rows x C columns, padded to a multiple of 128 rows
and 4 columns, as 512-byte tiles of 128 rows x 4 columns; tiles are ordered with
the column tile fastest. Inside a tile, element (r, c) sits at
``(r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4``.
"""

from __future__ import annotations

import enum

import torch

from ..validate import require_int_arg


class ScaleLayout(enum.Enum):
    """Where block scale (row, col) lives in memory."""

    LINEAR = "linear"  # row-major [rows, cols]
    SWIZZLED_128X4 = "128x4"  # cuDNN F8_128x4 tiles, see the module docstring

SWIZZLE_ROWS = 128
SWIZZLE_COLS = 4


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def swizzled_shape(rows: int, cols: int) -> tuple[int, int]:
    """Padded (rows, cols) of the 128x4 layout for a rows x cols scale matrix."""
    require_int_arg("rows", rows, minimum=0)
    require_int_arg("cols", cols, minimum=0)
    return _round_up(rows, SWIZZLE_ROWS), _round_up(cols, SWIZZLE_COLS)


def swizzled_offset(row: int, col: int, cols: int) -> int:
    """Byte offset of scale (row, col) in the 128x4 layout of a matrix with ``cols`` columns.

    row >= 0, cols >= 1 and 0 <= col < cols (TypeError / ValueError otherwise: an index past the
    matrix would name another element's slot or a negative offset).
    """
    require_int_arg("row", row, minimum=0)
    require_int_arg("cols", cols, minimum=1)
    require_int_arg("col", col, minimum=0, maximum=cols - 1)
    col_tiles = _round_up(cols, SWIZZLE_COLS) // SWIZZLE_COLS
    tile = (row // SWIZZLE_ROWS) * col_tiles + col // SWIZZLE_COLS
    return tile * 512 + (row % 32) * 16 + ((row % SWIZZLE_ROWS) // 32) * 4 + col % SWIZZLE_COLS


def swizzle_128x4(scales: torch.Tensor) -> torch.Tensor:
    """Linear scales [..., R, C] -> 128x4-swizzled [..., Rp * Cp] (same dtype; padding is zero).

    Rp = R rounded up to 128, Cp = C rounded up to 4. Works for any 1-byte or wider dtype.
    """
    if not isinstance(scales, torch.Tensor):
        raise TypeError(f"scales must be a torch.Tensor, got {type(scales).__name__}")
    if scales.dim() < 2:
        raise ValueError(f"scales must have at least 2 dimensions [..., R, C], got shape {tuple(scales.shape)}")
    *lead, rows, cols = scales.shape
    padded_rows, padded_cols = swizzled_shape(rows, cols)
    padded = scales.new_zeros(*lead, padded_rows, padded_cols)
    padded[..., :rows, :cols] = scales
    # (r // 128, (r % 128) // 32, r % 32, c // 4, c % 4) -> (r // 128, c // 4, r % 32, (r % 128) // 32, c % 4)
    tiles = padded.reshape(*lead, padded_rows // 128, 4, 32, padded_cols // 4, 4)
    n = len(lead)
    order = [*range(n), n, n + 3, n + 2, n + 1, n + 4]
    return tiles.permute(order).reshape(*lead, padded_rows * padded_cols)


def unswizzle_128x4(swizzled: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of swizzle_128x4: [..., Rp * Cp] -> linear [..., rows, cols] (padding dropped)."""
    if not isinstance(swizzled, torch.Tensor):
        raise TypeError(f"swizzled must be a torch.Tensor, got {type(swizzled).__name__}")
    if swizzled.dim() < 1:
        raise ValueError("swizzled must have at least 1 dimension [..., Rp * Cp], got a 0-d tensor")
    require_int_arg("rows", rows, minimum=1)
    require_int_arg("cols", cols, minimum=1)
    padded_rows, padded_cols = swizzled_shape(rows, cols)
    *lead, size = swizzled.shape
    if size != padded_rows * padded_cols:
        raise ValueError(
            f"swizzled scales hold {size} entries per matrix; a {rows}x{cols} matrix needs "
            f"{padded_rows}x{padded_cols} = {padded_rows * padded_cols}"
        )
    tiles = swizzled.reshape(*lead, padded_rows // 128, padded_cols // 4, 32, 4, 4)
    n = len(lead)
    order = [*range(n), n, n + 3, n + 2, n + 1, n + 4]
    linear = tiles.permute(order).reshape(*lead, padded_rows, padded_cols)
    return linear[..., :rows, :cols].contiguous()
