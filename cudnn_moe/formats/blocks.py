"""Shared helpers for block-scaled formats: argument checks, blocking the last dimension and casting scales.

Every public format function checks its arguments with these before touching the data:
TypeError / ValueError naming the argument for non-tensors, wrong dtypes, too few dims,
mismatched scale shapes and bad global scales.
"""

from __future__ import annotations

import torch

from ..validate import (
    FLOAT_DTYPES,
    require_finite,
    require_float32_scalar,
    require_float_tensor,
    require_positive_finite,
    require_tensor,
)

E4M3_MAX = 448.0


def check_values(name: str, x: object, *, min_rank: int = 1, finite: bool = True) -> torch.Tensor:
    """A float16/bfloat16/float32/float64 tensor of at least ``min_rank`` dims to quantize.

    finite=True also reads the data and refuses NaN / Inf (a device sync on CUDA).
    """
    x = require_float_tensor(name, x, min_rank=min_rank)
    if finite:
        require_finite(name, x)
    return x


def check_codes(name: str, value: object, dtype: torch.dtype, *, min_rank: int = 1) -> torch.Tensor:
    """An encoded tensor of exactly ``dtype`` with at least ``min_rank`` dims."""
    value = require_tensor(name, value, dtype)
    if value.dim() < min_rank:
        raise ValueError(f"{name} must have at least {min_rank} dimension(s), got shape {tuple(value.shape)}")
    return value


def check_scales(name: str, scales: object, dtypes: tuple[torch.dtype, ...], shape: tuple[int, ...]) -> torch.Tensor:
    """Block scales of one of ``dtypes`` with exactly ``shape``."""
    scales = require_tensor(name, scales, dtypes)
    if tuple(scales.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)} to match the values, got {tuple(scales.shape)}")
    return scales


def check_out_dtype(dtype: object) -> torch.dtype:
    """The dtype a dequantize function returns: float16, bfloat16, float32 or float64.

    Narrower floating dtypes (float8 variants) are refused: they cannot hold the decoded values
    (an NVFP4 block reaches 2688, an E4M3 value times its scale more than 448) and the cast would
    clip them silently. float16 holds magnitudes up to 65504; larger decoded values become inf.
    """
    if not isinstance(dtype, torch.dtype) or dtype not in FLOAT_DTYPES:
        names = ", ".join(str(d).replace("torch.", "") for d in FLOAT_DTYPES)
        raise TypeError(f"dtype must be a floating torch.dtype ({names}), got {dtype!r}")
    return dtype


def check_global_scale(name: str, scale: object, x: torch.Tensor) -> None:
    """A positive number, or a floating tensor over x's leading dims, whose values and reciprocals are
    finite and nonzero in float32 (the NVFP4 math runs in float32 and decodes by dividing by it):
    about 2.94e-39 <= scale <= 3.4e38, so 1e-300 (0 in float32) and 1e39 (inf) are refused.

    A tensor scale is read (a device sync on CUDA). Zero, negative, NaN and Inf are refused.
    """
    if isinstance(scale, torch.Tensor) and scale.dim() > 0:
        require_tensor(name, scale, FLOAT_DTYPES)
        lead = tuple(x.shape[: scale.dim()])
        if scale.dim() >= x.dim() or tuple(scale.shape) != lead:
            raise ValueError(
                f"{name} of shape {tuple(scale.shape)} must cover leading dims of the values "
                f"(e.g. {tuple(x.shape[:1])} for shape {tuple(x.shape)})"
            )
        require_positive_finite(name, scale, reciprocal=True)
        return
    require_float32_scalar(name, scale, reciprocal=True)


def split_blocks(x: torch.Tensor, block: int, name: str = "x") -> torch.Tensor:
    """[..., K] -> float32 [..., K / block, block]; K must be a multiple of ``block``."""
    if x.shape[-1] % block:
        raise ValueError(f"the last dimension of {name} ({x.shape[-1]}) must be a multiple of the block size {block}")
    return x.float().reshape(*x.shape[:-1], x.shape[-1] // block, block)


def block_scale_shape(values_shape: torch.Size, elements: int, block: int, name: str) -> tuple[int, ...]:
    """Scale shape [..., elements / block] for values [..., *] holding ``elements`` per row."""
    if elements % block:
        raise ValueError(f"{name} holds {elements} values per row, not a multiple of the block size {block}")
    return (*values_shape[:-1], elements // block)


def to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """float32 -> float8_e4m3fn, round to nearest even, saturating at +-448 (never NaN for finite x)."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def broadcast_per_lead(scale: float | torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """A scalar, or a scale tensor over the leading dims of ``blocks`` [..., nb, block],
    as a float32 tensor that broadcasts against ``blocks``."""
    scale = torch.as_tensor(scale, dtype=torch.float32, device=blocks.device)
    return scale.reshape(*scale.shape, *([1] * (blocks.dim() - scale.dim())))
