"""The low-latency MoE op: ``low_latency_moe`` (1..8 tokens, contract 004) on the GPU.

What runs a call (cudnn_moe.low_latency.tactics): the engine ``config.engine`` names, or with "auto" the one
``LowLatencyMoeConfig.tune`` measured fastest for this layer and token count (kept in the persistent cache),
else the engine registry's first that supports the call (cudnn_moe.engines.registry): on SM90 the SM90 engine
takes finalized calls with NVFP4 weight-only weights and BF16 tokens and output, MXFP4 weight-only ones likewise
where preparation found their exact shifted form (``weights.nvfp4_problem`` says why not), MXINT4 weight-only ones
(INT4 tiles, FP32 preactivation), BF16 weights (read in place, row-major), the NVFP4 pair, and the MXFP4 pair
where preparation found its weights' exact shifted form (MXFP8 tokens and intermediate held as exact BF16 values),
through the shared pipeline (cudnn_moe.low_latency.grouped; tensor cores); everything else runs on the CUDA-core
engine (cudnn_moe.engines.cuda_cores: two launches, GEMM1 + activation, then GEMM2 with the finalize folded
into its last CTA per feature column; the raw output skips the finalize). For the FP8 formats the ll_mma
engine (cudnn_moe.engines.ll_mma: named, or chosen by ``tune``) runs the CUDA-core engine's launches with
tensor-core dot products. All round at the same points.
The call allocates nothing when ``out`` is given (workspaces are kept per weights, cudnn_moe.pipeline) and
reads no device data, so a caller can record it in its own CUDA graph once one eager call has warmed it up
(kernels compiled, workspace allocated). The CUDA-core path (ll_mma too) never synchronizes; the SM90 path
captures CUDA graphs (a device sync each) on the first call of a token count and on the second
consecutive call of a new set of tensors, then replays them: reuse the input and ``out`` tensors across
decode steps. Calls with the same weights on different streams (threads) are ordered on the GPU
(cudnn_moe.pipeline.order) and give the single-stream results.
Every argument is checked before anything is launched (cudnn_moe.low_latency.checks); errors name the
argument (TypeError for a wrong type or dtype, ValueError for a wrong value).

Calls of more than ``config.max_num_tokens`` tokens run on the weights' prepared fallback
(``config.prepare_fallback``, NVFP4 formats on SM90: cudnn_moe.low_latency.fallback), the shared pipeline
with the same rounding points in larger token buckets; without one they raise ValueError saying how to
prepare it, or why the format has none.

Numerics are those of cudnn_moe.low_latency.reference, rounding point for rounding point:

- preactivation (GEMM1 in FP32) rounded to the input dtype (BF16 or FP16) for BF16, FP16, NVFP4, MXFP4
  and FP8 weight-only weights (FP8: the FP32 sum times the expert's scale); kept in FP32 for MXINT4;
  rounded to BF16 for the NVFP4 weight + NVFP4 activation pair;
- activation in FP32, intermediate rounded to the input dtype (BF16 for the pair);
- per-tensor FP8 (E4M3 tokens and weights, static scales): GEMM1's FP32 sum of code products times the
  expert's FP32 factor input_scale * w1_scale, rounded to BF16; the activation in FP32 times the FP32
  multiplier 1 / intermediate_scale, rounded once to E4M3 (nearest even, saturating at +-448) inside the
  GEMM1 kernel (the intermediate workspace holds those E4M3 values, unscaled, exactly as BF16); GEMM2's FP32
  sum times intermediate_scale * w2_scale, rounded to BF16 (BF16 output only);
- DeepSeek FP8 (E4M3 weights with FP32 128 x 128 block scales): BF16 tokens quantized per 128 values on the
  GPU (scale fp32(amax / 448), codes e4m3(fp32(x / scale)); or prequantized codes and scales used as given);
  GEMM1's FP32 sums of exact code products scaled per 128-K block by fp32(token scale * weight scale), kept in
  FP32 (no preactivation rounding); the activation in FP32, kept unrounded; the intermediate quantized per 128
  values the same way (a launch of its own between the GEMMs: four launches for BF16 tokens, three for
  prequantized ones); GEMM2 likewise, rows rounded to BF16 (BF16 output only);
- the MX pairs (MXFP4 or MXFP8 weights with E8M0 scales per 32 K values, MXFP8 tokens from
  ``config.prepare_mxfp8_activations``): GEMM1's FP32 sums of exact code products scaled per 32-K block by
  fp32(token scale * weight scale), rounded to BF16; the activation in FP32, quantized to MXFP8 per 32 values
  inside the GEMM1 kernel (scale 2^clamp(floor(log2 amax) - 8, -127, 127), codes e4m3(fp32(y / scale)):
  ``cudnn_moe.formats.quantize_mxfp8``), so a call is two launches; GEMM2 likewise on those codes and scales,
  rows rounded to ``out_dtype`` (BF16 or FP16);
- expert rows (GEMM2 in FP32) rounded to ``out_dtype``;
- finalize: per token, in slot order, acc = fp32(acc + fp32(w * row)) (separate multiply and add),
  rounded once to ``out_dtype``; packed route weights are their BF16 values.

Only the order of the FP32 sums inside the GEMMs differs from the float64 reference.

The raw output (finalize=False) keeps the identity route mapping (row (t, j) is slot j of token t); with
return_scores=True the call also returns each slot's routing score, float32 [T, top_k], as the caller gave
it (packed scores: their BF16 value), written by the GEMM2 launch, unrouted slots included.

Expert ids outside [0, E): for the NVFP4 pair and the MX pairs they mark unrouted slots (finalize skips them and their
route weights, so a NaN there never reaches the output; the raw output has zero rows for them). For the
other formats the contract requires ids in [0, E); checking that would need a device sync, so it is not
checked: the kernels never read out of bounds for such ids and currently treat them like the pair does,
but that result is not part of the contract (the float reference raises ValueError for them).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..activations import Activation, SwiGLU, parse_activation
from ..arch import device_arch
from ..engines.base import GemmEngine, LowLatencyCall
from ..pipeline.lifetime import release_deferred
from ..pipeline.workspaces import workspace_for
from ..routing import Routing
from ..weights.low_latency import DeepSeekFp8Activations, Fp8PerTensorActivations, LowLatencyWeights, Mxfp8Activations
from ..weights.nvfp4 import Nvfp4Activations
from . import grouped
from .checks import (
    check_call, check_devices, check_inputs, check_out, check_scores_out, check_scores_request, check_sizes,
    weight_tensors,
)
from .config import LowLatencyMoeConfig
from .fallback import check_fallback_device, fallback_for_call, fallback_tensors
from .tactics import TacticKey, layer_request, select


class RawOutput(NamedTuple):
    """The raw result of ``low_latency_moe(..., finalize=False, return_scores=True)``.

    rows: [T, top_k, H] of the output dtype; row (t, j) belongs to slot j of token t (the identity route
        mapping), zero for unrouted slots.
    scores: float32 [T, top_k], each slot's routing score as the caller gave it; packed routing gives the
        BF16 value its bits hold (widened exactly), FP32/BF16 scores come back unchanged. Unrouted slots keep
        whatever score they had (NaN or Inf included): a reducer must skip those slots itself.
    """

    rows: torch.Tensor
    scores: torch.Tensor


def low_latency_moe(
    config: LowLatencyMoeConfig,
    inputs: torch.Tensor | Nvfp4Activations | Fp8PerTensorActivations | DeepSeekFp8Activations | Mxfp8Activations,
    weights: LowLatencyWeights,
    routing: Routing,
    *,
    activation: Activation | str = SwiGLU(),
    out_dtype: torch.dtype = torch.bfloat16,
    finalize: bool = True,
    out: torch.Tensor | None = None,
    return_scores: bool = False,
    scores_out: torch.Tensor | None = None,
) -> torch.Tensor | RawOutput:
    """Run one routed MoE layer of 1..``config.max_num_tokens`` tokens on the GPU (more with a prepared
    fallback: finalized BF16 calls up to ``weights.fallback.config.max_num_tokens``, see the module docstring).

    inputs: hidden states [T, H], BF16 or FP16 (BF16 for BF16 weights, FP16 for FP16 weights; either
        for the 4-bit and FP8 weight-only formats), 16-byte aligned and contiguous; for the NVFP4 pair the
        Nvfp4Activations of ``config.prepare_nvfp4_activations``; for per-tensor FP8 weights the
        Fp8PerTensorActivations of ``config.prepare_fp8_per_tensor_activations`` (quantized with those weights);
        for DeepSeek FP8 weights BF16 [T, H] (quantized per 128 values inside the call) or the
        DeepSeekFp8Activations of ``config.prepare_deepseek_fp8_activations`` (E4M3 codes and FP32 scales); for
        the MX pairs (``config.prepare_weights``) the Mxfp8Activations of ``config.prepare_mxfp8_activations``.
    weights: from one of the config's prepare methods (any format of ``weights.format``).
    routing: ``Routing.packed`` or ``Routing.unpacked`` [T, top_k], top_k <= 32, on the same device.
    activation: one of the ten typed activations (gated iff the weights were prepared gated).
    out_dtype: torch.bfloat16 or torch.float16 (the expert rows and the output; BF16 only for the NVFP4 pair,
        for per-tensor FP8 and for DeepSeek FP8; either for the MX pairs).
    finalize: True returns out_dtype [T, H], the route-weighted sum; False returns the raw per-slot
        rows out_dtype [T, top_k, H] (row (t, j) is slot j of token t; zero rows for unrouted slots).
    out: optional destination of that shape and dtype (contiguous, 16-byte aligned, same device,
        sharing no memory with the inputs); with it the call allocates nothing.
    return_scores: with finalize=False, return ``RawOutput(rows, scores)``: the raw rows and the routing
        scores of every slot, float32 [T, top_k] (packed scores as their BF16 values, others unchanged),
        written by the same launch that writes the rows. Not allowed with finalize=True.
    scores_out: optional float32 [T, top_k] destination of the scores (return_scores=True only;
        contiguous, same device, sharing no memory with the other tensors); with it and ``out`` the call
        allocates nothing.

    Returns ``out`` (or a new tensor), or a RawOutput when return_scores. T = 0 returns an empty result
    and launches nothing.
    """
    release_deferred()  # GPU objects of dropped weights, destroyed here rather than inside a capture
    act = parse_activation(activation)
    check_call(config, weights, routing, act, out_dtype, finalize)
    check_scores_request(return_scores, scores_out, finalize)
    x, x_scales = check_inputs(inputs, weights)
    tokens, top_k, hidden = x.shape[0], routing.top_k, weights.hidden_size
    x_dtype = None if x_scales is not None else x.dtype
    fallback = fallback_for_call(config.max_num_tokens, weights, tokens, x_dtype, out_dtype, finalize)
    check_sizes(tokens, routing.num_tokens, top_k)
    ids, route_weights, _ = routing.kernel_operands()
    device = check_devices(x, ids, weights)
    if fallback is not None:
        check_fallback_device(fallback, device_arch(device))
    else:
        request = layer_request(weights, device_arch(device), tokens, x_dtype, out_dtype, finalize)
        engine = select(config.engine, TacticKey(request, top_k, weights.gated, x.dtype, device.index))
    shape = (tokens, hidden) if finalize else (tokens, top_k, hidden)
    if out is not None:
        others = [("hidden_states", x), ("routing", ids)]
        if x_scales is not None:
            others.append(("inputs.scales", x_scales))
        if route_weights is not None:
            others.append(("routing weights", route_weights))
        others += [(f"weights tensor {i}", t) for i, t in enumerate(weight_tensors(weights))]
        if fallback is not None:
            others += [(f"weights.fallback tensor {i}", t) for i, t in enumerate(fallback_tensors(fallback))]
        out = check_out(out, shape, out_dtype, finalize, device, others)
    if scores_out is not None:
        others = [("hidden_states", x), ("routing", ids), *([("out", out)] if out is not None else [])]
        if route_weights is not None:
            others.append(("routing weights", route_weights))
        scores_out = check_scores_out(scores_out, (tokens, top_k), device, others)
    if return_scores and scores_out is None:
        scores_out = torch.empty((tokens, top_k), dtype=torch.float32, device=device)
    if out is None:
        out = torch.empty(shape, dtype=out_dtype, device=device)
    if tokens == 0:
        return RawOutput(out, scores_out) if return_scores else out
    if fallback is not None:
        call = LowLatencyCall(weights, x, x_scales, routing, act, out_dtype, finalize, out,
                              fallback.config.max_num_tokens)
        grouped.run_on(fallback.weights, call, fallback.config.max_num_tokens)
        return out
    call = LowLatencyCall(weights, x, x_scales, routing, act, out_dtype, finalize, out, config.max_num_tokens,
                          scores_out)
    if issubclass(engine, GemmEngine):
        grouped.run(engine, call)
    else:
        key, spec = engine.workspace_spec(call)
        workspace = workspace_for(weights, (engine.name, key), spec, device)
        with workspace.order.use():
            engine.run(call, workspace.buffers)
    return RawOutput(out, scores_out) if return_scores else out
