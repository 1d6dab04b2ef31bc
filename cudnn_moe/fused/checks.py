"""The fused op's argument checks (TypeError for a wrong type or dtype, ValueError for a wrong value, shape
or device, each naming the argument), run before anything is launched."""

from __future__ import annotations

import torch

from ..activations import Activation, require_gating
from ..arch import arch_name, device_arch
from ..engines.base import NVFP4, OP_FUSED, Request
from ..engines.registry import choose
from ..pipeline.executor import row_capacity
from ..routing import Routing
from ..validate import (
    require_contiguous,
    require_int_arg,
    require_no_overlap,
    require_same_device,
    require_shape,
    require_tensor,
)
from ..weights.nvfp4 import Nvfp4Activations, Nvfp4Weights
from .config import Nvfp4MoeConfig

INT32_MAX = (1 << 31) - 1


def require_weights(weights: object) -> Nvfp4Weights:
    if not isinstance(weights, Nvfp4Weights):
        raise TypeError("weights must be the Nvfp4Weights from config.prepare_weights()")
    return weights


def require_config(config: object) -> Nvfp4MoeConfig:
    if not isinstance(config, Nvfp4MoeConfig):
        raise TypeError(f"config must be an Nvfp4MoeConfig, got {type(config).__name__}")
    return config


def unfinalized_row_count(weights: Nvfp4Weights, num_tokens: int, top_k: int) -> int:
    """Rows R of ``UnfinalizedOutput.rows`` for a call of this size with these weights (set by the
    row alignment of the engine they were prepared for): the size an ``out`` tensor [R, H] must have
    with finalize=False."""
    require_weights(weights)
    require_int_arg("num_tokens", num_tokens, 0)
    require_int_arg("top_k", top_k, 1)
    return row_capacity(num_tokens, top_k, weights.num_experts, weights.spec.row_alignment)


def check_layer(config: object, weights: object, top_k: object, activation: Activation, local_expert_start: object) -> None:
    """What an executor is built from: config an Nvfp4MoeConfig; weights its Nvfp4Weights; top_k >= 1, with the
    slots and rows of config.max_num_tokens' bucket in int32; activation gated as the weights are;
    local_expert_start >= 0, with the weights' last global expert id in int32."""
    config, weights = require_config(config), require_weights(weights)
    require_int_arg("top_k", top_k, 1)
    require_int_arg("local_expert_start", local_expert_start, 0, INT32_MAX - weights.num_experts + 1)
    require_gating(activation, weights.gated)
    bucket = 1 << (config.max_num_tokens - 1).bit_length()
    if row_capacity(bucket, top_k, weights.num_experts, weights.spec.row_alignment) > INT32_MAX:
        raise ValueError(f"top_k={top_k} is too large for max_num_tokens={config.max_num_tokens}: the "
                         f"{bucket}-token bucket's slots and rows must fit int32 indices")


def check_call(
    config: object,
    activations: object,
    routing: object,
    weights: object,
    activation: Activation,
    local_expert_start: object,
) -> None:
    """The inputs of one fused_moe call (the output is checked by ``check_out``)."""
    config, weights = require_config(config), require_weights(weights)
    if not isinstance(activations, Nvfp4Activations):
        raise TypeError("activations must be the Nvfp4Activations from config.prepare_activations()")
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
    require_gating(activation, weights.gated)
    require_int_arg("local_expert_start", local_expert_start, 0)
    device = require_same_device(
        activations=activations.packed, activation_scales=activations.scales, weights=weights.w1,
        routing=routing.device_tensor(),
    )
    if device.type != "cuda":
        raise ValueError(f"fused_moe runs on a CUDA device; the inputs are on {device}")
    arch = device_arch(device)
    choose(Request(OP_FUSED, arch, NVFP4))  # ValueError naming why no engine runs the op on this GPU
    if weights.spec.arch != arch:
        raise ValueError(f"weights were prepared for the {weights.spec.describe()} but this GPU is {arch_name(arch)}; "
                         "prepare them with a config for this GPU")


def check_out(out: torch.Tensor, rows: int, activations: Nvfp4Activations, routing: Routing,
              weights: Nvfp4Weights) -> None:
    """``out``: a contiguous bfloat16 [rows, H] tensor on the weights' device, sharing no memory with any input."""
    require_tensor("out", out, torch.bfloat16, rank=2)
    require_shape("out", out, (rows, weights.hidden_size))
    require_contiguous(out=out)
    require_same_device(out=out, weights=weights.w1)
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
        if tensor is not None:
            require_no_overlap("out", out, name, tensor)
