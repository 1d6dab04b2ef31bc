"""Bad input to the CPU-side public API raises TypeError / ValueError naming the argument, before any work.

One table row per (call, expected exception, text the message must contain); the shared checks
of cudnn_moe.validate get their own unit tests below.
"""

from __future__ import annotations

import math

import pytest
import torch

import cudnn_moe

from cudnn_moe.activations import parse_activation
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
    swizzled_shape,
    unpack_nibbles,
    unswizzle_128x4,
)
from cudnn_moe.reference import reference_moe
from cudnn_moe.routing import Routing, pack_routing, unpack_routing
from cudnn_moe.validate import (
    require_finite_scalar,
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
    ("fp8 tensor 0-d", lambda: quantize_fp8_per_tensor(torch.tensor(1.0)), ValueError, "x must have at least 1"),
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
