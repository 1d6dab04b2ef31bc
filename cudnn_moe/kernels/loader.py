"""Compiling, caching and launching the CUDA sources of kernels_cuda/.

Compilation: NVRTC, through CuPy's ``compile_using_nvrtc``, gives the module's binary (a cubin for the
device's architecture); it is loaded with ``cuModuleLoadData`` and kept in the package's persistent
cache (``cudnn_moe.cache.active_cache()``) under a key of the source digest (the file and every
header), the options, the GPU, the CuPy version and the driver version. A later process loads that
binary and compiles nothing; fresh and cached modules are loaded the same way.

Loading and launching go through the CUDA driver directly (cudnn_moe.kernels.driver: ``cuModuleLoadData``,
``cuLaunchKernel`` with an argument buffer packed by ``packed_args``, on torch's current stream), so a
process whose kernels all come from the cache never imports CuPy.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import importlib.metadata
import os
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..cache import KIND_KERNEL, EntryKey, Environment, active_cache, current_environment, record
from ..cache.store import report_once
from . import driver
from .codes import cuda_defines

_lock = threading.RLock()
_modules: dict[tuple[int, str, tuple[str, ...]], _Module] = {}
_functions: dict[tuple[int, str, str, tuple[str, ...]], int] = {}
_shared_limits: dict[int, int] = {}  # CUfunction -> dynamic shared memory limit set so far


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
    """The text of kernels_cuda/``filename`` prefixed with a digest of every header, so any cache keyed
    by source text recompiles when a shared header changes."""
    root = kernels_dir()
    digest = hashlib.sha256()
    for header in sorted(root.rglob("*.cuh")):
        digest.update(header.relative_to(root).as_posix().encode())
        digest.update(header.read_bytes())
    return f"// headers sha256 {digest.hexdigest()}\n{(root / filename).read_text()}"


_CUPY_DISTRIBUTIONS = ("cupy-cuda13x", "cupy-cuda12x", "cupy-cuda11x", "cupy")


def compiler_version() -> str | None:
    """The string "cupy <version>, driver <CUDA version>" of the kernels' compiler (CuPy's NVRTC) and the driver
    that loads them, read without importing CuPy (from its installed distribution) so that cached kernels load
    fast; None without CuPy. The NVRTC version is not part of it: a cubin it built stays valid for the GPU and
    driver it was loaded on (a binary the driver refuses is rebuilt, see ``_load``); ``prebuild --clear``
    drops old ones."""
    cupy_version = None
    for name in _CUPY_DISTRIBUTIONS:
        try:
            cupy_version = importlib.metadata.version(name)
            break
        except importlib.metadata.PackageNotFoundError:
            continue
    if cupy_version is None:
        return None
    try:
        return f"cupy {cupy_version}, driver {driver.driver_version()}"
    except driver.CudaDriverError:  # no usable driver: loading fails on its own, with its reason
        return f"cupy {cupy_version}"


@functools.cache
def _kernel_environment(device: int) -> Environment:
    return dataclasses.replace(current_environment(device, cudnn=False), compiler=compiler_version())


def kernel_key(filename: str, source: str, options: tuple[str, ...], environment: Environment) -> EntryKey:
    """The cache key of one compiled module: source digest and options (include paths left out:
    the digest covers what they hold), valid in ``environment`` (GPU, compute capability, CuPy/NVRTC)."""
    return EntryKey(
        KIND_KERNEL,
        f"{filename} {' '.join(o for o in options if o.startswith('-DSM90'))}".strip(),
        {
            "file": filename,
            "source_sha256": hashlib.sha256(source.encode()).hexdigest(),
            "options": [o for o in options if not o.startswith("-I")],
        },
        environment,
    )


@dataclass
class _Module:
    """A loaded module: its CUmodule handle, and where it came from ('disk', 'built')."""

    handle: int
    source: str

    def function(self, name: str) -> int:
        """The CUfunction handle of kernel ``name``."""
        return driver.module_get_function(self.handle, name)


ARCH_SPECIFIC = "-DMOE_ARCH_SPECIFIC=1"  # an option of modules built for the "a" target (sm_90a: wgmma)


def _compile(source: str, options: tuple[str, ...]) -> bytes:
    """The NVRTC binary of ``source`` for the current device (a cubin, or PTX where NVRTC cannot target it).
    With ARCH_SPECIFIC among the options, a cubin for the device's architecture-specific target (sm_90a)."""
    if ARCH_SPECIFIC in options:
        return _compile_arch_specific(source, options)
    from cupy.cuda import compiler

    binary, _ = compiler.compile_using_nvrtc(source, options)
    return binary.encode() if isinstance(binary, str) else bytes(binary)


def _compile_arch_specific(source: str, options: tuple[str, ...]) -> bytes:
    """NVRTC straight (CuPy's wrapper knows no "a" targets): a cubin for sm_<cc>a of the current device."""
    import cupy
    from cupy.cuda import nvrtc
    from cupy.cuda.compiler import CompileException

    arch = f"-arch=sm_{cupy.cuda.Device().compute_capability}a"
    program = nvrtc.createProgram(source, "cudnn_moe_module", (), ())
    try:
        try:
            nvrtc.compileProgram(program, (*options, arch))
        except nvrtc.NVRTCError:
            raise CompileException(nvrtc.getProgramLog(program), source, "cudnn_moe_module", (*options, arch)) from None
        return bytes(nvrtc.getCUBIN(program))
    finally:
        nvrtc.destroyProgram(program)


def _module_from(binary: bytes, device: int, source: str) -> _Module:
    with torch.cuda.device(device):
        _bind(device)
        return _Module(driver.module_load_data(binary), source)


def _load(filename: str, device: int, extra_options: tuple[str, ...]) -> _Module:
    source, options = module_source(filename), compile_options(extra_options)
    key = kernel_key(filename, source, options, _kernel_environment(device))
    disk = active_cache()
    binary = disk.get(key) if disk is not None else None
    if binary is not None:
        try:
            return _module_from(binary, device, "disk")
        except Exception as exc:  # a binary the driver refuses: rebuilt and replaced, never fatal
            report_once(str(disk.path_for(key)), f"cannot load the cached kernel {key.name} ({exc}); recompiling")
    import cupy  # only to compile (NVRTC for the device's architecture)

    with cupy.cuda.Device(device):
        binary = _compile(source, options)
    if disk is not None:
        disk.put_or_report(key, binary)  # an unwritable cache costs a compile next time, nothing else
    return _module_from(binary, device, "built")


def load_module(filename: str, device: int, extra_options: tuple[str, ...] = ()) -> _Module:
    """The loaded module of kernels_cuda/``filename`` on CUDA device ``device``: from this process's
    memory, the persistent cache, or compiled now (and stored)."""
    key = (device, filename, extra_options)
    with _lock:
        module = _modules.get(key)
        if module is None:
            module = _modules[key] = _load(filename, device, extra_options)
            record(KIND_KERNEL, module.source)
        return module


def kernel_function(filename: str, name: str, device: int, extra_options: tuple[str, ...] = ()) -> int:
    """The CUfunction handle of kernel ``name`` of kernels_cuda/``filename`` (cached)."""
    key = (device, filename, name, extra_options)
    function = _functions.get(key)
    if function is None:
        with _lock:
            function = _functions.get(key)
            if function is None:
                module = load_module(filename, device, extra_options)
                function = _functions[key] = module.function(name)  # a module's functions need no current context
    return function


_STRUCT_CODES: dict[type, str] = {
    np.int8: "b", np.uint8: "B", np.int16: "h", np.uint16: "H", np.int32: "i", np.uint32: "I",
    np.int64: "q", np.uint64: "Q", np.float32: "f", np.float64: "d",
}


@functools.lru_cache(maxsize=256)
def _layout(types: tuple[type, ...]) -> tuple[struct.Struct, tuple[int, ...]]:
    """struct layout (little-endian, each argument aligned to its own size) and offsets of ``types``."""
    fmt, offsets, size = ["<"], [], 0
    for index, kind in enumerate(types):
        code = _STRUCT_CODES.get(kind)
        if code is None:
            raise TypeError(f"kernel argument {index} must be a numpy scalar (np.int32, np.uint64, np.float32, ...), "
                            f"got {kind.__name__}")
        width = struct.calcsize("<" + code)
        aligned = -(-size // width) * width
        fmt.append("x" * (aligned - size) + code)
        offsets.append(aligned)
        size = aligned + width
    return struct.Struct("".join(fmt)), tuple(offsets)


class PackedArgs:
    """Kernel arguments laid out for cuLaunchKernel: ``pointer`` is the address of a ``void*[n]`` whose
    entries point at each argument's bytes in one buffer (both kept alive by this object).

    args: numpy scalars (np.int32, np.uint64, np.float32, ...), each stored little-endian at an offset
    aligned to its size, as the kernel's parameter list lays them out. ``repack`` overwrites the
    values in place (same types), so a launcher can reuse one PackedArgs per argument layout.
    """

    def __init__(self, args: tuple[Any, ...]) -> None:
        self.types = tuple(map(type, args))
        self.layout, self.offsets = _layout(self.types)
        self.buffer = ctypes.create_string_buffer(max(self.layout.size, 1))
        base = ctypes.addressof(self.buffer)
        self.params = (ctypes.c_void_p * max(len(self.offsets), 1))(*[base + o for o in self.offsets])
        self.pointer = ctypes.addressof(self.params)
        self.repack(args)

    def repack(self, args: tuple[Any, ...]) -> None:
        """Write ``args`` (of this object's types) into the buffer."""
        self.layout.pack_into(self.buffer, 0, *args)

    def argument_bytes(self, index: int, size: int) -> bytes:
        """The ``size`` bytes entry ``index`` of the pointer array points at."""
        return ctypes.string_at(self.params[index], size)


_packers = threading.local()


def packed_args(args: tuple[Any, ...]) -> PackedArgs:
    """``args`` packed into this thread's reusable PackedArgs for their type layout (valid until the
    thread's next launch with the same layout; cuLaunchKernel copies the values at the call)."""
    cache = getattr(_packers, "by_types", None)
    if cache is None:
        cache = _packers.by_types = {}
    types = tuple(map(type, args))
    packed = cache.get(types)
    if packed is None:
        packed = cache[types] = PackedArgs(args)
    else:
        packed.repack(args)
    return packed


_bound = threading.local()


def _bind(index: int) -> None:
    """Make device ``index`` (torch's current device) bind its primary context on this thread, once per
    thread and device: driver-API calls need a current context; torch, CuPy and cuDNN share that one."""
    devices = getattr(_bound, "devices", None)
    if devices is None:
        devices = _bound.devices = set()
    if index not in devices and not torch.cuda.is_current_stream_capturing():  # a capturing thread has one
        driver.make_device_current(index)
        devices.add(index)


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

    A grid with a zero extent launches nothing. ``shared_mem`` bytes of dynamic shared memory are requested (the
    kernel's limit is raised to it on first use: with its static shared memory the block may pass the default 48 KB
    even with less than 48 KB of dynamic). ``args`` are numpy scalars (``ptr(tensor)`` gives a device address)."""
    grid = (grid,) if isinstance(grid, int) else grid
    if min(grid) <= 0:
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    function = kernel_function(filename, name, index, extra_options)
    packed = packed_args(args)
    gx, gy, gz = (*grid, 1, 1)[:3]
    stream = torch._C._cuda_getCurrentRawStream(index)
    if torch.cuda.current_device() == index:
        _launch(function, gx, gy, gz, block, shared_mem, stream, packed, index)
    else:
        with torch.cuda.device(index):
            _launch(function, gx, gy, gz, block, shared_mem, stream, packed, index)


PDL_ENV_VAR = "CUDNN_MOE_PDL"


@functools.cache
def programmatic_launch(index: int) -> bool:
    """Whether kernels on device ``index`` launch with Programmatic Dependent Launch: on SM90 and later,
    unless ``$CUDNN_MOE_PDL`` is ``0`` (read once per process). Every kernel waits for its predecessor
    before touching memory (kernels_cuda/common.cuh grid_dependency_begin), or, the SM90 decode GEMM2 behind a
    tile handoff, for each tile of it (sm90/grouped_gemm.cu SM90_AWAIT); the SM90 decode GEMMs' early forms read
    before their wait only weights and a routing complete before their launch (SM90_EARLY). So the results are the
    same either way; only the gap between dependent launches shrinks."""
    return os.environ.get(PDL_ENV_VAR, "1") != "0" and torch.cuda.get_device_capability(index)[0] >= 9


def _launch(function: int, gx: int, gy: int, gz: int, block: int, shared_mem: int, stream: int,
            packed: PackedArgs, index: int) -> None:
    _bind(index)
    if shared_mem and _shared_limits.get(function, 0) < shared_mem:  # static + dynamic may pass 48 KB below it
        driver.set_max_dynamic_shared(function, shared_mem)
        _shared_limits[function] = shared_mem
    if programmatic_launch(index):
        driver.launch_kernel_programmatic(function, (gx, gy, gz), block, shared_mem, stream, packed.pointer)
    else:
        driver.launch_kernel(function, (gx, gy, gz), block, shared_mem, stream, packed.pointer)


def ptr(tensor: torch.Tensor | None, align: int = 1, *, row_strided: bool = False) -> np.uint64:
    """Device address of a contiguous CUDA tensor (0 for None), checked to be a multiple of ``align`` bytes.
    row_strided: also accept a 2-D tensor whose rows are contiguous but strided (the kernel takes the stride)."""
    if tensor is None:
        return np.uint64(0)
    rows_ok = row_strided and tensor.dim() == 2 and tensor.stride(1) == 1
    if not tensor.is_cuda or not (rows_ok or tensor.is_contiguous()):
        raise ValueError(f"kernel operands must be contiguous CUDA tensors, got {tensor.device} {tuple(tensor.shape)}")
    address = tensor.data_ptr()
    if address % align:
        raise ValueError(f"kernel operand at {address:#x} must be {align}-byte aligned")
    return np.uint64(address)
