"""The aligned op's operands as one record, under the contract's names (the public functions take them
positionally, as the contract does, and build this once)."""

from __future__ import annotations

from typing import NamedTuple

import torch


class AlignedOperands(NamedTuple):
    """Every argument of ``aligned_moe`` / ``reference_aligned_moe`` (layouts: cudnn_moe.aligned.checks)."""

    hidden_states: torch.Tensor
    hidden_states_scale: torch.Tensor
    gemm1_weights: torch.Tensor
    gemm1_weights_scale: torch.Tensor
    gemm2_weights: torch.Tensor
    gemm2_weights_scale: torch.Tensor
    output1_scale_gate_scalar: torch.Tensor
    output1_scale_scalar: torch.Tensor
    output2_scale_scalar: torch.Tensor
    sorted_token_ids: torch.Tensor
    expert_ids: torch.Tensor
    num_tokens_post_padded: torch.Tensor
    topk_weights: torch.Tensor
    out: torch.Tensor
    top_k: int
    block_m: int = 8
    routed_scaling_factor: float = 1.0

    @property
    def raw_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gemm1_weights, gemm1_weights_scale, gemm2_weights, gemm2_weights_scale)."""
        return self.gemm1_weights, self.gemm1_weights_scale, self.gemm2_weights, self.gemm2_weights_scale

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensor operands by name, in argument order."""
        return {name: value for name, value in zip(self._fields[:14], self[:14])}
