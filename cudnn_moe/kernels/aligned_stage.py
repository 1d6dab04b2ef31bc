"""Stage of the aligned-plan op: the caller's NVFP4 tokens, route weights, output scales and routing
plan into the bucket buffers the shared pipeline reads (kernels_cuda/aligned_stage.cu)."""

from __future__ import annotations

import numpy as np
import torch

from .codes import ROW_THREADS
from .loader import launch, ptr
from .permute import require_token_rows

SOURCE = "aligned_stage.cu"
PLAN_THREADS = 256


def stage_aligned(
    x: torch.Tensor,
    x_scales: torch.Tensor,
    topk_weights: torch.Tensor,
    routed_scaling_factor: float,
    scales: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    xs: torch.Tensor,
    xss: torch.Tensor,
    ids_out: torch.Tensor,
    w_out: torch.Tensor,
    alpha1: torch.Tensor,
    alpha2: torch.Tensor,
    x_rows: torch.Tensor | None = None,
) -> None:
    """Copy M tokens into a bucket of B >= M rows and reset its routing.

    x uint8 [M, K/2] (inner stride 1; row stride and pointer 16-byte aligned), x_scales E4M3 [M, K/16]
    contiguous -> xs [B, K/2], xss [B, K/16] (rows >= M untouched). topk_weights float32 [M, k] ->
    w_out float32 [B, k] = fp32(weight * routed_scaling_factor) (0 for rows >= M); ids_out int32 [B, k]
    = -1 (plan_routes names the planned slots). scales = (up, gate, down) float32 [E] -> alpha1 [2E]
    = [up | gate], alpha2 [E] = down. x_rows: bfloat16 [>= B, K] (16-byte aligned, K % 64 == 0) or None; when
    given, the tokens are decoded exactly into its rows t < M (natural BF16 rows: what a gathering GEMM1 reads)
    instead of copied into xs / xss.
    """
    tokens, row_bytes = x.shape
    bucket, top_k = ids_out.shape
    up, gate, down = scales
    experts = up.numel()
    if tokens > bucket or tuple(topk_weights.shape) != (tokens, top_k) or alpha1.numel() != 2 * experts:
        raise ValueError(f"cannot stage {tokens} tokens x top-{top_k} ({experts} experts) into a bucket of {bucket}")
    if x_rows is not None:
        require_token_rows(x_rows, 2 * row_bytes, bucket)
    launch(
        SOURCE, "moe_stage_aligned", xs.device, bucket, ROW_THREADS,
        (
            ptr(x, 16, row_strided=True), np.int64(x.stride(0)), ptr(x_scales), ptr(topk_weights), np.float32(routed_scaling_factor),
            ptr(up), ptr(gate), ptr(down), np.int32(experts), ptr(xs), ptr(xss), ptr(x_rows, 16), ptr(ids_out), ptr(w_out),
            ptr(alpha1), ptr(alpha2), np.int32(tokens), np.int32(top_k), np.int32(row_bytes),
            np.int32(x_scales.shape[1]),
        ),
    )


def plan_routes(
    sorted_token_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_tokens_post_padded: torch.Tensor,
    block_m: int,
    num_slots: int,
    num_experts: int,
    ids_out: torch.Tensor,
) -> None:
    """ids_out[i] = expert_ids[r // block_m] for every plan entry r of an active block (r // block_m *
    block_m < num_tokens_post_padded[0], read on the device) holding a slot id 0 <= i < num_slots;
    padding entries and expert ids outside [0, num_experts) are skipped. ids_out int32 [>= num_slots],
    reset to -1 beforehand (stage_aligned)."""
    capacity = sorted_token_ids.numel()
    if ids_out.numel() < num_slots or expert_ids.numel() * block_m < capacity:
        raise ValueError(f"plan routes: {num_slots} slots, ids_out of {ids_out.numel()}, "
                         f"{expert_ids.numel()} blocks of {block_m} for {capacity} entries")
    if capacity == 0:
        return
    launch(
        SOURCE, "moe_plan_routes", ids_out.device, -(-capacity // PLAN_THREADS), PLAN_THREADS,
        (
            ptr(sorted_token_ids), ptr(expert_ids), ptr(num_tokens_post_padded), np.int32(capacity),
            np.int32(block_m), np.int32(num_slots), np.int32(num_experts), ptr(ids_out),
        ),
    )
