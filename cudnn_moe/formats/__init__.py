"""Quantized formats (pure torch, CPU or CUDA tensors): quantize, dequantize and scale layouts."""

from .e2m1 import E2M1_GRID, decode_e2m1, encode_e2m1, pack_nibbles, unpack_nibbles
from .fp8 import (
    FP8_BLOCK,
    dequantize_fp8_act128,
    dequantize_fp8_block128,
    dequantize_fp8_per_tensor,
    quantize_fp8_act128,
    quantize_fp8_block128,
    quantize_fp8_per_tensor,
)
from .int4 import MXINT4_BLOCK, dequantize_mxint4, quantize_mxint4
from .mx import MX_BLOCK, dequantize_mxfp4, dequantize_mxfp8, quantize_mxfp4, quantize_mxfp8
from .nvfp4 import NVFP4_BLOCK, NVFP4_MAX, dequantize_nvfp4, quantize_nvfp4
from .scale_layout import ScaleLayout, swizzle_128x4, swizzled_offset, swizzled_shape, unswizzle_128x4

__all__ = [
    "E2M1_GRID",
    "FP8_BLOCK",
    "MXINT4_BLOCK",
    "MX_BLOCK",
    "NVFP4_BLOCK",
    "NVFP4_MAX",
    "ScaleLayout",
    "decode_e2m1",
    "dequantize_fp8_act128",
    "dequantize_fp8_block128",
    "dequantize_fp8_per_tensor",
    "dequantize_mxfp4",
    "dequantize_mxfp8",
    "dequantize_mxint4",
    "dequantize_nvfp4",
    "encode_e2m1",
    "pack_nibbles",
    "quantize_fp8_act128",
    "quantize_fp8_block128",
    "quantize_fp8_per_tensor",
    "quantize_mxfp4",
    "quantize_mxfp8",
    "quantize_mxint4",
    "quantize_nvfp4",
    "swizzle_128x4",
    "swizzled_offset",
    "swizzled_shape",
    "unpack_nibbles",
    "unswizzle_128x4",
]
