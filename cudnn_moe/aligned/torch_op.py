"""``aligned_moe`` as the torch custom op ``torch.ops.cudnn_moe.aligned_moe_`` (``out`` declared as
mutated, returns nothing), so ``torch.compile`` keeps it as one opaque node and a caller's CUDA-graph
capture of a whole model can hold it.

Prepared weights enter by handle: ``aligned_weights_handle(prepared)`` registers them (while they
live) and returns the int the op takes; 0 means none (the op prepares from the raw tensors).
"""

from __future__ import annotations

import torch

from ..handles import HandleRegistry
from .op import aligned_moe
from .weights import AlignedWeights

_registered = HandleRegistry("prepare_aligned_weights() result")


def aligned_weights_handle(prepared: AlignedWeights) -> int:
    """The handle of ``prepared`` for ``torch.ops.cudnn_moe.aligned_moe_`` (the same int on every call;
    it stops resolving once ``prepared`` is freed)."""
    if not isinstance(prepared, AlignedWeights):
        raise TypeError(f"prepared must come from prepare_aligned_weights(), got {type(prepared).__name__}")
    return _registered.register(prepared)


@torch.library.custom_op("cudnn_moe::aligned_moe_", mutates_args=("out",), device_types="cuda")
def aligned_moe_op(
    hidden_states: torch.Tensor,
    hidden_states_scale: torch.Tensor,
    gemm1_weights: torch.Tensor,
    gemm1_weights_scale: torch.Tensor,
    gemm2_weights: torch.Tensor,
    gemm2_weights_scale: torch.Tensor,
    output1_scale_gate_scalar: torch.Tensor,
    output1_scale_scalar: torch.Tensor,
    output2_scale_scalar: torch.Tensor,
    sorted_token_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_tokens_post_padded: torch.Tensor,
    topk_weights: torch.Tensor,
    out: torch.Tensor,
    top_k: int,
    block_m: int,
    routed_scaling_factor: float,
    prepared: int,
) -> None:
    """cudnn_moe.aligned_moe with the same arguments; ``prepared`` is a handle from
    aligned_weights_handle(), or 0."""
    weights = _registered.resolve(prepared) if prepared else None
    aligned_moe(
        hidden_states, hidden_states_scale, gemm1_weights, gemm1_weights_scale, gemm2_weights, gemm2_weights_scale,
        output1_scale_gate_scalar, output1_scale_scalar, output2_scale_scalar, sorted_token_ids, expert_ids,
        num_tokens_post_padded, topk_weights, out, top_k, block_m, routed_scaling_factor, prepared=weights,
    )


@aligned_moe_op.register_fake
def _aligned_moe_fake(*args, **kwargs) -> None:  # noqa: ANN002, ANN003
    return None
