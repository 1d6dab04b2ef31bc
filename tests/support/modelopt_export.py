"""Tests' own ModelOpt NVFP4 exporter: float expert weights -> the tensors a ModelOpt checkpoint holds.

Per expert and projection: codes uint8 [out, in/2] (element 2i in the low nibble), E4M3 block scales
[out, in/16], weight_scale_2 = amax / 2688 (dequantized weight = e2m1 * scale * weight_scale_2) and an
input_scale; written under the per-expert names or the fused 3-D names that cudnn_moe.checkpoints reads.
"""

from __future__ import annotations

import torch

from cudnn_moe.formats import dequantize_nvfp4, quantize_nvfp4

NVFP4_MAX = 2688.0


def quantize_projection(w: torch.Tensor, weight_scale_2: float | None = None) -> tuple[torch.Tensor, torch.Tensor, float]:
    """float [out, in] -> (codes, scales, weight_scale_2) the way ModelOpt stores them."""
    scale_2 = float(w.abs().max()) / NVFP4_MAX if weight_scale_2 is None else weight_scale_2
    codes, scales = quantize_nvfp4(w.float(), 1.0 / scale_2)
    return codes, scales, scale_2


def dequantize_projection(codes: torch.Tensor, scales: torch.Tensor, scale_2: float) -> torch.Tensor:
    return dequantize_nvfp4(codes, scales, dtype=torch.float32) * scale_2


def export_experts(gate_up: torch.Tensor, down: torch.Tensor, prefix: str, *, fused: bool = False,
                   input_scale: float = 0.05, split_gate_up_globals: bool = False) -> tuple[dict, dict]:
    """(state dict of ModelOpt tensors, the dequantized weights {"gate_up": [E, 2I, H], "down": [E, H, I]}).

    gate_up [E, 2I, H] rows [gate; up] (transformers' fused experts), down [E, H, I]. split_gate_up_globals:
    give gate and up their own weight_scale_2 (else one, the larger, for both, as ModelOpt does when it
    fuses them)."""
    experts, rows, _ = gate_up.shape
    inter = rows // 2
    state: dict[str, torch.Tensor] = {}
    deq_gate_up, deq_down = torch.empty_like(gate_up, dtype=torch.float32), torch.empty_like(down, dtype=torch.float32)
    per_expert = []
    for e in range(experts):
        gate, up = gate_up[e, :inter], gate_up[e, inter:]
        shared = None if split_gate_up_globals else max(float(gate.abs().max()), float(up.abs().max())) / NVFP4_MAX
        parts = {"gate_proj": quantize_projection(gate, shared), "up_proj": quantize_projection(up, shared),
                 "down_proj": quantize_projection(down[e])}
        per_expert.append(parts)
        deq_gate_up[e, :inter] = dequantize_projection(*parts["gate_proj"])
        deq_gate_up[e, inter:] = dequantize_projection(*parts["up_proj"])
        deq_down[e] = dequantize_projection(*parts["down_proj"])
    if fused:
        stack = lambda p, i: torch.stack([per_expert[e][p][i] for e in range(experts)])  # noqa: E731
        globals_ = lambda p: torch.tensor([per_expert[e][p][2] for e in range(experts)], dtype=torch.float32)  # noqa: E731
        state[f"{prefix}.gate_up_proj.weight"] = torch.cat((stack("gate_proj", 0), stack("up_proj", 0)), dim=1)
        state[f"{prefix}.gate_up_proj.weight_scale"] = torch.cat((stack("gate_proj", 1), stack("up_proj", 1)), dim=1)
        state[f"{prefix}.gate_up_proj.weight_scale_2"] = torch.stack((globals_("gate_proj"), globals_("up_proj")), dim=1)
        state[f"{prefix}.gate_up_proj.input_scale"] = torch.full((experts,), input_scale)
        state[f"{prefix}.down_proj.weight"] = stack("down_proj", 0)
        state[f"{prefix}.down_proj.weight_scale"] = stack("down_proj", 1)
        state[f"{prefix}.down_proj.weight_scale_2"] = globals_("down_proj")
        state[f"{prefix}.down_proj.input_scale"] = torch.full((experts,), input_scale)
    else:
        for e, parts in enumerate(per_expert):
            for p, (codes, scales, scale_2) in parts.items():
                base = f"{prefix}.{e}.{p}"
                state[f"{base}.weight"], state[f"{base}.weight_scale"] = codes, scales
                state[f"{base}.weight_scale_2"] = torch.tensor(scale_2, dtype=torch.float32)
                state[f"{base}.input_scale"] = torch.tensor(input_scale, dtype=torch.float32)
    return state, {"gate_up": deq_gate_up, "down": deq_down}
