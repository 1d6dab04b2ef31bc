"""Shared helpers for block-scaled formats: blocking the last dimension and casting scales."""

from __future__ import annotations

import torch

E4M3_MAX = 448.0


def split_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """[..., K] -> float32 [..., K / block, block]; K must be a multiple of ``block``."""
    if x.shape[-1] % block:
        raise ValueError(f"the last dimension ({x.shape[-1]}) must be a multiple of the block size {block}")
    return x.float().reshape(*x.shape[:-1], x.shape[-1] // block, block)


def to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """float32 -> float8_e4m3fn, round to nearest even, saturating at +-448 (never NaN for finite x)."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def broadcast_per_lead(scale: float | torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """A scalar, or a scale tensor over the leading dims of ``blocks`` [..., nb, block],
    as a float32 tensor that broadcasts against ``blocks``."""
    scale = torch.as_tensor(scale, dtype=torch.float32, device=blocks.device)
    return scale.reshape(*scale.shape, *([1] * (blocks.dim() - scale.dim())))
