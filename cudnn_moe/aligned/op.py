"""The aligned-plan NVFP4 MoE op on the GPU: the caller's plan drives the shared pipeline.

The op reuses the NVFP4 pipeline of ``fused_moe`` (cudnn_moe.executor: sort, permute, GEMM1,
SwiGLU + NVFP4 requantize, GEMM2) on weights laid out by ``prepare_aligned_weights``; only its two
ends differ. Its stage copies the caller's NVFP4 tokens, scales the route weights by
routed_scaling_factor, loads the three output scales and turns the plan into per-slot expert ids on
the device (blocks past num_tokens_post_padded are skipped there); its finish adds each token's
contributions, in slot order, into the FP32 value of ``out`` and writes ``out`` once. The pipeline
groups the planned slots by expert again, so the plan's block size does not shape the GEMMs.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Hashable

import numpy as np
import torch

from .. import kernels
from ..engines import engine_for
from ..executor import Bucket, MoeExecutor
from ..ops import tensor_signature
from ..pipeline import cached_executor, release_deferred
from .checks import AlignedDims, check_aligned_args
from .weights import GATED, AlignedWeights, owner_of, prepare_aligned_weights, raw_signature

BUCKET_LIMIT = 1 << 20  # tokens: warmup's default ceiling only; buckets are allocated on demand
PREPARED_CACHE_SIZE = 4  # weight sets prepared on the fly (no ``prepared`` argument) kept per process
_warned_eviction = False
SIGNATURES_CACHE_SIZE = 64

_prepared: OrderedDict[tuple, AlignedWeights] = OrderedDict()
# Signatures whose checks passed -> weak references to their weights and executor (a dropped
# ``prepared`` is freed; its signature then goes through the checks again).
_checked: OrderedDict[Hashable, tuple[weakref.ref, weakref.ref]] = OrderedDict()
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
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("aligned_moe must prepare these weights, but the stream is capturing a CUDA graph: "
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
    warnings.warn(f"aligned_moe prepared more than {PREPARED_CACHE_SIZE} weight sets on the fly: each call now lays "
                  "its weights out again; pass prepared=prepare_aligned_weights(...) per layer", stacklevel=4)


def _executor(weights: AlignedWeights, top_k: int) -> MoeExecutor:
    """The pipeline executor cached on ``weights`` for ``top_k``."""
    layer = weights.layer
    return cached_executor(layer, ("aligned", top_k), lambda: MoeExecutor(
        layer, engine_for(layer.spec, layer.device), top_k=top_k, activation=GATED, local_expert_start=0,
        max_num_tokens=BUCKET_LIMIT,
    ))


def _float32_bits(value: object) -> object:
    """The float32 bits the stage bakes in for a number (so 0.0 and -0.0 differ), else the value itself."""
    try:
        return np.float32(value).tobytes()
    except (TypeError, ValueError):
        return value


def _signature(args: tuple, scalars: tuple, prepared: AlignedWeights | None) -> Hashable | None:
    try:
        key = (*(tensor_signature(a) for a in args), *(t._version for t in args[2:6]), *scalars, id(prepared))
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
    Without it the weights are laid out on the first call and the layout is cached (for the last
    PREPARED_CACHE_SIZE weight sets; more layers than that re-lay their weights on every call, with a
    warning) by the raw tensors' identity, addresses, shapes and torch version counters: writes torch
    does not see, e.g. by a foreign CUDA kernel, need ``prepared`` built again. w1_scale_prepared /
    w2_scale_prepared: the contract's panels of another library's layout; accepted only as None (pass
    ``prepared`` instead). Calls with one prepared weight set share its workspaces and the scratch of
    the output scales: order them on one stream.

    The plan is read on the device only: blocks past num_tokens_post_padded are skipped there, and a
    CUDA graph of the call follows a new plan on replay. Entries that break the plan (a slot named
    twice, expert ids outside [0, E) in an active block) are not detected; they skip the entry or
    keep one of the two. Launches go on torch's current stream; a first call of each token count
    allocates workspaces, so make one before capturing the op into a CUDA graph.
    """
    release_deferred()  # GPU objects of dropped weights, destroyed here rather than inside a capture
    raw = (gemm1_weights, gemm1_weights_scale, gemm2_weights, gemm2_weights_scale)
    args = (hidden_states, hidden_states_scale, *raw, output1_scale_gate_scalar, output1_scale_scalar,
            output2_scale_scalar, sorted_token_ids, expert_ids, num_tokens_post_padded, topk_weights, out)
    scalars = (top_k, block_m, _float32_bits(routed_scaling_factor), w1_scale_prepared is None,
               w2_scale_prepared is None)
    key = _signature(args, scalars, prepared)
    found = _checked.get(key) if key is not None else None
    weights, executor = (found[0](), found[1]()) if found is not None else (None, None)
    if weights is not None and not all(ref() is owner_of(t) for ref, t in zip(weights.owners, raw)):
        weights = None  # new tensors at the addresses of freed ones: check everything again
    elif weights is not None:
        with _lock:
            if key in _checked:
                _checked.move_to_end(key)
    dims = None
    if weights is None or executor is None:
        dims = check_aligned_args(*args, top_k, block_m, routed_scaling_factor)
        for name, value in (("w1_scale_prepared", w1_scale_prepared), ("w2_scale_prepared", w2_scale_prepared)):
            if value is not None:
                raise ValueError(f"{name} must be None: panels of another library's layout do not apply here; "
                                 "pass prepared=prepare_aligned_weights(gemm1_weights, ...) instead")
        if hidden_states.device.type != "cuda":
            raise ValueError(f"aligned_moe runs on a CUDA device; the inputs are on {hidden_states.device} "
                             "(cudnn_moe.aligned.reference_aligned_moe computes it on the CPU)")
        weights = _weights_for(raw, prepared)
        if weights.layer.device != hidden_states.device:
            raise ValueError(f"prepared lives on {weights.layer.device} but the inputs are on {hidden_states.device}")
        executor = _executor(weights, top_k)
    num_tokens = hidden_states.shape[0]
    if num_tokens == 0:
        return
    if dims is not None and key is not None:
        with _lock:
            _checked[key] = (weakref.ref(weights), weakref.ref(executor))
            while len(_checked) > SIGNATURES_CACHE_SIZE:
                _checked.popitem(last=False)
    scaling = float(routed_scaling_factor)
    num_experts = weights.num_experts
    layer = executor.weights

    def stage(bucket: Bucket) -> None:
        kernels.stage_aligned(
            hidden_states, hidden_states_scale, topk_weights, scaling,
            (output1_scale_scalar, output1_scale_gate_scalar, output2_scale_scalar),
            bucket.x, bucket.x_scales, bucket.ids, bucket.route_weights, layer.w1_alpha, layer.w2_alpha,
        )
        kernels.plan_routes(sorted_token_ids, expert_ids, num_tokens_post_padded, block_m, num_tokens * top_k,
                            num_experts, bucket.ids.view(-1))

    def finish(bucket: Bucket) -> None:
        kernels.finalize(bucket.gemm2.out, bucket.slot_to_row, bucket.route_weights, top_k, out, accumulate=True)

    executor.run_call(num_tokens, stage, finish, use_cuda_graph=True, signature=key)


def clear_aligned_caches() -> None:
    """Forget the weights prepared on the fly and the remembered call signatures."""
    with _lock:
        _prepared.clear()
        _checked.clear()


__all__ = ["AlignedDims", "aligned_moe", "clear_aligned_caches"]
