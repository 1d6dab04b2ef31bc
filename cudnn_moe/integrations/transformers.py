"""Hugging Face transformers (>= 5) experts implementation "cudnn_moe".

Importing this module registers ``experts_forward`` under the name "cudnn_moe" in transformers' experts
registry (``transformers.integrations.moe.ExpertsInterface``), so a model whose experts module is built with
``@use_experts_implementation`` (Qwen3-MoE, Mixtral, DeepSeek-V3, ...) runs its experts through this library
with ``from_pretrained(..., experts_implementation="cudnn_moe")`` or ``model.set_experts_implementation(
"cudnn_moe")``. ``register()`` does the same explicitly. ``import cudnn_moe`` never imports transformers.

What a call does, for an experts module holding ``gate_up_proj`` [E, 2I, H] (rows [gate; up]) and
``down_proj`` [E, H, I] and called with (hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]):

- On the module's first call (outside any CUDA-graph capture), its weights are quantized to NVFP4 once
  per expert (global = amax / 2688) and kept on the module; they are prepared again when the module's
  parameters are replaced or written in place. ``use_prepared(module, ...)`` attaches weights prepared
  elsewhere instead (e.g. from a ModelOpt checkpoint: cudnn_moe.checkpoints), taken as they are.
- mode "weight_only" (the default, ``register(mode=...)`` or ``module.cudnn_moe_mode``): calls of up to 8
  tokens run ``low_latency_moe`` with NVFP4 weights and BF16 tokens; larger calls run ``fused_moe``
  (NVFP4 tokens too). mode "nvfp4": every call runs ``fused_moe``.
- The result is cast to the hidden states' dtype. Tokens are cast to BF16 first where they are not.

What the library cannot run raises ValueError naming the module (its class and the reason) on the first
call, before anything is prepared: biases, transposed or interleaved gate/up layouts, experts without a
gate, an activation other than SiLU / GELU / tanh-GELU, hidden or intermediate sizes the formats refuse
(H a multiple of 128, I a multiple of 128), a module not on a CUDA device. Nothing falls back silently.
CUDA-graph capture of the model works after one eager call of each token count (as for any module
here); under ``torch.compile`` the call is a graph break.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch

from ..activations import Activation, GeGLU, GeGLUTanh, SwiGLU
from ..capture import refuse_during_capture
from ..fused import Nvfp4MoeConfig, fused_moe
from ..low_latency import LowLatencyMoeConfig, low_latency_moe
from ..routing import Routing
from ..weights.nvfp4 import Nvfp4Weights, quantize_experts

NAME = "cudnn_moe"
MODES = ("weight_only", "nvfp4")
LOW_LATENCY_TOKENS = 8
FUSED_MAX_TOKENS = 8192
SIZE_MULTIPLE = 128
_ACTIVATIONS: dict[str, Activation] = {
    "silu": SwiGLU(), "swish": SwiGLU(), "gelu": GeGLU(), "gelu_pytorch_tanh": GeGLUTanh(), "gelu_new": GeGLUTanh(),
    "gelu_fast": GeGLUTanh(),
}
_default_mode = "weight_only"
_lock = threading.Lock()


@dataclass
class _Prepared:
    """What a module's calls run on: the source's identity (None: attached by use_prepared), the activation,
    and the prepared weights of each path (made on first use)."""

    source: tuple | None
    activation: Activation
    low_latency: Any = None
    fused: Nvfp4Weights | None = None


_LOW_LATENCY = LowLatencyMoeConfig(max_num_tokens=LOW_LATENCY_TOKENS)
_FUSED = Nvfp4MoeConfig(max_num_tokens=FUSED_MAX_TOKENS)


def register(mode: str = "weight_only") -> None:
    """Register "cudnn_moe" in transformers' experts registry (done on import too); ``mode`` is the default
    of every module: "weight_only" or "nvfp4" (see the module docstring)."""
    global _default_mode
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    from transformers.integrations.moe import ExpertsInterface

    _default_mode = mode
    ExpertsInterface.register(NAME, experts_forward)


def _name(module: torch.nn.Module) -> str:
    return type(module).__name__


def _activation(module: torch.nn.Module) -> Activation:
    """Our activation for the module's config.hidden_act; ValueError naming the module otherwise."""
    config = getattr(module, "config", None)
    act = getattr(config, "hidden_act", None)
    if act not in _ACTIVATIONS:
        raise ValueError(f"{_name(module)}: cudnn_moe runs gated SiLU / GELU / tanh-GELU experts, not hidden_act={act!r}")
    return _ACTIVATIONS[act]


def check_module(module: torch.nn.Module) -> Activation:
    """Everything the library needs of an experts module, else ValueError naming it; returns its activation."""
    name = _name(module)
    if getattr(module, "has_bias", False):
        raise ValueError(f"{name}: cudnn_moe runs experts without biases")
    if not getattr(module, "has_gate", True):
        raise ValueError(f"{name}: cudnn_moe runs gated experts (gate_up_proj); this module has no gate")
    if getattr(module, "is_transposed", False) or not getattr(module, "is_concatenated", True):
        raise ValueError(f"{name}: cudnn_moe needs gate_up_proj [E, 2I, H] with rows [gate; up] (not transposed, "
                         "not interleaved)")
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor) or gate_up.dim() != 3:
        raise ValueError(f"{name}: cudnn_moe needs 3-D gate_up_proj and down_proj parameters")
    experts, rows, hidden = gate_up.shape
    if rows % 2 or tuple(down.shape) != (experts, hidden, rows // 2):
        raise ValueError(f"{name}: gate_up_proj {list(gate_up.shape)} and down_proj {list(down.shape)} do not form "
                         "[E, 2I, H] and [E, H, I]")
    for label, size in (("hidden size", hidden), ("intermediate size", rows // 2)):
        if size % SIZE_MULTIPLE:
            raise ValueError(f"{name}: the {label} {size} is not a multiple of {SIZE_MULTIPLE}, as the NVFP4 formats need")
    activation = _activation(module)
    if gate_up.device.type != "cuda":
        raise ValueError(f"{name}: cudnn_moe runs on a CUDA device; the experts are on {gate_up.device}")
    return activation


def _source(module: torch.nn.Module) -> tuple:
    """What identifies the module's weights: the parameters' addresses and version counters."""
    return tuple((t.data_ptr(), t._version) for t in (module.gate_up_proj, module.down_proj))


def use_prepared(module: torch.nn.Module, *, low_latency: Any = None, fused: Nvfp4Weights | None = None) -> None:
    """Run ``module`` on weights prepared elsewhere (taken as they are, never requantized): ``low_latency`` from
    LowLatencyMoeConfig(max_num_tokens=8).prepare_nvfp4_weight_only_weights (or a ModelOpt checkpoint's
    low_latency_weights), ``fused`` from Nvfp4MoeConfig.prepare_weights (or fused_weights). A call that needs a
    path with no weights attached raises ValueError."""
    module._cudnn_moe = _Prepared(None, _activation(module), low_latency, fused)


def _prepared(module: torch.nn.Module) -> _Prepared:
    state = getattr(module, "_cudnn_moe", None)
    if state is not None and (state.source is None or state.source == _source(module)):
        return state
    activation = check_module(module)
    with _lock:
        state = _Prepared(_source(module), activation)
        module._cudnn_moe = state
    return state


def _gemm1_up_gate(module: torch.nn.Module) -> torch.Tensor:
    """gate_up_proj's halves in the library's order: [E, 2I, H] rows [up; gate]."""
    gate, up = module.gate_up_proj.detach().chunk(2, dim=1)
    return torch.cat((up, gate), dim=1)


def _low_latency_weights(module: torch.nn.Module, state: _Prepared) -> Any:
    if state.low_latency is None:
        if state.source is None:
            raise ValueError(f"{_name(module)}: no low-latency weights were attached (use_prepared(low_latency=...))")
        refuse_during_capture(f"{_name(module)} must prepare its NVFP4 weights", "run one eager call first")
        c1, s1, g1 = quantize_experts("gate_up_proj", _gemm1_up_gate(module))
        c2, s2, g2 = quantize_experts("down_proj", module.down_proj.detach())
        state.low_latency = _LOW_LATENCY.prepare_nvfp4_weight_only_weights(c1, s1, g1, c2, s2, g2, activation=state.activation)
    return state.low_latency


def _fused_weights(module: torch.nn.Module, state: _Prepared) -> Nvfp4Weights:
    if state.fused is None:
        if state.source is None:
            raise ValueError(f"{_name(module)}: no fused weights were attached (use_prepared(fused=...))")
        refuse_during_capture(f"{_name(module)} must prepare its NVFP4 weights", "run one eager call first")
        state.fused = _FUSED.prepare_weights(_gemm1_up_gate(module), module.down_proj.detach(),
                                             activation=state.activation)
    return state.fused


def experts_forward(
    self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The experts of ``self`` on ``hidden_states`` [T, H] routed by ``top_k_index`` / ``top_k_weights`` [T, k]:
    [T, H] in the hidden states' dtype (see the module docstring)."""
    state = _prepared(self)
    tokens = hidden_states.shape[0]
    x = hidden_states if hidden_states.dtype == torch.bfloat16 else hidden_states.to(torch.bfloat16)
    routing = Routing.unpacked(top_k_index.contiguous(), top_k_weights.float().contiguous())
    mode = getattr(self, "cudnn_moe_mode", _default_mode)
    if mode not in MODES:
        raise ValueError(f"{_name(self)}: cudnn_moe_mode must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "weight_only" and tokens <= LOW_LATENCY_TOKENS:
        out = low_latency_moe(_LOW_LATENCY, x.contiguous(), _low_latency_weights(self, state), routing,
                              activation=state.activation)
    else:
        out = fused_moe(_FUSED, _FUSED.prepare_activations(x), routing, _fused_weights(self, state),
                        activation=state.activation)
    return out if out.dtype == hidden_states.dtype else out.to(hidden_states.dtype)


register()  # needs transformers >= 5 (an optional extra): without it this import raises ImportError
