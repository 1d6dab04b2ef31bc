"""Stage: copy the caller's tokens and routing into a bucket's static buffers (kernels_cuda/stage.cu)."""

from __future__ import annotations

import numpy as np
import torch

from .codes import ROW_THREADS, RoutingFormat
from .loader import launch, ptr
from .permute import require_token_rows

SOURCE = "stage.cu"


def check_routing(ids: torch.Tensor, weights: torch.Tensor | None, routing_format: int, tokens: int, top_k: int,
                  bucket: int) -> None:
    """Raise ValueError unless ``ids`` / ``weights`` are routing of ``tokens`` x ``top_k`` slots in ``routing_format``
    (stage_inputs' formats) that a bucket of ``bucket`` tokens holds."""
    if routing_format == RoutingFormat.PACKED:
        if ids.dtype != torch.int32:
            raise ValueError(f"packed routing must be int32, got {ids.dtype}")
    else:
        expected = {RoutingFormat.FP32: torch.float32, RoutingFormat.BF16: torch.bfloat16}.get(routing_format)
        if expected is None or weights is None or weights.dtype != expected:
            found = None if weights is None else weights.dtype
            raise ValueError(f"routing format {routing_format} does not match weights of dtype {found}")
        if ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"routing ids must be int32 or int64, got {ids.dtype}")
    if tokens > bucket or tuple(ids.shape) != (tokens, top_k):
        raise ValueError(f"cannot stage routing {tuple(ids.shape)} of {tokens} tokens x top-{top_k} into a bucket of "
                         f"{bucket}")


def routing_args(ids: torch.Tensor, weights: torch.Tensor | None, routing_format: int) -> tuple[np.generic, ...]:
    """The kernel arguments of checked routing (check_routing): ids, weights, format, whether the ids are int64."""
    return ptr(ids), ptr(weights), np.int32(routing_format), np.int32(ids.dtype == torch.int64)


def stage_inputs(
    x_packed: torch.Tensor,
    x_scales: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor | None,
    routing_format: int,
    xs: torch.Tensor,
    xss: torch.Tensor,
    ids_out: torch.Tensor,
    w_out: torch.Tensor,
    x_rows: torch.Tensor | None = None,
) -> None:
    """Copy T tokens into a bucket of B >= T rows.

    x_packed uint8 [T, H/2] -> xs [B, H/2]; x_scales (1-byte E4M3, linear) [T, H/16] -> xss [B, H/16];
    rows >= T of xs/xss are left as they are. x_rows: bfloat16 [>= B, H] (16-byte aligned, H % 64 == 0) or None;
    when given, the NVFP4 tokens are decoded exactly into its rows t < T (natural BF16 rows: what a gathering GEMM1
    reads) instead, and xs / xss are not written. ids: packed int32 [T, k] (RoutingFormat.PACKED, weights None) or
    int32/int64 [T, k] with weights float32 (RoutingFormat.FP32) / bfloat16 (RoutingFormat.BF16) [T, k].
    ids_out int32 [B, k] and w_out float32 [B, k] get the decoded routing, -1 / 0.0 for rows >= T.
    """
    tokens, row_bytes = x_packed.shape
    bucket, top_k = ids_out.shape
    check_routing(ids, weights, routing_format, tokens, top_k, bucket)
    if x_scales.element_size() != 1:
        raise ValueError(f"stage: 1-byte E4M3 token scales, got {x_scales.dtype}")
    if x_rows is not None:
        require_token_rows(x_rows, 2 * row_bytes, bucket)
        if x_packed.dtype != torch.uint8 or tuple(x_scales.shape) != (tokens, row_bytes // 8):
            raise ValueError(f"stage into token rows: NVFP4 codes uint8 [T, H/2] with scales [T, H/16]; got "
                             f"{x_packed.dtype} {tuple(x_packed.shape)}, scales {tuple(x_scales.shape)}")
    launch(
        SOURCE,
        "moe_stage_inputs",
        xs.device,
        bucket,
        ROW_THREADS,
        (
            ptr(x_packed),
            ptr(x_scales),
            *routing_args(ids, weights, routing_format),
            ptr(xs),
            ptr(xss),
            ptr(x_rows, 16),
            ptr(ids_out),
            ptr(w_out),
            np.int32(tokens),
            np.int32(top_k),
            np.int32(row_bytes),
            np.int32(x_scales.shape[1]),
        ),
    )
