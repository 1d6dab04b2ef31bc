"""Quantized formats (pure torch, CPU or CUDA tensors): quantize, dequantize and scale layouts."""

from .e2m1 import E2M1_GRID, decode_e2m1, encode_e2m1, pack_nibbles, unpack_nibbles
from .nvfp4 import NVFP4_BLOCK, NVFP4_MAX, dequantize_nvfp4, quantize_nvfp4
from .scale_layout import swizzle_128x4, swizzled_offset, swizzled_shape, unswizzle_128x4

__all__ = [
    "E2M1_GRID",
    "NVFP4_BLOCK",
    "NVFP4_MAX",
    "decode_e2m1",
    "dequantize_nvfp4",
    "encode_e2m1",
    "pack_nibbles",
    "quantize_nvfp4",
    "swizzle_128x4",
    "swizzled_offset",
    "swizzled_shape",
    "unpack_nibbles",
    "unswizzle_128x4",
]
