"""128x4 scale swizzle against its offset formula evaluated element by element."""

from __future__ import annotations

import pytest
import torch

from cudnn_moe.formats import swizzle_128x4, swizzled_offset, swizzled_shape, unswizzle_128x4

SHAPES = [(1, 1), (5, 3), (128, 4), (130, 7), (256, 8), (200, 12), (129, 1)]


def expected_offset(r: int, c: int, cols: int) -> int:
    """Byte offset of (r, c): 512-byte tiles of 128 rows x 4 columns, column tile fastest;
    inside a tile, row r % 32 selects a 16-byte line and (r % 128) // 32 its 4-byte group."""
    col_tiles = -(-cols // 4)
    return ((r // 128) * col_tiles + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4


def distinct_values(*shape: int) -> torch.Tensor:
    """1, 2, 3, ... (never zero, so padding is told apart) as int32 of ``shape``."""
    n = 1
    for size in shape:
        n *= size
    return torch.arange(1, n + 1, dtype=torch.int32).reshape(shape)


@pytest.mark.parametrize(("rows", "cols"), SHAPES)
def test_swizzled_shape(rows, cols):
    padded_rows, padded_cols = swizzled_shape(rows, cols)
    assert padded_rows % 128 == 0 and rows <= padded_rows < rows + 128
    assert padded_cols % 4 == 0 and cols <= padded_cols < cols + 4


@pytest.mark.parametrize(("rows", "cols"), SHAPES)
def test_swizzle_places_every_entry_at_its_offset(rows, cols):
    scales = distinct_values(rows, cols)
    out = swizzle_128x4(scales)
    padded_rows, padded_cols = swizzled_shape(rows, cols)
    assert out.shape == (padded_rows * padded_cols,) and out.dtype == torch.int32
    flat = out.tolist()
    written = set()
    for r in range(rows):
        for c in range(cols):
            offset = expected_offset(r, c, cols)
            assert swizzled_offset(r, c, cols) == offset
            assert flat[offset] == scales[r, c].item()
            written.add(offset)
    assert len(written) == rows * cols
    assert all(flat[i] == 0 for i in range(len(flat)) if i not in written)


def test_batched_leading_dims():
    experts, rows, cols = 3, 130, 5
    scales = distinct_values(experts, rows, cols)
    out = swizzle_128x4(scales)
    padded_rows, padded_cols = swizzled_shape(rows, cols)
    assert out.shape == (experts, padded_rows * padded_cols)
    for e in range(experts):
        for r in range(0, rows, 7):
            for c in range(cols):
                assert out[e, expected_offset(r, c, cols)].item() == scales[e, r, c].item()
    assert int((out != 0).sum()) == experts * rows * cols


def test_float8_scales_keep_their_bytes_and_zero_padding():
    bits = torch.randint(1, 0x7F, (2, 40, 6), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    scales = bits.view(torch.float8_e4m3fn)
    out = swizzle_128x4(scales)
    assert out.dtype == torch.float8_e4m3fn
    out_bits = out.view(torch.uint8)
    assert out_bits[1, expected_offset(39, 5, 6)].item() == bits[1, 39, 5].item()
    assert int((out_bits != 0).sum()) == bits.numel()
    assert torch.equal(unswizzle_128x4(out, 40, 6).view(torch.uint8), bits)


@pytest.mark.parametrize(("rows", "cols"), SHAPES)
def test_unswizzle_inverts_swizzle(rows, cols):
    scales = distinct_values(2, rows, cols)
    assert torch.equal(unswizzle_128x4(swizzle_128x4(scales), rows, cols), scales)


def test_unswizzle_reads_offsets():
    rows, cols = 131, 6
    padded_rows, padded_cols = swizzled_shape(rows, cols)
    swizzled = torch.arange(padded_rows * padded_cols, dtype=torch.int64)
    linear = unswizzle_128x4(swizzled, rows, cols)
    assert linear.shape == (rows, cols)
    for r in range(rows):
        for c in range(cols):
            assert linear[r, c].item() == expected_offset(r, c, cols)


def test_unswizzle_rejects_wrong_size():
    with pytest.raises(ValueError):
        unswizzle_128x4(torch.zeros(128 * 4 - 1), 128, 4)
    with pytest.raises(ValueError):
        unswizzle_128x4(torch.zeros(2, 256 * 4), 100, 4)
