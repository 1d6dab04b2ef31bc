"""Permute: gather each routed slot's token into its expert-sorted row, in the GEMM engine's token
layout (kernels_cuda/permute.cu: moe_permute for the NVFP4 layouts, moe_permute_bf16 for the BF16 layouts of
NVFP4 tokens, moe_permute_bf16_tokens for the BF16 layouts of BF16 tokens)."""

from __future__ import annotations

import numpy as np
import torch

from ..formats.scale_layout import swizzled_shape
from .codes import ROW_THREADS, TokenLayout
from .loader import launch, ptr

SOURCE = "permute.cu"
UNIT_THREADS = 256  # most threads of a block of the unit-per-thread kernels (moe_permute_bf16, moe_activation)


def unit_grid(items: int, units: int, max_threads: int = UNIT_THREADS) -> tuple[int, int]:
    """(blocks, threads) of a kernel with one thread per unit and ``units`` units per item (token or row): as
    many whole items per block as ``max_threads`` threads hold (at least one; the kernel derives the same
    count as max(1, blockDim.x / units)), the block rounded up to whole warps."""
    per_block = max(1, max_threads // units)
    threads = min(max_threads, -(-per_block * units // 32) * 32)
    return -(-items // per_block), threads


def require_bf16_rows(xp: torch.Tensor, hidden: int, layout: TokenLayout) -> None:
    """Check that ``layout`` is a BF16 layout the permute writes (fragments or natural rows: BF16_TILED is the second
    GEMM's token operand, which the activation writes) and xp a bfloat16 [R, hidden] matrix with hidden % 64 == 0."""
    if layout not in (TokenLayout.BF16_FRAGMENTS, TokenLayout.BF16_ROWS):
        raise ValueError(f"permute: BF16 token rows need a BF16 layout (BF16_FRAGMENTS or BF16_ROWS), got {layout!r}")
    if xp.dtype != torch.bfloat16 or xp.dim() != 2 or xp.shape[1] != hidden or hidden % 64:
        raise ValueError(f"permute: BF16 token rows need xp bfloat16 [R, {hidden}] with H % 64 == 0, got "
                         f"{xp.dtype} {tuple(xp.shape)}")


def require_token_rows(x_rows: torch.Tensor, hidden: int, bucket: int) -> None:
    """Check the stage's decode target: natural BF16 rows [>= bucket, hidden] (require_bf16_rows)."""
    require_bf16_rows(x_rows, hidden, TokenLayout.BF16_ROWS)
    if x_rows.shape[0] < bucket:
        raise ValueError(f"stage into token rows: {x_rows.shape[0]} rows for a bucket of {bucket}")


def require_scale_room(scales: torch.Tensor, rows: int, cols: int, layout: TokenLayout) -> None:
    """Check that ``scales`` holds a rows x cols E4M3 matrix, linear or padded to 128 x 4 tiles."""
    swizzled = layout is TokenLayout.NVFP4_SWIZZLED_128X4
    padded_rows, padded_cols = swizzled_shape(rows, cols) if swizzled else (rows, cols)
    if scales.numel() * scales.element_size() < padded_rows * padded_cols:
        raise ValueError(f"a {rows}x{cols} scale buffer ({'128x4' if swizzled else 'linear'}) is too small")


def permute_tokens(
    xs: torch.Tensor,
    xss: torch.Tensor,
    slot_to_row: torch.Tensor,
    num_slots: int,
    top_k: int,
    layout: TokenLayout,
    xp: torch.Tensor,
    xps: torch.Tensor | None,
) -> None:
    """Copy token t = slot // top_k of every routed slot to its row r = slot_to_row[slot] >= 0.

    xs uint8 [B, H/2] packed E2M1, xss (1-byte E4M3, linear) [B, H/16]. By ``layout``:
    NVFP4_LINEAR / NVFP4_SWIZZLED_128X4: xp uint8 [R, H/2], xps the scales of an R x H/16 matrix,
    linear or in 128x4 tiles (flat, >= roundup(R, 128) * roundup(H/16, 4) bytes).
    BF16_FRAGMENTS / BF16_ROWS: xp bfloat16 [R, H], the decoded values (exact) in token-fragment or natural
    column order; xps unused (moe_permute_bf16: each token decoded once for all its slots). Rows no slot maps
    to are not written.
    """
    hidden = 2 * xs.shape[1]
    scale_cols = xss.shape[1]
    if top_k < 1 or num_slots > slot_to_row.numel() or hidden != 16 * scale_cols:
        raise ValueError(f"permute: top_k={top_k}, {num_slots} slots, slot_to_row of {slot_to_row.numel()}, "
                         f"tokens {tuple(xs.shape)} with scales {tuple(xss.shape)}")
    if layout.is_bf16:
        require_bf16_rows(xp, hidden, layout)
        blocks, threads = unit_grid(-(-num_slots // top_k), hidden // 32)
        launch(
            SOURCE, "moe_permute_bf16", xs.device, blocks, threads,
            (ptr(xs, 16), ptr(xss), ptr(slot_to_row), np.int32(num_slots), np.int32(top_k), np.int32(hidden),
             np.int32(layout), ptr(xp, 16)),
        )
        return
    rows = xp.shape[0]
    if xps is None or xp.dtype != torch.uint8 or tuple(xp.shape[1:]) != (hidden // 2,):
        raise ValueError(f"permute: NVFP4 tokens need xp uint8 [R, {hidden // 2}] and a scale buffer")
    require_scale_room(xps, rows, scale_cols, layout)
    launch(
        SOURCE, "moe_permute", xs.device, num_slots, ROW_THREADS,
        (
            ptr(xs), ptr(xss), ptr(slot_to_row), np.int32(top_k), np.int32(hidden // 2), np.int32(scale_cols),
            np.int32(layout is TokenLayout.NVFP4_SWIZZLED_128X4), ptr(xp), ptr(xps),
        ),
    )


def permute_bf16_tokens(x: torch.Tensor, slot_to_row: torch.Tensor, num_slots: int, top_k: int, xp: torch.Tensor,
                        layout: TokenLayout = TokenLayout.BF16_FRAGMENTS) -> None:
    """Copy BF16 token t = slot // top_k of every routed slot to row r = slot_to_row[slot] >= 0 of xp in the
    column order of the BF16 ``layout`` (token fragments, or natural rows), values unchanged.

    x bfloat16 [B, H] (H % 64 == 0), xp bfloat16 [R, H], both 16-byte aligned; rows no slot maps to are not
    written (moe_permute_bf16_tokens: each token read once for all its slots).
    """
    hidden = x.shape[1]
    if x.dtype != torch.bfloat16 or x.dim() != 2:
        raise ValueError(f"permute: BF16 tokens [B, H], got {tuple(x.shape)} {x.dtype}")
    require_bf16_rows(xp, hidden, layout)
    if top_k < 1 or num_slots > slot_to_row.numel():
        raise ValueError(f"permute: top_k={top_k}, {num_slots} slots, slot_to_row of {slot_to_row.numel()}")
    blocks, threads = unit_grid(-(-num_slots // top_k), hidden // 32)
    launch(
        SOURCE, "moe_permute_bf16_tokens", x.device, blocks, threads,
        (ptr(x, 16), ptr(slot_to_row), np.int32(num_slots), np.int32(top_k), np.int32(hidden), np.int32(layout),
         ptr(xp, 16)),
    )
