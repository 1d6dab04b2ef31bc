"""The aligned-plan NVFP4 MoE op on the GPU: the caller's plan drives the shared pipeline.

The op reuses the NVFP4 pipeline of ``fused_moe`` (cudnn_moe.pipeline.executor: sort, permute, GEMM1,
SwiGLU + NVFP4 requantize, GEMM2) on the weights ``prepare_aligned_weights`` prepares (read in place, or
laid out); only its two ends differ. Its stage copies the caller's NVFP4 tokens, scales the route weights by
routed_scaling_factor, loads the three output scales into the token bucket and turns the plan into per-slot expert ids on
the device (blocks past num_tokens_post_padded are skipped there); its finish adds each token's
contributions, in slot order, into the FP32 value of ``out`` and writes ``out`` once. The pipeline
groups the planned slots by expert again, so the plan's block size does not shape the GEMMs.
"""

from __future__ import annotations

import threading
import warnings
from collections import OrderedDict
from collections.abc import Hashable

import numpy as np
import torch

from .. import kernels
from ..capture import refuse_during_capture
from ..engines.registry import engine_for
from ..pipeline.call_cache import CheckedCalls, tensor_signature
from ..pipeline.executor import Bucket, MoeExecutor
from ..pipeline.lifetime import cached, release_deferred
from .checks import check_operands
from .operands import AlignedOperands
from .weights import GATED, AlignedWeights, owner_of, prepare_aligned_weights, raw_signature

BUCKET_LIMIT = 1 << 20  # tokens: warmup's default ceiling only; buckets are allocated on demand
PREPARED_CACHE_SIZE = 4  # weight sets prepared on the fly (no ``prepared`` argument) kept per process
_warned_eviction = False

_prepared: OrderedDict[tuple, AlignedWeights] = OrderedDict()
_checked = CheckedCalls()  # signature -> (weights, executor); a dropped ``prepared`` misses
_lock = threading.Lock()


def _weights_for(
    raw: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], prepared: AlignedWeights | None
) -> AlignedWeights:
    """``prepared`` after checking it was built from these raw tensors, or weights prepared now (and
    cached by the raw tensors' identity, addresses and version counters)."""
    if prepared is not None:
        if not isinstance(prepared, AlignedWeights):
            raise TypeError(f"prepared must come from prepare_aligned_weights(), got {type(prepared).__name__}")
        if not prepared.same_tensors(raw):
            raise ValueError("prepared was built from other weight tensors (or they were written since): prepare "
                             "them again from gemm1_weights, gemm1_weights_scale, gemm2_weights, gemm2_weights_scale")
        return prepared
    sources = tuple(raw_signature(t) for t in raw)
    with _lock:
        found = _prepared.get(sources)
        if found is not None and found.same_tensors(raw):
            _prepared.move_to_end(sources)
            return found
    refuse_during_capture("aligned_moe must prepare these weights",
                          "pass prepared=prepare_aligned_weights(...) or make one call before capture")
    weights = prepare_aligned_weights(*raw)
    with _lock:
        _prepared[sources] = weights
        if len(_prepared) > PREPARED_CACHE_SIZE:
            _prepared.popitem(last=False)
            if not _warned_eviction:
                _warn_eviction()
    return weights


def _warn_eviction() -> None:
    global _warned_eviction
    _warned_eviction = True
    warnings.warn(f"aligned_moe prepared more than {PREPARED_CACHE_SIZE} weight sets on the fly: each call now "
                  "prepares its weights again; pass prepared=prepare_aligned_weights(...) per layer", stacklevel=4)


def _executor(weights: AlignedWeights, top_k: int) -> MoeExecutor:
    """The pipeline executor of ``weights`` for ``top_k`` (kept while the weights live)."""
    layer = weights.layer
    return cached(layer, ("aligned", top_k), lambda: MoeExecutor(
        layer, engine_for(layer.spec, layer.device), top_k=top_k, activation=GATED, local_expert_start=0,
        max_num_tokens=BUCKET_LIMIT,
    ))


def _float32_bits(value: object) -> object:
    """The float32 bits the stage bakes in for a number (so 0.0 and -0.0 differ), else the value itself."""
    try:
        return np.float32(value).tobytes()
    except (TypeError, ValueError):
        return value


def _signature(operands: AlignedOperands, panels: tuple, prepared: AlignedWeights | None) -> Hashable | None:
    """What the checks of a call read: each tensor's signature, the raw weights' version counters, the
    scalars (the scaling factor by its float32 bits), whether the panels are None, and ``prepared``."""
    try:
        key = (*(tensor_signature(t) for t in operands[:14]), *(t._version for t in operands.raw_weights),
               operands.top_k, operands.block_m, _float32_bits(operands.routed_scaling_factor), *panels, id(prepared))
        hash(key)
    except (AttributeError, TypeError):
        return None
    return key


def aligned_moe(
    hidden_states: torch.Tensor,
    hidden_states_scale: torch.Tensor,
    gemm1_weights: torch.Tensor,
    gemm1_weights_scale: torch.Tensor,
    gemm2_weights: torch.Tensor,
    gemm2_weights_scale: torch.Tensor,
    output1_scale_gate_scalar: torch.Tensor,
    output1_scale_scalar: torch.Tensor,
    output2_scale_scalar: torch.Tensor,
    sorted_token_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_tokens_post_padded: torch.Tensor,
    topk_weights: torch.Tensor,
    out: torch.Tensor,
    top_k: int,
    block_m: int = 8,
    routed_scaling_factor: float = 1.0,
    w1_scale_prepared: torch.Tensor | None = None,
    w2_scale_prepared: torch.Tensor | None = None,
    *,
    prepared: AlignedWeights | None = None,
) -> None:
    """Add one NVFP4 MoE layer, routed by an aligned plan, into ``out`` (returns None).

    Arguments, layouts and checks: cudnn_moe.aligned.check_aligned_args (the contract's names); the
    plan format: cudnn_moe.align_routing; the rounding points: cudnn_moe.aligned.reference_aligned_moe,
    which this op matches up to FP32 evaluation noise (accumulation order, FP32 SiLU). ``out`` is read
    and written once per element and nothing else the caller owns is written. Deterministic: the same
    inputs give the same bits.

    prepared: from prepare_aligned_weights(gemm1_weights, ...), built once per layer before serving.
    Without it the weights are prepared on the first call as prepare_aligned_weights does by default (read
    in place where the engine can, else laid out in its layout) and cached (for the last
    PREPARED_CACHE_SIZE weight sets; more layers than that prepare their weights again on every call, with a
    warning) by the raw tensors' identity, addresses, shapes and torch version counters: writes torch
    does not see, e.g. by a foreign CUDA kernel, need ``prepared`` built again. w1_scale_prepared /
    w2_scale_prepared: the contract's panels of another library's layout; accepted only as None (pass
    ``prepared`` instead). Calls with one prepared weight set share its workspaces (the output scales
    are staged into them, never into ``prepared``); calls on different streams (threads) are ordered on
    the GPU (cudnn_moe.pipeline.order) and give the single-stream results.

    The plan is read on the device only: blocks past num_tokens_post_padded are skipped there, and a
    CUDA graph of the call follows a new plan on replay. Entries that break the plan (a slot named
    twice, expert ids outside [0, E) in an active block) are not detected; they skip the entry or
    keep one of the two. Launches go on torch's current stream; a first call of each token count
    allocates workspaces, so make one before capturing the op into a CUDA graph.
    """
    release_deferred()  # GPU objects of dropped weights, destroyed here rather than inside a capture
    operands = AlignedOperands(
        hidden_states, hidden_states_scale, gemm1_weights, gemm1_weights_scale, gemm2_weights, gemm2_weights_scale,
        output1_scale_gate_scalar, output1_scale_scalar, output2_scale_scalar, sorted_token_ids, expert_ids,
        num_tokens_post_padded, topk_weights, out, top_k, block_m, routed_scaling_factor,
    )
    raw = operands.raw_weights
    key = _signature(operands, (w1_scale_prepared is None, w2_scale_prepared is None), prepared)
    found = _checked.get(key)
    if found is not None and all(ref() is owner_of(t) for ref, t in zip(found[0].owners, raw)):
        weights, executor = found
    else:  # never checked, or new tensors at the addresses of freed ones: check everything
        weights, executor = _check_and_prepare(operands, w1_scale_prepared, w2_scale_prepared, prepared)
        _checked.remember(key, weights, executor)
    if operands.hidden_states.shape[0]:
        _run(executor, operands, key)


def _check_and_prepare(
    operands: AlignedOperands,
    w1_scale_prepared: torch.Tensor | None,
    w2_scale_prepared: torch.Tensor | None,
    prepared: AlignedWeights | None,
) -> tuple[AlignedWeights, MoeExecutor]:
    check_operands(operands)
    for name, value in (("w1_scale_prepared", w1_scale_prepared), ("w2_scale_prepared", w2_scale_prepared)):
        if value is not None:
            raise ValueError(f"{name} must be None: panels of another library's layout do not apply here; "
                             "pass prepared=prepare_aligned_weights(gemm1_weights, ...) instead")
    device = operands.hidden_states.device
    if device.type != "cuda":
        raise ValueError(f"aligned_moe runs on a CUDA device; the inputs are on {device} "
                         "(cudnn_moe.aligned.reference_aligned_moe computes it on the CPU)")
    weights = _weights_for(operands.raw_weights, prepared)
    if weights.layer.device != device:
        raise ValueError(f"prepared lives on {weights.layer.device} but the inputs are on {device}")
    return weights, _executor(weights, operands.top_k)


def _run(executor: MoeExecutor, o: AlignedOperands, key: Hashable | None) -> None:
    """Stage (tokens, scaled route weights, the three output scales into the bucket, the plan as per-slot expert
    ids), the pipeline, and the finish (each token's contributions added into ``out``)."""
    num_tokens, scaling = o.hidden_states.shape[0], float(o.routed_scaling_factor)
    num_experts = executor.weights.num_experts

    def stage(bucket: Bucket) -> None:
        kernels.stage_aligned(
            o.hidden_states, o.hidden_states_scale, o.topk_weights, scaling,
            (o.output1_scale_scalar, o.output1_scale_gate_scalar, o.output2_scale_scalar),
            bucket.x, bucket.x_scales, bucket.ids, bucket.route_weights, bucket.alpha1, bucket.alpha2,
            x_rows=bucket.x_rows,
        )
        kernels.plan_routes(o.sorted_token_ids, o.expert_ids, o.num_tokens_post_padded, o.block_m,
                            num_tokens * o.top_k, num_experts, bucket.ids.view(-1))

    def finish(bucket: Bucket) -> None:
        kernels.finalize(bucket.gemm2.out, bucket.slot_to_row, bucket.route_weights, o.top_k, o.out, accumulate=True)

    executor.run_call(num_tokens, stage, finish, use_cuda_graph=True, signature=key)


def clear_aligned_caches() -> None:
    """Forget the weights prepared on the fly and the remembered call signatures."""
    with _lock:
        _prepared.clear()
    _checked.clear()
