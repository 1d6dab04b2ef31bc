"""The fused NVFP4 MoE op: ``fused_moe`` on the shared pipeline (stage: the caller's tokens and routing into
the bucket; finish: the weighted combine or the unfinalized rows)."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch

from ..activations import Activation, SwiGLU, parse_activation
from ..engines.registry import engine_for
from ..pipeline.call_cache import CheckedCalls, tensor_signature
from ..pipeline.executor import MoeExecutor, UnfinalizedOutput
from ..pipeline.lifetime import cached, release_deferred
from ..routing import Routing, check_distinct_experts
from ..weights.nvfp4 import Nvfp4Activations, Nvfp4Weights
from .checks import check_call, check_layer, check_out, unfinalized_row_count
from .config import Nvfp4MoeConfig

_checked = CheckedCalls()


def get_executor(
    config: Nvfp4MoeConfig,
    weights: Nvfp4Weights,
    *,
    top_k: int,
    activation: Activation | str,
    local_expert_start: int,
) -> MoeExecutor:
    """The executor of ``weights`` for this (top_k, activation, expert range, max tokens), built on first use
    and kept while the weights live (cudnn_moe.pipeline.lifetime). Everything is checked before anything is
    built (cudnn_moe.fused.checks.check_layer: TypeError / ValueError naming the argument)."""
    act = parse_activation(activation)
    check_layer(config, weights, top_k, act, local_expert_start)
    if weights.device.type != "cuda":
        raise ValueError(f"weights are on {weights.device}; the executor runs on a CUDA device")
    key = (top_k, act, local_expert_start, config.max_num_tokens)
    return cached(weights, key, lambda: MoeExecutor(
        weights, engine_for(weights.spec, weights.device), top_k=top_k, activation=act,
        local_expert_start=local_expert_start, max_num_tokens=config.max_num_tokens,
    ))


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
    multiply-add) of route weight x GEMM2 row, rounded once (rounding points: cudnn_moe.fused.reference).
    finalize=False returns an UnfinalizedOutput. ``out``, when given, receives the result ([T, H],
    or [R, H] rows for finalize=False) and must be a contiguous bfloat16 tensor on the same device
    that shares no memory with any input; nothing else the caller owns is written.

    use_cuda_graph=False launches every kernel eagerly (for debugging); results are bitwise equal.
    When the current stream is capturing a CUDA graph the launches are recorded into it. Calls with
    the same weights on different streams (threads) are ordered on the GPU (cudnn_moe.pipeline.order).

    Host path: the checks of a call are remembered per signature (the caller's tensor addresses,
    shapes, strides, dtypes, devices, T and the other arguments), so a repeated call skips them; a
    finalized call with ``out`` that repeats its signature replays one CUDA graph of the whole call
    (see cudnn_moe.pipeline.executor). Pass ``out`` (reused across calls) for the fastest path.
    """
    release_deferred()  # GPU objects of dropped weights, destroyed here rather than inside a capture
    key = None if check_routing else signature_key(
        config, activations, routing, weights, activation, local_expert_start, finalize, out, use_cuda_graph
    )
    checked = _checked.get(key)
    if checked is not None and checked[0] is config and checked[1] is weights:
        return checked[2].run(activations, routing, finalize=finalize, out=out, use_cuda_graph=use_cuda_graph,
                              signature=key)
    act = parse_activation(activation)
    check_call(config, activations, routing, weights, act, local_expert_start)
    tokens = activations.num_tokens
    if out is not None:
        check_out(out, tokens if finalize else unfinalized_row_count(weights, tokens, routing.top_k), activations,
                  routing, weights)
    if check_routing:
        check_distinct_experts(routing.ids_and_weights()[0])
    executor = get_executor(config, weights, top_k=routing.top_k, activation=act, local_expert_start=local_expert_start)
    if tokens == 0:
        return _empty_result(routing, weights, finalize, out)
    _checked.remember(key, config, weights, executor)
    return executor.run(activations, routing, finalize=finalize, out=out, use_cuda_graph=use_cuda_graph, signature=key)


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


def clear_checked_signatures() -> None:
    """Forget every remembered signature (the next call of each is checked in full again)."""
    _checked.clear()


def _empty_result(
    routing: Routing, weights: Nvfp4Weights, finalize: bool, out: torch.Tensor | None
) -> torch.Tensor | UnfinalizedOutput:
    empty = out if out is not None else torch.empty(0, weights.hidden_size, dtype=torch.bfloat16, device=weights.device)
    if finalize:
        return empty
    ids, route_weights = routing.ids_and_weights()
    return UnfinalizedOutput(empty, route_weights, torch.full_like(ids, -1))
