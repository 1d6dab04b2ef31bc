"""One cuDNN handle per CUDA device, shared by every graph on that device.

A handle carries one stream at a time, so running on it means "set the stream,
then execute". `using_handle` holds the device's lock across both steps, which
keeps two threads driving the same device from swapping streams under each other.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from .probe import require_cudnn

_registry_lock = threading.Lock()
_handles: dict[int, Any] = {}  # device index -> cudnn.Handle
_device_locks: dict[int, threading.Lock] = {}


def device_index(device: int | str | torch.device) -> int:
    """CUDA device ordinal of ``device`` ('cuda' alone means the current device)."""
    if isinstance(device, int):
        return device
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"cuDNN graphs run on CUDA devices, got {device}")
    return torch.cuda.current_device() if device.index is None else device.index


def _entry(index: int) -> tuple[Any, threading.Lock]:
    with _registry_lock:
        handle = _handles.get(index)
        if handle is None:
            cudnn = require_cudnn()
            with torch.cuda.device(index):  # a cuDNN handle binds the current device
                handle = cudnn.create_handle()
            _handles[index] = handle
            _device_locks[index] = threading.Lock()
        return handle, _device_locks[index]


def handle_for(device: int | str | torch.device, stream_ptr: int) -> Any:
    """The device's handle with its stream set to ``stream_ptr`` (a raw cudaStream_t)."""
    handle, _ = _entry(device_index(device))
    import cudnn  # loaded and checked by _entry

    cudnn.set_stream(handle=handle, stream=stream_ptr)  # the Handle skips the backend call for an unchanged stream
    return handle


@contextmanager
def using_handle(device: int | str | torch.device, stream_ptr: int) -> Iterator[Any]:
    """`handle_for` under the device's lock, held until the block ends (set stream + execute)."""
    index = device_index(device)
    _, lock = _entry(index)
    with lock:
        yield handle_for(index, stream_ptr)
