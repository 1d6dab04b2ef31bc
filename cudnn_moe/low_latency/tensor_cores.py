"""The tensor-core path of the low-latency call on Hopper: the NVFP4 weight formats through the SM90 engine's
grouped GEMM (decode kernel: weights decoded exactly in registers, tokens on the narrow side of mma.sync,
split-K) and the shared pipeline (cudnn_moe.executor): stage, sort, permute, GEMM1, activation rounded to
BF16 (``bf16_intermediate``: never requantized), GEMM2, ordered FP32 combine.

- NVFP4 weight-only with BF16 tokens: the tokens enter as they are (``bf16_tokens``);
- NVFP4 weights with NVFP4 activations (the pair): the tokens are decoded exactly to BF16 fragments.

Numerics are the format's contract (cudnn_moe.low_latency.reference), the same as the CUDA-core
kernels': GEMM1 = bf16(global1[e] * FP32 sum of exact products), activation in FP32 rounded to BF16,
expert rows = bf16(global2[e] * FP32 sum), combine in slot order with separate FP32 multiply and add.
Only the FP32 summation order differs, so the two paths agree to accumulation-order noise. Slots whose
expert id lies outside [0, E) are skipped with their route weights (the pair's unrouted slots; the
weight-only format requires ids in range).

The weights are repacked once into the SM90 fragment tiles (kept beside the caller's canonical tensors
while the prepared weights live).
"""

from __future__ import annotations

import threading
import weakref

import torch

from .. import kernels
from ..activations import Activation
from ..arch import SM90, Arch
from ..config import Nvfp4Weights
from ..engines import engine_for
from ..engines.sm90.engine import Sm90GemmEngine
from ..executor import Bucket, MoeExecutor
from ..pipeline import cached_executor
from ..kernels.codes import SORT_MAX_EXPERTS
from ..ops import tensor_signature
from ..routing import Routing
from .config import MAX_NUM_TOKENS
from .weights import LowLatencyWeights, Nvfp4WeightOnlyWeights, WeightFormat

_views: weakref.WeakKeyDictionary[LowLatencyWeights, Nvfp4Weights] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def applies(weights: LowLatencyWeights, x_dtype: torch.dtype | None, out_dtype: torch.dtype, finalize: bool,
            arch: Arch) -> bool:
    """Whether a call of these properties runs on the tensor-core path: finalized, BF16 output, on SM90, at
    most SORT_MAX_EXPERTS experts (the pipeline's sort), with NVFP4 weight-only weights and BF16 tokens or
    the NVFP4 pair. Measured on an H200 (benchmarks/RESULTS.md)
    it is 1.3-3x faster than the CUDA-core kernels from two tokens on; at one token it is 1.9x faster on
    DeepSeek-V3 and up to 10% slower on Qwen3-30B-A3B, so it takes every T."""
    if arch != SM90 or not finalize or out_dtype != torch.bfloat16 or weights.num_experts > SORT_MAX_EXPERTS:
        return False
    if weights.format is WeightFormat.NVFP4_WEIGHT_ONLY:
        return x_dtype == torch.bfloat16
    return weights.format is WeightFormat.NVFP4_W_NVFP4_A


def layer_view(weights: Nvfp4WeightOnlyWeights) -> Nvfp4Weights:
    """The SM90-engine view of NVFP4 weight-only weights (repacked on first use, then cached): w1 [E, N1p, H]
    as fragment tiles with the w1 global as alpha, w2 [E, H, Ip] likewise; intermediate size Ip."""
    view = _views.get(weights)
    if view is not None:
        return view
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("low_latency_moe must lay these weights out for the tensor cores first, but the stream is "
                           "capturing a CUDA graph: make one call with them (of each token count) before capture")
    with _lock:
        view = _views.get(weights)
        if view is None:
            w1, w1_scales = Sm90GemmEngine.pack_weights_chunked(SM90, weights.w1_codes, weights.w1_scales)
            w2, w2_scales = Sm90GemmEngine.pack_weights_chunked(SM90, weights.w2_codes, weights.w2_scales)
            view = Nvfp4Weights(
                w1, w1_scales, weights.w1_global, w2, w2_scales, weights.w2_global, Sm90GemmEngine.spec(SM90),
                weights.gated, weights.hidden_size, weights.padded_intermediate,
            )
            _views[weights] = view
    return view


def _executor(view: Nvfp4Weights, top_k: int, activation: Activation, bf16_tokens: bool) -> MoeExecutor:
    return cached_executor(view, ("low_latency", top_k, activation, bf16_tokens), lambda: MoeExecutor(
        view, engine_for(view.spec, view.device), top_k=top_k, activation=activation, local_expert_start=0,
        max_num_tokens=MAX_NUM_TOKENS, bf16_tokens=bf16_tokens, bf16_intermediate=True,
    ))


def run(x: torch.Tensor, x_scales: torch.Tensor | None, weights: Nvfp4WeightOnlyWeights, routing: Routing,
        activation: Activation, out: torch.Tensor) -> None:
    """out bfloat16 [T, H] = the layer (arguments checked by the caller) for BF16 tokens x [T, H] (x_scales
    None), or for the pair's NVFP4 tokens: codes x uint8 [T, H/2] with E4M3 scales x_scales [T, H/16]."""
    bf16_tokens = x_scales is None
    executor = _executor(layer_view(weights), routing.top_k, activation, bf16_tokens)
    ids, route_weights, routing_format = routing.kernel_operands()
    tokens, top_k = x.shape[0], routing.top_k

    def stage(b: Bucket) -> None:
        if bf16_tokens:  # staged as bytes, with an empty scale row
            kernels.stage_inputs(x.view(torch.uint8), b.x_scales[:tokens], ids, route_weights, routing_format,
                                 b.x.view(torch.uint8), b.x_scales, b.ids, b.route_weights)
        else:
            kernels.stage_inputs(x, x_scales, ids, route_weights, routing_format, b.x, b.x_scales, b.ids,
                                 b.route_weights)

    def finish(b: Bucket) -> None:
        kernels.finalize(b.gemm2.out, b.slot_to_row, b.route_weights, top_k, out)

    signature = (tensor_signature(x), tensor_signature(x_scales), tensor_signature(ids),
                 tensor_signature(route_weights), routing_format, tensor_signature(out), tokens)
    executor.run_call(tokens, stage, finish, use_cuda_graph=True, signature=signature)
