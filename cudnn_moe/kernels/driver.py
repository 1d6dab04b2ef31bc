"""The CUDA driver API calls of the kernel loader (and the node types of a captured CUDA graph, which the
benchmarks count launches with), through ctypes on the driver library torch already uses.

Loading a cached binary, finding its kernels and launching them are a handful of driver calls; making
them here keeps CuPy (about 100 ms to import) off the serving path: a process whose kernels all come
from the persistent cache never imports it (CuPy's NVRTC is used to compile, on a cache miss only).
Every call raises CudaDriverError naming the call and the driver's error name on failure.
"""

from __future__ import annotations

import ctypes
import functools
import sys
import threading

_c_void_p, _c_uint, _c_int = ctypes.c_void_p, ctypes.c_uint, ctypes.c_int

# name: argument types (each returns CUresult, an int)
_SIGNATURES: dict[str, tuple[type, ...]] = {
    "cuInit": (_c_uint,),
    "cuDriverGetVersion": (ctypes.POINTER(_c_int),),
    "cuDeviceGet": (ctypes.POINTER(_c_int), _c_int),
    "cuDeviceGetAttribute": (ctypes.POINTER(_c_int), _c_int, _c_int),
    "cuDevicePrimaryCtxRetain": (ctypes.POINTER(_c_void_p), _c_int),
    "cuCtxSetCurrent": (_c_void_p,),
    "cuModuleLoadData": (ctypes.POINTER(_c_void_p), ctypes.c_char_p),
    "cuModuleUnload": (_c_void_p,),
    "cuModuleGetFunction": (ctypes.POINTER(_c_void_p), _c_void_p, ctypes.c_char_p),
    "cuFuncSetAttribute": (_c_void_p, _c_int, _c_int),
    "cuLaunchKernel": (_c_void_p, _c_uint, _c_uint, _c_uint, _c_uint, _c_uint, _c_uint, _c_uint, _c_void_p, _c_void_p,
                       _c_void_p),
    "cuLaunchKernelEx": (_c_void_p, _c_void_p, _c_void_p, _c_void_p),
    "cuGetErrorName": (_c_int, ctypes.POINTER(ctypes.c_char_p)),
    "cuGraphGetNodes": (_c_void_p, ctypes.POINTER(_c_void_p), ctypes.POINTER(ctypes.c_size_t)),
    "cuGraphNodeGetType": (_c_void_p, ctypes.POINTER(_c_int)),
}

CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE = 36  # kHz
CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH = 37  # bits
CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
CU_GRAPH_NODE_TYPE_KERNEL = 0
CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class _LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute: the id, padding to 8 bytes, then the 64-byte value union (an int at offset 0 for
    the attributes used here)."""

    _fields_ = [("id", _c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int), ("rest", ctypes.c_char * 60)]


class _LaunchConfig(ctypes.Structure):
    """CUlaunchConfig of cuda.h (CUDA 12.0 and later)."""

    _fields_ = [("grid_x", _c_uint), ("grid_y", _c_uint), ("grid_z", _c_uint), ("block_x", _c_uint),
                ("block_y", _c_uint), ("block_z", _c_uint), ("shared_mem", _c_uint), ("stream", _c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", _c_uint)]


_PROGRAMMATIC = _LaunchAttribute(CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, b"", 1)


class CudaDriverError(RuntimeError):
    """A CUDA driver API call returned an error."""


@functools.cache
def _library() -> ctypes.CDLL:
    name = "nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1"
    try:
        lib = ctypes.CDLL(name)
    except OSError as exc:
        raise CudaDriverError(f"cannot load the CUDA driver library {name} ({exc}); is an NVIDIA driver installed?") from exc
    for function, argtypes in _SIGNATURES.items():
        entry = getattr(lib, function)
        entry.argtypes, entry.restype = argtypes, _c_int
    _check(lib.cuInit(0), "cuInit", lib)
    return lib


def _check(status: int, call: str, lib: ctypes.CDLL | None = None) -> None:
    if status:
        name = ctypes.c_char_p()
        known = (lib or _library()).cuGetErrorName(status, ctypes.byref(name)) == 0 and name.value
        raise CudaDriverError(f"{call} failed: {name.value.decode() if known else 'unknown error'} ({status})")


def driver_version() -> int:
    """The driver's CUDA version, e.g. 13000 for 13.0."""
    version = _c_int()
    _check(_library().cuDriverGetVersion(ctypes.byref(version)), "cuDriverGetVersion")
    return version.value


def device_attribute(device: int, attribute: int) -> int:
    """The CUdevice_attribute ``attribute`` of CUDA device ``device`` (an ordinal, as torch numbers devices)."""
    lib, handle, value = _library(), _c_int(), _c_int()
    _check(lib.cuDeviceGet(ctypes.byref(handle), device), "cuDeviceGet")
    _check(lib.cuDeviceGetAttribute(ctypes.byref(value), attribute, handle.value), "cuDeviceGetAttribute")
    return value.value


_contexts: dict[int, int] = {}
_contexts_lock = threading.Lock()


def make_device_current(device: int) -> None:
    """Make ``device``'s primary context (the one torch and the CUDA runtime use) current on this thread."""
    with _contexts_lock:
        context = _contexts.get(device)
        if context is None:
            lib, handle, ctx = _library(), _c_int(), _c_void_p()
            _check(lib.cuDeviceGet(ctypes.byref(handle), device), "cuDeviceGet")
            _check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), handle.value), "cuDevicePrimaryCtxRetain")
            context = _contexts[device] = ctx.value
    _check(_library().cuCtxSetCurrent(context), "cuCtxSetCurrent")


def graph_node_types(graph: int) -> list[int]:
    """The CUgraphNodeType of every node of the CUDA graph ``graph`` (a cudaGraph_t / CUgraph handle, e.g. of
    ``torch.cuda.CUDAGraph(keep_graph=True).raw_cuda_graph()``): CU_GRAPH_NODE_TYPE_KERNEL for each launch."""
    lib, count = _library(), ctypes.c_size_t()
    _check(lib.cuGraphGetNodes(graph, None, ctypes.byref(count)), "cuGraphGetNodes")
    nodes = (_c_void_p * count.value)()
    _check(lib.cuGraphGetNodes(graph, nodes, ctypes.byref(count)), "cuGraphGetNodes")
    types = []
    for node in nodes[: count.value]:
        kind = _c_int()
        _check(lib.cuGraphNodeGetType(node, ctypes.byref(kind)), "cuGraphNodeGetType")
        types.append(kind.value)
    return types


def module_load_data(image: bytes) -> int:
    """cuModuleLoadData: a loaded module (CUmodule handle) from a cubin / PTX image, in the current context."""
    module = _c_void_p()
    _check(_library().cuModuleLoadData(ctypes.byref(module), image), "cuModuleLoadData")
    return module.value


def module_unload(module: int) -> None:
    _check(_library().cuModuleUnload(module), "cuModuleUnload")


def module_get_function(module: int, name: str) -> int:
    """cuModuleGetFunction: the CUfunction handle of kernel ``name`` of ``module``."""
    function = _c_void_p()
    _check(_library().cuModuleGetFunction(ctypes.byref(function), module, name.encode()), f"cuModuleGetFunction({name})")
    return function.value


def set_max_dynamic_shared(function: int, size: int) -> None:
    """Allow ``function`` up to ``size`` bytes of dynamic shared memory (needed above 48 KB)."""
    _check(_library().cuFuncSetAttribute(function, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, size),
           "cuFuncSetAttribute")


def launch_kernel(function: int, grid: tuple[int, int, int], block: int, shared_mem: int, stream: int,
                  params: int) -> None:
    """cuLaunchKernel of ``function`` on ``stream`` with the ``void*[]`` argument array at address ``params``."""
    status = _library().cuLaunchKernel(function, *grid, block, 1, 1, shared_mem, stream, params, None)
    if status:
        _check(status, "cuLaunchKernel")


def launch_kernel_programmatic(function: int, grid: tuple[int, int, int], block: int, shared_mem: int, stream: int,
                               params: int) -> None:
    """cuLaunchKernelEx with programmatic stream serialization: the kernel may start while the previous kernel
    of ``stream`` still runs, and must begin with ``griddepcontrol.wait`` (kernels_cuda/common.cuh
    grid_dependency_begin). Recorded into a CUDA graph as a programmatic edge when the stream is capturing."""
    config = _LaunchConfig(*grid, block, 1, 1, shared_mem, stream, ctypes.pointer(_PROGRAMMATIC), 1)
    status = _library().cuLaunchKernelEx(ctypes.byref(config), function, params, None)
    if status:
        _check(status, "cuLaunchKernelEx")
