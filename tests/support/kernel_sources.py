"""Shared by the CPU tests that read the CUDA sources: the C signatures of their entry points, the
stand-ins that let a host C++ compiler build the device headers' number-format and activation helpers, and
the session's nvcc builds (each command compiled once, in parallel, started before the first test)."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

# C parameter type -> the numpy scalar type a launch wrapper must pass for it.
ARG_TYPES = {"int": np.int32, "i64": np.int64, "float": np.float32, "pointer": np.uint64}
_ENTRY = re.compile(r'extern "C" __global__ void(?:\s+__launch_bounds__\([^)]*\))?\s+(\w+)\(([^)]*)\)')


_DEFINE = re.compile(r"^#define (\w+)[ \t]+((?:.*\\\n)*.*)$", re.M)


def kernel_signatures(paths: Iterable[Path], headers: Iterable[Path] = ()) -> dict[str, list[str]]:
    """Entry point name -> parameter kinds ("int", "i64", "float" or "pointer"), parsed from the sources; a parameter
    list may name a macro of ``headers`` (e.g. WARM_PARAMS of l2_warm.cuh) or of the sources themselves, which is
    expanded first."""
    paths = list(paths)
    macros = {name: body.replace("\\\n", " ")
              for source in (*headers, *paths) for name, body in _DEFINE.findall(source.read_text())}
    signatures = {}
    for path in paths:
        for kernel, params in _ENTRY.findall(path.read_text()):
            params = re.sub(r"\b\w+\b", lambda m: macros.get(m.group(0), m.group(0)), params)
            decls = (param.strip() for param in params.split(","))
            signatures[kernel] = ["pointer" if "*" in decl else decl.split()[0] for decl in decls]
    return signatures


# The start of a host driver program: C++ headers and stand-ins for the CUDA qualifiers, vector types and
# bit-cast intrinsics the device headers use; a driver appends its #include of a header and its main().
HOST_PRELUDE = r"""
#include <cmath>
#include <cstdio>
#include <cstring>
#define __device__
#define __forceinline__ inline
struct uint2 { unsigned int x, y; };
struct uint4 { unsigned int x, y, z, w; };
static inline uint4 make_uint4(unsigned int x, unsigned int y, unsigned int z, unsigned int w) { return {x, y, z, w}; }
static inline unsigned int __float_as_uint(float f) { unsigned int u; std::memcpy(&u, &f, 4); return u; }
static inline float __uint_as_float(unsigned int u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fmul_rn(float a, float b) { return a * b; }
"""

CXX = shutil.which("c++") or shutil.which("g++")  # the host compiler of those drivers (None: there is none)


def host_program(folder: Path, name: str, driver: str, opt: str = "-O1") -> Path:
    """``driver`` (HOST_PRELUDE, an #include of a kernels_cuda/ header and a main()) built with CXX at ``opt`` and
    the kernels' -D codes into folder/name. Skips the test without a compiler; fails it with the compiler's errors."""
    from cudnn_moe.kernels import cuda_defines, kernels_dir

    if CXX is None:
        pytest.skip("no C++ compiler")
    source, program = folder / f"{name}.cpp", folder / name
    source.write_text(driver)
    build = [CXX, "-std=c++17", opt, "-I", str(kernels_dir()), *cuda_defines(), str(source), "-o", str(program)]
    result = subprocess.run(build, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return program


# ---------------------------------------------------------------------------------------------------------------
# nvcc builds shared by the test session: each (command, inputs' content) compiles once, in a pool of background
# workers, and the conftest's session fixture starts every build the selected tests need before the first test
# runs (prefetch), so the compilations overlap each other and the tests that need no compiler.
# ---------------------------------------------------------------------------------------------------------------

NVCC = shutil.which("nvcc") or shutil.which("nvcc", path="/usr/local/cuda/bin")
# Parallel nvcc processes (default: one per core); CUDNN_MOE_TEST_NVCC_JOBS overrides.
NVCC_JOBS = int(os.environ.get("CUDNN_MOE_TEST_NVCC_JOBS", "0")) or os.cpu_count() or 1

Build = tuple[subprocess.CompletedProcess, Path]  # nvcc's result (returncode, stderr with ptxas -v) and its output
Job = tuple[list[str], str]  # an nvcc command without "-o OUT", and the output file's suffix

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_out_dir: Path | None = None
_builds: dict[tuple[tuple[str, ...], str, str], Future] = {}


def _inputs_digest() -> str:
    """sha256 of every file of kernels_cuda/ (the sources and the headers they include)."""
    from cudnn_moe.kernels import kernels_dir

    root, digest = kernels_dir(), hashlib.sha256()
    for path in sorted(root.rglob("*")):
        if path.is_file():
            digest.update(path.relative_to(root).as_posix().encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


# The builds run at a lower CPU priority, so that the tests running meanwhile keep their pace and the builds
# take the idle time (the result is the same: the command is only prefixed).
_NICE = [nice, "-n", "10"] if (nice := shutil.which("nice")) else []


def _run(command: list[str], out: Path) -> Build:
    result = subprocess.run([*_NICE, *command, "-o", str(out)], capture_output=True, text=True)
    result.args = [*command, "-o", str(out)]
    return result, out


def submit(command: list[str], suffix: str = ".o") -> Future:
    """The (future) Build of ``command`` (nvcc, without -o): started now in the pool unless the same command on
    the same kernels_cuda/ content was already started this session."""
    global _pool, _out_dir
    key = (tuple(command), suffix, _inputs_digest())
    with _lock:
        future = _builds.get(key)
        if future is None:
            if _pool is None:
                _pool = ThreadPoolExecutor(max_workers=NVCC_JOBS, thread_name_prefix="nvcc")
                _out_dir = Path(tempfile.mkdtemp(prefix="cudnn-moe-nvcc-"))
            assert _out_dir is not None
            future = _builds[key] = _pool.submit(_run, list(command), _out_dir / f"build{len(_builds)}{suffix}")
        return future


def find_nvrtc() -> str | None:
    """libnvrtc: $LL_NVRTC_LIBRARY, the CUDA toolkit next to nvcc, or an nvidia-* wheel of this Python."""
    import ctypes.util

    candidates = [os.environ.get("LL_NVRTC_LIBRARY", "")]
    if NVCC:
        candidates += sorted(str(p) for p in (Path(NVCC).resolve().parent.parent / "lib64").glob("libnvrtc.so*"))
    try:
        import nvidia  # type: ignore[import-not-found]

        for base in getattr(nvidia, "__path__", []):
            candidates += sorted(str(p) for p in Path(base).glob("*/lib/libnvrtc.so*"))
    except ImportError:
        pass
    candidates.append(ctypes.util.find_library("nvrtc") or "")
    return next((c for c in candidates if c and Path(c).exists()), None)


NVRTC = find_nvrtc()


def nvrtc_build(filename: str, extra_options: tuple[str, ...], arch: str) -> tuple[int, str]:
    """(status, log) of NVRTC (libnvrtc at NVRTC) compiling kernels_cuda/``filename`` as the GPU build does (no host
    headers, the loader's source text and options, cudnn_moe.kernels.loader) for ``arch`` (e.g. "sm_90a")."""
    import ctypes

    from cudnn_moe.kernels.loader import compile_options, module_source

    assert NVRTC is not None, "no libnvrtc"
    lib = ctypes.CDLL(NVRTC)
    program = ctypes.c_void_p()
    source = module_source(filename).encode()
    assert lib.nvrtcCreateProgram(ctypes.byref(program), source, Path(filename).name.encode(), 0, None, None) == 0
    options = [o.encode() for o in (*compile_options(extra_options), f"--gpu-architecture={arch}")]
    status = lib.nvrtcCompileProgram(program, len(options), (ctypes.c_char_p * len(options))(*options))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(program, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(program, log)
    lib.nvrtcDestroyProgram(ctypes.byref(program))
    return status, log.value.decode(errors="replace")


def compiled(command: list[str], suffix: str = ".o") -> Build:
    """nvcc's result and output file for ``command`` (without -o), compiled once per session."""
    return submit(command, suffix).result()


def ptxas_report(result: subprocess.CompletedProcess, kernel: str) -> str:
    """The ptxas lines of ``kernel`` in an nvcc -Xptxas -v build's stderr (asserting the build succeeded)."""
    assert result.returncode == 0, result.stderr
    return result.stderr.split(f"Compiling entry function '{kernel}'")[1].split("Compiling entry")[0]


def register_usage(report: str) -> tuple[int, int]:
    """Registers a thread and bytes of spill stores in one kernel's ptxas report (``ptxas_report``)."""
    return (int(re.search(r"Used (\d+) registers", report).group(1)),
            int(re.search(r"(\d+) bytes spill stores", report).group(1)))


def _skipped(item: Any) -> bool:
    """An item a skip mark or a true skipif condition will skip (it needs no build)."""
    if item.get_closest_marker("skip") is not None:
        return True
    for mark in item.iter_markers("skipif"):
        condition = mark.args[0] if mark.args else mark.kwargs.get("condition")
        if isinstance(condition, bool) and condition:
            return True
    return False


def prefetch(items: Iterable[Any]) -> int:
    """Start, in the tests' order, the builds of the items whose module defines ``nvcc_jobs(item) -> [Job]``;
    returns how many builds were asked for (a build asked for twice starts once)."""
    jobs = [job for item in items if not _skipped(item)
            for job in getattr(getattr(item, "module", None), "nvcc_jobs", lambda _: [])(item)]
    for command, suffix in jobs:
        submit(command, suffix)
    return len(jobs)


def shutdown() -> None:
    """End of the session: drop the builds not started, wait for those running, remove the outputs."""
    global _pool, _out_dir
    with _lock:
        pool, out_dir, _pool, _out_dir = _pool, _out_dir, None, None
        _builds.clear()
    if pool is not None:
        pool.shutdown(wait=True, cancel_futures=True)
    if out_dir is not None:
        shutil.rmtree(out_dir, ignore_errors=True)
