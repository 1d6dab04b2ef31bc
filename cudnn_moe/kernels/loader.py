"""Compiling and launching the CUDA sources of kernels_cuda/ through CuPy (NVRTC).

Modules compile once per (device, source, options) and are cached in memory; CuPy also caches
the binaries on disk, keyed by source text and options. Launches go on torch's current stream.
"""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .codes import cuda_defines

_lock = threading.RLock()
_modules: dict[tuple[int, str, tuple[str, ...]], Any] = {}
_functions: dict[tuple[int, str, str, tuple[str, ...]], Any] = {}
_streams: dict[tuple[int, int], Any] = {}


def kernels_dir() -> Path:
    """The CUDA sources: cudnn_moe/_kernels_cuda in an installed wheel, else the repository's kernels_cuda/."""
    package = Path(__file__).resolve().parent.parent
    for candidate in (package / "_kernels_cuda", package.parent / "kernels_cuda"):
        if (candidate / "common.cuh").is_file():
            return candidate
    raise FileNotFoundError(f"CUDA kernel sources not found next to {package}")


def compile_options(extra_options: tuple[str, ...] = ()) -> tuple[str, ...]:
    """NVRTC options of a kernel module: C++17, the source folder on the include path, the shared codes."""
    return ("-std=c++17", f"-I{kernels_dir()}", *cuda_defines(), *extra_options)


def module_source(filename: str) -> str:
    """The text of kernels_cuda/``filename`` prefixed with a digest of every header, so CuPy's disk cache
    (keyed by source text) recompiles when a shared header changes."""
    root = kernels_dir()
    digest = hashlib.sha256()
    for header in sorted(root.rglob("*.cuh")):
        digest.update(header.relative_to(root).as_posix().encode())
        digest.update(header.read_bytes())
    return f"// headers sha256 {digest.hexdigest()}\n{(root / filename).read_text()}"


def load_module(filename: str, device: int, extra_options: tuple[str, ...] = ()) -> Any:
    """The compiled cupy.RawModule of kernels_cuda/``filename`` on CUDA device ``device`` (cached)."""
    key = (device, filename, extra_options)
    with _lock:
        module = _modules.get(key)
        if module is None:
            import cupy

            with cupy.cuda.Device(device):
                module = cupy.RawModule(code=module_source(filename), options=compile_options(extra_options))
                module.compile()
            _modules[key] = module
        return module


def kernel_function(filename: str, name: str, device: int, extra_options: tuple[str, ...] = ()) -> Any:
    """The cupy RawKernel ``name`` of kernels_cuda/``filename`` (cached)."""
    key = (device, filename, name, extra_options)
    function = _functions.get(key)
    if function is None:
        with _lock:
            function = _functions.get(key)
            if function is None:
                function = _functions[key] = load_module(filename, device, extra_options).get_function(name)
    return function


class _StreamRef:
    """A raw cudaStream_t behind the CUDA stream protocol (for cupy.cuda.Stream.from_external)."""

    def __init__(self, handle: int) -> None:
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)


def _cupy_stream(handle: int, index: int) -> Any:
    """A CuPy view of the raw CUDA stream ``handle`` of device ``index`` (cached: building one costs host time)."""
    key = (handle, index)
    stream = _streams.get(key)
    if stream is None:
        import cupy

        if hasattr(cupy.cuda.Stream, "from_external"):  # CuPy >= 14
            stream = cupy.cuda.Stream.from_external(_StreamRef(handle))
        else:
            stream = cupy.cuda.ExternalStream(handle, index)
        stream = _streams.setdefault(key, stream)
    return stream


def launch(
    filename: str,
    name: str,
    device: torch.device,
    grid: int | tuple[int, ...],
    block: int,
    args: tuple[Any, ...],
    *,
    shared_mem: int = 0,
    extra_options: tuple[str, ...] = (),
) -> None:
    """Launch kernel ``name`` of kernels_cuda/``filename`` on torch's current stream of ``device``.

    A grid with a zero extent launches nothing. ``shared_mem`` bytes of dynamic shared memory are
    requested (the kernel's limit is raised on first use when above 48 KB).
    """
    grid = (grid,) if isinstance(grid, int) else grid
    if min(grid) <= 0:
        return
    import cupy

    index = device.index if device.index is not None else torch.cuda.current_device()
    function = kernel_function(filename, name, index, extra_options)
    if shared_mem > 48 * 1024 and function.max_dynamic_shared_size_bytes < shared_mem:
        function.max_dynamic_shared_size_bytes = shared_mem
    # The raw handle of torch's current stream, without building a torch.cuda.Stream object per launch.
    stream = _cupy_stream(torch._C._cuda_getCurrentRawStream(index), index)
    with cupy.cuda.Device(index), stream:
        function(grid, (block,), args, shared_mem=shared_mem)


def ptr(tensor: torch.Tensor | None, align: int = 1) -> np.uint64:
    """Device address of a contiguous CUDA tensor (0 for None), checked to be a multiple of ``align`` bytes."""
    if tensor is None:
        return np.uint64(0)
    if not tensor.is_cuda or not tensor.is_contiguous():
        raise ValueError(f"kernel operands must be contiguous CUDA tensors, got {tensor.device} {tuple(tensor.shape)}")
    address = tensor.data_ptr()
    if address % align:
        raise ValueError(f"kernel operand at {address:#x} must be {align}-byte aligned")
    return np.uint64(address)
