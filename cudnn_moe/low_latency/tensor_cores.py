"""The tensor-core path of the low-latency call: NVFP4 weight-only layers with BF16 tokens and a BF16
output on Hopper, through the SM90 engine's grouped GEMM (decode kernel: weights decoded exactly in
registers, tokens on the narrow side of mma.sync, split-K) and the shared pipeline run with
``bf16_activations`` (cudnn_moe.executor): stage, sort, permute of the BF16 tokens, GEMM1, activation
rounded to BF16, GEMM2, ordered FP32 combine.

Numerics are the format's contract (cudnn_moe.low_latency.reference), the same as the CUDA-core
kernels': GEMM1 = bf16(global1[e] * FP32 sum of exact products), activation in FP32 rounded to BF16,
expert rows = bf16(global2[e] * FP32 sum), combine in slot order with separate FP32 multiply and add.
Only the FP32 summation order differs, so the two paths agree to accumulation-order noise.

The weights are repacked once into the SM90 fragment tiles (kept beside the caller's canonical tensors
while the prepared weights live). Expert ids must lie in [0, E), as the format requires; others are
skipped (masked by the stage), never read out of bounds.
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
from ..ops import tensor_signature
from ..routing import Routing
from .config import MAX_NUM_TOKENS
from .weights import LowLatencyWeights, Nvfp4WeightOnlyWeights, WeightFormat

_views: weakref.WeakKeyDictionary[LowLatencyWeights, Nvfp4Weights] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def applies(weights: LowLatencyWeights, x_dtype: torch.dtype | None, out_dtype: torch.dtype, finalize: bool,
            arch: Arch) -> bool:
    """Whether a call of these properties runs on the tensor-core path: NVFP4 weight-only, BF16 tokens and
    output, finalized, on SM90. Measured on an H200 (benchmarks/RESULTS.md) it is 1.9-3x faster than the
    CUDA-core kernels from two tokens on, and at one token as fast on Qwen3-30B-A3B and 1.9x faster on
    DeepSeek-V3, so it takes every T."""
    return (weights.format is WeightFormat.NVFP4_WEIGHT_ONLY and arch == SM90 and x_dtype == torch.bfloat16
            and out_dtype == torch.bfloat16 and finalize)


def layer_view(weights: Nvfp4WeightOnlyWeights) -> Nvfp4Weights:
    """The SM90-engine view of NVFP4 weight-only weights (repacked on first use, then cached): w1 [E, N1p, H]
    as fragment tiles with the w1 global as alpha, w2 [E, H, Ip] likewise; intermediate size Ip."""
    view = _views.get(weights)
    if view is not None:
        return view
    with _lock:
        view = _views.get(weights)
        if view is None:
            w1, w1_scales = Sm90GemmEngine.pack_weights(SM90, weights.w1_codes, weights.w1_scales)
            w2, w2_scales = Sm90GemmEngine.pack_weights(SM90, weights.w2_codes, weights.w2_scales)
            view = Nvfp4Weights(
                w1, w1_scales, weights.w1_global, w2, w2_scales, weights.w2_global, Sm90GemmEngine.spec(SM90),
                weights.gated, weights.hidden_size, weights.padded_intermediate,
            )
            _views[weights] = view
    return view


def _executor(view: Nvfp4Weights, top_k: int, activation: Activation) -> MoeExecutor:
    key = ("low_latency", top_k, activation)
    executor = view.executors.get(key)
    if executor is None:
        executor = MoeExecutor(view, engine_for(view.spec, view.device), top_k=top_k, activation=activation,
                               local_expert_start=0, max_num_tokens=MAX_NUM_TOKENS, bf16_activations=True)
        executor = view.executors.setdefault(key, executor)
    return executor


def run(x: torch.Tensor, weights: Nvfp4WeightOnlyWeights, routing: Routing, activation: Activation,
        out: torch.Tensor) -> None:
    """out bfloat16 [T, H] = the layer for BF16 tokens x [T, H] (arguments checked by the caller)."""
    executor = _executor(layer_view(weights), routing.top_k, activation)
    ids, route_weights, routing_format = routing.kernel_operands()
    tokens, top_k = x.shape[0], routing.top_k

    def stage(b: Bucket) -> None:
        kernels.stage_inputs(x.view(torch.uint8), b.x_scales[:tokens], ids, route_weights, routing_format,
                             b.x.view(torch.uint8), b.x_scales, b.ids, b.route_weights)

    def finish(b: Bucket) -> None:
        kernels.finalize(b.gemm2.out, b.slot_to_row, b.route_weights, top_k, out)

    signature = (tensor_signature(x), tensor_signature(ids), tensor_signature(route_weights), routing_format,
                 tensor_signature(out), tokens)
    executor.run_call(tokens, stage, finish, use_cuda_graph=True, signature=signature)
