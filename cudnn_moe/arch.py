"""GPU architectures: the constants every module uses and parsing compute capabilities (what runs where is
declared by the engines, cudnn_moe.engines.registry)."""

from __future__ import annotations

import functools
import re

import torch

Arch = tuple[int, int]

SM80: Arch = (8, 0)  # Ampere
SM90: Arch = (9, 0)  # Hopper
SM100: Arch = (10, 0)  # data-center Blackwell
SM103: Arch = (10, 3)
SM107: Arch = (10, 7)
SM120: Arch = (12, 0)  # consumer Blackwell


def parse_arch(arch: str | int | tuple[int, int]) -> Arch:
    """Accept (10, 0), 100, "sm100", "sm_100a", "sm_100f", "10.0" and return (major, minor).

    A string must match one of these forms entirely (case and surrounding spaces aside): two or
    three digits, optionally after "sm" / "sm_" and before the suffix "a" or "f", or "MAJOR.MINOR".
    Anything else ("sm90x", "sm 90", "") raises ValueError, as do negative numbers; a non-int,
    non-str, non-pair argument raises TypeError.
    """
    if isinstance(arch, tuple):
        if len(arch) == 2 and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in arch):
            return arch
        raise ValueError(f"arch as a tuple must be (major, minor) of two non-negative ints, got {arch!r}")
    if isinstance(arch, bool) or not isinstance(arch, (int, str)):
        raise TypeError(f"arch must be a str, an int or a (major, minor) tuple, got {type(arch).__name__}")
    if isinstance(arch, int):
        if arch < 0:
            raise ValueError(f"arch must be a non-negative compute capability such as 90 or 100, got {arch}")
        return divmod(arch, 10)
    text = arch.strip().lower()
    match = re.fullmatch(r"(?:sm_?)?(\d{2,3})[af]?", text)
    if match:
        return divmod(int(match.group(1)), 10)
    match = re.fullmatch(r"(\d+)\.(\d)", text)
    if match:
        return int(match.group(1)), int(match.group(2))
    raise ValueError(f"arch {arch!r} is not a GPU architecture; use e.g. 'sm90', 'sm_100a', '10.0', 100 or (10, 0)")


def _device_index(device: torch.device | int | None) -> int:
    """The ordinal of ``device`` (a torch.device or an index; the current device for None or an unindexed one)."""
    index = device.index if isinstance(device, torch.device) else device
    return torch.cuda.current_device() if index is None else index


def device_arch(device: torch.device | int | None = None) -> Arch:
    """Compute capability of a CUDA device (the current one by default); cached per device."""
    return _capability(_device_index(device))


@functools.cache
def _capability(index: int) -> Arch:
    return tuple(torch.cuda.get_device_capability(index))  # type: ignore[return-value]


def peak_dram_tbs(device: torch.device | int | None = None) -> float:
    """Peak DRAM bandwidth of a CUDA device (the current one by default) in TB/s: two transfers per memory clock
    over the bus width, as the driver reports them (an H100 SXM read 3.35; an H200 gives 4.9); cached per device."""
    return _peak_dram_tbs(_device_index(device))


@functools.cache
def _peak_dram_tbs(index: int) -> float:
    from .kernels import driver  # the driver library loads on first use only

    khz = driver.device_attribute(index, driver.CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE)
    bits = driver.device_attribute(index, driver.CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH)
    return 2 * khz * 1e3 * bits / 8 / 1e12


def is_blackwell(arch: Arch) -> bool:
    """SM100 / SM103 data-center Blackwell: native NVFP4 block-scaled MMA in cuDNN."""
    return arch[0] == 10


def arch_name(arch: Arch) -> str:
    """(10, 0) -> 'sm100'."""
    return f"sm{arch[0]}{arch[1]}"


def target_arch(arch: Arch | None) -> Arch:
    """The architecture to prepare weights for: ``arch``, else the current GPU's, else SM90 (no GPU)."""
    if arch is not None:
        return arch
    return device_arch() if torch.cuda.is_available() else SM90
