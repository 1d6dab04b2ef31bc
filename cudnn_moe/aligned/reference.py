"""Float64 oracle of the aligned-plan NVFP4 MoE op (contract 002): it walks the plan block by block.

For every active block j (``j * block_m < num_tokens_post_padded``), with e = expert_ids[j], and
every entry i of the block that is not padding (``i < M * top_k``; token t = i // top_k, slot
s = i % top_k). The rounding points, in data-path order, are those of the NVFP4 pipeline
(cudnn_moe.fused.reference), with the op's two GEMM1 scales:

1. activations and weights are decoded exactly (E2M1 code times E4M3 block scale; no global
   scale: the per-expert output scales carry it);
2. GEMM1 accumulates x_t . w1_e over K in FP32 (order free). Rows 0 .. N/2-1 of w1_e are the gate,
   rows N/2 .. N-1 the up projection; each half's scale is applied to the FP32 accumulator and the
   result rounds once to BF16: gate = bf16(output1_scale_gate_scalar[e] * acc_gate), up =
   bf16(output1_scale_scalar[e] * acc_up) (the contract leaves this precision open; ours is the
   pipeline's BF16 GEMM output);
3. y = silu(gate) * up in FP32;
4. y is requantized to NVFP4 with global scale one per 16 values straight from FP32
   (requantize_nvfp4_rows: scale = e4m3(amax / 6), codes = e2m1(y / scale)), decoded exactly;
5. GEMM2 accumulates y_q . w2_e over N/2 in FP32 and rounds once to BF16:
   down = bf16(output2_scale_scalar[e] * acc2);
6. each route weight is scaled in FP32: w = fp32(topk_weights[t, s] * routed_scaling_factor);
7. out[t] = bf16(float(out[t]) + sum over the planned slots s of t, in slot order, of w[t, s] *
   down[t, s]), each product and sum a separate FP32 operation on the GPU (deterministic: no
   atomics, the same inputs give the same bits); this oracle sums in float64 and rounds once.

What remains between the GPU and this oracle is FP32 evaluation: the accumulation order of the
GEMMs and of step 7, the FP32 SiLU (the oracle's float64 one is rounded to FP32 only at the
requantization), and the GPU's FP32 product of scale and accumulator before each BF16 rounding. Each
can move a BF16 rounding by one unit and, rarely, an NVFP4 code of the intermediate by one step. A slot the plan never names contributes nothing; a slot named twice breaks the plan
format (this oracle raises, the GPU op keeps one of the two).
"""

from __future__ import annotations

import torch

from ..formats import dequantize_nvfp4
from ..formats.rounding import requantize_nvfp4_rows, round_bf16
from ..validate import require_finite
from .checks import check_operands
from .operands import AlignedOperands


def _check_plan_values(
    sorted_token_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_tokens_post_padded: torch.Tensor,
    block_m: int,
    num_experts: int,
    num_slots: int,
) -> int:
    """Read the plan (a device sync on CUDA) and return the number of active blocks.

    The contract requires what the GPU op cannot check without a sync: 0 <= extent <=
    expert_ids.numel() * block_m; valid expert ids, non-negative entries and no slot twice in
    active blocks.
    """
    extent = int(num_tokens_post_padded[0])
    if not 0 <= extent <= expert_ids.numel() * block_m:
        raise ValueError(
            f"num_tokens_post_padded ({extent}) must lie in [0, expert_ids.numel() * block_m = "
            f"{expert_ids.numel() * block_m}]"
        )
    active = -(-extent // block_m)
    experts = expert_ids[:active]
    if bool(((experts < 0) | (experts >= num_experts)).any()):
        raise ValueError(f"expert_ids must lie in [0, {num_experts}) in the blocks before num_tokens_post_padded")
    entries = sorted_token_ids[: active * block_m]
    if bool((entries < 0).any()):
        raise ValueError("sorted_token_ids must be non-negative in the blocks before num_tokens_post_padded")
    slots = entries[entries < num_slots]
    if slots.numel() != torch.unique(slots).numel():
        raise ValueError("sorted_token_ids names a slot twice in the blocks before num_tokens_post_padded")
    return active


def reference_aligned_moe(
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
) -> torch.Tensor:
    """The value the aligned op leaves in ``out``: a new BF16 [M, K] tensor; ``out`` itself is
    only read, never written (the op adds into it in place).

    Arguments as check_aligned_args describes (the contract's names and layouts); the module
    docstring gives the walk and its rounding points. A block is active when its first entry
    lies before num_tokens_post_padded, and all its entries are then walked (those inside
    sorted_token_ids; a last partial block is shorter); entries >= M * top_k are padding.
    Raises TypeError / ValueError naming the argument; also ValueError when the plan breaks the
    contract (extent past the capacity, an expert id outside [0, E), a negative entry or a slot
    named twice in an active block), or when an output scale (output1_scale_gate_scalar,
    output1_scale_scalar, output2_scale_scalar) holds NaN or Inf: this oracle reads the plan and
    the scales, the GPU op will not.
    """
    dims = check_operands(AlignedOperands(
        hidden_states, hidden_states_scale, gemm1_weights, gemm1_weights_scale, gemm2_weights,
        gemm2_weights_scale, output1_scale_gate_scalar, output1_scale_scalar, output2_scale_scalar,
        sorted_token_ids, expert_ids, num_tokens_post_padded, topk_weights, out, top_k, block_m,
        routed_scaling_factor,
    ))
    for name, scale in (("output1_scale_gate_scalar", output1_scale_gate_scalar),
                        ("output1_scale_scalar", output1_scale_scalar), ("output2_scale_scalar", output2_scale_scalar)):
        require_finite(name, scale)
    f64, half = torch.float64, dims.n // 2
    num_slots = dims.num_tokens * top_k
    active = _check_plan_values(sorted_token_ids, expert_ids, num_tokens_post_padded, block_m, dims.num_experts,
                                num_slots)
    x = dequantize_nvfp4(hidden_states, hidden_states_scale, dtype=f64)
    scaled = topk_weights.reshape(-1) * torch.tensor(dims.routed_scaling_factor, dtype=torch.float32)
    route_weights = scaled.to(f64)  # the FP32 product of step 6
    down = torch.zeros(num_slots, dims.hidden, dtype=f64, device=x.device)
    planned = torch.zeros(num_slots, dtype=torch.bool, device=x.device)
    entries, experts = sorted_token_ids.tolist(), expert_ids[:active].tolist()
    loaded = -1  # the expert whose weights are decoded (one at a time: E * N * K float64 would not fit)
    for block, expert in enumerate(experts):
        slots = [i for i in entries[block * block_m : (block + 1) * block_m] if i < num_slots]
        if not slots:
            continue
        if expert != loaded:
            w1 = dequantize_nvfp4(gemm1_weights[expert], gemm1_weights_scale[expert], dtype=f64)
            w2 = dequantize_nvfp4(gemm2_weights[expert], gemm2_weights_scale[expert], dtype=f64)
            loaded = expert
        index = torch.tensor(slots, dtype=torch.int64, device=x.device)
        acc1 = x[index // top_k] @ w1.T  # [rows, N]: [gate | up]
        gate = round_bf16(float(output1_scale_gate_scalar[expert]) * acc1[:, :half])
        up = round_bf16(float(output1_scale_scalar[expert]) * acc1[:, half:])
        y = requantize_nvfp4_rows(torch.nn.functional.silu(gate) * up)
        down[index] = round_bf16(float(output2_scale_scalar[expert]) * (y @ w2.T))
        planned[index] = True
    acc = out.to(f64)
    down = down.view(dims.num_tokens, top_k, dims.hidden)
    route_weights, planned = route_weights.view(dims.num_tokens, top_k), planned.view(dims.num_tokens, top_k)
    for slot in range(top_k):  # slot order; unplanned slots add nothing, whatever their weight
        contribution = route_weights[:, slot, None] * down[:, slot]
        acc += torch.where(planned[:, slot, None], contribution, 0.0)
    return acc.to(torch.bfloat16)
