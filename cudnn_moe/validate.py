"""Argument checks shared by the public entry points; each raises before any work is launched."""

from __future__ import annotations

import math
import struct
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
    """Check that a size is a positive multiple of ``multiple`` (1: any positive size)."""
    if value <= 0 or value % multiple:
        what = "positive" if multiple == 1 else f"a positive multiple of {multiple}"
        raise ValueError(f"{name} must be {what}, got {value}")


_FINITE_CHUNK = 1 << 26  # elements per isfinite pass: its bool temporary stays at 64 MiB


def _all_finite(value: torch.Tensor) -> torch.Tensor:
    """A 0-dim bool tensor on value's device: every element finite. Checked in slices along the leading
    dimensions, so no temporary is as large as the tensor (a DeepSeek-V3 BF16 w1 is 7.5 G elements)."""
    if value.dim() == 0 or value.numel() <= _FINITE_CHUNK:
        return torch.isfinite(value).all()
    rows = _FINITE_CHUNK // (value.numel() // value.shape[0])
    if rows < 1:
        return torch.stack([_all_finite(value[i]) for i in range(value.shape[0])]).all()
    return torch.stack([torch.isfinite(value[i:i + rows]).all() for i in range(0, value.shape[0], rows)]).all()


def require_finite(name: str, value: torch.Tensor) -> None:
    """Check for NaN/Inf (reads the data: one device sync for CUDA tensors, so only on preparation paths)."""
    if not bool(_all_finite(value)):
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


def require_choice(name: str, value: object, choices: tuple[str, ...]) -> str:
    """Check that ``value`` is one of the str ``choices`` (TypeError for a non-str, ValueError otherwise)."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, one of {', '.join(map(repr, choices))}; got {type(value).__name__}")
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")
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


def require_positive_finite(name: str, value: torch.Tensor, *, in_float32: bool = False, reciprocal: bool = False) -> None:
    """Check that every element is finite and > 0 (reads the data: a device sync on CUDA).

    in_float32=True checks the values rounded to float32, where the computation runs (a float64
    1e-300 is 0 there, 1e39 is inf); reciprocal=True (implies in_float32) also requires 1 / value to
    be finite in float32, for a scale the computation divides by.
    """
    if not value.numel():
        return
    if in_float32 or reciprocal:
        value = value.float()
    ok = torch.isfinite(value) & (value > 0)
    if reciprocal:
        ok &= torch.isfinite(1.0 / value)
    if not bool(ok.all()):
        where = " in float32" if in_float32 or reciprocal else ""
        also = f", with 1/{name} finite too" if reciprocal else ""
        raise ValueError(f"{name} must be finite and positive everywhere{where}{also}")


FLOAT32_MAX = 3.4028234663852886e38  # torch.finfo(torch.float32).max
FLOAT32_MIN_RECIPROCAL = 1.0 / FLOAT32_MAX  # about 2.94e-39: the least x whose 1 / x is finite in float32


def to_float32(value: float) -> float:
    """``value`` rounded to the nearest float32 (to +-inf past the float32 range), as a Python float."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


def require_float32_scalar(name: str, value: object, *, positive: bool = False, reciprocal: bool = False) -> float:
    """Check a number (as require_finite_scalar accepts) that stays finite once rounded to float32,
    where the computation runs; return it rounded to float32.

    positive=True also refuses values that are <= 0 or round to 0 in float32 (e.g. 1e-300).
    reciprocal=True (a scale the computation divides by; implies positive) also requires 1 / value to
    be finite in float32: value >= FLOAT32_MIN_RECIPROCAL (about 2.94e-39).
    """
    positive = positive or reciprocal
    value = require_finite_scalar(name, value, positive=positive)
    single = to_float32(value)
    if not math.isfinite(single):
        raise ValueError(f"{name} must be finite in float32 (|{name}| <= {FLOAT32_MAX:.7g}), got {value}")
    if positive and single == 0:
        raise ValueError(f"{name} must be positive in float32, got {value} (it rounds to 0)")
    if reciprocal and not math.isfinite(to_float32(1.0 / single)):
        raise ValueError(
            f"{name} must be at least {FLOAT32_MIN_RECIPROCAL:.7g} so that 1/{name} is finite in float32, got {value}"
        )
    return single


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
