"""CPU tests of the SM90 engine's layouts: the weight-tile repack round-trips to the canonical NVFP4
tensors, and the token-fragment order puts each lane's B registers where layout.py says."""

from __future__ import annotations

import pytest
import torch

from cudnn_moe.engines.sm90.layout import (
    MXFP4_TILE_SCALE_POW2,
    from_token_fragments,
    from_token_layout,
    pack_mxfp4_weight_tiles,
    pack_weight_tiles,
    to_token_fragments,
    to_token_layout,
    token_fragment_order,
    unpack_weight_tiles,
)
from cudnn_moe.kernels import TokenLayout
from cudnn_moe.kernels.codes import NVFP4_TILE_SCALE_BASE


@pytest.mark.parametrize("experts, n, k", [(1, 16, 64), (3, 48, 192), (2, 128, 2048)])
def test_weight_tiles_round_trip(experts: int, n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(n + k)
    packed = torch.randint(0, 256, (experts, n, k // 2), dtype=torch.uint8, generator=gen)
    scales = torch.randint(0, 127, (experts, n, k // 16), dtype=torch.uint8, generator=gen)
    scales[0, 0, 0] = 0x80  # negative zero, which preparation accepts as zero
    scales = scales.view(torch.float8_e4m3fn)
    tiles, tile_scales = pack_weight_tiles(packed, scales)
    assert tiles.shape == (experts, n * k // 2) and tile_scales.shape == (experts, n * k // 16)
    assert not torch.equal(tiles.view(experts, n, k // 2), packed)  # really moved
    back, back_scales = unpack_weight_tiles(tiles, tile_scales, n, k)
    assert torch.equal(back, packed)
    assert torch.equal(back_scales.view(torch.uint8), scales.view(torch.uint8))


def test_scale_tile_bytes() -> None:
    """Byte g*8 + s*2 + h of tile (i, j) is the scale code of row 16i + g + 8h, k block 4j + s: the code c whose
    BF16 bits 16 c + NVFP4_TILE_SCALE_BASE are the scale times 2^118 (160 for a zero scale)."""
    n, k = 32, 128
    scales = torch.arange(n * k // 16, dtype=torch.int32).remainder(127).to(torch.uint8).view(1, n, k // 16)
    _, tile_scales = pack_weight_tiles(torch.zeros(1, n, k // 2, dtype=torch.uint8), scales.view(torch.float8_e4m3fn))
    tiles = tile_scales.view(n // 16, k // 64, 64)
    for i in range(n // 16):
        for j in range(k // 64):
            for g in range(8):
                for s in range(4):
                    for h in range(2):
                        code = int(tiles[i, j, g * 8 + s * 2 + h])
                        scale = scales[0, 16 * i + g + 8 * h, 4 * j + s].view(torch.float8_e4m3fn).double().item()
                        bits = torch.tensor([16 * code + NVFP4_TILE_SCALE_BASE], dtype=torch.int32).to(torch.int16)
                        assert code == 160 if scale == 0 else bits.view(torch.bfloat16).item() == scale * 2.0**118


def test_mxfp4_scale_tile_bytes() -> None:
    """Byte g*4 + 2h + r of MXFP4 tile (i, j) is the scale of row 16i + g + 8r, k32 block 2j + h, stored as the
    BF16 exponent field of 2^(p + 118) for a recoded scale 2^p (byte p + 127 + 118), and 0 for byte 0."""
    n, k = 32, 128
    powers = torch.arange(n * k // 32, dtype=torch.int32).remainder(18) - 9  # every recoded power 2^-9 .. 2^8
    raw = (powers + 127).to(torch.uint8).view(1, n, k // 32)
    raw[0, 5, 2] = 0  # an all-zero block's byte
    _, tile_scales = pack_mxfp4_weight_tiles(torch.zeros(1, n, k // 2, dtype=torch.uint8),
                                             raw.view(torch.float8_e8m0fnu))
    tiles = tile_scales.view(n // 16, k // 64, 32)
    for i in range(n // 16):
        for j in range(k // 64):
            for g in range(8):
                for h in range(2):
                    for r in range(2):
                        byte = int(raw[0, 16 * i + g + 8 * r, 2 * j + h])
                        want = 0 if byte == 0 else byte + MXFP4_TILE_SCALE_POW2
                        assert tiles[i, j, g * 4 + 2 * h + r] == want
                        if byte:  # the multiplier the kernel builds from it: 2^(p + 118)
                            bits = torch.tensor([want << 7], dtype=torch.int32).to(torch.int16)
                            assert bits.view(torch.bfloat16).item() == 2.0 ** (byte - 127 + 118)


@pytest.mark.parametrize("n, k", [(8, 64), (16, 96)])
def test_weight_shapes_rejected(n: int, k: int) -> None:
    with pytest.raises(ValueError):
        pack_weight_tiles(torch.zeros(1, n, k // 2, dtype=torch.uint8), torch.zeros(1, n, k // 16, dtype=torch.uint8))


def test_token_fragment_order_gives_each_lane_its_registers() -> None:
    """Lane (g, q) reads 32 bytes at 32q of a token's k64 block: words 2s and 2s + 1 are its b0 and b1 of
    k16 step s, i.e. columns 16s + 2q + (0, 1) and 16s + 8 + 2q + (0, 1)."""
    order = token_fragment_order(128)
    for block in range(2):
        for q in range(4):
            for s in range(4):
                base = 64 * block + 16 * q + 4 * s
                assert order[base : base + 4].tolist() == [64 * block + 16 * s + 2 * q + d for d in (0, 1, 8, 9)]
    x = torch.randn(3, 192)
    assert torch.equal(from_token_fragments(to_token_fragments(x)), x)
    with pytest.raises(ValueError):
        token_fragment_order(100)


def test_tiled_rows_place_each_chunk_as_documented() -> None:
    """BF16_TILED against its definition, element by element: value (r, c) at ((c // 64) R + r) 64 +
    8 ((c % 64 // 8) ^ (r % 8)) + c % 8 of the flat storage; and back."""
    rows, k = 24, 192
    x = torch.randn(rows, k).to(torch.bfloat16)
    flat = to_token_layout(x, TokenLayout.BF16_TILED).reshape(-1)
    for r in range(rows):
        for c in range(k):
            at = ((c // 64) * rows + r) * 64 + 8 * ((c % 64 // 8) ^ (r % 8)) + c % 8
            assert flat[at] == x[r, c]
    assert torch.equal(from_token_layout(flat.reshape(rows, k), TokenLayout.BF16_TILED), x)
    for bad in (torch.zeros(20, 192), torch.zeros(24, 96), torch.zeros(2, 8, 64)):
        with pytest.raises(ValueError, match="BF16_TILED"):
            to_token_layout(bad, TokenLayout.BF16_TILED)


@pytest.mark.parametrize("layout", [TokenLayout.BF16_FRAGMENTS, TokenLayout.BF16_ROWS], ids=lambda l: l.name)
def test_token_layouts_round_trip(layout: TokenLayout) -> None:
    """Natural rows -> a BF16 token layout -> back: fragments permute inside each 64-column block, rows stay."""
    x = torch.randn(5, 192).to(torch.bfloat16)
    y = to_token_layout(x, layout)
    assert torch.equal(from_token_layout(y, layout), x)
    assert torch.equal(y, to_token_fragments(x) if layout is TokenLayout.BF16_FRAGMENTS else x)
    with pytest.raises(ValueError, match="BF16 token layout"):
        to_token_layout(x, TokenLayout.NVFP4_LINEAR)
