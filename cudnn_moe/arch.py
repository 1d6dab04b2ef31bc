"""GPU architectures: parsing compute capabilities (what runs where is the engines' business)."""

from __future__ import annotations

import functools
import re

import torch

Arch = tuple[int, int]

SM90: Arch = (9, 0)
SM100: Arch = (10, 0)
SM103: Arch = (10, 3)


def parse_arch(arch: str | int | tuple[int, int]) -> Arch:
    """Accept (10, 0), 100, "sm100", "sm_100a", "10.0" and return (major, minor)."""
    if isinstance(arch, tuple) and len(arch) == 2 and all(isinstance(v, int) for v in arch):
        return arch
    if isinstance(arch, int) and not isinstance(arch, bool):
        return divmod(arch, 10)
    if isinstance(arch, str):
        text = arch.strip().lower()
        match = re.fullmatch(r"(?:sm_?)?(\d{2,3})[a-z]?", text)
        if match:
            return divmod(int(match.group(1)), 10)
        match = re.fullmatch(r"(\d+)\.(\d)", text)
        if match:
            return int(match.group(1)), int(match.group(2))
    raise ValueError(f"cannot read a GPU architecture from {arch!r}; use e.g. 'sm90', 'sm100' or (10, 0)")


def device_arch(device: torch.device | int | None = None) -> Arch:
    """Compute capability of a CUDA device (the current one by default); cached per device."""
    index = device.index if isinstance(device, torch.device) else device
    return _capability(torch.cuda.current_device() if index is None else index)


@functools.cache
def _capability(index: int) -> Arch:
    return tuple(torch.cuda.get_device_capability(index))  # type: ignore[return-value]


def is_blackwell(arch: Arch) -> bool:
    """SM100 / SM103 data-center Blackwell: native NVFP4 block-scaled MMA in cuDNN."""
    return arch[0] == 10


def arch_name(arch: Arch) -> str:
    """(10, 0) -> 'sm100'."""
    return f"sm{arch[0]}{arch[1]}"
