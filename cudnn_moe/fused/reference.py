"""Float64 oracle of the NVFP4 MoE layer, and the rounding contract every GEMM engine follows.

It quantizes and rounds exactly where the GPU pipeline does and computes everything else in
float64. The rounding points, in data-path order:

1. activations and weights are decoded exactly (E2M1 code times E4M3 block scale; the
   activation global scale is one); every product of two decoded values is exact in FP32;
2. GEMM1 accumulates in FP32 (order free); the expert's w1 global is applied to the FP32
   accumulator, then the result rounds once to BF16: h1 = bf16(w1_alpha[e] * (x_t @ w1_e^T));
3. y = activation(h1) in FP32, splitting GEMM1's columns into [up | gate] when gated;
4. y is requantized to NVFP4 with global scale one per row in blocks of 16 (scale =
   e4m3(amax / 6), codes e2m1(y / scale)) straight from FP32, and decoded exactly again;
5. GEMM2 likewise: row = bf16(w2_alpha[e] * (y_q @ w2_e^T));
6. finalize: out[t] = bf16(sum over slots, in slot order, of weight[t, s] * row[t, s]), each
   product and sum a separate FP32 operation (no fused multiply-add); the reference sums in
   float64 and rounds once.

What remains between an engine and this oracle is the FP32 accumulation order of the GEMMs:
it can move a BF16 rounding by one unit and, rarely, an NVFP4 code of the intermediate by one
step. Slots whose expert is not local are masked: they contribute nothing, whatever their weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..activations import Activation, ActivationKind, parse_activation
from ..formats import NVFP4_BLOCK, dequantize_nvfp4
from ..formats.rounding import requantize_nvfp4_rows, round_bf16
from ..routing import Routing, check_distinct_experts, local_mask
from ..validate import require_finite
from ..weights.nvfp4 import Nvfp4Activations, Nvfp4Weights


@dataclass(frozen=True, eq=False)
class UnfinalizedReference:
    """The reference's per-slot results before the weighted sum.

    rows: float64 [T, k, H], w2_alpha applied, zero where mask is False.
    weights: float32 [T, k] route weights (BF16-rounded when routing was packed).
    mask: bool [T, k], True where the slot's expert is local.

    The GPU's unfinalized output keeps one BF16 row per routed slot in expert order plus a
    token_to_row map [T, k]; its row ``token_to_row[t, s]`` is compared with ``rows[t, s]``
    wherever ``mask[t, s]``.
    """

    rows: torch.Tensor
    weights: torch.Tensor
    mask: torch.Tensor


def _expect(tensor: object, name: str, dtype: torch.dtype, shape: tuple[int, ...], device: torch.device) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {tensor.dtype}")
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(tensor.shape)}")
    if tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device}, expected {device} like act_packed")


def _expert_rows(
    x: torch.Tensor,
    w1: torch.Tensor,
    w1_alpha: torch.Tensor,
    w2: torch.Tensor,
    w2_alpha: torch.Tensor,
    ids: torch.Tensor,
    activation: Activation,
    local_expert_start: int,
) -> torch.Tensor:
    """The pipeline after dequantization, all float64.

    x [T, H], w1 [E, N1, H], w1_alpha [E], w2 [E, H, I], w2_alpha [E], global ids [T, k].
    Returns rows [T, k, H]: bf16(w2_alpha[e] * (requant(act(bf16(w1_alpha[e] * (x_t @ w1_e^T)))) @ w2_e^T)),
    zero for slots whose expert is not local.
    """
    num_tokens, top_k = ids.shape
    rows = torch.zeros(num_tokens, top_k, w2.shape[1], dtype=torch.float64, device=x.device)
    for local in range(w1.shape[0]):
        tokens, slots = (ids == local_expert_start + local).nonzero(as_tuple=True)
        if tokens.numel() == 0:
            continue
        h1 = round_bf16(w1_alpha[local] * (x[tokens] @ w1[local].T))
        y = requantize_nvfp4_rows(activation.apply_gemm1(h1))
        rows[tokens, slots] = round_bf16(w2_alpha[local] * (y @ w2[local].T))
    return rows


def _finalize(rows: torch.Tensor, weights: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sum_s weight[t, s] * rows[t, s] in slot order, float64 [T, H]; masked slots are skipped
    (a NaN or inf weight there does not reach the output)."""
    out = torch.zeros(rows.shape[0], rows.shape[2], dtype=torch.float64, device=rows.device)
    for slot in range(rows.shape[1]):
        contribution = weights[:, slot, None].to(torch.float64) * rows[:, slot]
        out += torch.where(mask[:, slot, None], contribution, 0.0)
    return out


def reference_moe(
    act_packed: torch.Tensor,
    act_scales: torch.Tensor,
    w1_packed: torch.Tensor,
    w1_scales: torch.Tensor,
    w1_alpha: torch.Tensor,
    w2_packed: torch.Tensor,
    w2_scales: torch.Tensor,
    w2_alpha: torch.Tensor,
    routing: Routing,
    activation: Activation | ActivationKind | str,
    *,
    local_expert_start: int = 0,
    finalize: bool = True,
) -> torch.Tensor | UnfinalizedReference:
    """Float64 result of the NVFP4 MoE layer.

    act_packed uint8 [T, H/2], act_scales float8_e4m3fn [T, H/16] (linear, global scale one);
    w1_packed uint8 [E, N1, H/2], w1_scales float8_e4m3fn [E, N1, H/16] (linear), w1_alpha
    float32 [E]; w2_packed uint8 [E, H, I/2], w2_scales float8_e4m3fn [E, H, I/16] (linear),
    w2_alpha float32 [E]. E counts the local experts, global ids local_expert_start .. + E - 1;
    N1 = 2I for gated activations (rows [up; gate]), else I. H and I are multiples of 16.

    Returns float64 [T, H] when finalize, else an UnfinalizedReference. Raises ValueError when
    a token names an expert twice or an int64 id lies outside the int32 range (the GPU op
    masks such ids instead), or when w1_alpha / w2_alpha hold NaN or Inf (it would reach every
    output of that expert's tokens); TypeError / ValueError naming a malformed argument.
    """
    activation = parse_activation(activation)
    if not isinstance(routing, Routing):
        raise TypeError(f"routing must be a Routing, got {type(routing).__name__}")
    if isinstance(local_expert_start, bool) or not isinstance(local_expert_start, int) or local_expert_start < 0:
        raise ValueError(f"local_expert_start must be a non-negative int, got {local_expert_start!r}")
    if not isinstance(act_packed, torch.Tensor) or act_packed.dim() != 2:
        raise ValueError("act_packed must be a 2-D tensor [T, H/2]")
    if not isinstance(w2_packed, torch.Tensor) or w2_packed.dim() != 3:
        raise ValueError("w2_packed must be a 3-D tensor [E, H, I/2]")
    num_tokens, hidden = act_packed.shape[0], 2 * act_packed.shape[1]
    num_experts, intermediate = w2_packed.shape[0], 2 * w2_packed.shape[2]
    if hidden % NVFP4_BLOCK or intermediate % NVFP4_BLOCK:
        raise ValueError(f"hidden ({hidden}) and intermediate ({intermediate}) sizes must be multiples of 16")
    n1 = activation.gemm1_columns(intermediate)
    device = act_packed.device
    u8, e4m3 = torch.uint8, torch.float8_e4m3fn
    _expect(act_packed, "act_packed", u8, (num_tokens, hidden // 2), device)
    _expect(act_scales, "act_scales", e4m3, (num_tokens, hidden // NVFP4_BLOCK), device)
    _expect(w1_packed, "w1_packed", u8, (num_experts, n1, hidden // 2), device)
    _expect(w1_scales, "w1_scales", e4m3, (num_experts, n1, hidden // NVFP4_BLOCK), device)
    _expect(w1_alpha, "w1_alpha", torch.float32, (num_experts,), device)
    _expect(w2_packed, "w2_packed", u8, (num_experts, hidden, intermediate // 2), device)
    _expect(w2_scales, "w2_scales", e4m3, (num_experts, hidden, intermediate // NVFP4_BLOCK), device)
    _expect(w2_alpha, "w2_alpha", torch.float32, (num_experts,), device)
    require_finite("w1_alpha", w1_alpha)
    require_finite("w2_alpha", w2_alpha)
    if routing.num_tokens != num_tokens:
        raise ValueError(f"routing has {routing.num_tokens} tokens, act_packed has {num_tokens}")
    if routing.device != device:
        raise ValueError(f"routing is on {routing.device}, expected {device} like act_packed")

    ids, weights = routing.ids_and_weights()
    check_distinct_experts(ids)
    mask = local_mask(ids, local_expert_start, num_experts)
    f64 = torch.float64
    rows = _expert_rows(
        dequantize_nvfp4(act_packed, act_scales, dtype=f64),
        dequantize_nvfp4(w1_packed, w1_scales, dtype=f64),
        w1_alpha.to(f64),
        dequantize_nvfp4(w2_packed, w2_scales, dtype=f64),
        w2_alpha.to(f64),
        ids,
        activation,
        local_expert_start,
    )
    if not finalize:
        return UnfinalizedReference(rows=rows, weights=weights, mask=mask)
    return _finalize(rows, weights, mask)


def reference_for_prepared(
    activations: Nvfp4Activations,
    weights: Nvfp4Weights,
    routing: Routing,
    activation: Activation | ActivationKind | str,
    *,
    local_expert_start: int = 0,
    finalize: bool = True,
) -> torch.Tensor | UnfinalizedReference:
    """reference_moe on what Nvfp4MoeConfig prepared (the weights' canonical form, whatever the engine layout)."""
    w1, w1_scales, w2, w2_scales = weights.canonical()
    return reference_moe(
        activations.packed, activations.scales, w1, w1_scales, weights.w1_alpha,
        w2, w2_scales, weights.w2_alpha, routing, activation,
        local_expert_start=local_expert_start, finalize=finalize,
    )
