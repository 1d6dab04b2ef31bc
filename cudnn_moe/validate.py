"""Argument checks shared by the public entry points; each raises before any work is launched."""

from __future__ import annotations

import math
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


FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def require_int_arg(name: str, value: object, minimum: int | None = None, maximum: int | None = None) -> int:
    """Check that ``value`` is a Python int (``True``/``False`` are refused) within [minimum, maximum]."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")
    return value


def require_finite_scalar(name: str, value: object, *, positive: bool = False) -> float:
    """Check a finite number (int, float, or a one-element floating tensor; not bool); return it as float.

    positive=True also refuses zero and negative values. A tensor is read (a device sync on CUDA).
    """
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or not value.is_floating_point():
            raise TypeError(f"{name} must be a number or a one-element floating tensor, got {value.dtype} {tuple(value.shape)}")
        value = float(value)
    elif isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if positive and value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


def require_positive_finite(name: str, value: torch.Tensor) -> None:
    """Check that every element is finite and > 0 (reads the data: a device sync on CUDA)."""
    if value.numel() and not bool((torch.isfinite(value) & (value > 0)).all()):
        raise ValueError(f"{name} must be finite and positive everywhere")


def require_float_tensor(
    name: str, value: object, *, min_rank: int = 0, dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES
) -> torch.Tensor:
    """Check a floating tensor (float16/bfloat16/float32/float64 by default) of at least ``min_rank`` dims."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must be a floating tensor ({names}), got {str(value.dtype).replace('torch.', '')}")
    if value.dim() < min_rank:
        raise ValueError(f"{name} must have at least {min_rank} dimension(s), got shape {tuple(value.shape)}")
    return value


def _byte_extent(t: torch.Tensor) -> tuple[int, int]:
    """[first, last + 1) byte addresses a strided tensor can touch (a superset for interleaved views)."""
    low = high = 0
    for size, stride in zip(t.shape, t.stride()):
        reach = (size - 1) * stride
        if reach >= 0:
            high += reach
        else:
            low += reach
    start, item = t.data_ptr(), t.element_size()
    return start + low * item, start + (high + 1) * item


def require_no_overlap(name_a: str, a: torch.Tensor, name_b: str, b: torch.Tensor) -> None:
    """Check that two tensors share no memory (empty and meta tensors never overlap).

    Compares the byte ranges each tensor's strides can reach on one device; two interleaved
    views of one buffer that touch disjoint elements are still refused (conservative).
    """
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device or a.device.type == "meta":
        return
    a_start, a_end = _byte_extent(a)
    b_start, b_end = _byte_extent(b)
    if a_start < b_end and b_start < a_end:
        raise ValueError(f"{name_a} overlaps the memory of {name_b}; pass a separate tensor")
