"""The torch FP8 MoE layer the low-latency benchmark sets beside the FP8 formats (bench_low_latency.py).

E4M3 weights with one FP32 scale per expert and GEMM (the same codes the low_latency_moe row streams), tokens
and intermediate quantized to E4M3 per row on the fly (scale = amax / 448), GEMMs in FP32 with BF16 outputs,
SwiGLU in FP32 between them ([up; gate] rows), the route-weighted sum in FP32 rounded to BF16. Two forms:

- ``grouped_layer``: torch._scaled_grouped_mm over the expert-sorted slots (the BF16 peer's structure,
  bench_moe.grouped_mm_layer), where this torch and GPU run it;
- ``per_expert_layer``: torch._scaled_mm per touched expert, the touched experts and their slots read once
  on the host before capture (``expert_slots``): the graph replays that routing.

Either is captured in ONE CUDA graph and timed like every contender (common.capture, Timer). Per-tensor FP8
weights give their per-expert scales; DeepSeek FP8 weights give each expert's first 128 x 128 block scale
(torch has no SM90 block-scaled grouped GEMM; the bytes streamed are the same codes).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from common import REASON_CHARS  # noqa: F401 - the cell width, re-exported
from common import Report, Timer, capture, failure_cell, fmt, reason

from cudnn_moe.weights.low_latency import DeepSeekFp8Weights, E4m3Weights

E4M3_MAX = 448.0


class Fp8Operands(NamedTuple):
    """w1 float8_e4m3fn [E, 2I, H] (rows [up; gate]), w2 [E, H, I]; s1 float32 [E, 2I], s2 [E, H]: each row's
    dequantization scale (its expert's, repeated along the row axis, as the rowwise scaled GEMMs take it)."""

    w1: torch.Tensor
    s1: torch.Tensor
    w2: torch.Tensor
    s2: torch.Tensor


def operands(weights: E4m3Weights | DeepSeekFp8Weights) -> Fp8Operands:
    """The peer's operands from a prepared FP8 record, its codes as they are (padding to Ip adds nothing: zero
    rows of w1 give zero activations, zero columns of w2 read them)."""
    if isinstance(weights, DeepSeekFp8Weights):
        e1, e2 = weights.w1_scales[:, 0, 0], weights.w2_scales[:, 0, 0]
    else:
        e1, e2 = weights.w1_scale, weights.w2_scale
    w1, w2 = weights.w1_codes, weights.w2_codes
    return Fp8Operands(w1, e1[:, None].expand(-1, w1.shape[1]).contiguous(), w2,
                       e2[:, None].expand(-1, w2.shape[1]).contiguous())


def rowwise_e4m3(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """v [M, K] -> (float8_e4m3fn codes [M, K], float32 scales [M]): scale = fp32(amax(|row|) / 448) (tiny rows
    floored at 1e-12 / 448), codes = e4m3(fp32(v / scale)); v ~ codes * scale."""
    scale = v.abs().amax(1).float().clamp(min=1e-12) / E4M3_MAX
    return (v.float() / scale[:, None]).to(torch.float8_e4m3fn), scale


def _swiglu(h: torch.Tensor) -> torch.Tensor:
    """[up; gate] BF16 [M, 2I] -> silu(gate) * up in FP32 [M, I]."""
    up, gate = h.float().chunk(2, dim=1)
    return torch.nn.functional.silu(gate) * up


def grouped_layer(x: torch.Tensor, ids: torch.Tensor, route_w: torch.Tensor, ops: Fp8Operands) -> torch.Tensor:
    """BF16 [T, H] = the layer of x BF16 [T, H], ids int64 [T, k], route_w float32 [T, k] on
    torch._scaled_grouped_mm; nothing waits for the GPU, so it can be captured."""
    tokens, top_k = ids.shape
    sorted_ids, order = torch.sort(ids.reshape(-1), stable=True)
    experts = torch.arange(ops.w1.shape[0], device=ids.device, dtype=ids.dtype)
    offs = torch.searchsorted(sorted_ids, experts, right=True, out_int32=True)  # int32 cumulative segment ends
    q, sa = rowwise_e4m3(x[order // top_k])
    h = torch._scaled_grouped_mm(q, ops.w1.transpose(1, 2), sa, ops.s1, offs=offs, out_dtype=torch.bfloat16)
    q, sa = rowwise_e4m3(_swiglu(h))
    y = torch._scaled_grouped_mm(q, ops.w2.transpose(1, 2), sa, ops.s2, offs=offs, out_dtype=torch.bfloat16)
    out = torch.zeros(tokens * top_k, x.shape[1], dtype=torch.float32, device=x.device)
    out[order] = y.float()
    return (out.view(tokens, top_k, -1) * route_w.unsqueeze(-1)).sum(1).to(torch.bfloat16)


class ExpertSlots(NamedTuple):
    """One touched expert's slots: ``expert``, its tokens int64 [n] and their route weights float32 [n]."""

    expert: int
    tokens: torch.Tensor
    route_w: torch.Tensor


def expert_slots(ids: torch.Tensor, route_w: torch.Tensor) -> list[ExpertSlots]:
    """The touched experts of ids [T, k] in increasing order, with their slots (reads ids: a sync; outside
    any capture)."""
    top_k = ids.shape[1]
    flat_ids, flat_w = ids.reshape(-1), route_w.reshape(-1).float()
    slots = []
    for e in torch.unique(flat_ids).tolist():
        where = (flat_ids == e).nonzero().squeeze(1)
        slots.append(ExpertSlots(int(e), where // top_k, flat_w[where]))
    return slots


def per_expert_layer(x: torch.Tensor, slots: list[ExpertSlots], ops: Fp8Operands) -> torch.Tensor:
    """BF16 [T, H] = the layer of x BF16 [T, H] routed as ``slots`` (expert_slots), one torch._scaled_mm pair per
    touched expert (rowwise scales), the weighted rows summed in FP32."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e, rows, weight in slots:
        q, sa = rowwise_e4m3(x[rows])
        h = torch._scaled_mm(q, ops.w1[e].t(), scale_a=sa[:, None], scale_b=ops.s1[e : e + 1], out_dtype=torch.bfloat16)
        q, sa = rowwise_e4m3(_swiglu(h))
        y = torch._scaled_mm(q, ops.w2[e].t(), scale_a=sa[:, None], scale_b=ops.s2[e : e + 1], out_dtype=torch.bfloat16)
        out.index_add_(0, rows, y.float() * weight[:, None])
    return out.to(torch.bfloat16)


class Fp8Peer:
    """The torch FP8 layer's cell for one batch: the grouped form where it runs, else per expert, else why not."""

    def __init__(self, report: Report) -> None:
        self.report = report

    def cell(self, timer: Timer, weights: E4m3Weights | DeepSeekFp8Weights, x: torch.Tensor, ids: torch.Tensor,
             route_w: torch.Tensor) -> str:
        """'<us> (grouped)' or '<us> (per expert)', else ``failure_cell`` (each failure's reason in the notes)."""
        ops, ids_long = operands(weights), ids.long()
        try:
            return self._timed(timer, "grouped", lambda: grouped_layer(x, ids_long, route_w, ops))
        except Exception as exc:  # noqa: BLE001 - a peer that cannot run here is reported, not fatal
            self.report.note(f"torch FP8 layer on torch._scaled_grouped_mm: {reason(exc)}")
        slots = expert_slots(ids_long, route_w)
        try:
            return self._timed(timer, "per expert", lambda: per_expert_layer(x, slots, ops))
        except Exception as exc:  # noqa: BLE001
            self.report.note(f"torch FP8 layer on torch._scaled_mm per expert: {reason(exc)}")
            return failure_cell(exc)

    @staticmethod
    def _timed(timer: Timer, form: str, layer: Callable[[], object]) -> str:
        return f"{fmt(timer.median_us(capture(layer).replay))} ({form})"
