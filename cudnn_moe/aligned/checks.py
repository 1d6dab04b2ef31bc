"""Argument checks of the aligned-plan NVFP4 MoE op (contract 002), shared by its reference.

They look at types, shapes, strides, devices and pointers only: no tensor data is read, so
nothing synchronizes with the device. Each failure raises TypeError / ValueError naming the
argument.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..formats import NVFP4_BLOCK
from ..validate import (
    require_contiguous,
    require_float32_scalar,
    require_int_arg,
    require_no_overlap,
    require_shape,
    require_tensor,
)
from .operands import AlignedOperands

K_MULTIPLE = 256  # K = 2 * hidden_states.shape[1] and N must be positive multiples of this
ALIGNMENT = 16  # bytes: hidden_states' and out's data pointers, hidden_states' row stride
_INT32_MAX = (1 << 31) - 1
_U8, _E4M3, _F32, _I32 = torch.uint8, torch.float8_e4m3fn, torch.float32, torch.int32


@dataclass(frozen=True)
class AlignedDims:
    """Sizes the checks derived: M tokens, K hidden (logical), N GEMM1 rows ([gate; up], so the
    intermediate size is N / 2), E experts; and the checked scalars."""

    num_tokens: int
    hidden: int
    n: int
    num_experts: int
    top_k: int
    block_m: int
    routed_scaling_factor: float


def _check_hidden_states(hidden_states: torch.Tensor, hidden: int) -> None:
    """Inner stride 1; a row stride (when M > 1) >= K/2 and a multiple of 16; a 16-byte aligned pointer."""
    rows, row_bytes = hidden_states.shape
    if hidden_states.stride(1) != 1:
        raise ValueError(f"hidden_states must have inner stride 1, got strides {hidden_states.stride()}")
    row_stride = hidden_states.stride(0)
    if rows > 1 and (row_stride < row_bytes or row_stride % ALIGNMENT):
        raise ValueError(
            f"hidden_states' row stride must be >= K/2 = {hidden // 2} and a multiple of {ALIGNMENT}, got {row_stride}"
        )
    if hidden_states.data_ptr() % ALIGNMENT:
        raise ValueError(f"hidden_states' data pointer must be {ALIGNMENT}-byte aligned")


def check_aligned_args(
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
) -> AlignedDims:
    """``check_operands`` of the arguments under the contract's names."""
    return check_operands(AlignedOperands(
        hidden_states, hidden_states_scale, gemm1_weights, gemm1_weights_scale, gemm2_weights, gemm2_weights_scale,
        output1_scale_gate_scalar, output1_scale_scalar, output2_scale_scalar, sorted_token_ids, expert_ids,
        num_tokens_post_padded, topk_weights, out, top_k, block_m, routed_scaling_factor,
    ))


def check_operands(operands: AlignedOperands) -> AlignedDims:
    """Check every argument of the aligned op; return the sizes.

    hidden_states uint8 [M, K/2] (K >= 256, K % 256 == 0; inner stride 1, rows may be strided),
    hidden_states_scale e4m3 [M, K/16]; gemm1_weights uint8 [E, N, K/2] (N % 256 == 0),
    gemm1_weights_scale e4m3 [E, N, K/16]; gemm2_weights uint8 [E, K, N/4], gemm2_weights_scale
    e4m3 [E, K, N/32]; the three output scales float32 [E]; sorted_token_ids int32 [S],
    expert_ids int32 [ceil(S / block_m)], num_tokens_post_padded int32 [1]; topk_weights float32
    [M, top_k]; out bfloat16 [M, K], 16-byte aligned and sharing no memory with any input.
    All on one device; everything but hidden_states contiguous. top_k >= 1; block_m >= 8 and
    a multiple of 8; routed_scaling_factor a Python number finite in float32 (a tensor would need a sync).
    M * top_k must fit in int32 (it is the plan's padding value).
    """
    (hidden_states, hidden_states_scale, gemm1_weights, gemm1_weights_scale, gemm2_weights, gemm2_weights_scale,
     _, _, _, sorted_token_ids, expert_ids, num_tokens_post_padded, topk_weights, out, top_k, block_m,
     routed_scaling_factor) = operands
    kinds = {
        "hidden_states": (_U8, 2), "hidden_states_scale": (_E4M3, 2), "gemm1_weights": (_U8, 3),
        "gemm1_weights_scale": (_E4M3, 3), "gemm2_weights": (_U8, 3), "gemm2_weights_scale": (_E4M3, 3),
        "output1_scale_gate_scalar": (_F32, 1), "output1_scale_scalar": (_F32, 1), "output2_scale_scalar": (_F32, 1),
        "sorted_token_ids": (_I32, 1), "expert_ids": (_I32, 1), "num_tokens_post_padded": (_I32, 1),
        "topk_weights": (_F32, 2), "out": (torch.bfloat16, 2),
    }
    tensors = {name: (value, *kinds[name]) for name, value in operands.tensors().items()}
    for name, (value, dtype, rank) in tensors.items():
        require_tensor(name, value, dtype, rank)
    top_k = require_int_arg("top_k", top_k, minimum=1)
    block_m = require_int_arg("block_m", block_m, minimum=8)
    if block_m % 8:
        raise ValueError(f"block_m must be a multiple of 8, got {block_m}")
    if isinstance(routed_scaling_factor, torch.Tensor):
        raise TypeError("routed_scaling_factor must be a Python number, got a torch.Tensor (reading it would sync)")
    scaling = require_float32_scalar("routed_scaling_factor", routed_scaling_factor)  # the kernels scale in FP32

    num_tokens, hidden = hidden_states.shape[0], 2 * hidden_states.shape[1]
    if hidden < K_MULTIPLE or hidden % K_MULTIPLE:
        raise ValueError(
            f"K = 2 * hidden_states.shape[1] must be a positive multiple of {K_MULTIPLE}, got {hidden}"
        )
    num_experts, n = gemm1_weights.shape[0], gemm1_weights.shape[1]
    if num_experts < 1:
        raise ValueError(f"gemm1_weights must hold at least one expert, got shape {tuple(gemm1_weights.shape)}")
    if n < K_MULTIPLE or n % K_MULTIPLE:
        raise ValueError(f"N = gemm1_weights.shape[1] must be a positive multiple of {K_MULTIPLE}, got {n}")
    if num_tokens * top_k > _INT32_MAX:
        raise ValueError(f"M * top_k = {num_tokens * top_k} must fit in int32")
    require_shape("hidden_states_scale", hidden_states_scale, (num_tokens, hidden // NVFP4_BLOCK))
    require_shape("gemm1_weights", gemm1_weights, (num_experts, n, hidden // 2))
    require_shape("gemm1_weights_scale", gemm1_weights_scale, (num_experts, n, hidden // NVFP4_BLOCK))
    require_shape("gemm2_weights", gemm2_weights, (num_experts, hidden, n // 4))
    require_shape("gemm2_weights_scale", gemm2_weights_scale, (num_experts, hidden, n // (2 * NVFP4_BLOCK)))
    for name in ("output1_scale_gate_scalar", "output1_scale_scalar", "output2_scale_scalar"):
        require_shape(name, tensors[name][0], (num_experts,))
    blocks = -(-sorted_token_ids.numel() // block_m)
    if expert_ids.numel() != blocks:
        raise ValueError(
            f"expert_ids must have ceil(sorted_token_ids.numel() / block_m) = {blocks} entries, got {expert_ids.numel()}"
        )
    require_shape("num_tokens_post_padded", num_tokens_post_padded, (1,))
    require_shape("topk_weights", topk_weights, (num_tokens, top_k))
    require_shape("out", out, (num_tokens, hidden))

    device = hidden_states.device
    for name, (value, _, _) in tensors.items():
        if value.device != device:
            raise ValueError(f"{name} is on {value.device} but hidden_states is on {device}; all must share one device")
    _check_hidden_states(hidden_states, hidden)
    require_contiguous(**{name: value for name, (value, _, _) in tensors.items() if name != "hidden_states"})
    if out.data_ptr() % ALIGNMENT:
        raise ValueError(f"out's data pointer must be {ALIGNMENT}-byte aligned")
    for name, (value, _, _) in tensors.items():
        if name != "out":
            require_no_overlap("out", out, name, value)
    return AlignedDims(num_tokens, hidden, n, num_experts, top_k, block_m, scaling)
