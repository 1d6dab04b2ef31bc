"""The cuDNN engine and every cuDNN concern: import probe, handles, the NVFP4 grouped-GEMM graphs.

Importing this package does not import `cudnn`; building or running a graph does.
"""

from .engine import CudnnGemmEngine
from .grouped_gemm import (
    UID,
    GroupedFp4Gemm,
    GroupedGemmKey,
    ScaleLayout,
    build_grouped_fp4_gemm,
    offsets_len_for,
    segmented_scale_rows,
    token_scale_bytes,
    weight_scale_shape,
)
from .handles import device_index, handle_for, using_handle
from .plan_cache import graph_for
from .probe import MIN_BACKEND, MIN_FRONTEND, NATIVE_NVFP4_MOE_BACKEND, backend_version, require_cudnn

__all__ = [
    "MIN_BACKEND",
    "MIN_FRONTEND",
    "NATIVE_NVFP4_MOE_BACKEND",
    "UID",
    "CudnnGemmEngine",
    "GroupedFp4Gemm",
    "GroupedGemmKey",
    "ScaleLayout",
    "backend_version",
    "build_grouped_fp4_gemm",
    "device_index",
    "graph_for",
    "handle_for",
    "offsets_len_for",
    "require_cudnn",
    "segmented_scale_rows",
    "token_scale_bytes",
    "using_handle",
    "weight_scale_shape",
]
