"""Bad input to the CPU-side public API raises TypeError / ValueError naming the argument, before any work.

One table row per (call, expected exception, text the message must contain); the shared checks
of cudnn_moe.validate get their own unit tests below.
"""

from __future__ import annotations

import argparse
import functools
import math

import pytest
import torch

import cudnn_moe

from cudnn_moe import prebuild
from cudnn_moe.activations import SiTU, SwiGLU, SwiGLUStep, parse_activation
from cudnn_moe.aligned import align_routing, reference_aligned_moe
from cudnn_moe.arch import parse_arch
from cudnn_moe.fused.config import MAX_NUM_TOKENS, Nvfp4MoeConfig
from cudnn_moe.distributed import expert_shard, shard_weights
from cudnn_moe.formats import (
    decode_e2m1,
    dequantize_fp8_act128,
    dequantize_fp8_block128,
    dequantize_fp8_per_tensor,
    dequantize_mxfp4,
    dequantize_mxfp8,
    dequantize_mxint4,
    dequantize_nvfp4,
    encode_e2m1,
    pack_nibbles,
    quantize_fp8_act128,
    quantize_fp8_block128,
    quantize_fp8_per_tensor,
    quantize_mxfp4,
    quantize_mxfp8,
    quantize_mxint4,
    quantize_nvfp4,
    swizzle_128x4,
    swizzled_offset,
    swizzled_shape,
    unpack_nibbles,
    unswizzle_128x4,
)
from cudnn_moe.low_latency import LowLatencyMoeConfig
from cudnn_moe.fused.reference import reference_moe
from cudnn_moe.routing import Routing, pack_routing, unpack_routing
from cudnn_moe.fused.torch_op import MoeLayer
from cudnn_moe.validate import (
    require_finite_scalar,
    require_float32_scalar,
    require_float_tensor,
    require_int_arg,
    require_no_overlap,
    require_positive_finite,
)

NAN, INF = math.nan, math.inf
I32, I64, F32 = torch.int32, torch.int64, torch.float32


def x16(*shape: int, dtype: torch.dtype = F32) -> torch.Tensor:
    return torch.ones(*shape, 16, dtype=dtype)


def with_value(t: torch.Tensor, value: float) -> torch.Tensor:
    t = t.clone()
    t.view(-1)[0] = value
    return t


def nvfp4_pair(rows: int = 2, k: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_nvfp4(torch.ones(rows, k))


def mx_pair(fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    return {"fp4": quantize_mxfp4, "fp8": quantize_mxfp8, "int4": quantize_mxint4}[fmt](torch.ones(2, 64))


def reference_layer(ids: torch.Tensor) -> tuple:
    """A 1-expert, H = I = 16 SwiGLU layer for reference_moe, routed by ``ids`` [1, k]."""
    act_packed, act_scales = quantize_nvfp4(torch.ones(1, 16))
    w1_packed, w1_scales = quantize_nvfp4(torch.ones(1, 32, 16))
    w2_packed, w2_scales = quantize_nvfp4(torch.ones(1, 16, 16))
    alpha = torch.ones(1)
    routing = Routing.unpacked(ids, torch.ones(ids.shape))
    return (act_packed, act_scales, w1_packed, w1_scales, alpha, w2_packed, w2_scales, alpha, routing,
            parse_activation("swiglu"))


def ids2(*rows: list[int], dtype: torch.dtype = I32) -> torch.Tensor:
    return torch.tensor(rows, dtype=dtype)


def replaced(args: tuple, index: int, value: object) -> tuple:
    """``args`` with entry ``index`` replaced by ``value``."""
    return (*args[:index], value, *args[index + 1 :])


W1_ALPHA, W2_ALPHA = 4, 7  # their positions in reference_layer's tuple


def aligned_args(**changes: object) -> dict[str, object]:
    """Valid reference_aligned_moe arguments (M = 1 token, K = N = 256, E = 2, top_k = 1), with ``changes``."""
    hidden_states, hidden_states_scale = quantize_nvfp4(torch.ones(1, 256))
    gemm1_weights, gemm1_weights_scale = quantize_nvfp4(torch.ones(2, 256, 256))
    gemm2_weights, gemm2_weights_scale = quantize_nvfp4(torch.ones(2, 256, 128))
    sorted_token_ids, expert_ids, num_tokens_post_padded = align_routing(torch.zeros(1, 1, dtype=I32), 8, 2)
    args = dict(
        hidden_states=hidden_states, hidden_states_scale=hidden_states_scale, gemm1_weights=gemm1_weights,
        gemm1_weights_scale=gemm1_weights_scale, gemm2_weights=gemm2_weights, gemm2_weights_scale=gemm2_weights_scale,
        output1_scale_gate_scalar=torch.ones(2), output1_scale_scalar=torch.ones(2), output2_scale_scalar=torch.ones(2),
        sorted_token_ids=sorted_token_ids, expert_ids=expert_ids, num_tokens_post_padded=num_tokens_post_padded,
        topk_weights=torch.ones(1, 1), out=torch.zeros(1, 256, dtype=torch.bfloat16), top_k=1, block_m=8,
        routed_scaling_factor=1.0,
    )
    return {**args, **changes}


@functools.cache
def cpu_layer() -> tuple[Nvfp4MoeConfig, cudnn_moe.Nvfp4Weights]:
    """A 2-expert SwiGLU layer (H = I = 128) prepared for sm90 on the CPU (read-only in the rows)."""
    gen = torch.Generator().manual_seed(0)
    config = Nvfp4MoeConfig(arch="sm90")
    return config, config.prepare_weights(torch.randn(2, 256, 128, generator=gen), torch.randn(2, 128, 128, generator=gen))


def executor_for(config: Nvfp4MoeConfig | None = None, weights: object = None, **changes: object):
    """get_executor on cpu_layer() (top_k 2, swiglu, start 0) with the given arguments changed."""
    layer_config, layer_weights = cpu_layer()
    kwargs = {"top_k": 2, "activation": "swiglu", "local_expert_start": 0, **changes}
    return cudnn_moe.get_executor(config or layer_config, weights or layer_weights, **kwargs)


def moe_layer(**kwargs: object) -> MoeLayer:
    return MoeLayer(*cpu_layer(), **kwargs)


def dense_pair(dtype: torch.dtype, bad: str, value: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Low-latency 16-bit weights w1 [1, 16, 8], w2 [1, 8, 8] (SwiGLU, H = I = 8), one value of ``bad`` set."""
    w1, w2 = torch.ones(1, 16, 8, dtype=dtype), torch.ones(1, 8, 8, dtype=dtype)
    return (with_value(w1, value), w2) if bad == "w1" else (w1, with_value(w2, value))


LL = LowLatencyMoeConfig(arch="sm90")
E4M3_ONES = torch.ones(4).to(torch.float8_e4m3fn)


ROWS = [
    # --- pack_routing / unpack_routing
    ("pack 3-D ids", lambda: pack_routing(torch.zeros(2, 2, 1, dtype=I32), torch.zeros(2, 2, 1)), ValueError, "ids must be 2-D"),
    ("pack 1-D weights", lambda: pack_routing(torch.zeros(2, dtype=I32), torch.zeros(2)), ValueError, "ids must be 2-D"),
    ("pack 0-d", lambda: pack_routing(torch.tensor(1), torch.tensor(1.0)), ValueError, "ids must be 2-D"),
    ("pack list ids", lambda: pack_routing([[1, 2]], torch.zeros(1, 2)), TypeError, "ids must be a torch.Tensor"),
    ("pack list weights", lambda: pack_routing(ids2([1, 2]), [[0.5, 0.5]]), TypeError, "weights must be a torch.Tensor"),
    ("pack bool ids", lambda: pack_routing(torch.ones(1, 2, dtype=torch.bool), torch.zeros(1, 2)), TypeError, "ids must be an integer"),
    ("pack float ids", lambda: pack_routing(torch.ones(1, 2), torch.zeros(1, 2)), TypeError, "ids must be an integer"),
    ("pack int weights", lambda: pack_routing(ids2([1, 2]), ids2([1, 2])), TypeError, "weights must be a floating"),
    ("pack shapes differ", lambda: pack_routing(ids2([1, 2]), torch.zeros(1, 3)), ValueError, "one shape"),
    ("pack devices differ", lambda: pack_routing(ids2([1, 2]), torch.zeros(1, 2, device="meta")), ValueError, "one device"),
    ("pack int64 id above int16", lambda: pack_routing(ids2([1, 2**40], dtype=I64), torch.zeros(1, 2)), ValueError, "expert ids must lie in"),
    ("pack id below int16", lambda: pack_routing(ids2([-40000, 1]), torch.zeros(1, 2)), ValueError, "expert ids must lie in"),
    ("pack weight 1e39", lambda: pack_routing(ids2([1, 2]), torch.tensor([[1e39, 0.5]], dtype=torch.float64)), ValueError, "weights must be finite"),
    ("pack weight nan", lambda: pack_routing(ids2([1, 2]), torch.tensor([[NAN, 0.5]])), ValueError, "weights must be finite"),
    ("pack weight -inf", lambda: pack_routing(ids2([1, 2]), torch.tensor([[-INF, 0.5]])), ValueError, "weights must be finite"),
    ("unpack list", lambda: unpack_routing([[1]]), TypeError, "packed routing must be a torch.Tensor"),
    ("unpack int64", lambda: unpack_routing(torch.zeros(1, 1, dtype=I64)), TypeError, "packed routing must be int32"),
    # --- Routing.packed / Routing.unpacked
    ("packed list", lambda: Routing.packed([[1, 2]]), TypeError, "packed must be a torch.Tensor"),
    ("packed 0-d", lambda: Routing.packed(torch.tensor(3, dtype=I32)), ValueError, "packed must be 2-D"),
    ("packed 3-D", lambda: Routing.packed(torch.zeros(1, 2, 2, dtype=I32)), ValueError, "packed must be 2-D"),
    ("packed int64", lambda: Routing.packed(torch.zeros(1, 2, dtype=I64)), TypeError, "packed must be int32"),
    ("packed non-contiguous", lambda: Routing.packed(torch.zeros(3, 4, dtype=I32)[:, 1:3]), ValueError, "packed must be contiguous"),
    ("packed transposed", lambda: Routing.packed(torch.zeros(3, 4, dtype=I32).T), ValueError, "packed must be contiguous"),
    ("unpacked ids list", lambda: Routing.unpacked([[0, 1]], torch.ones(1, 2)), TypeError, "ids must be a torch.Tensor"),
    ("unpacked weights list", lambda: Routing.unpacked(ids2([0, 1]), [[1.0, 1.0]]), TypeError, "weights must be a torch.Tensor"),
    ("unpacked ids 0-d", lambda: Routing.unpacked(torch.tensor(0, dtype=I32), torch.tensor(1.0)), ValueError, "ids must be 2-D"),
    ("unpacked weights 0-d", lambda: Routing.unpacked(ids2([0]), torch.tensor(1.0)), ValueError, "weights must be 2-D"),
    ("unpacked bool ids", lambda: Routing.unpacked(torch.ones(1, 2, dtype=torch.bool), torch.ones(1, 2)), TypeError, "ids must be int32 or int64"),
    ("unpacked float64 weights", lambda: Routing.unpacked(ids2([0, 1]), torch.ones(1, 2, dtype=torch.float64)), TypeError, "weights must be float32 or bfloat16"),
    ("unpacked ids non-contiguous", lambda: Routing.unpacked(torch.zeros(4, 3, dtype=I32)[:, :2], torch.ones(4, 2)), ValueError, "ids must be contiguous"),
    ("unpacked weights non-contiguous", lambda: Routing.unpacked(torch.zeros(2, 4, dtype=I32), torch.ones(4, 2).T), ValueError, "weights must be contiguous"),
    ("unpacked top_k 0", lambda: Routing.unpacked(torch.zeros(2, 0, dtype=I32), torch.zeros(2, 0)), ValueError, "ids needs top_k >= 1"),
    ("int64 id 2^32 + 1 to ids_and_weights", lambda: Routing.unpacked(ids2([2**32 + 1], dtype=I64), torch.ones(1, 1)).ids_and_weights(), ValueError, "ids must lie in the int32 range"),
    # --- reference_moe
    ("reference int64 id 2^31", lambda: reference_moe(*reference_layer(ids2([2**31, 0], dtype=I64))), ValueError, "ids must lie in the int32 range"),
    ("reference int64 id 2^32 (wraps to 0)", lambda: reference_moe(*reference_layer(ids2([2**32, -1], dtype=I64))), ValueError, "ids must lie in the int32 range"),
    ("reference int64 id below int32", lambda: reference_moe(*reference_layer(ids2([-(2**31) - 1, 0], dtype=I64))), ValueError, "ids must lie in the int32 range"),
    ("reference local_expert_start True", lambda: reference_moe(*reference_layer(ids2([0, -1])), local_expert_start=True), ValueError, "local_expert_start"),
    ("reference local_expert_start float", lambda: reference_moe(*reference_layer(ids2([0, -1])), local_expert_start=0.0), ValueError, "local_expert_start"),
    # --- quantize_nvfp4 / dequantize_nvfp4
    ("nvfp4 int tensor", lambda: quantize_nvfp4(torch.ones(2, 16, dtype=I32)), TypeError, "x must be a floating tensor"),
    ("nvfp4 uint8 tensor", lambda: quantize_nvfp4(torch.ones(2, 16, dtype=torch.uint8)), TypeError, "x must be a floating tensor"),
    ("nvfp4 bool tensor", lambda: quantize_nvfp4(torch.ones(2, 16, dtype=torch.bool)), TypeError, "x must be a floating tensor"),
    ("nvfp4 fp8 tensor", lambda: quantize_nvfp4(torch.ones(2, 16).to(torch.float8_e4m3fn)), TypeError, "x must be a floating tensor"),
    ("nvfp4 list", lambda: quantize_nvfp4([[1.0] * 16]), TypeError, "x must be a torch.Tensor"),
    ("nvfp4 0-d", lambda: quantize_nvfp4(torch.tensor(1.0)), ValueError, "x must have at least 1 dimension"),
    ("nvfp4 K not a multiple of 16", lambda: quantize_nvfp4(torch.ones(2, 24)), ValueError, "last dimension of x (24)"),
    ("nvfp4 nan", lambda: quantize_nvfp4(with_value(x16(2), NAN)), ValueError, "x contains NaN or Inf"),
    ("nvfp4 inf", lambda: quantize_nvfp4(with_value(x16(2), INF)), ValueError, "x contains NaN or Inf"),
    ("nvfp4 global 0", lambda: quantize_nvfp4(x16(2), 0.0), ValueError, "global_scale must be positive"),
    ("nvfp4 global negative", lambda: quantize_nvfp4(x16(2), -1.0), ValueError, "global_scale must be positive"),
    ("nvfp4 global nan", lambda: quantize_nvfp4(x16(2), NAN), ValueError, "global_scale must be finite"),
    ("nvfp4 global inf", lambda: quantize_nvfp4(x16(2), INF), ValueError, "global_scale must be finite"),
    ("nvfp4 global bool", lambda: quantize_nvfp4(x16(2), True), TypeError, "global_scale must be a number"),
    ("nvfp4 global str", lambda: quantize_nvfp4(x16(2), "1"), TypeError, "global_scale must be a number"),
    ("nvfp4 global 0-d zero tensor", lambda: quantize_nvfp4(x16(2), torch.tensor(0.0)), ValueError, "global_scale must be positive"),
    ("nvfp4 global int tensor", lambda: quantize_nvfp4(x16(2), torch.tensor(1)), TypeError, "global_scale must be a number or a one-element floating"),
    ("nvfp4 global tensor with a zero", lambda: quantize_nvfp4(x16(2, 1), torch.tensor([1.0, 0.0])), ValueError, "global_scale must be finite and positive"),
    ("nvfp4 global tensor with nan", lambda: quantize_nvfp4(x16(2, 1), torch.tensor([1.0, NAN])), ValueError, "global_scale must be finite and positive"),
    ("nvfp4 global tensor wrong shape", lambda: quantize_nvfp4(x16(2, 1), torch.ones(3)), ValueError, "global_scale of shape (3,)"),
    ("nvfp4 global tensor covers K", lambda: quantize_nvfp4(x16(2), torch.ones(2, 16)), ValueError, "global_scale of shape (2, 16)"),
    ("nvfp4 global int64 tensor", lambda: quantize_nvfp4(x16(2, 1), torch.ones(2, dtype=I64)), TypeError, "global_scale must have dtype"),
    ("dequant nvfp4 packed int8", lambda: dequantize_nvfp4(nvfp4_pair()[0].to(torch.int8), nvfp4_pair()[1]), TypeError, "packed must have dtype uint8"),
    ("dequant nvfp4 packed list", lambda: dequantize_nvfp4([[1]], nvfp4_pair()[1]), TypeError, "packed must be a torch.Tensor"),
    ("dequant nvfp4 packed 0-d", lambda: dequantize_nvfp4(torch.tensor(1, dtype=torch.uint8), nvfp4_pair()[1]), ValueError, "packed must have at least 1"),
    ("dequant nvfp4 scales float32", lambda: dequantize_nvfp4(nvfp4_pair()[0], nvfp4_pair()[1].float()), TypeError, "scales must have dtype float8_e4m3fn"),
    ("dequant nvfp4 scales shape", lambda: dequantize_nvfp4(nvfp4_pair()[0], nvfp4_pair(3)[1]), ValueError, "scales must have shape (2, 2)"),
    ("dequant nvfp4 packed odd width", lambda: dequantize_nvfp4(torch.zeros(2, 12, dtype=torch.uint8), nvfp4_pair()[1]), ValueError, "packed holds 24 values per row"),
    ("dequant nvfp4 global 0", lambda: dequantize_nvfp4(*nvfp4_pair(), 0.0), ValueError, "global_scale must be positive"),
    ("dequant nvfp4 dtype int", lambda: dequantize_nvfp4(*nvfp4_pair(), dtype=I32), TypeError, "dtype must be a floating"),
    ("dequant nvfp4 dtype str", lambda: dequantize_nvfp4(*nvfp4_pair(), dtype="float32"), TypeError, "dtype must be a floating"),
    # --- MXFP4 / MXFP8 / MXINT4
    ("mxfp4 int", lambda: quantize_mxfp4(torch.ones(2, 32, dtype=I32)), TypeError, "x must be a floating tensor"),
    ("mxfp4 list", lambda: quantize_mxfp4([1.0] * 32), TypeError, "x must be a torch.Tensor"),
    ("mxfp4 0-d", lambda: quantize_mxfp4(torch.tensor(2.0)), ValueError, "x must have at least 1"),
    ("mxfp4 nan", lambda: quantize_mxfp4(with_value(torch.ones(32), NAN)), ValueError, "x contains NaN or Inf"),
    ("mxfp4 K 48", lambda: quantize_mxfp4(torch.ones(48)), ValueError, "multiple of the block size 32"),
    ("mxfp8 bool", lambda: quantize_mxfp8(torch.ones(32, dtype=torch.bool)), TypeError, "x must be a floating tensor"),
    ("mxfp8 inf", lambda: quantize_mxfp8(with_value(torch.ones(32), -INF)), ValueError, "x contains NaN or Inf"),
    ("mxint4 int", lambda: quantize_mxint4(torch.ones(32, dtype=I64)), TypeError, "x must be a floating tensor"),
    ("mxint4 0-d", lambda: quantize_mxint4(torch.tensor(1.0)), ValueError, "x must have at least 1"),
    ("mxint4 nan", lambda: quantize_mxint4(with_value(torch.ones(32), NAN)), ValueError, "x contains NaN or Inf"),
    ("dequant mxfp4 scales e4m3", lambda: dequantize_mxfp4(mx_pair("fp4")[0], mx_pair("fp4")[1].float().to(torch.float8_e4m3fn)), TypeError, "scales must have dtype float8_e8m0fnu"),
    ("dequant mxfp4 scales shape", lambda: dequantize_mxfp4(mx_pair("fp4")[0], mx_pair("fp4")[1][:, :1]), ValueError, "scales must have shape (2, 2)"),
    ("dequant mxfp8 values uint8", lambda: dequantize_mxfp8(mx_pair("fp8")[0].view(torch.uint8), mx_pair("fp8")[1]), TypeError, "values must have dtype float8_e4m3fn"),
    ("dequant mxint4 scales float32", lambda: dequantize_mxint4(mx_pair("int4")[0], mx_pair("int4")[1].float()), TypeError, "scales must have dtype bfloat16"),
    ("dequant mxint4 list", lambda: dequantize_mxint4([1], mx_pair("int4")[1]), TypeError, "packed must be a torch.Tensor"),
    # --- FP8
    ("fp8 tensor int", lambda: quantize_fp8_per_tensor(torch.ones(4, dtype=I32)), TypeError, "x must be a floating tensor"),
    ("fp8 tensor empty without a scale", lambda: quantize_fp8_per_tensor(torch.empty(0)), ValueError, "x is empty"),
    ("fp8 tensor empty 2-D without a scale", lambda: quantize_fp8_per_tensor(torch.empty(3, 0)), ValueError, "x is empty"),
    ("fp8 tensor nan", lambda: quantize_fp8_per_tensor(torch.tensor([NAN, 1.0])), ValueError, "x contains NaN or Inf"),
    ("fp8 tensor scale 0", lambda: quantize_fp8_per_tensor(torch.ones(4), scale=0.0), ValueError, "scale must be positive"),
    ("fp8 tensor scale -2", lambda: quantize_fp8_per_tensor(torch.ones(4), scale=-2.0), ValueError, "scale must be positive"),
    ("fp8 tensor scale nan", lambda: quantize_fp8_per_tensor(torch.ones(4), scale=NAN), ValueError, "scale must be finite"),
    ("fp8 tensor scale 2 elements", lambda: quantize_fp8_per_tensor(torch.ones(4), scale=torch.ones(2)), TypeError, "scale must be a number or a one-element"),
    ("dequant fp8 tensor values float", lambda: dequantize_fp8_per_tensor(torch.ones(4), 1.0), TypeError, "values must have dtype float8_e4m3fn"),
    ("dequant fp8 tensor scale inf", lambda: dequantize_fp8_per_tensor(torch.ones(4).to(torch.float8_e4m3fn), INF), ValueError, "scale must be finite"),
    ("fp8 block 1-D", lambda: quantize_fp8_block128(torch.ones(128)), ValueError, "w must have at least 2"),
    ("fp8 block int", lambda: quantize_fp8_block128(torch.ones(4, 4, dtype=I32)), TypeError, "w must be a floating tensor"),
    ("fp8 block inf", lambda: quantize_fp8_block128(with_value(torch.ones(4, 4), INF)), ValueError, "w contains NaN or Inf"),
    ("dequant fp8 block scales shape", lambda: dequantize_fp8_block128(torch.ones(200, 10).to(torch.float8_e4m3fn), torch.ones(1, 1)), ValueError, "scales must have shape (2, 1)"),
    ("dequant fp8 block scales int", lambda: dequantize_fp8_block128(torch.ones(4, 4).to(torch.float8_e4m3fn), torch.ones(1, 1, dtype=I32)), TypeError, "scales must have dtype"),
    ("fp8 act list", lambda: quantize_fp8_act128([1.0] * 128), TypeError, "x must be a torch.Tensor"),
    ("fp8 act 192", lambda: quantize_fp8_act128(torch.ones(2, 192)), ValueError, "multiple of the block size 128"),
    ("fp8 act nan", lambda: quantize_fp8_act128(with_value(torch.ones(128), NAN)), ValueError, "x contains NaN or Inf"),
    ("dequant fp8 act scales shape", lambda: dequantize_fp8_act128(torch.ones(2, 256).to(torch.float8_e4m3fn), torch.ones(2, 1)), ValueError, "scales must have shape (2, 2)"),
    # --- E2M1 codec and nibble packing
    ("encode int", lambda: encode_e2m1(torch.ones(4, dtype=I32)), TypeError, "x must have dtype"),
    ("encode list", lambda: encode_e2m1([1.0]), TypeError, "x must be a torch.Tensor"),
    ("decode float", lambda: decode_e2m1(torch.ones(4)), TypeError, "codes must have dtype uint8"),
    ("decode int64", lambda: decode_e2m1(torch.ones(4, dtype=I64)), TypeError, "codes must have dtype uint8"),
    ("pack nibbles list", lambda: pack_nibbles([1, 2]), TypeError, "codes must be a torch.Tensor"),
    ("pack nibbles 0-d", lambda: pack_nibbles(torch.tensor(1, dtype=torch.uint8)), ValueError, "codes must have at least 1"),
    ("pack nibbles odd", lambda: pack_nibbles(torch.ones(3, dtype=torch.uint8)), ValueError, "must be even"),
    ("pack nibbles int32", lambda: pack_nibbles(torch.ones(4, dtype=I32)), TypeError, "codes must have dtype uint8"),
    ("unpack nibbles 0-d", lambda: unpack_nibbles(torch.tensor(1, dtype=torch.uint8)), ValueError, "packed must have at least 1"),
    ("unpack nibbles bool", lambda: unpack_nibbles(torch.ones(2, dtype=torch.bool)), TypeError, "packed must have dtype uint8"),
    # --- 128x4 swizzle
    ("swizzle list", lambda: swizzle_128x4([[1, 2]]), TypeError, "scales must be a torch.Tensor"),
    ("swizzle 1-D", lambda: swizzle_128x4(torch.ones(4)), ValueError, "scales must have at least 2"),
    ("swizzle 0-d", lambda: swizzle_128x4(torch.tensor(1.0)), ValueError, "scales must have at least 2"),
    ("unswizzle list", lambda: unswizzle_128x4([0] * 512, 1, 1), TypeError, "swizzled must be a torch.Tensor"),
    ("unswizzle 0-d", lambda: unswizzle_128x4(torch.tensor(1), 1, 1), ValueError, "swizzled must have at least 1"),
    ("unswizzle rows True", lambda: unswizzle_128x4(torch.zeros(512), True, 4), TypeError, "rows must be an int"),
    ("unswizzle cols float", lambda: unswizzle_128x4(torch.zeros(512), 128, 4.0), TypeError, "cols must be an int"),
    ("unswizzle rows 0", lambda: unswizzle_128x4(torch.zeros(512), 0, 4), ValueError, "rows must be >= 1"),
    ("unswizzle size", lambda: unswizzle_128x4(torch.zeros(500), 128, 4), ValueError, "swizzled scales hold 500"),
    ("swizzled_shape negative", lambda: swizzled_shape(-1, 4), ValueError, "rows must be >= 0"),
    ("swizzled_shape str", lambda: swizzled_shape(4, "4"), TypeError, "cols must be an int"),
    ("swizzled_offset row -1", lambda: swizzled_offset(-1, 0, 4), ValueError, "row must be >= 0"),
    ("swizzled_offset col 9 of 4", lambda: swizzled_offset(0, 9, 4), ValueError, "col must be <= 3"),
    ("swizzled_offset col 4 of 4", lambda: swizzled_offset(0, 4, 4), ValueError, "col must be <= 3"),
    ("swizzled_offset col -1", lambda: swizzled_offset(0, -1, 4), ValueError, "col must be >= 0"),
    ("swizzled_offset cols 0", lambda: swizzled_offset(0, 0, 0), ValueError, "cols must be >= 1"),
    ("swizzled_offset row float", lambda: swizzled_offset(0.0, 0, 4), TypeError, "row must be an int"),
    # --- scalar scales in float32, where the format math runs (finite in float64 is not enough)
    ("nvfp4 global 1e-300 (0 in float32)", lambda: quantize_nvfp4(x16(2), 1e-300), ValueError, "global_scale must be positive in float32"),
    ("nvfp4 global 1e39 (inf in float32)", lambda: quantize_nvfp4(x16(2), 1e39), ValueError, "global_scale must be finite in float32"),
    ("nvfp4 global 1e-39 (1/g inf in float32)", lambda: quantize_nvfp4(x16(2), 1e-39), ValueError, "so that 1/global_scale is finite in float32"),
    ("nvfp4 global float64 tensor 1e-300", lambda: quantize_nvfp4(x16(2), torch.tensor([1.0, 1e-300], dtype=torch.float64)), ValueError, "global_scale must be finite and positive everywhere in float32"),
    ("nvfp4 global float64 tensor 1e39", lambda: quantize_nvfp4(x16(2), torch.tensor([1e39, 1.0], dtype=torch.float64)), ValueError, "global_scale must be finite and positive everywhere in float32"),
    ("nvfp4 global float32 tensor 1e-39", lambda: quantize_nvfp4(x16(2), torch.tensor([1.0, 1e-39])), ValueError, "with 1/global_scale finite too"),
    ("dequant nvfp4 global 1e39", lambda: dequantize_nvfp4(*nvfp4_pair(), 1e39), ValueError, "global_scale must be finite in float32"),
    ("dequant nvfp4 global 1e-300", lambda: dequantize_nvfp4(*nvfp4_pair(), 1e-300), ValueError, "global_scale must be positive in float32"),
    ("dequant nvfp4 global 1e-39", lambda: dequantize_nvfp4(*nvfp4_pair(), 1e-39), ValueError, "so that 1/global_scale is finite in float32"),
    ("dequant nvfp4 global 0-d float64 1e39", lambda: dequantize_nvfp4(*nvfp4_pair(), torch.tensor(1e39, dtype=torch.float64)), ValueError, "global_scale must be finite in float32"),
    ("dequant nvfp4 global tensor 1e-300", lambda: dequantize_nvfp4(*nvfp4_pair(), torch.tensor([1e-300, 1.0], dtype=torch.float64)), ValueError, "global_scale must be finite and positive everywhere in float32"),
    ("fp8 tensor scale 1e-300", lambda: quantize_fp8_per_tensor(torch.ones(4), scale=1e-300), ValueError, "scale must be positive in float32"),
    ("fp8 tensor scale 1e39", lambda: quantize_fp8_per_tensor(torch.ones(4), scale=1e39), ValueError, "scale must be finite in float32"),
    ("fp8 tensor scale 1e-39 (divided by)", lambda: quantize_fp8_per_tensor(torch.ones(4), scale=1e-39), ValueError, "so that 1/scale is finite in float32"),
    ("fp8 tensor scale float64 tensor 1e-300", lambda: quantize_fp8_per_tensor(torch.ones(4), scale=torch.tensor([1e-300], dtype=torch.float64)), ValueError, "scale must be positive in float32"),
    ("dequant fp8 tensor scale 1e39", lambda: dequantize_fp8_per_tensor(E4M3_ONES, 1e39), ValueError, "scale must be finite in float32"),
    ("dequant fp8 tensor scale 1e-300", lambda: dequantize_fp8_per_tensor(E4M3_ONES, 1e-300), ValueError, "scale must be positive in float32"),
    ("dequant fp8 tensor scale float64 tensor 1e39", lambda: dequantize_fp8_per_tensor(E4M3_ONES, torch.tensor(1e39, dtype=torch.float64)), ValueError, "scale must be finite in float32"),
    # --- output dtypes that cannot hold the decoded values (float8 would clip 2688 to 448)
    ("dequant nvfp4 dtype float8_e4m3fn", lambda: dequantize_nvfp4(*nvfp4_pair(), dtype=torch.float8_e4m3fn), TypeError, "dtype must be a floating torch.dtype (float16, bfloat16, float32, float64)"),
    ("dequant nvfp4 dtype float8_e5m2", lambda: dequantize_nvfp4(*nvfp4_pair(), dtype=torch.float8_e5m2), TypeError, "dtype must be a floating"),
    ("dequant mxfp4 dtype float8_e4m3fn", lambda: dequantize_mxfp4(*mx_pair("fp4"), dtype=torch.float8_e4m3fn), TypeError, "dtype must be a floating"),
    ("dequant mxfp8 dtype float8_e4m3fn", lambda: dequantize_mxfp8(*mx_pair("fp8"), dtype=torch.float8_e4m3fn), TypeError, "dtype must be a floating"),
    ("dequant mxint4 dtype float8_e5m2", lambda: dequantize_mxint4(*mx_pair("int4"), dtype=torch.float8_e5m2), TypeError, "dtype must be a floating"),
    ("dequant fp8 tensor dtype float8_e4m3fn", lambda: dequantize_fp8_per_tensor(E4M3_ONES, 1.0, dtype=torch.float8_e4m3fn), TypeError, "dtype must be a floating"),
    ("dequant fp8 tensor dtype complex64", lambda: dequantize_fp8_per_tensor(E4M3_ONES, 1.0, dtype=torch.complex64), TypeError, "dtype must be a floating"),
    # --- nibble codes past 4 bits
    ("pack nibbles code 16", lambda: pack_nibbles(torch.tensor([16, 0], dtype=torch.uint8)), ValueError, "codes must lie in 0..15"),
    ("pack nibbles code 255", lambda: pack_nibbles(torch.tensor([[1, 2], [3, 255]], dtype=torch.uint8)), ValueError, "got a code of 255"),
    # --- GPU architectures
    ("config arch sm90x", lambda: Nvfp4MoeConfig(arch="sm90x"), ValueError, "arch 'sm90x' is not a GPU architecture"),
    ("arch sm_90z", lambda: parse_arch("sm_90z"), ValueError, "arch 'sm_90z' is not a GPU architecture"),
    ("arch sm 90", lambda: parse_arch("sm 90"), ValueError, "is not a GPU architecture"),
    ("arch sm_1000", lambda: parse_arch("sm_1000"), ValueError, "is not a GPU architecture"),
    ("arch empty", lambda: parse_arch(""), ValueError, "is not a GPU architecture"),
    ("arch -90", lambda: parse_arch(-90), ValueError, "arch must be a non-negative"),
    ("arch 1-tuple", lambda: parse_arch((9,)), ValueError, "arch as a tuple must be (major, minor)"),
    ("arch negative tuple", lambda: parse_arch((9, -1)), ValueError, "arch as a tuple must be (major, minor)"),
    ("arch None", lambda: parse_arch(None), TypeError, "arch must be a str, an int or a (major, minor) tuple"),
    ("arch float", lambda: parse_arch(9.0), TypeError, "arch must be a str"),
    ("arch bool", lambda: parse_arch(True), TypeError, "arch must be a str"),
    # --- Nvfp4MoeConfig.max_num_tokens and get_executor's int32 slot / row indices
    ("config max_num_tokens 2^40", lambda: Nvfp4MoeConfig(max_num_tokens=2**40), ValueError, f"max_num_tokens must be <= MAX_NUM_TOKENS = {MAX_NUM_TOKENS}"),
    ("config max_num_tokens 2^20 + 1", lambda: Nvfp4MoeConfig(max_num_tokens=MAX_NUM_TOKENS + 1), ValueError, "max_num_tokens must be <= MAX_NUM_TOKENS"),
    ("executor top_k too large for int32", lambda: executor_for(Nvfp4MoeConfig(arch="sm90", max_num_tokens=MAX_NUM_TOKENS), top_k=4096), ValueError, "top_k=4096 is too large for max_num_tokens=1048576"),
    # --- get_executor: checked before anything is built
    ("executor activation bogus", lambda: executor_for(activation="bogus"), ValueError, "unknown activation 'bogus'"),
    ("executor activation non-gated", lambda: executor_for(activation="gelu"), ValueError, "activation GELU is non-gated"),
    ("executor activation int", lambda: executor_for(activation=3), TypeError, "activation must be"),
    ("executor CPU weights", lambda: executor_for(), ValueError, "weights are on cpu; the executor runs on a CUDA device"),
    ("executor config str", lambda: executor_for("config"), TypeError, "config must be an Nvfp4MoeConfig"),
    ("executor weights str", lambda: executor_for(weights="weights"), TypeError, "weights must be the Nvfp4Weights"),
    ("executor local_expert_start -1", lambda: executor_for(local_expert_start=-1), ValueError, "local_expert_start must be >= 0"),
    ("executor local_expert_start past int32", lambda: executor_for(local_expert_start=2**31 - 1), ValueError, "local_expert_start must be <= 2147483646"),
    # --- MoeLayer
    ("MoeLayer local_expert_start -5", lambda: moe_layer(local_expert_start=-5), ValueError, "local_expert_start must be >= 0"),
    ("MoeLayer local_expert_start True", lambda: moe_layer(local_expert_start=True), TypeError, "local_expert_start must be an int"),
    ("MoeLayer local_expert_start 2^31", lambda: moe_layer(local_expert_start=2**31), ValueError, "local_expert_start must be <="),
    ("MoeLayer activation non-gated", lambda: moe_layer(activation="relu"), ValueError, "activation ReLU is non-gated"),
    ("MoeLayer activation bogus", lambda: moe_layer(activation="bogus"), ValueError, "unknown activation 'bogus'"),
    # --- low-latency 16-bit weights
    ("ll bf16 w1 nan", lambda: LL.prepare_bf16_weights(*dense_pair(torch.bfloat16, "w1", NAN)), ValueError, "w1 contains NaN or Inf"),
    ("ll bf16 w2 -inf", lambda: LL.prepare_bf16_weights(*dense_pair(torch.bfloat16, "w2", -INF)), ValueError, "w2 contains NaN or Inf"),
    ("ll fp16 w1 inf", lambda: LL.prepare_fp16_weights(*dense_pair(torch.float16, "w1", INF)), ValueError, "w1 contains NaN or Inf"),
    ("ll fp16 w2 nan", lambda: LL.prepare_fp16_weights(*dense_pair(torch.float16, "w2", NAN)), ValueError, "w2 contains NaN or Inf"),
    # --- expert scales of the references
    ("reference w1_alpha nan", lambda: reference_moe(*replaced(reference_layer(ids2([0, -1])), W1_ALPHA, torch.tensor([NAN]))), ValueError, "w1_alpha contains NaN or Inf"),
    ("reference w2_alpha inf", lambda: reference_moe(*replaced(reference_layer(ids2([0, -1])), W2_ALPHA, torch.tensor([INF]))), ValueError, "w2_alpha contains NaN or Inf"),
    ("aligned reference gate scale nan", lambda: reference_aligned_moe(**aligned_args(output1_scale_gate_scalar=torch.tensor([1.0, NAN]))), ValueError, "output1_scale_gate_scalar contains NaN or Inf"),
    ("aligned reference up scale inf", lambda: reference_aligned_moe(**aligned_args(output1_scale_scalar=torch.tensor([INF, 1.0]))), ValueError, "output1_scale_scalar contains NaN or Inf"),
    ("aligned reference down scale -inf", lambda: reference_aligned_moe(**aligned_args(output2_scale_scalar=torch.tensor([1.0, -INF]))), ValueError, "output2_scale_scalar contains NaN or Inf"),
    ("aligned routed_scaling_factor 1e39", lambda: reference_aligned_moe(**aligned_args(routed_scaling_factor=1e39)), ValueError, "routed_scaling_factor must be finite in float32"),
    # --- align_routing
    ("align_routing num_experts 2^40", lambda: align_routing(ids2([0]), 8, num_experts=2**40), ValueError, "num_experts must be <= 512"),
    ("align_routing num_experts 513", lambda: align_routing(ids2([0]), 8, num_experts=513), ValueError, "num_experts must be <= 512"),
    # --- activation parameters
    ("SwiGLU alpha str", lambda: SwiGLU(alpha="1"), TypeError, "SwiGLU.alpha must be a real number, got str"),
    ("SwiGLU beta None", lambda: SwiGLU(beta=None), TypeError, "SwiGLU.beta must be a real number, got NoneType"),
    ("SwiGLU limit bool", lambda: SwiGLU(limit=True), TypeError, "SwiGLU.limit must be a real number, got bool"),
    ("SwiGLU limit tensor", lambda: SwiGLU(limit=torch.tensor(7.0)), TypeError, "SwiGLU.limit must be a real number, got Tensor"),
    ("SiTU a None", lambda: SiTU(a=None), TypeError, "SiTU.a must be a real number, got NoneType"),
    ("SwiGLUStep limit str", lambda: SwiGLUStep(limit="7"), TypeError, "SwiGLUStep.limit must be a real number, got str"),
    ("SwiGLU beta nan", lambda: SwiGLU(beta=NAN), ValueError, "SwiGLU.beta must be finite"),
    ("SwiGLU alpha 1e39 (inf in float32)", lambda: SwiGLU(alpha=1e39), ValueError, "SwiGLU.alpha must be finite"),
    ("SwiGLU limit 1e-50 (0 in float32)", lambda: SwiGLU(limit=1e-50), ValueError, "SwiGLU.limit must be positive (inf allowed) in float32"),
    ("SiTU a 1e-50 (0 in float32)", lambda: SiTU(a=1e-50), ValueError, "SiTU.a must be positive and finite in float32"),
    ("SiTU b nan", lambda: SiTU(b=NAN), ValueError, "SiTU.b must be positive and finite"),
    ("SiTU b 1e39", lambda: SiTU(b=1e39), ValueError, "SiTU.b must be positive and finite"),
    # --- prebuild's argument parsing (argparse turns these into "argument --shape: ..." and exit 2)
    ("prebuild shape H 100", lambda: prebuild.parse_shape("8,100,256,2"), argparse.ArgumentTypeError, "hidden size H must be a multiple of 128, got 100"),
    ("prebuild shape I 200", lambda: prebuild.parse_shape("8,128,200,2"), argparse.ArgumentTypeError, "intermediate size I must be a multiple of 128, got 200"),
    ("prebuild buckets max=5000", lambda: prebuild.parse_buckets("max=5000"), argparse.ArgumentTypeError, "max must be <= 4096 (the largest token bucket), got 5000"),
    # --- expert sharding: world_size and rank are keyword-only (they cannot be swapped silently)
    ("expert_shard positional", lambda: expert_shard(8, 2, 1), TypeError, "positional"),
    ("shard_weights positional", lambda: shard_weights(torch.zeros(8, 1), torch.zeros(8, 1), 1, 2), TypeError, "positional"),
    ("expert_shard rank 2 of 2", lambda: expert_shard(8, world_size=2, rank=2), ValueError, "rank must be <= 1"),
    ("shard_weights world_size 0", lambda: shard_weights(torch.zeros(8, 1), torch.zeros(8, 1), world_size=0, rank=0), ValueError, "world_size must be >= 1"),
]


@pytest.mark.parametrize(("call", "error", "message"), [row[1:] for row in ROWS], ids=[row[0] for row in ROWS])
def test_bad_input_is_refused(call, error: type[Exception], message: str) -> None:
    with pytest.raises(error) as raised:
        call()
    assert type(raised.value) is error
    assert message in str(raised.value)


def test_reference_accepts_int64_ids_at_the_int32_edges() -> None:
    out = reference_moe(*reference_layer(torch.tensor([[0, 2**31 - 1]], dtype=I64)))
    masked = reference_moe(*reference_layer(torch.tensor([[0, -1]], dtype=I64)))
    assert torch.equal(out, masked)  # 2^31 - 1 names no local expert: unrouted, as on the GPU


def test_nvfp4_without_the_finite_check_documents_nan_and_inf() -> None:
    x = torch.ones(2, 16)
    x[0, 3], x[1, 5] = NAN, -INF
    packed, scales = quantize_nvfp4(x, check_finite=False)
    assert math.isnan(scales[0, 0].float().item()) and unpack_nibbles(packed)[0].eq(0).all()
    assert scales[1, 0].float().item() == 448.0 and unpack_nibbles(packed)[1, 5].item() == 0xF  # -6


def test_nothing_is_written_when_a_check_fails() -> None:
    w = torch.ones(2, 16)
    before = w.clone()
    with pytest.raises(ValueError):
        quantize_nvfp4(w, torch.tensor([1.0, -1.0]))
    assert torch.equal(w, before)


def test_fp8_per_tensor_takes_any_shape_as_documented() -> None:
    values, scale = quantize_fp8_per_tensor(torch.tensor(-3.0))  # 0-d: its own amax
    assert values.shape == () and scale.item() == pytest.approx(3.0 / 448)
    assert dequantize_fp8_per_tensor(values, scale).item() == pytest.approx(-3.0)
    empty, given = quantize_fp8_per_tensor(torch.empty(2, 0), scale=0.5)  # empty with an explicit scale
    assert empty.shape == (2, 0) and empty.dtype == torch.float8_e4m3fn and given.item() == 0.5
    assert dequantize_fp8_per_tensor(E4M3_ONES, torch.ones(1, 1)).shape == (4,)  # a one-element scale keeps the shape


def test_scales_at_the_float32_edges_are_accepted() -> None:
    tiny = 2.0**-126  # the smallest normal float32: 1 / tiny = 2^126 is finite
    for g in (tiny, 3.0e38):
        packed, scales = quantize_nvfp4(x16(2), g)
        assert torch.isfinite(dequantize_nvfp4(packed, scales, g)).all()
    assert torch.isfinite(dequantize_fp8_per_tensor(E4M3_ONES, 1e-40)).all()  # decoding multiplies: subnormal is fine
    assert dequantize_nvfp4(*nvfp4_pair(), dtype=torch.float16).dtype == torch.float16


def test_pack_nibbles_takes_every_4_bit_code() -> None:
    codes = torch.arange(16, dtype=torch.uint8)
    assert torch.equal(unpack_nibbles(pack_nibbles(codes)), codes)
    assert pack_nibbles(torch.empty(0, dtype=torch.uint8)).shape == (0,)


def test_swizzled_offset_edges() -> None:
    assert swizzled_offset(0, 3, 4) == 3 and swizzled_offset(127, 0, 4) == 31 * 16 + 3 * 4
    assert swizzled_offset(0, 4, 5) == 512  # the second column tile


def test_parse_arch_accepts_the_documented_forms() -> None:
    for text in ("sm90", "sm_90", "SM_90A", " sm90a ", "90", "9.0", "sm_90f"):
        assert parse_arch(text) == (9, 0)
    assert parse_arch("sm_103a") == (10, 3) and parse_arch(100) == (10, 0) and parse_arch((10, 0)) == (10, 0)


def test_align_routing_takes_the_most_experts_a_layer_holds() -> None:
    _, _, post = align_routing(ids2([511]), 8, num_experts=512)
    assert post.tolist() == [8]


def test_prebuild_buckets_max_rounds_up_to_a_power_of_two() -> None:
    assert prebuild.parse_buckets("max=5") == (1, 2, 4, 8)
    assert prebuild.parse_shape("8,128,256,2").hidden == 128


# ----------------------------------------------------------------------------- cudnn_moe.validate


@pytest.mark.parametrize(
    ("value", "minimum", "maximum", "error", "message"),
    [
        (True, None, None, TypeError, "n must be an int, got bool"),
        (False, 0, None, TypeError, "got bool"),
        (1.0, None, None, TypeError, "got float"),
        ("3", None, None, TypeError, "got str"),
        (torch.tensor(3), None, None, TypeError, "got Tensor"),
        (0, 1, None, ValueError, "n must be >= 1, got 0"),
        (9, 1, 8, ValueError, "n must be <= 8, got 9"),
    ],
)
def test_require_int_arg_refuses(value, minimum, maximum, error, message) -> None:
    with pytest.raises(error, match=message):
        require_int_arg("n", value, minimum, maximum)


def test_require_int_arg_accepts() -> None:
    assert require_int_arg("n", 5, 1, 8) == 5
    assert require_int_arg("n", -3) == -3


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        (NAN, ValueError, "s must be finite"),
        (INF, ValueError, "s must be finite"),
        (0.0, ValueError, "s must be positive"),
        (-1, ValueError, "s must be positive"),
        (True, TypeError, "s must be a number"),
        (None, TypeError, "s must be a number"),
        (torch.ones(2), TypeError, "one-element floating tensor"),
        (torch.tensor(2), TypeError, "one-element floating tensor"),
        (torch.tensor(NAN), ValueError, "s must be finite"),
    ],
)
def test_require_finite_scalar_refuses(value, error, message) -> None:
    with pytest.raises(error, match=message):
        require_finite_scalar("s", value, positive=True)


def test_require_finite_scalar_accepts() -> None:
    assert require_finite_scalar("s", 2) == 2.0
    assert require_finite_scalar("s", torch.tensor([0.5])) == 0.5
    assert require_finite_scalar("s", -1.5) == -1.5  # sign allowed unless positive=True


@pytest.mark.parametrize(
    ("value", "kwargs", "message"),
    [
        (1e39, {}, "s must be finite in float32"),
        (-1e39, {}, "s must be finite in float32"),
        (3.4028236e38, {}, "s must be finite in float32"),  # rounds past the largest float32
        (1e-300, {"positive": True}, "s must be positive in float32, got 1e-300 (it rounds to 0)"),
        (1e-39, {"reciprocal": True}, "so that 1/s is finite in float32"),
        (0.0, {"reciprocal": True}, "s must be positive"),
        (NAN, {}, "s must be finite"),
    ],
)
def test_require_float32_scalar_refuses(value, kwargs, message) -> None:
    with pytest.raises(ValueError) as raised:
        require_float32_scalar("s", value, **kwargs)
    assert message in str(raised.value)


def test_require_float32_scalar_accepts() -> None:
    assert require_float32_scalar("s", 3.4028234663852886e38) == 3.4028234663852886e38
    assert require_float32_scalar("s", 1e-300) == 0.0  # fine where zero is fine
    assert require_float32_scalar("s", -2) == -2.0
    assert require_float32_scalar("s", 0.1) == float(torch.tensor(0.1, dtype=torch.float32))  # the float32 value
    assert require_float32_scalar("s", 2.0**-126, reciprocal=True) == 2.0**-126
    assert require_float32_scalar("s", torch.tensor([1e-39]), positive=True) > 0  # a subnormal is positive


def test_require_positive_finite_in_float32() -> None:
    wide = torch.tensor([1.0, 1e-300], dtype=torch.float64)
    require_positive_finite("g", wide)  # positive in float64
    with pytest.raises(ValueError, match="g must be finite and positive everywhere in float32"):
        require_positive_finite("g", wide, in_float32=True)
    require_positive_finite("g", torch.tensor([1e-39]), in_float32=True)
    with pytest.raises(ValueError, match="with 1/g finite too"):
        require_positive_finite("g", torch.tensor([1e-39]), reciprocal=True)


def test_require_positive_finite() -> None:
    require_positive_finite("g", torch.tensor([1.0, 2.0]))
    require_positive_finite("g", torch.empty(0))
    for bad in (0.0, -1.0, NAN, INF):
        with pytest.raises(ValueError, match="g must be finite and positive"):
            require_positive_finite("g", torch.tensor([1.0, bad]))


def test_require_float_tensor() -> None:
    assert require_float_tensor("x", torch.ones(2), min_rank=1).shape == (2,)
    with pytest.raises(TypeError, match="x must be a torch.Tensor, got list"):
        require_float_tensor("x", [1.0])
    with pytest.raises(TypeError, match="x must be a floating tensor .*got int32"):
        require_float_tensor("x", torch.ones(2, dtype=I32))
    with pytest.raises(ValueError, match="x must have at least 2"):
        require_float_tensor("x", torch.ones(2), min_rank=2)


def test_require_no_overlap() -> None:
    buf = torch.zeros(10, 8)
    require_no_overlap("a", buf[:5], "b", buf[5:])  # adjacent, disjoint
    require_no_overlap("a", buf, "b", torch.zeros(10, 8))
    require_no_overlap("a", buf[:0], "b", buf)  # empty never overlaps
    require_no_overlap("a", torch.zeros(4, device="meta"), "b", torch.zeros(4, device="meta"))
    for a, b in [
        (buf, buf),
        (buf[:6], buf[5:]),
        (buf[3:4, 2:3], buf),  # a single element inside
        (buf.view(torch.uint8)[3:4, 5:6], buf[3]),  # another dtype view of the same bytes
        (buf.T, buf[9]),  # a transposed view reaches the last row
        (buf[:, 0], buf[:, 7]),  # strided columns: interleaved extents are refused (conservative)
    ]:
        with pytest.raises(ValueError, match="out overlaps the memory of weights.w1"):
            require_no_overlap("out", a, "weights.w1", b)


# ---------------------------------------------------------------------------------------------------------------
# The public op's own argument checks (CPU: they fire before any GPU work)
# ---------------------------------------------------------------------------------------------------------------


def _cpu_layer():
    from cudnn_moe import Nvfp4MoeConfig

    gen = torch.Generator().manual_seed(0)
    config = Nvfp4MoeConfig(arch="sm90")
    weights = config.prepare_weights(torch.randn(2, 256, 128, generator=gen), torch.randn(2, 128, 128, generator=gen))
    return config, weights


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda c, w: cudnn_moe.get_executor(c, w, top_k=2, activation="swiglu", local_expert_start=True),
         TypeError, "local_expert_start"),
        (lambda c, w: cudnn_moe.get_executor(c, w, top_k=0, activation="swiglu", local_expert_start=0),
         ValueError, "top_k"),
        (lambda c, w: cudnn_moe.unfinalized_row_count(w, True, 2), TypeError, "num_tokens"),
        (lambda c, w: cudnn_moe.unfinalized_row_count(w, -1, 2), ValueError, "num_tokens"),
        (lambda c, w: cudnn_moe.unfinalized_row_count(w, 4, 2.0), TypeError, "top_k"),
        (lambda c, w: cudnn_moe.unfinalized_row_count("weights", 4, 2), TypeError, "weights"),
        (lambda c, w: cudnn_moe.Nvfp4MoeConfig(max_num_tokens=True), ValueError, "max_num_tokens"),
        (lambda c, w: cudnn_moe.Nvfp4MoeConfig(engine="fastest"), ValueError, "engine"),
        (lambda c, w: cudnn_moe.Nvfp4MoeConfig(arch="sm120"), ValueError, "arch"),
    ],
)
def test_op_arguments(call, error, match):
    config, weights = _cpu_layer()
    with pytest.raises(error, match=match):
        call(config, weights)


def test_unfinalized_row_count_needs_no_gpu():
    _, weights = _cpu_layer()
    # 6 slots + up to 7 padding rows for each of the 2 experts, rounded up to the 8-row alignment
    assert cudnn_moe.unfinalized_row_count(weights, 3, 2) == 24


@pytest.mark.parametrize("shape", [(3, 50, 7), (2, 1000), (1000,), (5, 7, 3, 11)])
def test_finiteness_is_checked_in_slices(monkeypatch: pytest.MonkeyPatch, shape: tuple[int, ...]) -> None:
    """require_finite reads large tensors in slices (no full-size temporary) and still finds a NaN or Inf in
    the first or last element, whatever the slicing."""
    from cudnn_moe import validate

    monkeypatch.setattr(validate, "_FINITE_CHUNK", 100)
    value = torch.randn(shape)
    validate.require_finite("w1", value)
    for index, bad in ((-1, float("nan")), (0, float("inf"))):
        broken = value.clone()
        broken.view(-1)[index] = bad
        with pytest.raises(ValueError, match="w1 contains NaN or Inf"):
            validate.require_finite("w1", broken)
