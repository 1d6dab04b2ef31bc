"""Float64 references of the low-latency MoE config, one per weight format, with the contract's roundings.

Weights are decoded exactly (in float64; MXFP4 through FP32 like the kernels, which keeps E8M0's
range) and every GEMM is summed in float64. Then, per routed slot (token t, expert e), in order:

1. preactivation h = x_t @ w1_e^T, rounded through FP32 (the kernels' accumulator) to
   - the input dtype (BF16 or FP16) for BF16, FP16, NVFP4, MXFP4 and FP8 weight-only (FP8: weight =
     e4m3 * the expert's FP32 scale, exact in float64; the GPU multiplies its FP32 sum by the scale);
   - FP32 only (kept as FP32) for MXINT4 weight-only;
   - BF16 for the NVFP4 weight + NVFP4 activation pair (its inputs are NVFP4, decoded exactly);
2. intermediate y = activation(h) in float64, rounded through FP32 to the input dtype (BF16 for the
   NVFP4 pair; this config does not requantize it to NVFP4);
3. expert row r = y @ w2_e^T, rounded through FP32 to the output dtype (BF16 or FP16; BF16 only
   for the NVFP4 pair);
4. finalize, per token: acc = 0 (FP32); for each slot in order, p = fp32(weight * r) then
   acc = fp32(acc + p): a separate multiply and add, never fused; out = acc rounded to the output
   dtype. Packed route weights are the BF16 values of the packing; unpacked FP32/BF16 weights are
   used as FP32.

Expert ids: for the NVFP4 pair and the MX pairs an id outside [0, E) marks an unrouted slot: finalize skips it and its
weight (a NaN or Inf weight there never reaches the output) and its raw row is zero. For every other
format such an id raises ValueError (the GPU call cannot check it without a device sync and requires
ids in range). A token may name an expert twice; each slot is computed on its own.

Per-tensor FP8 (``reference_fp8_per_tensor``) has its own steps 1-3, in E4M3 code values (every E4M3 value
and every product of two is exact in FP32 and float64):
1. h = fp32(sum_k xq[k] * w1q[e, n, k] * fc1_factor[e]) rounded to BF16, where xq are the token codes of
   ``prepare_fp8_per_tensor_activations``, w1q the weight codes and fc1_factor[e] = fp32(input_scale * w1_scale[e]);
2. y = activation(h) in float64, rounded to FP32; q = e4m3(fp32(y * fp32(1 / intermediate_scale))) (nearest
   even, saturating at +-448), kept as its unscaled E4M3 value (what the GPU's intermediate workspace holds);
3. r = fp32(sum_i q[i] * w2q[e, h, i] * fc2_factor[e]) rounded to BF16, fc2_factor[e] =
   fp32(intermediate_scale * w2_scale[e]); step 4 as above, BF16 output only.

DeepSeek FP8 (``reference_deepseek_fp8``) likewise, with scales per 128 values (block b = k // 128):
0. tokens: BF16 x quantized per 128 values, s_x[t, b] = fp32(amax / 448) (1.0 for an all-zero block) and
   xq = e4m3(fp32(x / s_x)) (``cudnn_moe.formats.quantize_fp8_act128``), or prequantized codes and scales as given;
1. h[n] = fp32(sum_b P1[b] * fp32(s_x[t, b] * s_w1[e, n // 128, b])), P1[b] the exact sum of the block's code
   products; h stays FP32 (no preactivation rounding);
2. y = fp32(activation(h)) (float64 activation); per 128 values of y: s_y = fp32(amax / 448) (1.0 for zero),
   yq = e4m3(fp32(y / s_y));
3. r[h] = fp32(sum_b P2[b] * fp32(s_y[b] * s_w2[e, h // 128, b])) rounded to BF16; step 4 as above, BF16 only.

The MX pairs (``reference_mx_pair``: MXFP4 or MXFP8 weights, MXFP8 tokens, E8M0 scales per 32 values, b = k // 32):
1. h[n] = fp32(sum_b P1[b] * fp32(s_x[t, b] * s_w1[e, n, b])) rounded to BF16, P1[b] the exact block code products;
2. y = fp32(activation(h)); per 32 values of y: s_y = 2^clamp(floor(log2 amax) - 8, -127, 127) (2^-127 for zero),
   yq = e4m3(fp32(y / s_y)) (``cudnn_moe.formats.quantize_mxfp8``);
3. r[h] = fp32(sum_b P2[b] * fp32(s_y[b] * s_w2[e, h, b])) rounded to the output dtype (BF16 or FP16); step 4 as
   above.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..activations import Activation, ActivationKind, parse_activation
from ..formats import (
    MX_BLOCK,
    decode_e2m1,
    dequantize_mxfp4,
    dequantize_mxint4,
    dequantize_nvfp4,
    quantize_mxfp8,
    unpack_nibbles,
)
from ..engines.base import MX_PAIRS
from ..formats.fp8 import quantize_fp8_act128
from ..formats.blocks import to_e4m3
from ..routing import Routing
from ..validate import require_tensor
from ..weights.low_latency import (
    DeepSeekFp8Activations,
    DeepSeekFp8Weights,
    DenseWeights,
    Fp8PerTensorActivations,
    Fp8PerTensorWeights,
    Fp8WeightOnlyWeights,
    LowLatencyWeights,
    Mxfp4PairWeights,
    Mxfp4WeightOnlyWeights,
    Mxfp8Activations,
    Mxfp8PairWeights,
    Mxint4WeightOnlyWeights,
    Nvfp4PairWeights,
    Nvfp4WeightOnlyWeights,
    WeightFormat,
)
from ..weights.nvfp4 import Nvfp4Activations
from .config import MAX_NUM_TOKENS, MAX_TOP_K

_OUT_DTYPES = (torch.bfloat16, torch.float16)
_F64 = torch.float64
ActivationArg = Activation | ActivationKind | str


@dataclass(frozen=True, eq=False)
class RawReference:
    """Per-slot results before the weighted sum (identity route mapping: slot (t, s) is row (t, s)).

    rows: [T, k, H] of the output dtype, zero where ``mask`` is False.
    weights: float32 [T, k], the route weights as given (packed ones BF16-rounded), NaN/Inf kept: the scores
        ``low_latency_moe(..., finalize=False, return_scores=True)`` returns (also as ``scores``).
    mask: bool [T, k], False for unrouted slots (NVFP4 and MX pairs only; all True otherwise).
    """

    rows: torch.Tensor
    weights: torch.Tensor
    mask: torch.Tensor

    @property
    def scores(self) -> torch.Tensor:
        """``weights`` under the name of the GPU call's raw output (``RawOutput.scores``): what it must return."""
        return self.weights


def _round(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float64 -> FP32 (the accumulator) -> ``dtype``, back in float64 storage."""
    return x.float().to(dtype).double()


def combine_ordered_fp32(
    rows: torch.Tensor, weights: torch.Tensor, mask: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """Finalize: rows [T, k, H] (values of the output dtype), weights float32 [T, k], mask bool [T, k].

    acc = 0; for s in slot order where mask: acc = fp32(acc + fp32(weight[:, s] * rows[:, s])). Each
    multiply and add is its own FP32 operation (no fused multiply-add). Returns ``out_dtype`` [T, H].
    """
    acc = torch.zeros(rows.shape[0], rows.shape[2], dtype=torch.float32, device=rows.device)
    for slot in range(rows.shape[1]):
        product = weights[:, slot, None].float() * rows[:, slot].float()
        acc = torch.where(mask[:, slot, None], acc + product, acc)
    return acc.to(out_dtype)


def _decode(weights: LowLatencyWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact float64 (w1 [E, N1, H], w2 [E, H, I]) from the weights' canonical (unpadded) form."""
    if isinstance(weights, DenseWeights):
        w1, w2 = weights.canonical()
        return w1.double(), w2.double()
    if isinstance(weights, Fp8WeightOnlyWeights):
        w1, s1, w2, s2 = weights.canonical()
        return w1.double() * s1.double()[:, None, None], w2.double() * s2.double()[:, None, None]
    if isinstance(weights, Nvfp4WeightOnlyWeights):
        w1c, w1s, w1g, w2c, w2s, w2g = weights.canonical()
        w1 = dequantize_nvfp4(w1c, w1s, dtype=_F64) * w1g.double()[:, None, None]
        return w1, dequantize_nvfp4(w2c, w2s, dtype=_F64) * w2g.double()[:, None, None]
    decode = dequantize_mxfp4 if isinstance(weights, Mxfp4WeightOnlyWeights) else dequantize_mxint4
    w1c, w1s, w2c, w2s = weights.canonical()
    return decode(w1c, w1s).double(), decode(w2c, w2s).double()  # through FP32, as the kernels decode


def _routing(routing: object, num_tokens: int, num_experts: int, device: torch.device, unrouted_ok: bool):
    """(ids int64 [T, k], weights float32 [T, k], mask bool [T, k]) after the checks on ``routing``."""
    if not isinstance(routing, Routing):
        raise TypeError(f"routing must be a Routing, got {type(routing).__name__}")
    if routing.num_tokens != num_tokens:
        raise ValueError(f"routing has {routing.num_tokens} tokens but the input has {num_tokens}")
    if routing.top_k > MAX_TOP_K:
        raise ValueError(f"routing has top_k={routing.top_k}; the low-latency config takes top_k <= {MAX_TOP_K}")
    if routing.device != device:
        raise ValueError(f"routing is on {routing.device} but the weights are on {device}")
    ids, route_weights = routing.ids_and_weights()
    mask = (ids >= 0) & (ids < num_experts)
    if not unrouted_ok and not bool(mask.all()):
        bad = ids[~mask][0].item()
        raise ValueError(
            f"routing names expert {bad}, outside [0, {num_experts}); only the pairs with quantized activations "
            "(NVFP4 + NVFP4, MXFP4 or MXFP8 + MXFP8) treat such ids as unrouted slots"
        )
    return ids.long(), route_weights, mask


def _run(
    x: torch.Tensor,
    weights: LowLatencyWeights,
    routing: object,
    activation: ActivationArg,
    *,
    preact_dtype: torch.dtype,
    inter_dtype: torch.dtype,
    out_dtype: object,
    finalize: bool,
    unrouted_ok: bool,
) -> torch.Tensor | RawReference:
    """Shared pipeline; x is float64 [T, H] (exact input values)."""
    act = _activation_for(activation, weights)
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"out_dtype must be torch.bfloat16 or torch.float16, got {out_dtype!r}")
    _require_bool("finalize", finalize)
    w1, w2 = _decode(weights)
    if x.device != w1.device:
        raise ValueError(f"the input is on {x.device} but the weights are on {w1.device}")
    num_tokens = x.shape[0]
    ids, route_weights, mask = _routing(routing, num_tokens, w1.shape[0], w1.device, unrouted_ok)
    rows = torch.zeros(num_tokens, ids.shape[1], weights.hidden_size, dtype=out_dtype, device=x.device)
    for expert in range(w1.shape[0]):
        tokens, slots = ((ids == expert) & mask).nonzero(as_tuple=True)
        if tokens.numel():
            h = _round(x[tokens] @ w1[expert].T, preact_dtype)
            y = _round(act.apply_gemm1(h), inter_dtype)
            rows[tokens, slots] = (y @ w2[expert].T).float().to(out_dtype)
    if not finalize:
        return RawReference(rows=rows, weights=route_weights, mask=mask)
    return combine_ordered_fp32(rows, route_weights, mask, out_dtype)


def _activation_for(activation: ActivationArg, weights: LowLatencyWeights) -> Activation:
    """The parsed activation, refused (ValueError) when its gating does not match the weights'."""
    act = parse_activation(activation)
    if act.gated != weights.gated:
        kind = "gated" if weights.gated else "non-gated"
        raise ValueError(f"activation {type(act).__name__} does not fit the {kind} weights")
    return act


def _require_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


def _check_input(x: object, weights: object, cls: type, fmt: WeightFormat, dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    if not isinstance(weights, cls) or weights.format is not fmt:
        raise TypeError(f"weights must be {cls.__name__} prepared as {fmt.value}, got {type(weights).__name__}"
                        + (f" ({weights.format.value})" if isinstance(weights, LowLatencyWeights) else ""))
    x = require_tensor("x", x, dtypes, rank=2)
    if x.shape[1] != weights.hidden_size:
        raise ValueError(f"x must be [T, {weights.hidden_size}] to match the weights, got {tuple(x.shape)}")
    if x.shape[0] > MAX_NUM_TOKENS:
        raise ValueError(f"x has {x.shape[0]} tokens; the low-latency config takes at most {MAX_NUM_TOKENS}")
    return x


def _reference_16bit(fmt: WeightFormat, dtype: torch.dtype, x, weights, routing, activation, out_dtype, finalize):
    x = _check_input(x, weights, DenseWeights, fmt, (dtype,))
    return _run(x.double(), weights, routing, activation, preact_dtype=dtype, inter_dtype=dtype,
                out_dtype=out_dtype, finalize=finalize, unrouted_ok=False)


def reference_bf16(
    x: torch.Tensor, weights: DenseWeights, routing: Routing, activation: ActivationArg, *,
    out_dtype: torch.dtype = torch.bfloat16, finalize: bool = True,
) -> torch.Tensor | RawReference:
    """BF16 weights and BF16 x [T, H] (T <= 8): preactivation and intermediate rounded to BF16, rows to
    ``out_dtype``, ordered FP32 combine. Returns ``out_dtype`` [T, H], or a RawReference."""
    return _reference_16bit(WeightFormat.BF16, torch.bfloat16, x, weights, routing, activation, out_dtype, finalize)


def reference_fp16(
    x: torch.Tensor, weights: DenseWeights, routing: Routing, activation: ActivationArg, *,
    out_dtype: torch.dtype = torch.bfloat16, finalize: bool = True,
) -> torch.Tensor | RawReference:
    """FP16 twin of ``reference_bf16`` (FP16 x and weights, preactivation and intermediate rounded to FP16)."""
    return _reference_16bit(WeightFormat.FP16, torch.float16, x, weights, routing, activation, out_dtype, finalize)


def _reference_weight_only(
    fmt: WeightFormat, cls: type, x, weights, routing, activation, out_dtype, finalize
) -> torch.Tensor | RawReference:
    x = _check_input(x, weights, cls, fmt, _OUT_DTYPES)
    preact = torch.float32 if fmt is WeightFormat.MXINT4_WEIGHT_ONLY else x.dtype
    return _run(x.double(), weights, routing, activation, preact_dtype=preact, inter_dtype=x.dtype,
                out_dtype=out_dtype, finalize=finalize, unrouted_ok=False)


def reference_nvfp4_weight_only(
    x: torch.Tensor, weights: Nvfp4WeightOnlyWeights, routing: Routing, activation: ActivationArg, *,
    out_dtype: torch.dtype = torch.bfloat16, finalize: bool = True,
) -> torch.Tensor | RawReference:
    """NVFP4 weight-only, x BF16 or FP16 [T, H]: preactivation and intermediate rounded to x's dtype,
    rows to ``out_dtype``, ordered FP32 combine."""
    return _reference_weight_only(WeightFormat.NVFP4_WEIGHT_ONLY, Nvfp4WeightOnlyWeights, x, weights, routing,
                                  activation, out_dtype, finalize)


def reference_mxfp4_weight_only(
    x: torch.Tensor, weights: Mxfp4WeightOnlyWeights, routing: Routing, activation: ActivationArg, *,
    out_dtype: torch.dtype = torch.bfloat16, finalize: bool = True,
) -> torch.Tensor | RawReference:
    """MXFP4 weight-only (weights decoded through FP32), x BF16 or FP16: roundings as NVFP4 weight-only."""
    return _reference_weight_only(WeightFormat.MXFP4_WEIGHT_ONLY, Mxfp4WeightOnlyWeights, x, weights, routing,
                                  activation, out_dtype, finalize)


def reference_mxint4_weight_only(
    x: torch.Tensor, weights: Mxint4WeightOnlyWeights, routing: Routing, activation: ActivationArg, *,
    out_dtype: torch.dtype = torch.bfloat16, finalize: bool = True,
) -> torch.Tensor | RawReference:
    """MXINT4 weight-only, x BF16 or FP16: FP32 preactivation (not rounded to x's dtype), intermediate
    rounded to x's dtype, rows to ``out_dtype``, ordered FP32 combine."""
    return _reference_weight_only(WeightFormat.MXINT4_WEIGHT_ONLY, Mxint4WeightOnlyWeights, x, weights, routing,
                                  activation, out_dtype, finalize)


def reference_fp8_weight_only(
    x: torch.Tensor, weights: Fp8WeightOnlyWeights, routing: Routing, activation: ActivationArg, *,
    out_dtype: torch.dtype = torch.bfloat16, finalize: bool = True,
) -> torch.Tensor | RawReference:
    """FP8 weight-only (weight = e4m3 * per-expert FP32 scale), x BF16 or FP16 [T, H]. Rounding points:
    preactivation (the FP32 sum times the scale) to x's dtype; activation in float64, intermediate to x's
    dtype; expert rows to ``out_dtype``; ordered FP32 combine (separate multiply and add)."""
    return _reference_weight_only(WeightFormat.FP8_WEIGHT_ONLY, Fp8WeightOnlyWeights, x, weights, routing,
                                  activation, out_dtype, finalize)


def reference_nvfp4_pair(
    activations: Nvfp4Activations, weights: Nvfp4PairWeights, routing: Routing, activation: ActivationArg, *,
    out_dtype: torch.dtype = torch.bfloat16, finalize: bool = True,
) -> torch.Tensor | RawReference:
    """NVFP4 weights with NVFP4 activations (packed uint8 [T, H/2], linear e4m3 scales [T, H/16], global
    one): BF16 preactivation, BF16 intermediate, BF16 rows, ordered FP32 combine. Ids outside [0, E)
    are unrouted slots (skipped by finalize, zero raw rows). ``out_dtype`` must be BF16."""
    if not isinstance(activations, Nvfp4Activations):
        raise TypeError(f"activations must be Nvfp4Activations, got {type(activations).__name__}")
    if out_dtype is not torch.bfloat16:
        raise ValueError(f"out_dtype must be torch.bfloat16 for the NVFP4 weight + NVFP4 activation pair, got {out_dtype!r}")
    if not isinstance(weights, Nvfp4PairWeights):
        raise TypeError(f"weights must be Nvfp4PairWeights (prepare_nvfp4_weights), got {type(weights).__name__}")
    packed = require_tensor("activations.packed", activations.packed, torch.uint8, rank=2)
    scales = require_tensor("activations.scales", activations.scales, torch.float8_e4m3fn, rank=2)
    hidden = weights.hidden_size
    if tuple(packed.shape[1:]) != (hidden // 2,) or tuple(scales.shape) != (packed.shape[0], hidden // 16):
        raise ValueError(f"activations must be packed [T, {hidden // 2}] and scales [T, {hidden // 16}], "
                         f"got {tuple(packed.shape)} and {tuple(scales.shape)}")
    if packed.shape[0] > MAX_NUM_TOKENS:
        raise ValueError(f"activations hold {packed.shape[0]} tokens; the low-latency config takes at most {MAX_NUM_TOKENS}")
    x = dequantize_nvfp4(packed, scales, dtype=_F64)
    return _run(x, weights, routing, activation, preact_dtype=torch.bfloat16, inter_dtype=torch.bfloat16,
                out_dtype=out_dtype, finalize=finalize, unrouted_ok=True)


def _fp8_per_tensor(
    activations: object, weights: object, routing: object, activation: ActivationArg, out_dtype: object,
    finalize: object, intermediate: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows bf16 [T, k, H], route weights, mask, intermediate float64 [T, k, I]) of per-tensor FP8."""
    if not isinstance(activations, Fp8PerTensorActivations):
        raise TypeError(f"activations must be Fp8PerTensorActivations, got {type(activations).__name__}")
    if not isinstance(weights, Fp8PerTensorWeights):
        raise TypeError(f"weights must be Fp8PerTensorWeights (prepare_fp8_per_tensor_weights), got {type(weights).__name__}")
    if out_dtype is not torch.bfloat16:
        raise ValueError(f"out_dtype must be torch.bfloat16 for per-tensor FP8, got {out_dtype!r}")
    _require_bool("finalize", finalize)
    codes = require_tensor("activations.codes", activations.codes, torch.float8_e4m3fn, rank=2)
    if codes.shape[1] != weights.hidden_size:
        raise ValueError(f"activations.codes must be [T, {weights.hidden_size}], got {tuple(codes.shape)}")
    if codes.shape[0] > MAX_NUM_TOKENS:
        raise ValueError(f"activations hold {codes.shape[0]} tokens; the low-latency config takes at most {MAX_NUM_TOKENS}")
    if activations.input_scale != weights.input_scale:
        raise ValueError("activations were quantized with another input_scale than the weights'")
    act = _activation_for(activation, weights)
    w1q, _, w2q, _ = weights.canonical()
    w1, w2, x = w1q.double(), w2q.double(), codes.double()
    if x.device != w1.device:
        raise ValueError(f"the input is on {x.device} but the weights are on {w1.device}")
    f1, f2 = weights.fc1_factor.double(), weights.fc2_factor.double()
    multiplier = weights.inter_multiplier.float().reshape(())
    num_tokens, inter = x.shape[0], weights.intermediate_size
    ids, route_weights, mask = _routing(routing, num_tokens, w1.shape[0], w1.device, False)
    if intermediate is not None:
        intermediate = require_tensor("intermediate", intermediate, (torch.bfloat16, torch.float32, torch.float64), rank=3)
        if tuple(intermediate.shape[:2]) != tuple(ids.shape) or intermediate.shape[2] < inter:
            raise ValueError(f"intermediate must be [T, k, >= {inter}], got {tuple(intermediate.shape)}")
    rows = torch.zeros(num_tokens, ids.shape[1], weights.hidden_size, dtype=torch.bfloat16, device=x.device)
    quantized = torch.zeros(num_tokens, ids.shape[1], inter, dtype=_F64, device=x.device)
    for expert in range(w1.shape[0]):
        tokens, slots = ((ids == expert) & mask).nonzero(as_tuple=True)
        if tokens.numel():
            h = _round((x[tokens] @ w1[expert].T) * f1[expert], torch.bfloat16)
            q = to_e4m3(act.apply_gemm1(h).float() * multiplier).double()
            quantized[tokens, slots] = q
            if intermediate is not None:
                q = intermediate[tokens, slots, :inter].double()
            rows[tokens, slots] = ((q @ w2[expert].T) * f2[expert]).float().to(torch.bfloat16)
    return rows, route_weights, mask, quantized


def reference_fp8_per_tensor(
    activations: Fp8PerTensorActivations, weights: Fp8PerTensorWeights, routing: Routing, activation: ActivationArg,
    *, out_dtype: torch.dtype = torch.bfloat16, finalize: bool = True, intermediate: torch.Tensor | None = None,
) -> torch.Tensor | RawReference:
    """Per-tensor FP8: E4M3 token codes (``prepare_fp8_per_tensor_activations``) and E4M3 weights with static
    scales (``prepare_fp8_per_tensor_weights``). Rounding points, per routed slot (token t, expert e):

    1. preactivation: the exact sum of token code x weight code products, times fc1_factor[e] (the FP32
       input_scale * w1_scale[e]), rounded through FP32 to BF16;
    2. activation in float64, rounded to FP32; times the FP32 multiplier fp32(1 / intermediate_scale) in FP32;
       rounded once to E4M3 (nearest even, saturating at +-448); the unscaled E4M3 value is the intermediate;
    3. expert row: the exact sum of intermediate x w2 code products, times fc2_factor[e] (the FP32
       intermediate_scale * w2_scale[e]), rounded through FP32 to BF16;
    4. finalize: ordered FP32 combine (separate multiply and add), rounded to BF16.

    ``out_dtype`` must be BF16. intermediate: optional [T, k, >= I] values (BF16/FP32/float64) that replace
    step 2's for every routed slot (row (t, j) for slot j of token t): steps 3-4 on another intermediate, e.g.
    the GPU's, to check GEMM2 and the combine apart from a rare E4M3 flip of step 2 (see
    ``fp8_per_tensor_intermediate``). Returns BF16 [T, H], or a RawReference (rows [T, k, H]).
    """
    rows, route_weights, mask, _ = _fp8_per_tensor(activations, weights, routing, activation, out_dtype, finalize,
                                                   intermediate)
    if not finalize:
        return RawReference(rows=rows, weights=route_weights, mask=mask)
    return combine_ordered_fp32(rows, route_weights, mask, torch.bfloat16)


def fp8_per_tensor_intermediate(
    activations: Fp8PerTensorActivations, weights: Fp8PerTensorWeights, routing: Routing, activation: ActivationArg,
) -> torch.Tensor:
    """Step 2 of ``reference_fp8_per_tensor``: the unscaled E4M3 intermediate of every slot, float64 [T, k, I]."""
    return _fp8_per_tensor(activations, weights, routing, activation, torch.bfloat16, True, None)[3]


@dataclass(frozen=True, eq=False)
class DeepSeekFp8Intermediate:
    """Step 2 of ``reference_deepseek_fp8`` for every slot (zero for unrouted slots):
    activation float32 [T, k, I] (y before quantization), codes float8_e4m3fn [T, k, I] and scales float32
    [T, k, I/128] (y ~ codes * scales)."""

    activation: torch.Tensor
    codes: torch.Tensor
    scales: torch.Tensor


def _block_sums(a: torch.Tensor, b: torch.Tensor, block: int) -> torch.Tensor:
    """a [m, K], b [n, K] (float64 code values, K % block == 0) -> [m, n, K/block]: the per-block dot products,
    exact (every product of two E4M3 or E4M3 and E2M1 codes, and every sum of 128 of them, fits float64)."""
    m, n, k = a.shape[0], b.shape[0], a.shape[1]
    return torch.einsum("mbk,nbk->mnb", a.reshape(m, k // block, block), b.reshape(n, k // block, block))


def _scaled_sum(partials: torch.Tensor, x_scales: torch.Tensor, w_scales: torch.Tensor) -> torch.Tensor:
    """partials [m, n, nb] (float64), x_scales [m, nb] and w_scales [n, nb] (weight row n's scales; FP32 or E8M0)
    -> float32 [m, n]: fp32(sum_b partial * fp32(x_scale * w_scale)), the sum exact in float64."""
    factor = (x_scales.float()[:, None, :] * w_scales.float()[None]).double()  # one FP32 product, as the kernel
    return (partials * factor).sum(-1).float()


def _rows_of_blocks(w_scales: torch.Tensor, rows: int) -> torch.Tensor:
    """DeepSeek FP8 weight scales [ceil(n / 128), nb] -> each weight row's [n, nb] (row n's in row n // 128)."""
    return w_scales.repeat_interleave(128, dim=0)[:rows]


def _deepseek_fp8(
    inputs: object, weights: object, routing: object, activation: ActivationArg, out_dtype: object, finalize: object,
    intermediate: DeepSeekFp8Intermediate | tuple[torch.Tensor, torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, DeepSeekFp8Intermediate]:
    """(rows bf16 [T, k, H], route weights, mask, step 2) of DeepSeek FP8."""
    if not isinstance(weights, DeepSeekFp8Weights):
        raise TypeError(f"weights must be DeepSeekFp8Weights (prepare_deepseek_fp8_weights), got {type(weights).__name__}")
    if out_dtype is not torch.bfloat16:
        raise ValueError(f"out_dtype must be torch.bfloat16 for DeepSeek FP8, got {out_dtype!r}")
    _require_bool("finalize", finalize)
    hidden, inter = weights.hidden_size, weights.intermediate_size
    if isinstance(inputs, DeepSeekFp8Activations):
        codes = require_tensor("inputs.codes", inputs.codes, torch.float8_e4m3fn, rank=2)
        x_scales = require_tensor("inputs.scales", inputs.scales, torch.float32, rank=2)
        if codes.shape[1] != hidden or tuple(x_scales.shape) != (codes.shape[0], hidden // 128):
            raise ValueError(f"inputs must be codes [T, {hidden}] and scales [T, {hidden // 128}], got "
                             f"{tuple(codes.shape)} and {tuple(x_scales.shape)}")
        if not bool((torch.isfinite(x_scales) & (x_scales > 0)).all()):
            raise ValueError("inputs.scales must be finite and positive")
    elif isinstance(inputs, torch.Tensor):
        x = require_tensor("hidden_states", inputs, torch.bfloat16, rank=2)
        if x.shape[1] != hidden:
            raise ValueError(f"hidden_states must be [T, {hidden}], got {tuple(x.shape)}")
        codes, x_scales = quantize_fp8_act128(x)
    else:
        raise TypeError(f"inputs must be a BF16 tensor or DeepSeekFp8Activations, got {type(inputs).__name__}")
    if codes.shape[0] > MAX_NUM_TOKENS:
        raise ValueError(f"inputs hold {codes.shape[0]} tokens; the low-latency config takes at most {MAX_NUM_TOKENS}")
    act = _activation_for(activation, weights)
    w1q, w1s, w2q, w2s = weights.canonical()
    w1, w2, xq = w1q.double(), w2q.double(), codes.double()
    if xq.device != w1.device:
        raise ValueError(f"the input is on {xq.device} but the weights are on {w1.device}")
    num_tokens = xq.shape[0]
    ids, route_weights, mask = _routing(routing, num_tokens, w1.shape[0], w1.device, False)
    if intermediate is not None:
        given_codes, given_scales = (intermediate.codes, intermediate.scales) if isinstance(
            intermediate, DeepSeekFp8Intermediate) else intermediate
        given_codes = require_tensor("intermediate codes", given_codes, torch.float8_e4m3fn, rank=3)
        given_scales = require_tensor("intermediate scales", given_scales, torch.float32, rank=3)
        if tuple(given_codes.shape) != (*ids.shape, inter) or tuple(given_scales.shape) != (*ids.shape, inter // 128):
            raise ValueError(f"intermediate must be codes [T, k, {inter}] and scales [T, k, {inter // 128}], got "
                             f"{tuple(given_codes.shape)} and {tuple(given_scales.shape)}")
    shape = (num_tokens, ids.shape[1])
    rows = torch.zeros(*shape, hidden, dtype=torch.bfloat16, device=xq.device)
    y_all = torch.zeros(*shape, inter, dtype=torch.float32, device=xq.device)
    yq_all = torch.zeros(*shape, inter, dtype=torch.float8_e4m3fn, device=xq.device)
    ys_all = torch.ones(*shape, inter // 128, dtype=torch.float32, device=xq.device)
    for expert in range(w1.shape[0]):
        tokens, slots = ((ids == expert) & mask).nonzero(as_tuple=True)
        if not tokens.numel():
            continue
        h = _scaled_sum(_block_sums(xq[tokens], w1[expert], 128), x_scales[tokens],
                        _rows_of_blocks(w1s[expert], w1.shape[1]))  # FP32 preactivation
        y = act.apply_gemm1(h.double()).float()
        yq, ys = quantize_fp8_act128(y)
        y_all[tokens, slots], yq_all[tokens, slots], ys_all[tokens, slots] = y, yq, ys
        if intermediate is not None:
            yq, ys = given_codes[tokens, slots], given_scales[tokens, slots]
        r = _scaled_sum(_block_sums(yq.double(), w2[expert], 128), ys, _rows_of_blocks(w2s[expert], hidden))
        rows[tokens, slots] = r.to(torch.bfloat16)
    return rows, route_weights, mask, DeepSeekFp8Intermediate(y_all, yq_all, ys_all)


def reference_deepseek_fp8(
    inputs: torch.Tensor | DeepSeekFp8Activations, weights: DeepSeekFp8Weights, routing: Routing,
    activation: ActivationArg, *, out_dtype: torch.dtype = torch.bfloat16, finalize: bool = True,
    intermediate: DeepSeekFp8Intermediate | tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor | RawReference:
    """DeepSeek FP8: E4M3 weights with FP32 128 x 128 block scales (``prepare_deepseek_fp8_weights``), tokens BF16
    [T, H] or prequantized (``DeepSeekFp8Activations``). Rounding points, per routed slot (token t, expert e),
    blocks b of 128 values along K:

    0. BF16 tokens: s_x[t, b] = fp32(amax / 448) (1.0 for an all-zero block), xq = e4m3(fp32(x / s_x)), nearest
       even, saturating at +-448 (``quantize_fp8_act128``); prequantized tokens: their codes and scales;
    1. preactivation h[n] = fp32(sum_b P[b] * fp32(s_x[t, b] * s_w1[e, n // 128, b])): P[b] is the exact sum of
       the block's 128 code products (exact in float64), each block's factor one FP32 product; h is FP32;
    2. activation of h in float64, rounded to FP32 (y); per 128 values of y: s_y = fp32(amax / 448) (1.0 for an
       all-zero block), yq = e4m3(fp32(y / s_y));
    3. expert row r[h] = fp32(sum_b P2[b] * fp32(s_y[b] * s_w2[e, h // 128, b])) rounded to BF16;
    4. finalize: ordered FP32 combine (separate multiply and add), rounded to BF16.

    The GPU sums in FP32 (each lane's 16 products of a 128-block chunk, then the scaled chunks): only that order
    differs. ``out_dtype`` must be BF16. intermediate: optional codes [T, k, I] and scales [T, k, I/128] (or a
    DeepSeekFp8Intermediate) that replace step 2's for every routed slot, e.g. the GPU's, so GEMM2 and the combine
    can be checked apart from a rare E4M3 flip in step 2 (``deepseek_fp8_intermediate`` gives step 2).
    Returns BF16 [T, H], or a RawReference (rows [T, k, H]).
    """
    rows, route_weights, mask, _ = _deepseek_fp8(inputs, weights, routing, activation, out_dtype, finalize,
                                                 intermediate)
    if not finalize:
        return RawReference(rows=rows, weights=route_weights, mask=mask)
    return combine_ordered_fp32(rows, route_weights, mask, torch.bfloat16)


def deepseek_fp8_intermediate(
    inputs: torch.Tensor | DeepSeekFp8Activations, weights: DeepSeekFp8Weights, routing: Routing,
    activation: ActivationArg,
) -> DeepSeekFp8Intermediate:
    """Step 2 of ``reference_deepseek_fp8`` for every slot: the FP32 activation and its per-128 E4M3 codes and scales."""
    return _deepseek_fp8(inputs, weights, routing, activation, torch.bfloat16, True, None)[3]


@dataclass(frozen=True, eq=False)
class MxPairIntermediate:
    """Step 2 of ``reference_mx_pair`` for every slot (zero for unrouted slots): activation float32 [T, k, I] (y
    before quantization), codes float8_e4m3fn [T, k, I] and scales float8_e8m0fnu [T, k, I/32]
    (y ~ codes * 2^(scale byte - 127))."""

    activation: torch.Tensor
    codes: torch.Tensor
    scales: torch.Tensor




def _mx_codes(weights: Mxfp4PairWeights | Mxfp8PairWeights) -> tuple[torch.Tensor, ...]:
    """(w1 codes float64 [E, N1, H], w1 scales float32 [E, N1, H/32], w2 codes float64 [E, H, I], w2 scales): the
    code values, exact (E2M1 from the packed nibbles, E4M3 from its bits), and the E8M0 scales' values (exact)."""
    w1c, w1s, w2c, w2s = weights.canonical()
    if weights.format is WeightFormat.MXFP4_W_MXFP8_A:
        w1c, w2c = decode_e2m1(unpack_nibbles(w1c)), decode_e2m1(unpack_nibbles(w2c))
    return w1c.double(), w1s.float(), w2c.double(), w2s.float()


def _mx_pair(
    activations: object, weights: object, routing: object, activation: ActivationArg, out_dtype: object,
    finalize: object, intermediate: MxPairIntermediate | tuple[torch.Tensor, torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, MxPairIntermediate]:
    """(rows [T, k, H] of out_dtype, route weights, mask, step 2) of an MX pair."""
    if not isinstance(weights, (Mxfp4PairWeights, Mxfp8PairWeights)) or weights.format not in MX_PAIRS:
        raise TypeError(f"weights must be the Mxfp4PairWeights or Mxfp8PairWeights of prepare_weights, got "
                        f"{type(weights).__name__}")
    if not isinstance(activations, Mxfp8Activations):
        raise TypeError(f"activations must be the Mxfp8Activations of prepare_mxfp8_activations, got "
                        f"{type(activations).__name__}")
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"out_dtype must be torch.bfloat16 or torch.float16, got {out_dtype!r}")
    _require_bool("finalize", finalize)
    hidden, inter = weights.hidden_size, weights.intermediate_size
    codes = require_tensor("activations.codes", activations.codes, torch.float8_e4m3fn, rank=2)
    x_scales = require_tensor("activations.scales", activations.scales, torch.float8_e8m0fnu, rank=2)
    if codes.shape[1] != hidden or tuple(x_scales.shape) != (codes.shape[0], hidden // MX_BLOCK):
        raise ValueError(f"activations must be codes [T, {hidden}] and scales [T, {hidden // MX_BLOCK}], got "
                         f"{tuple(codes.shape)} and {tuple(x_scales.shape)}")
    if codes.shape[0] > MAX_NUM_TOKENS:
        raise ValueError(f"activations hold {codes.shape[0]} tokens; the low-latency config takes at most {MAX_NUM_TOKENS}")
    act = _activation_for(activation, weights)
    w1, w1s, w2, w2s = _mx_codes(weights)
    xq, xs = codes.double(), x_scales.float()
    if xq.device != w1.device:
        raise ValueError(f"the input is on {xq.device} but the weights are on {w1.device}")
    num_tokens = xq.shape[0]
    ids, route_weights, mask = _routing(routing, num_tokens, w1.shape[0], w1.device, True)
    shape = (num_tokens, ids.shape[1])
    if intermediate is not None:
        given_codes, given_scales = (intermediate.codes, intermediate.scales) if isinstance(
            intermediate, MxPairIntermediate) else intermediate
        given_codes = require_tensor("intermediate codes", given_codes, torch.float8_e4m3fn, rank=3)
        given_scales = require_tensor("intermediate scales", given_scales, torch.float8_e8m0fnu, rank=3)
        if tuple(given_codes.shape) != (*shape, inter) or tuple(given_scales.shape) != (*shape, inter // MX_BLOCK):
            raise ValueError(f"intermediate must be codes [T, k, {inter}] and scales [T, k, {inter // MX_BLOCK}], got "
                             f"{tuple(given_codes.shape)} and {tuple(given_scales.shape)}")
        given_codes, given_scales = given_codes.double(), given_scales.float()
    rows = torch.zeros(*shape, hidden, dtype=out_dtype, device=xq.device)
    y_all = torch.zeros(*shape, inter, dtype=torch.float32, device=xq.device)
    yq_all = torch.zeros(*shape, inter, dtype=torch.float8_e4m3fn, device=xq.device)
    ys_all = torch.zeros(*shape, inter // MX_BLOCK, dtype=torch.uint8, device=xq.device)  # E8M0 bytes
    for expert in range(w1.shape[0]):
        tokens, slots = ((ids == expert) & mask).nonzero(as_tuple=True)
        if not tokens.numel():
            continue
        h = _scaled_sum(_block_sums(xq[tokens], w1[expert], MX_BLOCK), xs[tokens], w1s[expert])
        y = act.apply_gemm1(h.bfloat16().double()).float()  # BF16 preactivation, activation rounded to FP32
        yq, ys = quantize_mxfp8(y, check_finite=False)
        y_all[tokens, slots], yq_all[tokens, slots], ys_all[tokens, slots] = y, yq, ys.view(torch.uint8)
        yq, ys = yq.double(), ys.float()
        if intermediate is not None:
            yq, ys = given_codes[tokens, slots], given_scales[tokens, slots]
        r = _scaled_sum(_block_sums(yq, w2[expert], MX_BLOCK), ys, w2s[expert])
        rows[tokens, slots] = r.to(out_dtype)
    return rows, route_weights, mask, MxPairIntermediate(y_all, yq_all, ys_all.view(torch.float8_e8m0fnu))


def reference_mx_pair(
    activations: Mxfp8Activations, weights: Mxfp4PairWeights | Mxfp8PairWeights, routing: Routing,
    activation: ActivationArg, *, out_dtype: torch.dtype = torch.bfloat16, finalize: bool = True,
    intermediate: MxPairIntermediate | tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor | RawReference:
    """MXFP4 or MXFP8 weights (``prepare_weights``) with MXFP8 tokens (``prepare_mxfp8_activations``). Rounding
    points, per routed slot (token t, expert e), blocks b of 32 values along K, s_* the E8M0 scales as powers of two:

    1. preactivation h[n] = bf16(fp32(sum_b P1[b] * fp32(s_x[t, b] * s_w1[e, n, b]))): P1[b] is the exact sum of the
       block's 32 code products (E4M3 x E2M1 or E4M3 x E4M3, each exact in FP32), each block's factor one FP32
       product of the two scales (exact unless it leaves the FP32 range);
    2. activation of h in float64, rounded to FP32 (y); y quantized to MXFP8 per 32 values, ``quantize_mxfp8``:
       s_y = 2^clamp(floor(log2 amax) - 8, -127, 127) (2^-127 for an all-zero block), yq = e4m3(fp32(y / s_y)),
       nearest even, saturating at +-448;
    3. expert row r[h] = fp32(sum_b P2[b] * fp32(s_y[b] * s_w2[e, h, b])) rounded to ``out_dtype`` (BF16 or FP16);
    4. finalize: ordered FP32 combine (separate multiply and add), rounded to ``out_dtype``.

    Expert ids outside [0, E) are unrouted slots: finalize skips them and their scores (NaN or Inf there never
    reach the output), their raw rows are zero. The GPU sums each lane's chunk of a block (32 products for MXFP4
    weights, 16 for MXFP8 ones) in FP32, scales it and adds it in FP32 (one FMA): only that order differs.
    intermediate: optional codes [T, k, I] and scales [T, k, I/32] (or an MxPairIntermediate) replacing step 2's
    for every routed slot, e.g. the GPU's, so steps 3-4 can be checked apart from a rare E4M3 flip in step 2
    (``mx_pair_intermediate`` gives step 2). Returns ``out_dtype`` [T, H], or a RawReference (rows [T, k, H]).
    """
    rows, route_weights, mask, _ = _mx_pair(activations, weights, routing, activation, out_dtype, finalize,
                                            intermediate)
    if not finalize:
        return RawReference(rows=rows, weights=route_weights, mask=mask)
    return combine_ordered_fp32(rows, route_weights, mask, out_dtype)


def mx_pair_intermediate(
    activations: Mxfp8Activations, weights: Mxfp4PairWeights | Mxfp8PairWeights, routing: Routing,
    activation: ActivationArg,
) -> MxPairIntermediate:
    """Step 2 of ``reference_mx_pair`` for every slot: the FP32 activation and its MXFP8 codes and scales."""
    return _mx_pair(activations, weights, routing, activation, torch.bfloat16, True, None)[3]


def reference_low_latency(
    inputs: torch.Tensor | Nvfp4Activations | Fp8PerTensorActivations | DeepSeekFp8Activations | Mxfp8Activations,
    weights: LowLatencyWeights, routing: Routing, activation: ActivationArg,
    *, out_dtype: torch.dtype = torch.bfloat16, finalize: bool = True,
) -> torch.Tensor | RawReference:
    """The reference for ``weights.format``: x [T, H] (Nvfp4Activations for the NVFP4 pair,
    Fp8PerTensorActivations for per-tensor FP8, Mxfp8Activations for the MX pairs)."""
    if not isinstance(weights, LowLatencyWeights):
        raise TypeError(f"weights must be prepared by LowLatencyMoeConfig, got {type(weights).__name__}")
    function = _BY_FORMAT[weights.format]
    return function(inputs, weights, routing, activation, out_dtype=out_dtype, finalize=finalize)


_BY_FORMAT = {
    WeightFormat.BF16: reference_bf16,
    WeightFormat.FP16: reference_fp16,
    WeightFormat.NVFP4_WEIGHT_ONLY: reference_nvfp4_weight_only,
    WeightFormat.MXFP4_WEIGHT_ONLY: reference_mxfp4_weight_only,
    WeightFormat.MXINT4_WEIGHT_ONLY: reference_mxint4_weight_only,
    WeightFormat.NVFP4_W_NVFP4_A: reference_nvfp4_pair,
    WeightFormat.FP8_WEIGHT_ONLY: reference_fp8_weight_only,
    WeightFormat.FP8_PER_TENSOR: reference_fp8_per_tensor,
    WeightFormat.DEEPSEEK_FP8: reference_deepseek_fp8,
    WeightFormat.MXFP4_W_MXFP8_A: reference_mx_pair,
    WeightFormat.MXFP8_W_MXFP8_A: reference_mx_pair,
}
