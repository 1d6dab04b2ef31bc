"""Shared by the CPU tests that read the CUDA sources: the C signatures of their entry points, and the
stand-ins that let a host C++ compiler build the device headers' number-format and activation helpers."""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

import numpy as np

# C parameter type -> the numpy scalar type a launch wrapper must pass for it.
ARG_TYPES = {"int": np.int32, "i64": np.int64, "float": np.float32, "pointer": np.uint64}
_ENTRY = re.compile(r'extern "C" __global__ void(?:\s+__launch_bounds__\([^)]*\))?\s+(\w+)\(([^)]*)\)')


def kernel_signatures(paths: Iterable[Path]) -> dict[str, list[str]]:
    """Entry point name -> parameter kinds ("int", "i64", "float" or "pointer"), parsed from the sources."""
    signatures = {}
    for path in paths:
        for kernel, params in _ENTRY.findall(path.read_text()):
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
static inline unsigned int __float_as_uint(float f) { unsigned int u; std::memcpy(&u, &f, 4); return u; }
static inline float __uint_as_float(unsigned int u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
"""
