"""The public fused NVFP4 MoE op."""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Hashable
from typing import Any, NamedTuple

import torch

from .activations import Activation, SwiGLU, parse_activation
from .arch import arch_name, device_arch
from .config import Nvfp4Activations, Nvfp4MoeConfig, Nvfp4Weights
from .engines import engine_for
from .executor import MoeExecutor, UnfinalizedOutput, row_capacity
from .pipeline import cached_executor, release_deferred
from .routing import Routing, check_distinct_experts
from .validate import (
    require_contiguous,
    require_int_arg,
    require_no_overlap,
    require_same_device,
    require_shape,
    require_tensor,
)


def unfinalized_row_count(weights: Nvfp4Weights, num_tokens: int, top_k: int) -> int:
    """Rows R of ``UnfinalizedOutput.rows`` for a call of this size with these weights (set by the
    row alignment of the engine they were prepared for): the size an ``out`` tensor [R, H] must have
    with finalize=False."""
    if not isinstance(weights, Nvfp4Weights):
        raise TypeError("weights must be the Nvfp4Weights from config.prepare_weights()")
    require_int_arg("num_tokens", num_tokens, 0)
    require_int_arg("top_k", top_k, 1)
    return row_capacity(num_tokens, top_k, weights.num_experts, weights.spec.row_alignment)


def get_executor(
    config: Nvfp4MoeConfig,
    weights: Nvfp4Weights,
    *,
    top_k: int,
    activation: Activation | str,
    local_expert_start: int,
) -> MoeExecutor:
    """The executor cached on ``weights`` for this (top_k, activation, expert range, max tokens).

    Checked before anything is built (TypeError / ValueError naming the argument): config an
    Nvfp4MoeConfig; weights its Nvfp4Weights, on a CUDA device; top_k >= 1, with the slots and rows
    of config.max_num_tokens' bucket in int32; activation an Activation or a name, gated as the
    weights are; local_expert_start >= 0, with the weights' last global expert id in int32.
    """
    int32_max = (1 << 31) - 1
    if not isinstance(config, Nvfp4MoeConfig):
        raise TypeError(f"config must be an Nvfp4MoeConfig, got {type(config).__name__}")
    if not isinstance(weights, Nvfp4Weights):
        raise TypeError("weights must be the Nvfp4Weights from config.prepare_weights()")
    require_int_arg("top_k", top_k, 1)
    require_int_arg("local_expert_start", local_expert_start, 0, int32_max - weights.num_experts + 1)
    activation = parse_activation(activation)
    if activation.gated != weights.gated:
        raise ValueError(f"activation {type(activation).__name__} is {'' if activation.gated else 'non-'}gated but "
                         f"the weights were prepared for a {'' if weights.gated else 'non-'}gated activation")
    bucket = 1 << (config.max_num_tokens - 1).bit_length()
    if row_capacity(bucket, top_k, weights.num_experts, weights.spec.row_alignment) > int32_max:
        raise ValueError(f"top_k={top_k} is too large for max_num_tokens={config.max_num_tokens}: the "
                         f"{bucket}-token bucket's slots and rows must fit int32 indices")
    if weights.device.type != "cuda":
        raise ValueError(f"weights are on {weights.device}; the executor runs on a CUDA device")
    key = (top_k, activation, local_expert_start, config.max_num_tokens)
    return cached_executor(weights, key, lambda: MoeExecutor(
        weights, engine_for(weights.spec, weights.device), top_k=top_k, activation=activation,
        local_expert_start=local_expert_start, max_num_tokens=config.max_num_tokens,
    ))


def _validate(
    config: Nvfp4MoeConfig,
    activations: Nvfp4Activations,
    routing: Routing,
    weights: Nvfp4Weights,
    activation: Activation,
    local_expert_start: int,
) -> None:
    if not isinstance(config, Nvfp4MoeConfig):
        raise TypeError(f"config must be an Nvfp4MoeConfig, got {type(config).__name__}")
    if not isinstance(activations, Nvfp4Activations):
        raise TypeError("activations must be the Nvfp4Activations from config.prepare_activations()")
    if not isinstance(weights, Nvfp4Weights):
        raise TypeError("weights must be the Nvfp4Weights from config.prepare_weights()")
    if not isinstance(routing, Routing):
        raise TypeError("routing must be a cudnn_moe.Routing (Routing.packed(...) or Routing.unpacked(...))")
    tokens, hidden = activations.num_tokens, weights.hidden_size
    require_tensor("activations.packed", activations.packed, torch.uint8, rank=2)
    require_tensor("activations.scales", activations.scales, torch.float8_e4m3fn, rank=2)
    require_shape("activations.packed", activations.packed, (tokens, hidden // 2))
    require_shape("activations.scales", activations.scales, (tokens, hidden // 16))
    require_contiguous(activations_packed=activations.packed, activations_scales=activations.scales)
    if routing.num_tokens != tokens:
        raise ValueError(f"routing covers {routing.num_tokens} tokens but activations hold {tokens}")
    if tokens > config.max_num_tokens:
        raise ValueError(
            f"{tokens} tokens exceed the config's max_num_tokens={config.max_num_tokens}; "
            "raise it or split the batch"
        )
    if activation.gated != weights.gated:
        raise ValueError(
            f"{type(activation).__name__} is {'gated' if activation.gated else 'non-gated'} but the weights "
            f"were prepared for a {'gated' if weights.gated else 'non-gated'} activation"
        )
    require_int_arg("local_expert_start", local_expert_start, 0)
    device = require_same_device(
        activations=activations.packed, activation_scales=activations.scales, weights=weights.w1,
        routing=routing.device_tensor(),
    )
    if device.type != "cuda":
        raise ValueError(f"fused_moe runs on a CUDA device; the inputs are on {device}")
    arch = device_arch(device)
    if not config.supported(arch):
        raise RuntimeError(f"fused_moe supports sm90, sm100 and sm103; this GPU is {arch_name(arch)}")
    if weights.spec.arch != arch:
        raise ValueError(f"weights were prepared for the {weights.spec.describe()} but this GPU is {arch_name(arch)}; "
                         "prepare them with a config for this GPU")


def fused_moe(
    config: Nvfp4MoeConfig,
    activations: Nvfp4Activations,
    routing: Routing,
    weights: Nvfp4Weights,
    *,
    activation: Activation | str = SwiGLU(),
    local_expert_start: int = 0,
    finalize: bool = True,
    out: torch.Tensor | None = None,
    use_cuda_graph: bool = True,
    check_routing: bool = False,
) -> torch.Tensor | UnfinalizedOutput:
    """Run one NVFP4 MoE layer on the GPU.

    activations: T tokens from ``config.prepare_activations``. routing: top-k global expert ids
    and route weights for the T tokens. weights: this rank's E experts, global ids
    ``local_expert_start .. local_expert_start + E - 1``; slots naming other experts are skipped.
    Each token must name distinct experts (``check_routing=True`` verifies it, at the cost of a
    device sync).

    finalize=True returns bfloat16 [T, H]: sum over slots (in slot order, FP32, no fused
    multiply-add) of route weight x GEMM2 row, rounded once (rounding points: cudnn_moe.reference).
    finalize=False returns an UnfinalizedOutput. ``out``, when given, receives the result ([T, H],
    or [R, H] rows for finalize=False) and must be a contiguous bfloat16 tensor on the same device
    that shares no memory with any input; nothing else the caller owns is written.

    use_cuda_graph=False launches every kernel eagerly (for debugging); results are bitwise equal.
    When the current stream is capturing a CUDA graph the launches are recorded into it.

    Host path: the checks of a call are remembered per signature (the caller's tensor addresses,
    shapes, strides, dtypes, devices, T and the other arguments), so a repeated call skips them; a
    finalized call with ``out`` that repeats its signature replays one CUDA graph of the whole call
    (see cudnn_moe.executor). Pass ``out`` (reused across calls) for the fastest path.
    """
    release_deferred()  # GPU objects of dropped weights, destroyed here rather than inside a capture
    key = None if check_routing else signature_key(
        config, activations, routing, weights, activation, local_expert_start, finalize, out, use_cuda_graph
    )
    if key is not None:
        checked = _checked.get(key)
        if checked is not None and checked.config() is config and checked.weights() is weights:
            executor = checked.executor()
            if executor is not None:
                return executor.run(activations, routing, finalize=finalize, out=out,
                                    use_cuda_graph=use_cuda_graph, signature=key)
    act = parse_activation(activation)
    _validate(config, activations, routing, weights, act, local_expert_start)
    tokens, hidden = activations.num_tokens, weights.hidden_size
    if out is not None:
        rows = tokens if finalize else unfinalized_row_count(weights, tokens, routing.top_k)
        require_tensor("out", out, torch.bfloat16, rank=2)
        require_shape("out", out, (rows, hidden))
        require_contiguous(out=out)
        require_same_device(out=out, weights=weights.w1)
        _require_out_apart(out, activations, routing, weights)
    if check_routing:
        check_distinct_experts(routing.ids_and_weights()[0])
    executor = get_executor(
        config, weights, top_k=routing.top_k, activation=act, local_expert_start=local_expert_start
    )
    if tokens == 0:
        return _empty_result(routing, weights, finalize, out)
    if key is not None:
        _remember(key, config, weights, executor)
    return executor.run(activations, routing, finalize=finalize, out=out, use_cuda_graph=use_cuda_graph, signature=key)


MAX_CHECKED_SIGNATURES = 64


class _Checked(NamedTuple):
    """A signature whose checks passed: weak references to what it was checked against."""

    config: weakref.ref
    weights: weakref.ref
    executor: weakref.ref


_checked: OrderedDict[Hashable, _Checked] = OrderedDict()
_checked_lock = threading.Lock()


def tensor_signature(t: Any) -> tuple[Any, ...] | None:
    """What the checks of a tensor argument depend on: address, shape, strides, dtype, device."""
    if t is None:
        return None
    return (t.data_ptr(), t.shape, t.stride(), t.dtype, t.get_device())


def signature_key(
    config: Any,
    activations: Any,
    routing: Any,
    weights: Any,
    activation: Any,
    local_expert_start: Any,
    finalize: bool,
    out: Any,
    use_cuda_graph: bool,
) -> Hashable | None:
    """A cheap hashable identity of one fused_moe call's arguments: everything its checks read (object
    identities, the config's max_num_tokens, and each tensor's address, shape, strides, dtype and
    device) and T; None when the arguments cannot form one (they then go through the full checks)."""
    try:
        key = (
            id(config), config.max_num_tokens, id(weights), type(activations), type(routing), activation,
            type(local_expert_start), local_expert_start, bool(finalize), bool(use_cuda_graph),
            tensor_signature(activations.packed), tensor_signature(activations.scales),
            tensor_signature(routing.packed_tensor), tensor_signature(routing.ids),
            tensor_signature(routing.weights), tensor_signature(out),
        )
        hash(key)
    except (AttributeError, TypeError):
        return None
    return key


def _remember(key: Hashable, config: Nvfp4MoeConfig, weights: Nvfp4Weights, executor: MoeExecutor) -> None:
    """Record that ``key`` passed every check (bounded: the oldest signature goes first)."""
    checked = _Checked(weakref.ref(config), weakref.ref(weights), weakref.ref(executor))
    with _checked_lock:
        _checked[key] = checked
        _checked.move_to_end(key)
        while len(_checked) > MAX_CHECKED_SIGNATURES:
            _checked.popitem(last=False)


def clear_checked_signatures() -> None:
    """Forget every remembered signature (the next call of each is checked in full again)."""
    with _checked_lock:
        _checked.clear()


def _require_out_apart(out: torch.Tensor, activations: Nvfp4Activations, routing: Routing, weights: Nvfp4Weights) -> None:
    """``out`` must share no memory with any input (the op would write into it)."""
    inputs = {
        "activations.packed": activations.packed, "activations.scales": activations.scales,
        "weights.w1": weights.w1, "weights.w1_scales": weights.w1_scales, "weights.w1_alpha": weights.w1_alpha,
        "weights.w2": weights.w2, "weights.w2_scales": weights.w2_scales, "weights.w2_alpha": weights.w2_alpha,
    }
    if routing.is_packed:
        inputs["routing.packed"] = routing.packed_tensor
    else:
        inputs.update({"routing.ids": routing.ids, "routing.weights": routing.weights})
    for name, tensor in inputs.items():
        require_no_overlap("out", out, name, tensor)


def _empty_result(
    routing: Routing, weights: Nvfp4Weights, finalize: bool, out: torch.Tensor | None
) -> torch.Tensor | UnfinalizedOutput:
    empty = out if out is not None else torch.empty(0, weights.hidden_size, dtype=torch.bfloat16, device=weights.device)
    if finalize:
        return empty
    ids, route_weights = routing.ids_and_weights()
    return UnfinalizedOutput(empty, route_weights, torch.full_like(ids, -1))
