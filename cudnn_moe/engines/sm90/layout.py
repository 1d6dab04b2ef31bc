"""Layouts of the SM90 engine: NVFP4 weights repacked into mma.sync fragment tiles, and BF16
token fragments.

The SM90 kernels multiply with ``mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32`` and swap
the operands: the weights are the 16-row A operand (16 output features x 16 k) and the tokens
the 8-wide B operand (16 k x 8 tokens), so a single token still fills the tensor core's long
side. For lane L of a warp, g = L // 4 and q = L % 4:

    A registers  a0 = W[g, 2q:2q+2]   a1 = W[g+8, 2q:2q+2]   a2 = W[g, 2q+8:2q+10]   a3 = W[g+8, 2q+8:2q+10]
    B registers  b0 = X[g, 2q:2q+2]   b1 = X[g, 2q+8:2q+10]             (X[token, k], token g)
    C registers  c0 = (feature g, token 2q)    c1 = (g, 2q+1)    c2 = (g+8, 2q)    c3 = (g+8, 2q+1)

Each register holds two BF16 values, the lower k in the low half.

Weight tiles (``pack_weight_tiles``). An expert's NVFP4 matrix W [N, K] (codes + linear E4M3
scales per 16 k) is cut into m16 x k64 tiles, tile (i, j) = rows 16i.., columns 64j.., stored
at tile index i * (K/64) + j, so one warp streams a row block along K through consecutive
512-byte tiles. Inside a tile, lane L owns bytes [16L, 16L + 16): four little-endian words, word
s holding the eight E2M1 codes of its A registers for the k16 step s (k = 64j + 16s + ...).
Register r (a0..a3) takes two codes from the word (the low half of the register the lower k), at
these bits of the word (``CODE_BITS``: sign, then magnitude bits 0, 1, 2 of the code; low half's code / high
half's code), and kernels_cuda/common.cuh ``place_tile_e2m1`` decodes them:

    a0: 15, 6, 7, 8   / 31, 22, 23, 24     w & 0x81C081C0
    a1:  5, 28, 29, 30 / 21, 12, 13, 14     rotl(w, 10) & 0x81C081C0
    a2:  2, 25, 26, 27 / 18, 9, 10, 11      rotl(w, 13) & 0x81C081C0
    a3:  3, 4, 0, 1   / 19, 20, 16, 17     ((w & 0x001B001B) * 0x1084) & 0x81C081C0

Each decode puts both codes' signs at bit 15 and magnitudes at bits 6, 7, 8 of their halves: two BF16
values equal to the E2M1 values times 2^-126 exactly (the magnitude lands on the top mantissa bit and
the two low exponent bits). a3's multiply adds three copies of its eight kept bits shifted by 2, 7 and 12,
which never overlap, so no carry reaches a kept bit.

Scale tiles: 64 bytes per weight tile, at the same tile index; byte g * 8 + s * 2 + h is the scale code
of row 16i + g + 8h and k block 4j + s. The four lanes of a group g read the same 8 bytes. A code c
stands for the E4M3 scale s whose BF16 multiplier s x 2^118 has the bits 16 c + ``NVFP4_TILE_SCALE_BASE``
(cudnn_moe.kernels.codes): codes 0 .. 142 for the positive scales, 160 for +0 and 161 for -0 (BF16 -0
and a negative subnormal, whose products with any placed code are zero). The kernels then decode a pair
of codes with a PRMT and a LEA, where the E4M3 bytes took two shifts and masks and four bf16x2
multiplies a word; the products with the placed codes (E2M1 x 2^-126) are E2M1 x s x 2^-8, exact.
Scales that preparation refuses (NaN, negative: cudnn_moe.formats.nvfp4.require_unsigned_scales) get
code 153, a BF16 NaN, so that no finite wrong value can come of them. Both arrays keep the canonical
sizes (N*K/2 and N*K/16 bytes per expert), and ``unpack_weight_tiles`` gives the canonical tensors back.

MXINT4 tiles (``pack_int4_weight_tiles``, the low-latency op's MXINT4 weight-only layers): the same tile and
word order with two's-complement INT4 codes, register r's code at bits 4r .. 4r + 3 of each half
(``INT4_CODE_BITS``), which kernels_cuda/sm90/fragments.cuh decodes to BF16 exactly (one LOP3 and one FMA per
register). Their BF16 block scales (one per 32 k) fill the same 64 bytes per tile: bytes g * 8 + 4h + 2r, + 1 hold
the scale of row 16i + g + 8r and k block 2j + h.

MXFP4 tiles (``pack_mxfp4_weight_tiles``, the low-latency op's MXFP4 weight-only layers in their exact shifted form,
cudnn_moe.formats.mxfp4_as_nvfp4): the NVFP4 tiles' codes (``CODE_BITS``) with one scale byte per 32 k, 32 bytes per
tile: byte g * 4 + 2h + r holds the scale of row 16i + g + 8r and k block 2j + h, so lane (g, q) reads one word
whose low bytes are row g's and row g + 8's scales of the tile's first k32 block. The byte of a block whose recoded
E8M0 scale is 2^p (p = j - a in [-9, 8]) is p + 127 + ``MXFP4_TILE_SCALE_POW2`` (cudnn_moe.kernels.codes): the BF16
exponent field of 2^(p + 118), which the kernels shift into place as the BF16 multiplier of the placed codes
(E2M1 x 2^-126), giving the NVFP4 tiles' products E2M1 x 2^(p - 8); an all-zero block keeps byte 0 (multiplier 0).

Token fragments (``to_token_fragments``). Tokens enter the kernels as BF16 rows [R, K] whose
columns are permuted inside each block of 64: position 16q + 4s + 2b + e holds k = 16s + 8b +
2q + e. Lane (g, q) then finds its B registers of four k16 steps in 32 contiguous bytes
(b0 and b1 of step s at words 2s and 2s + 1 of the 8 words at byte 32q).
"""

from __future__ import annotations

import torch

from ...formats import MX_BLOCK, NVFP4_BLOCK, pack_nibbles, unpack_nibbles
from ...formats.mx import E8M0_BIAS
from ...formats.mxfp4_as_nvfp4 import E4M3_POW2_MAX, E4M3_POW2_MIN
from ...kernels.codes import MXFP4_TILE_SCALE_POW2, NVFP4_TILE_SCALE_BASE, TokenLayout

TILE_ROWS = 16  # weight rows (output features) per tile: the mma's M
TILE_K = 64  # reduction values per tile: four k16 steps

# Word bit positions (sign, magnitude bit 0, 1, 2) of register r's low-half code and high-half code.
CODE_BITS = (
    ((15, 6, 7, 8), (31, 22, 23, 24)),
    ((5, 28, 29, 30), (21, 12, 13, 14)),
    ((2, 25, 26, 27), (18, 9, 10, 11)),
    ((3, 4, 0, 1), (19, 20, 16, 17)),
)
# The same for MXINT4 codes (code bits 3, 0, 1, 2: the nibble as it is, at bits 4r .. 4r + 3 of each half).
INT4_CODE_BITS = tuple(tuple((16 * x + 4 * r + 3, 16 * x + 4 * r, 16 * x + 4 * r + 1, 16 * x + 4 * r + 2)
                             for x in range(2)) for r in range(4))


# Scale codes of zero E4M3 scales and of the scales preparation refuses (module docstring: scale tiles).
_ZERO_SCALE_CODE, _NEGATIVE_ZERO_SCALE_CODE, _NAN_SCALE_CODE = 160, 161, 153


def _tile_scale_codes() -> tuple[torch.Tensor, torch.Tensor]:
    """(code of each E4M3 byte, E4M3 byte of each code): uint8 [256] lookup tables of the NVFP4 tiles' scale codes
    (module docstring); the second maps the codes no byte takes to 0x7F (NaN)."""
    e4m3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    bits = (e4m3 * 2.0**MXFP4_TILE_SCALE_POW2).to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF
    positive = torch.isfinite(e4m3) & (e4m3 > 0)
    steps = bits - NVFP4_TILE_SCALE_BASE
    assert bool((steps[positive] % 16 == 0).all() & (steps[positive] >= 0).all())  # three mantissa bits in bits 4..6
    codes = torch.where(positive, steps // 16, _NAN_SCALE_CODE)
    codes[0x00], codes[0x80] = _ZERO_SCALE_CODE, _NEGATIVE_ZERO_SCALE_CODE
    bytes_of = torch.full((256,), 0x7F, dtype=torch.int64)
    taken = positive.clone()
    taken[0x00] = taken[0x80] = True
    bytes_of[codes[taken]] = torch.arange(256)[taken]
    return codes.to(torch.uint8), bytes_of.to(torch.uint8)


_SCALE_CODE_OF_BYTE, _SCALE_BYTE_OF_CODE = _tile_scale_codes()


def _look_up(table: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """table[x] for uint8 x [E, ...], one expert at a time: the int32 indices of one expert's bytes, never of the whole
    layer's (a DeepSeek-V3 layer's scales would take 1.9 GB of them)."""
    table = table.to(x.device)
    out = torch.empty_like(x)
    for expert in range(x.shape[0]):
        out[expert] = table[x[expert].int()]
    return out


def _check_weight_shapes(n: int, k: int) -> None:
    if n <= 0 or n % TILE_ROWS:
        raise ValueError(f"weight rows N must be a positive multiple of {TILE_ROWS}, got {n}")
    if k <= 0 or k % TILE_K:
        raise ValueError(f"reduction size K must be a positive multiple of {TILE_K}, got {k}")


def pack_weight_tiles(packed: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Canonical NVFP4 weights -> SM90 fragment tiles (layout in the module docstring).

    packed: uint8 [E, N, K/2] (element 2i in the low nibble); scales: float8_e4m3fn or uint8
    [E, N, K/16], linear, unsigned (a NaN or negative scale is stored as the NaN code). Returns (tiles uint8
    [E, N*K/2], tile_scales uint8 [E, N*K/16]: the scale codes).
    """
    experts, n, half_k = packed.shape
    k = 2 * half_k
    _check_weight_shapes(n, k)
    if tuple(scales.shape) != (experts, n, k // NVFP4_BLOCK):
        raise ValueError(f"scales must be [E, N, K/16] = {[experts, n, k // NVFP4_BLOCK]}, got {list(scales.shape)}")
    # scale[e, i, h, g, j, s] of row 16i + 8h + g, block 4j + s -> [e, i, j, g, s, h]
    raw = scales.view(torch.uint8) if scales.dtype != torch.uint8 else scales
    codes = _look_up(_SCALE_CODE_OF_BYTE, raw)
    tile_scales = codes.reshape(experts, n // 16, 2, 8, k // 64, 4).permute(0, 1, 4, 3, 5, 2)
    return _pack_codes(packed, CODE_BITS), tile_scales.reshape(experts, n * k // NVFP4_BLOCK).contiguous()


def pack_int4_weight_tiles(packed: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Canonical MXINT4 weights -> SM90 MXINT4 fragment tiles (module docstring).

    packed: uint8 [E, N, K/2] two's-complement INT4 codes (element 2i in the low nibble); scales: bfloat16
    [E, N, K/32], linear. Returns (tiles uint8 [E, N*K/2], tile_scales uint8 [E, N*K/16]: the BF16 scales' bytes).
    """
    n, k = _check_k32_scales(packed, scales, torch.bfloat16)
    tile_scales = _k32_scale_tiles(scales.view(torch.int16), n, k).view(torch.uint8)
    return _pack_codes(packed, INT4_CODE_BITS), tile_scales


def unpack_int4_weight_tiles(tiles: torch.Tensor, tile_scales: torch.Tensor, n: int,
                             k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of pack_int4_weight_tiles: -> (packed uint8 [E, N, K/2], scales bfloat16 [E, N, K/32])."""
    _check_tiles(tiles, tile_scales, n, k, NVFP4_BLOCK)
    scales = _k32_scale_rows(tile_scales.contiguous().view(torch.int16), n, k)
    return _unpack_codes(tiles, n, k, INT4_CODE_BITS), scales.view(torch.bfloat16)


def pack_mxfp4_weight_tiles(packed: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 weights in their exact shifted form -> SM90 MXFP4 fragment tiles (module docstring).

    packed: uint8 [E, N, K/2] E2M1 codes (element 2i in the low nibble); scales: float8_e8m0fnu [E, N, K/32], linear,
    the form's recoded scales (cudnn_moe.formats.mxfp4_as_nvfp4.form_scales: bytes 127 - 9 .. 127 + 8, or 0 for an
    all-zero block). Returns (tiles uint8 [E, N*K/2], tile_scales uint8 [E, N*K/32]).
    """
    n, k = _check_k32_scales(packed, scales, torch.float8_e8m0fnu)
    raw = scales.view(torch.uint8).to(torch.int32)
    if bool(((raw != 0) & ((raw < E8M0_BIAS + E4M3_POW2_MIN) | (raw > E8M0_BIAS + E4M3_POW2_MAX))).any()):
        raise ValueError("scales must be the exact shifted form's (2^-9 .. 2^8, or byte 0 for an all-zero block)")
    tile_bytes = torch.where(raw == 0, 0, raw + MXFP4_TILE_SCALE_POW2).to(torch.uint8)
    return _pack_codes(packed, CODE_BITS), _k32_scale_tiles(tile_bytes, n, k)


def unpack_mxfp4_weight_tiles(tiles: torch.Tensor, tile_scales: torch.Tensor, n: int,
                              k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of pack_mxfp4_weight_tiles: -> (packed uint8 [E, N, K/2], scales float8_e8m0fnu [E, N, K/32])."""
    _check_tiles(tiles, tile_scales, n, k, MX_BLOCK)
    raw = _k32_scale_rows(tile_scales.view(torch.uint8).to(torch.int32), n, k)
    scales = torch.where(raw == 0, 0, raw - MXFP4_TILE_SCALE_POW2).to(torch.uint8).view(torch.float8_e8m0fnu)
    return _unpack_codes(tiles, n, k, CODE_BITS), scales


def _check_k32_scales(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> tuple[int, int]:
    """(N, K) of codes uint8 [E, N, K/2] whose scales must be ``dtype`` [E, N, K/32] (ValueError otherwise)."""
    experts, n, half_k = packed.shape
    k = 2 * half_k
    _check_weight_shapes(n, k)
    if scales.dtype != dtype or tuple(scales.shape) != (experts, n, k // MX_BLOCK):
        raise ValueError(f"scales must be {str(dtype).removeprefix('torch.')} [E, N, K/32] = "
                         f"{[experts, n, k // MX_BLOCK]}, got {scales.dtype} {list(scales.shape)}")
    return n, k


def _check_tiles(tiles: torch.Tensor, tile_scales: torch.Tensor, n: int, k: int, per_scale_byte: int) -> None:
    """tiles must be [E, N*K/2] and tile_scales [E, N*K/per_scale_byte] bytes (ValueError otherwise)."""
    _check_weight_shapes(n, k)
    experts = tiles.shape[0]
    if tuple(tiles.shape) != (experts, n * k // 2) or tuple(tile_scales.shape) != (experts, n * k // per_scale_byte):
        raise ValueError(f"tiles [E, N*K/2] and tile_scales [E, N*K/{per_scale_byte}] do not match N={n}, K={k}")


def _k32_scale_tiles(scales: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Per-32 scales [E, N, K/32] (any dtype, one element a scale) -> [E, N*K/32] in tile order: tile (i, j) holds
    element g * 4 + 2h + r = the scale of row 16i + 8r + g, k32 block 2j + h (the MXINT4 and MXFP4 tiles' order)."""
    experts = scales.shape[0]
    # scale[e, i, r, g, j, h] -> [e, i, j, g, h, r]
    tiled = scales.reshape(experts, n // 16, 2, 8, k // 64, 2).permute(0, 1, 4, 3, 5, 2)
    return tiled.reshape(experts, n * k // MX_BLOCK).contiguous()


def _k32_scale_rows(tile_scales: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Inverse of _k32_scale_tiles: [E, N*K/32] -> [E, N, K/32]."""
    experts = tile_scales.shape[0]
    rows = tile_scales.reshape(experts, n // 16, k // 64, 8, 2, 2).permute(0, 1, 5, 3, 2, 4)
    return rows.reshape(experts, n, k // MX_BLOCK).contiguous()


def _pack_codes(packed: torch.Tensor, code_bits: tuple[tuple[int, ...], ...]) -> torch.Tensor:
    """4-bit codes uint8 [E, N, K/2] -> fragment tiles uint8 [E, N*K/2], the code bits (3, 0, 1, 2) of register r's
    half x at word bits ``code_bits[r][x]``."""
    experts, n, half_k = packed.shape
    k = 2 * half_k
    # codes[e, i, h, g, j, s, b, q, x] = code of row 16i + 8h + g, column 64j + 16s + 8b + 2q + x
    codes = unpack_nibbles(packed).view(experts, n // 16, 2, 8, k // 64, 4, 2, 4, 2).to(torch.int32)
    # -> [e, i, j, g, q, s, b, h, x]: lane (g, q), word s, register r = 2b + h, half x
    codes = codes.permute(0, 1, 4, 3, 7, 5, 6, 2, 8)
    word = torch.zeros(codes.shape[:6], dtype=torch.int64, device=packed.device)
    for r, register_bits in enumerate(code_bits):
        b, h = divmod(r, 2)
        for x, (sign_bit, *mag_bits) in enumerate(register_bits):
            c = codes[..., b, h, x].to(torch.int64)
            word |= ((c >> 3) & 1) << sign_bit
            for bit, pos in enumerate(mag_bits):
                word |= ((c >> bit) & 1) << pos
    word_bytes = torch.stack([(word >> (8 * byte)) & 0xFF for byte in range(4)], dim=-1).to(torch.uint8)
    return word_bytes.reshape(experts, n * k // 2)


def unpack_weight_tiles(tiles: torch.Tensor, tile_scales: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of pack_weight_tiles: -> (packed uint8 [E, N, K/2], scales float8_e4m3fn [E, N, K/16])."""
    _check_tiles(tiles, tile_scales, n, k, NVFP4_BLOCK)
    experts = tiles.shape[0]
    codes = tile_scales.reshape(experts, n // 16, k // 64, 8, 4, 2).permute(0, 1, 5, 3, 2, 4)
    scales = _look_up(_SCALE_BYTE_OF_CODE, codes.reshape(experts, n, k // NVFP4_BLOCK)).view(torch.float8_e4m3fn)
    return _unpack_codes(tiles, n, k, CODE_BITS), scales


def _unpack_codes(tiles: torch.Tensor, n: int, k: int, code_bits: tuple[tuple[int, ...], ...]) -> torch.Tensor:
    """Inverse of _pack_codes: fragment tiles uint8 [E, N*K/2] -> codes uint8 [E, N, K/2]."""
    experts = tiles.shape[0]
    word_bytes = tiles.reshape(experts, n // 16, k // 64, 8, 4, 4, 4).to(torch.int64)
    word = sum(word_bytes[..., byte] << (8 * byte) for byte in range(4))  # [e, i, j, g, q, s]
    codes = torch.zeros(*word.shape, 2, 2, 2, dtype=torch.int64, device=tiles.device)  # [.., b, h, x]
    for r, register_bits in enumerate(code_bits):
        b, h = divmod(r, 2)
        for x, (sign_bit, *mag_bits) in enumerate(register_bits):
            c = ((word >> sign_bit) & 1) << 3
            for bit, pos in enumerate(mag_bits):
                c |= ((word >> pos) & 1) << bit
            codes[..., b, h, x] = c
    # [e, i, j, g, q, s, b, h, x] -> [e, i, h, g, j, s, b, q, x]
    codes = codes.permute(0, 1, 7, 3, 2, 5, 6, 4, 8).reshape(experts, n, k).to(torch.uint8)
    return pack_nibbles(codes)


def token_fragment_order(k: int) -> torch.Tensor:
    """int64 [K]: entry p is the column k stored at position p of a token-fragment row."""
    if k <= 0 or k % TILE_K:
        raise ValueError(f"K must be a positive multiple of {TILE_K}, got {k}")
    p = torch.arange(k)
    within = p % 64
    q, s, b, x = within // 16, (within // 4) % 4, (within // 2) % 2, within % 2
    return p - within + 16 * s + 8 * b + 2 * q + x


def to_token_fragments(x: torch.Tensor) -> torch.Tensor:
    """Rows [..., K] in natural column order -> the token-fragment order (same dtype)."""
    return x[..., token_fragment_order(x.shape[-1]).to(x.device)]


def from_token_fragments(x: torch.Tensor) -> torch.Tensor:
    """Inverse of to_token_fragments."""
    order = token_fragment_order(x.shape[-1]).to(x.device)
    return torch.empty_like(x).index_copy_(x.dim() - 1, order, x)


def _tiled_positions(rows: int, device: torch.device) -> torch.Tensor:
    """int64 [R, 8]: the position j ^ (r % 8) of natural 16-byte chunk j within row r of a BF16_TILED plane."""
    r = torch.arange(rows, device=device)[:, None]
    return torch.arange(8, device=device)[None, :] ^ (r % 8)


def _check_tiled(x: torch.Tensor) -> tuple[int, int]:
    if x.dim() != 2 or x.shape[0] % 8 or x.shape[1] % 64:
        raise ValueError(f"the BF16_TILED layout needs 2-D rows [R, K] with R % 8 == 0 and K % 64 == 0, got "
                         f"{tuple(x.shape)}")
    return x.shape[0], x.shape[1]


def to_tiled_rows(x: torch.Tensor) -> torch.Tensor:
    """Rows [R, K] in natural column order (R % 8 == 0, K % 64 == 0) -> their BF16_TILED storage, [R, K] of the same
    dtype: K / 64 planes of R rows x 64 values, plane p holding columns 64 p .. 64 p + 63 of every row, each row's
    16-byte chunk j (8 values) at position j ^ (r % 8) (kernels_cuda/common.cuh tiled_chunk_offset)."""
    rows, k = _check_tiled(x)
    chunks = x.reshape(rows, k // 64, 8, 8).permute(1, 0, 2, 3)  # [plane, row, chunk j, 8 values]
    where = _tiled_positions(rows, x.device)[None, :, :, None].expand_as(chunks)
    return torch.empty_like(chunks).scatter_(2, where, chunks).reshape(rows, k)


def from_tiled_rows(x: torch.Tensor) -> torch.Tensor:
    """Inverse of to_tiled_rows."""
    rows, k = _check_tiled(x)
    planes = x.reshape(k // 64, rows, 8, 8)
    where = _tiled_positions(rows, x.device)[None, :, :, None].expand_as(planes)
    return planes.gather(2, where).permute(1, 0, 2, 3).reshape(rows, k)


def to_token_layout(x: torch.Tensor, layout: TokenLayout) -> torch.Tensor:
    """Rows [..., K] in natural column order -> the BF16 ``layout`` (BF16_FRAGMENTS: the token-fragment column order;
    BF16_ROWS: unchanged; BF16_TILED: to_tiled_rows, 2-D rows only)."""
    if not isinstance(layout, TokenLayout) or not layout.is_bf16:
        raise ValueError(f"layout must be a BF16 token layout, got {layout!r}")
    if layout is TokenLayout.BF16_TILED:
        return to_tiled_rows(x)
    return to_token_fragments(x) if layout is TokenLayout.BF16_FRAGMENTS else x


def from_token_layout(x: torch.Tensor, layout: TokenLayout) -> torch.Tensor:
    """Inverse of to_token_layout."""
    if not isinstance(layout, TokenLayout) or not layout.is_bf16:
        raise ValueError(f"layout must be a BF16 token layout, got {layout!r}")
    if layout is TokenLayout.BF16_TILED:
        return from_tiled_rows(x)
    return from_token_fragments(x) if layout is TokenLayout.BF16_FRAGMENTS else x
