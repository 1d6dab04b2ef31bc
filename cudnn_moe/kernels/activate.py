"""Activation: the first GEMM's rows -> activation -> NVFP4 requantize (global scale one), written in the
second GEMM's token layout (kernels_cuda/activation.cu)."""

from __future__ import annotations

import numpy as np
import torch

from ..activations import Activation
from .codes import IntermediateCode, TokenLayout
from .loader import launch, ptr
from .permute import require_scale_room, unit_grid


def check_activation_output(out: torch.Tensor, out_scales: torch.Tensor | None, layout: TokenLayout, rows: int,
                            inter: int, intermediate: IntermediateCode) -> None:
    """Check the activation stage's output (ValueError): ``out`` holds ``rows`` rows of ``inter`` values in
    ``layout`` (bfloat16 [rows, inter], or NVFP4 codes uint8 [rows, inter / 2] with room for their scales in
    ``out_scales``); IntermediateCode.BF16 and MXFP8 only with a BF16 layout."""
    if not isinstance(layout, TokenLayout):
        raise ValueError(f"activation: layout must be a TokenLayout, got {layout!r}")
    if not isinstance(intermediate, IntermediateCode):
        raise ValueError(f"activation: intermediate must be an IntermediateCode, got {intermediate!r}")
    if intermediate is not IntermediateCode.NVFP4 and not layout.is_bf16:
        raise ValueError(f"activation: a {intermediate.name} intermediate writes a BF16 layout only")
    columns = inter if layout.is_bf16 else inter // 2
    if out.dim() != 2 or tuple(out.shape) != (rows, columns):
        raise ValueError(f"activation: out must be [{rows}, {columns}] for {rows} rows of {inter} values in "
                         f"{layout.name}, got {tuple(out.shape)}")
    if rows % layout.row_multiple or (layout is TokenLayout.BF16_TILED and inter % 64):
        raise ValueError(f"activation: {layout.name} needs rows % {layout.row_multiple} == 0 and values per row "
                         f"% 64 == 0, got [{rows}, {inter}]")
    if layout.is_bf16:
        if out.dtype != torch.bfloat16:
            raise ValueError("activation: a BF16 layout needs a bfloat16 output")
    else:
        if out.dtype != torch.uint8 or out_scales is None:
            raise ValueError("activation: NVFP4 output needs uint8 codes and a scale buffer")
        require_scale_room(out_scales, rows, inter // 16, layout)


def activate_quantize(
    g1: torch.Tensor,
    row_to_slot: torch.Tensor,
    offsets: torch.Tensor,
    activation: Activation,
    layout: TokenLayout,
    out: torch.Tensor,
    out_scales: torch.Tensor | None,
    intermediate: IntermediateCode = IntermediateCode.NVFP4,
) -> None:
    """Activate GEMM1's output and requantize it to NVFP4 with global scale one (``intermediate``
    IntermediateCode.NVFP4), or round it to BF16 instead (IntermediateCode.BF16, BF16 layouts only) for a second
    GEMM on BF16 tokens, or quantize it to MXFP8 per 32 values and hold its elements as BF16 values
    (IntermediateCode.MXFP8, BF16 layouts only; its docstring states where they are exact).

    g1 bfloat16 [R, N1], the expert global already applied (N1 = 2I as [up | gate] when gated, else
    I; I % 64 == 0). Per 16-value block of y = activation(float(g1)) (FP32): s = e4m3(amax / 6),
    codes e2m1(y / s) (zero when s == 0). By ``layout``: NVFP4 codes out uint8 [R, I/2] (element
    2i in the low nibble) with E4M3 scales in out_scales (R x I/16, linear or 128x4); or
    BF16_FRAGMENTS / BF16_ROWS / BF16_TILED: out bfloat16 [R, I] storage, the decoded values code * s (exact) in
    token-fragment or natural column order, or in the tiled planes (R % 8 == 0). Rows >= offsets[E] are not
    written; padding rows (row_to_slot < 0) are written as zeros. g1 16-byte aligned; out 16-byte aligned for the
    BF16 layouts, 8 for the NVFP4 codes.
    """
    rows = out.shape[0]
    inter = out.shape[1] if layout.is_bf16 else 2 * out.shape[1]
    if inter % 64 or tuple(g1.shape) != (rows, activation.gemm1_columns(inter)) or row_to_slot.numel() < rows:
        raise ValueError(f"activation: g1 {tuple(g1.shape)} does not match an output of {rows} rows x {inter}")
    if g1.dtype != torch.bfloat16 or offsets.dtype != torch.int32:
        raise ValueError("activation: g1 must be bfloat16 and offsets int32 [E + 1]")
    check_activation_output(out, out_scales, layout, rows, inter, intermediate)
    a, b, limit = activation.params()
    blocks, threads = unit_grid(rows, inter // 32)  # a thread per 32 values
    out_align = 16 if layout.is_bf16 else 8
    launch(
        "activation.cu", "moe_activation", g1.device, blocks, threads,
        (
            ptr(g1, 16), ptr(row_to_slot), ptr(offsets), np.int32(offsets.numel() - 1), np.int32(activation.kind),
            np.int32(activation.gated), np.float32(a), np.float32(b), np.float32(limit), np.int32(inter),
            np.int32(layout), np.int32(intermediate), np.int32(rows), ptr(out, out_align), ptr(out_scales),
        ),
    )
