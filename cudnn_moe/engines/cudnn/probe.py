"""Lazy access to the cuDNN frontend (`import cudnn`) with install guidance.

`cudnn_moe` imports without cuDNN; only code that builds or runs a graph calls
`require_cudnn`, which returns the `cudnn` module or raises a RuntimeError saying
what to install.
"""

from __future__ import annotations

from types import ModuleType

MIN_FRONTEND = (1, 32)  # nvidia-cudnn-frontend: the pygraph API this package is written against
MIN_BACKEND = 91800  # cuDNN 9.18: first backend with moe_grouped_matmul
NATIVE_NVFP4_MOE_BACKEND = 92100  # cuDNN 9.21: native NVFP4 MoE (F8_128x4 scales) on SM100

INSTALL_HINT = (
    'install the cuDNN extra: pip install "cudnn-moe[cu12]" (CUDA 12) or "cudnn-moe[cu13]" (CUDA 13), '
    "i.e. nvidia-cudnn-frontend>=1.32 with nvidia-cudnn-cu12 / nvidia-cudnn-cu13 >= 9.18 "
    "(the native NVFP4 MoE engines on SM100 need cuDNN >= 9.21)"
)


def format_version(backend: int) -> str:
    """91900 -> '9.19.0'."""
    return f"{backend // 10000}.{backend // 100 % 100}.{backend % 100}"


def _import_cudnn() -> ModuleType:
    try:
        import cudnn
    except ImportError as exc:
        raise RuntimeError(f"the cuDNN frontend (python module `cudnn`) is not installed; {INSTALL_HINT}") from exc
    return cudnn


def _frontend_version(cudnn: ModuleType) -> tuple[int, int]:
    parts = str(getattr(cudnn, "__version__", "0.0")).split(".")
    return int(parts[0]), int(parts[1])


def backend_version() -> int:
    """The loaded cuDNN library's version as an int (9.19.0 -> 91900)."""
    cudnn = _import_cudnn()
    try:
        return int(cudnn.backend_version())
    except Exception as exc:  # the frontend imports even when libcudnn cannot be loaded
        raise RuntimeError(f"the cuDNN frontend is installed but the cuDNN library could not be loaded ({exc}); {INSTALL_HINT}") from exc


def require_cudnn(min_backend: int = MIN_BACKEND) -> ModuleType:
    """Return the `cudnn` module once frontend >= 1.32 and backend >= ``min_backend`` are confirmed."""
    cudnn = _import_cudnn()
    frontend = _frontend_version(cudnn)
    if frontend < MIN_FRONTEND:
        have = ".".join(map(str, frontend))
        raise RuntimeError(f"nvidia-cudnn-frontend {have} is too old (need >= 1.32); {INSTALL_HINT}")
    backend = backend_version()
    if backend < min_backend:
        raise RuntimeError(
            f"cuDNN {format_version(backend)} is loaded but this needs cuDNN >= {format_version(min_backend)}; {INSTALL_HINT}"
        )
    return cudnn
