"""The low-latency op on a grouped-GEMM engine (on SM90 the SM90 engine's decode kernels: weights decoded
exactly in registers, tokens on the narrow side of mma.sync, split-K) through the shared pipeline
(cudnn_moe.pipeline.executor): stage, sort, permute, GEMM1, activation rounded to BF16
(IntermediateCode.BF16: never requantized), GEMM2, ordered FP32 combine.

- NVFP4 weight-only with BF16 tokens: the tokens enter as they are (TokenCode.BF16);
- MXFP4 weight-only with BF16 tokens, likewise, on the weights' exact shifted form in the engine's MXFP4 tiles
  (BlockCode.MXFP4: the same codes, each E8M0 block scale 2^j recoded as 2^(j - a), one byte per 32 values, and a
  global 2^a per expert: cudnn_moe.formats.mxfp4_as_nvfp4);
- MXINT4 weight-only with BF16 tokens, likewise, in the engine's MXINT4 layout (BlockCode.MXINT4: INT4 decoded
  exactly, each 32-value block's FP32 partial sum times its BF16 scale; GEMM1 keeps the preactivation in FP32 and
  runs with the activation in its epilogue);
- NVFP4 weights with NVFP4 activations (the pair): the tokens are decoded exactly to BF16 fragments;
- MXFP4 weights with MXFP8 activations (the MXFP4 pair): in their exact shifted form, the weights' own MXFP4 tiles
  where they were prepared for SM90 (as weight-only MXFP4's), else their row-major tensors read in place
  (BlockCode.MXFP4_ROWS: no copy; fallback.mxfp4_rows_view), the MXFP8 tokens decoded to BF16 by
  the sort + permute (TokenCode.MXFP8), and the intermediate quantized to MXFP8 per 32
  values, held as BF16 values (IntermediateCode.MXFP8): exact for block scales 2^-117 .. 2^119, so the sums are FP32
  sums of the contract's exact products (reference_mx_pair; only their order differs);
- BF16 weights with BF16 tokens: the weights are read in place, row-major (BlockCode.BF16: the decode kernel's BF16
  form, tokens in natural rows), with alphas 1/256 (no global); the contract's rounding points are those of NVFP4
  weight-only (BF16 preactivation and intermediate).

Numerics are the format's contract (cudnn_moe.low_latency.reference), the same as the CUDA-core engine's:
GEMM1 = bf16(global1[e] * FP32 sum of exact products), activation in FP32 rounded to BF16, expert rows =
bf16(global2[e] * FP32 sum), combine in slot order with separate FP32 multiply and add (MXFP4: the power-of-two
global times the sum of the products shifted by 2^-a, which is the contract's FP32 sum; MXINT4: no global, and
GEMM1's FP32 sum is not rounded before the activation). Only the FP32
summation order differs, so the two engines agree to accumulation-order noise. Slots whose expert id lies
outside [0, E) are skipped with their route weights (the pair's unrouted slots; the weight-only formats
require ids in range).

The call runs as a fused_moe call does (``MoeExecutor.run``, finalized into ``out``): where the launches are
recorded for the call itself (an eager call, one recorded into the caller's graph, a full-call graph), the decode
chain stages the caller's tokens and routing in its sort + permute (for one token in its GEMM1, which then also sorts)
and its GEMM2 finalizes into ``out`` where the engine can (cudnn_moe.pipeline.executor).

Weights prepared for SM90 are already in the engine's layout (``weights.tiled``; MXFP4 in its exact shifted form): the
view holds their own tensors (``tiled_view``), one copy for both engines. Weights prepared for another arch are
repacked once, on the first call, and that copy is kept beside them while they live, unless they hold a prepared
fallback in the engine's layout (cudnn_moe.low_latency.fallback), whose view is used instead.
Calls above the config's max_num_tokens run here too, on the fallback's view with its token buckets
(``run_on``): the same launches and rounding points, in larger buckets.
"""

from __future__ import annotations

import threading
import weakref

import torch

from ..activations import Activation
from ..arch import Arch, device_arch
from ..capture import refuse_during_capture
from ..engines.base import BlockCode, GemmEngine, LowLatencyCall
from ..engines.registry import engine_for
from ..kernels.codes import IntermediateCode
from ..pipeline.call_cache import tensor_signature
from ..pipeline.executor import MoeExecutor
from ..pipeline.lifetime import cached
from ..pipeline.tokens import TokenCode, token_code
from ..weights.low_latency import (
    DenseWeights,
    Mxfp4WeightOnlyWeights,
    Mxfp8Activations,
    Mxint4WeightOnlyWeights,
    Nvfp4WeightOnlyWeights,
    WeightFormat,
)
from ..weights.nvfp4 import Nvfp4Activations, Nvfp4Weights
from .config import MAX_NUM_TOKENS
from .fallback import grouped_view, tiled_view, unit_alphas

# What this path runs (DenseWeights: BF16 ones only).
Viewable = Nvfp4WeightOnlyWeights | Mxfp4WeightOnlyWeights | Mxint4WeightOnlyWeights | DenseWeights
_views: weakref.WeakKeyDictionary[Viewable, Nvfp4Weights] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def layer_view(engine: type[GemmEngine], weights: Viewable) -> Nvfp4Weights:
    """The ``engine`` view of NVFP4 weights (or of MXFP4 weight-only weights in their exact shifted form, or of MXINT4
    weight-only weights in the engine's MXINT4 layout, or of BF16 weights as they are): the weights' own tensors when
    they are tiled for this engine (BF16: always), else the prepared fallback's when it is in this engine's layout (the
    same bytes), else repacked on first use (``grouped_view``, ``mxint4_view``), then kept."""
    view = _views.get(weights)
    if view is not None:
        return view
    dense = isinstance(weights, DenseWeights)
    if dense and weights.format is not WeightFormat.BF16:
        raise ValueError(f"the grouped path runs BF16 dense weights only, not {weights.format.value}")
    arch = device_arch((weights.w1 if dense else weights.w1_codes).device)
    fallback = weights.fallback if isinstance(weights, Nvfp4WeightOnlyWeights) else None
    if fallback is not None and fallback.weights.spec == engine.spec(arch):
        return fallback.weights
    if not isinstance(weights, (Mxint4WeightOnlyWeights, DenseWeights)):  # own tensors, no alphas: capturable
        view = tiled_view(engine, arch, weights)
        if view is not None:
            with _lock:
                return _views.setdefault(weights, view)
    refuse_during_capture("low_latency_moe must build its tensor-core view of these weights first",
                          "make one call with them (of each token count) before capture")
    with _lock:
        view = _views.get(weights)
        if view is None:
            pack = (bf16_view if dense else mxint4_view if isinstance(weights, Mxint4WeightOnlyWeights)
                    else grouped_view)
            view = _views[weights] = pack(engine, arch, weights)
    return view


def mxint4_view(engine: type[GemmEngine], arch: Arch, weights: Mxint4WeightOnlyWeights) -> Nvfp4Weights:
    """The ``engine`` view on ``arch`` of MXINT4 weight-only weights (their own tiles when tiled, else a repacked
    copy; BlockCode.MXINT4): w1 [E, N1p, H] and w2 [E, H, Ip] in the engine's MXINT4 layout, alphas 1/256 (the
    engine's alpha * 256 is then 1: MXINT4 has no global); intermediate size Ip."""
    view = tiled_view(engine, arch, weights)
    if view is not None:
        return view
    w1_codes, w1_scales, w2_codes, w2_scales = weights.row_payloads()
    w1, w1_scales = engine.pack_weights_chunked(arch, w1_codes, w1_scales, code=BlockCode.MXINT4)
    w2, w2_scales = engine.pack_weights_chunked(arch, w2_codes, w2_scales, code=BlockCode.MXINT4)
    alpha = unit_alphas(weights.num_experts, weights.w1_codes.device)
    return Nvfp4Weights(
        w1, w1_scales, alpha, w2, w2_scales, alpha, engine.spec(arch), weights.gated, weights.hidden_size,
        weights.padded_intermediate, code=BlockCode.MXINT4,
    )


def bf16_view(engine: type[GemmEngine], arch: Arch, weights: DenseWeights) -> Nvfp4Weights:
    """The ``engine`` view on ``arch`` of BF16 weights: their own tensors (no copy), w1 bfloat16 [E, N1p * H] and w2
    [E, H * Ip] row-major (BlockCode.BF16; the scales are empty), alphas 1/256 (a new tensor: the engine's alpha * 256
    is then 1); intermediate size Ip."""
    experts = weights.num_experts
    alpha = unit_alphas(experts, weights.w1.device)
    no_scales = torch.empty(experts, 0, dtype=torch.uint8, device=weights.w1.device)
    return Nvfp4Weights(
        weights.w1.reshape(experts, -1), no_scales, alpha, weights.w2.reshape(experts, -1), no_scales, alpha,
        engine.spec(arch), weights.gated, weights.hidden_size, weights.padded_intermediate, code=BlockCode.BF16,
    )


def _executor(view: Nvfp4Weights, top_k: int, activation: Activation, tokens: TokenCode,
              max_tokens: int) -> MoeExecutor:
    # The MXFP4 pair quantizes its intermediate to MXFP8; every other format rounds it to BF16.
    intermediate = IntermediateCode.MXFP8 if tokens is TokenCode.MXFP8 else IntermediateCode.BF16
    return cached(view, ("low_latency", top_k, activation, tokens, max_tokens), lambda: MoeExecutor(
        view, engine_for(view.spec, view.device), top_k=top_k, activation=activation, local_expert_start=0,
        max_num_tokens=max_tokens, tokens=tokens, intermediate=intermediate,
    ))


def run(engine: type[GemmEngine], call: LowLatencyCall) -> None:
    """call.out bfloat16 [T, H] = the layer (checked by the op) for BF16 tokens x [T, H] (no x_scales), for the
    NVFP4 pair's tokens: codes x uint8 [T, H/2] with E4M3 scales x_scales [T, H/16], or for the MXFP4 pair's: codes x
    float8_e4m3fn [T, H] with E8M0 scales x_scales [T, H/32]; T <= MAX_NUM_TOKENS."""
    run_on(layer_view(engine, call.weights), call, MAX_NUM_TOKENS)


def run_on(view: Nvfp4Weights, call: LowLatencyCall, max_tokens: int) -> None:
    """``run`` on a given view (the low-latency path's, or the prepared fallback's) with token buckets up to
    ``max_tokens`` (the call's T <= max_tokens)."""
    x, x_scales, routing, out = call.x, call.x_scales, call.routing, call.out
    tokens = (x if x_scales is None else Mxfp8Activations(x, x_scales) if x.dtype == torch.float8_e4m3fn
              else Nvfp4Activations(x, x_scales))
    executor = _executor(view, routing.top_k, call.activation, token_code(tokens), max_tokens)
    ids, route_weights, routing_format = routing.kernel_operands()
    signature = (tensor_signature(x), tensor_signature(x_scales), tensor_signature(ids),
                 tensor_signature(route_weights), routing_format, tensor_signature(out), x.shape[0])
    executor.run(tokens, routing, finalize=True, out=out, use_cuda_graph=True, signature=signature)
