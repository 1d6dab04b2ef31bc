"""``fused_moe`` as a torch custom op, so ``torch.compile`` and a caller's CUDA-graph capture of a whole
model can hold it.

``MoeLayer`` (an ``nn.Module``) owns a prepared layer; its forward calls the custom op
``torch.ops.cudnn_moe.fused_moe_`` with a handle to the layer, the activation pack, the routing and the
caller's ``out`` (declared as mutated; the op returns nothing). The op is opaque to the compiler, and
its fake implementation only says that ``out`` is written, so graphs compile without a break.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..activations import Activation, SwiGLU, parse_activation
from ..handles import HandleRegistry
from ..routing import Routing
from ..weights.nvfp4 import Nvfp4Activations, Nvfp4Weights
from .checks import check_layer
from .config import Nvfp4MoeConfig
from .op import fused_moe, get_executor


@dataclass(frozen=True)
class _Layer:
    config: Nvfp4MoeConfig
    weights: Nvfp4Weights
    activation: Activation
    local_expert_start: int


_layers = HandleRegistry("MoeLayer")


@torch.library.custom_op("cudnn_moe::fused_moe_", mutates_args=("out",), device_types="cuda")
def fused_moe_op(
    layer: int,
    act_packed: torch.Tensor,
    act_scales: torch.Tensor,
    routing_ids: torch.Tensor,
    routing_weights: torch.Tensor | None,
    out: torch.Tensor,
) -> None:
    """out bfloat16 [T, H] = fused_moe of layer ``layer`` (a MoeLayer handle) on the NVFP4 pack
    (uint8 [T, H/2], float8_e4m3fn [T, H/16]) and the routing: packed int32 [T, k] when
    ``routing_weights`` is None, else ids int32/int64 [T, k] + weights float32/bfloat16 [T, k]."""
    found = _layers.resolve(layer)
    routing = Routing.packed(routing_ids) if routing_weights is None else Routing.unpacked(routing_ids, routing_weights)
    fused_moe(
        found.config, Nvfp4Activations(act_packed, act_scales), routing, found.weights,
        activation=found.activation, local_expert_start=found.local_expert_start, out=out,
    )


@fused_moe_op.register_fake
def _fused_moe_fake(layer, act_packed, act_scales, routing_ids, routing_weights, out) -> None:  # noqa: ANN001
    return None


class MoeLayer(torch.nn.Module):
    """A prepared NVFP4 MoE layer as a module: ``forward(act_packed, act_scales, routing_ids,
    routing_weights=None, out=None) -> out`` (bfloat16 [T, H]).

    Inside a CUDA-graph capture (yours, or torch.compile's "reduce-overhead"), every token bucket the
    capture uses must have run once before, or call ``warmup()`` first.

    activation: the activation the weights were prepared for (gated or not, as they are).
    local_expert_start: the global id of the weights' first expert, an int >= 0 with
    ``local_expert_start + E - 1`` in int32 (the kernels' expert ids). Bad arguments raise
    TypeError / ValueError naming them, here rather than at the first call.
    """

    def __init__(
        self,
        config: Nvfp4MoeConfig,
        weights: Nvfp4Weights,
        *,
        activation: Activation | str = SwiGLU(),
        local_expert_start: int = 0,
    ) -> None:
        super().__init__()
        act = parse_activation(activation)
        check_layer(config, weights, 1, act, local_expert_start)
        self.layer = _Layer(config, weights, act, local_expert_start)  # held here, by handle in the registry
        self.handle = _layers.register(self.layer)

    def warmup(self, top_k: int, max_tokens: int | None = None) -> None:
        """Build every token bucket up to ``max_tokens`` (default: the config's) for routing of ``top_k``."""
        layer = self.layer
        get_executor(layer.config, layer.weights, top_k=top_k, activation=layer.activation,
                     local_expert_start=layer.local_expert_start).warmup(max_tokens)

    def forward(
        self,
        act_packed: torch.Tensor,
        act_scales: torch.Tensor,
        routing_ids: torch.Tensor,
        routing_weights: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if out is None:
            out = torch.empty(act_packed.shape[0], self.layer.weights.hidden_size, dtype=torch.bfloat16,
                              device=act_packed.device)
        torch.ops.cudnn_moe.fused_moe_(self.handle, act_packed, act_scales, routing_ids, routing_weights, out)
        return out
