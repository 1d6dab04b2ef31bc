"""Helpers shared by the test modules (they import this package, never each other):

- moe_checks: comparison of a GPU MoE output with the float64 reference (the shared tolerance);
- kernel_sources: C signatures of the CUDA entry points, the host prelude for device headers, and the
  session's nvcc builds (prefetched by tests/conftest.py's session fixture);
- number_formats: the inputs and checks of the number-format helpers of common.cuh (host and device);
- sm90_variants: the SM90 GEMM kernel variants the CPU tests compile and the GPU tests run;
- low_latency: the low-latency op's test cases, random layers and inputs, and the comparison bounds;
- low_latency_fp8: the per-tensor and DeepSeek FP8 layers and tokens, and the checks of their E4M3 intermediates
  (for every engine that runs them);
- serving: the small fused layer of the serving tests (also built by their child processes).

Imported as ``tests.support`` with the checkout's root on sys.path (pytest puts it there; a child process or
tests/distributed/ep_check.py does it itself). This module imports nothing beyond pathlib, so a child process
that must not import CuPy can use the package.
"""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent  # tests/
REPO = TESTS.parent  # the checkout: benchmarks/, scripts/, graphs/, kernels_cuda/
