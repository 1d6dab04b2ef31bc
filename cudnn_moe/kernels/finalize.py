"""Finalize: the weighted sum of each token's expert rows, or the per-slot rows themselves
(kernels_cuda/finalize.cu)."""

from __future__ import annotations

import numpy as np
import torch

from .codes import ROW_THREADS
from .loader import launch, ptr

SOURCE = "finalize.cu"


def _hidden_of(g2: torch.Tensor, out: torch.Tensor) -> int:
    hidden = g2.shape[1]
    if g2.dtype != torch.bfloat16 or out.dtype != torch.bfloat16 or out.shape[1] != hidden or hidden % 8:
        raise ValueError(f"need bfloat16 g2 {tuple(g2.shape)} and out {tuple(out.shape)} of one width H, H % 8 == 0")
    return hidden


def finalize(
    g2: torch.Tensor,
    slot_to_row: torch.Tensor,
    weights: torch.Tensor,
    top_k: int,
    out: torch.Tensor,
    accumulate: bool = False,
) -> None:
    """out bfloat16 [T, H] (T <= B): out[t] = bf16(sum over slots s in order with r = slot_to_row[t*k+s] >= 0
    of weights[t*k+s] * g2[r]), each product and sum a separate FP32 operation. accumulate=True starts
    each sum from float(out[t]) (out is read, then written once).

    g2 bfloat16 [R, H] (expert globals applied); slot_to_row int32 [B*k]; weights float32 [B*k].
    """
    hidden = _hidden_of(g2, out)
    tokens = out.shape[0]
    if tokens * top_k > min(slot_to_row.numel(), weights.numel()) or weights.dtype != torch.float32:
        raise ValueError(f"finalize: {tokens} tokens x top-{top_k} exceed the float32 routing of the bucket")
    # a block per token and ROW_THREADS x 8 columns: few tokens still spread over several SMs, one pass each
    launch(
        SOURCE, "moe_finalize", out.device, (tokens, -(-hidden // (8 * ROW_THREADS))), ROW_THREADS,
        (ptr(g2, 16), ptr(slot_to_row), ptr(weights), np.int32(top_k), np.int32(hidden), np.int32(accumulate),
         ptr(out, 16)),
    )


def unfinalized_rows(g2: torch.Tensor, row_to_slot: torch.Tensor, out_rows: torch.Tensor) -> None:
    """out_rows bfloat16 [R_out, H] (R_out <= R): g2[r] for rows with row_to_slot[r] >= 0, zero for the others."""
    hidden = _hidden_of(g2, out_rows)
    rows = out_rows.shape[0]
    if rows > min(g2.shape[0], row_to_slot.numel()):
        raise ValueError(f"unfinalized rows: {rows} output rows exceed the {g2.shape[0]} GEMM rows")
    launch(
        SOURCE, "moe_unfinalized_rows", out_rows.device, rows, ROW_THREADS,
        (ptr(g2, 16), ptr(row_to_slot), np.int32(hidden), ptr(out_rows, 16)),
    )
