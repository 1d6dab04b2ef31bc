"""The rounding points the float64 references share: a GEMM's BF16 output, and the NVFP4 requantization of
an intermediate (global scale one), both evaluated as the GPU does."""

from __future__ import annotations

import torch

from .nvfp4 import dequantize_nvfp4, quantize_nvfp4


def round_bf16(x: torch.Tensor) -> torch.Tensor:
    """Round float64 values to BF16 (nearest even), keeping float64 storage: a GEMM's BF16 output."""
    return x.to(torch.bfloat16).double()


def requantize_nvfp4_rows(y: torch.Tensor) -> torch.Tensor:
    """y [..., K] -> the values the GPU's NVFP4 requantization (global scale one) stores, as float64.

    Per block of 16: s = e4m3(amax / 6) (nearest even, saturating at 448), codes =
    e2m1(y / s) (nearest even, saturating at 6), zero codes when s == 0. quantize_nvfp4
    evaluates exactly that in float32, the kernel's precision: y is rounded to float32 first,
    and its ``y * 1 / s`` equals ``y / s`` (the product by one is exact; it divides by s
    rather than multiplying by a rounded 1 / s).
    """
    packed, scales = quantize_nvfp4(y, check_finite=False)  # the kernel saturates Inf rather than refusing it
    return dequantize_nvfp4(packed, scales, dtype=torch.float64)
