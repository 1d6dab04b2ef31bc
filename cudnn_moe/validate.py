"""Argument checks shared by the public entry points; each raises before any work is launched."""

from __future__ import annotations

from collections.abc import Iterable

import torch


def require_tensor(
    name: str,
    value: object,
    dtypes: torch.dtype | Iterable[torch.dtype],
    rank: int | None = None,
) -> torch.Tensor:
    """Check that ``value`` is a tensor of one of ``dtypes`` (and of ``rank`` dims if given)."""
    allowed = (dtypes,) if isinstance(dtypes, torch.dtype) else tuple(dtypes)
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.dtype not in allowed:
        names = " or ".join(str(d).replace("torch.", "") for d in allowed)
        raise TypeError(f"{name} must have dtype {names}, got {str(value.dtype).replace('torch.', '')}")
    if rank is not None and value.dim() != rank:
        raise ValueError(f"{name} must have {rank} dimensions, got shape {tuple(value.shape)}")
    return value


def require_shape(name: str, value: torch.Tensor, shape: tuple[int, ...]) -> None:
    """Check an exact shape."""
    if tuple(value.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(value.shape)}")


def require_same_device(**tensors: torch.Tensor) -> torch.device:
    """Check that all tensors live on one device; return it."""
    devices = {name: t.device for name, t in tensors.items()}
    first_name, first = next(iter(devices.items()))
    for name, device in devices.items():
        if device != first:
            raise ValueError(f"{name} is on {device} but {first_name} is on {first}; all inputs must share one device")
    return first


def require_contiguous(**tensors: torch.Tensor) -> None:
    """Check row-major contiguity (kernels index raw memory)."""
    for name, t in tensors.items():
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (row-major); call .contiguous() first")


def require_multiple(name: str, value: int, multiple: int) -> None:
    """Check that a size is a positive multiple of ``multiple``."""
    if value <= 0 or value % multiple:
        raise ValueError(f"{name} must be a positive multiple of {multiple}, got {value}")


def require_finite(name: str, value: torch.Tensor) -> None:
    """Check for NaN/Inf (reads the data: a device sync for CUDA tensors, so only on preparation paths)."""
    if not bool(torch.isfinite(value).all()):
        raise ValueError(f"{name} contains NaN or Inf values")
