"""The 4-bit peer the fused-layer benchmark sets beside ours (bench_moe.py --int4-peer): INT4 weights, BF16 tokens,
on FlagGems' W4A16 Triton kernel.

FlagGems' ``fused_experts_impl`` with ``use_int4_w4a16`` turns the INT4 weights into BF16 on every call (Triton
cannot mix dtypes in a dot, its comment says), which would time a BF16 layer plus a dequantization. This peer
composes instead the path vLLM's Triton ``fused_experts`` takes for group-quantized INT4 weights, from FlagGems'
own parts: ``moe_align_block_size`` (the routing in blocks of BLOCK_SIZE_M slots per expert), GEMM1 on
``fused_moe_kernel_gptq_awq`` (``invoke_fused_moe_wna16_triton_kernel``), SiLU-and-mul on the first half of
GEMM1's columns (``apply_moe_activation``), GEMM2 on the same kernel times the route weight, the top-k sum
(``moe_sum``); the tiles FlagGems picks for "int4_w4a16" at the batch's T. Like the Triton BF16 peer it is not a
dependency: its column appears where ``flag_gems`` imports.

Weights: the benchmark's BF16 w1 [E, 2I, H] and w2 [E, H, I], quantized symmetrically per GROUP values along K
(quantize_int4), 0.5 B a weight plus a BF16 scale per GROUP: 0.516 B a weight against NVFP4's 0.5625. Before it is
timed, the peer's output on the batch is checked against a float32 layer on the dequantized weights of the touched
experts (reference_layer); a peer that misses MAX_ERROR is reported and not timed. Timed like every contender
(common.py): one warm-up call, ONE call captured in a CUDA graph, median of L2-flushed replays.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from common import Report, Timer, capture, failure_cell, fmt, reason

GROUP = 128  # weights per BF16 scale, along K
MAX_ERROR = 0.02  # the largest |peer - reference| / max |reference| that counts as the same layer (BF16 intermediates)
Int4Tensor = tuple[torch.Tensor, torch.Tensor]  # codes uint8 [E, N, K/2], scales bfloat16 [E, N, K/GROUP]


def quantize_int4(w: torch.Tensor, chunk: int = 8) -> Int4Tensor:
    """w bfloat16 [E, N, K] (K % GROUP == 0) as (codes uint8 [E, N, K/2], scales bfloat16 [E, N, K/GROUP]): per group
    of GROUP values along K, scale = bf16(amax / 7) (1 for an all-zero group), q = clamp(round(w / scale), -8, 7);
    each byte holds the codes q + 8 of k = 2j (low nibble) and 2j + 1 (high nibble), the kernel's layout. ``chunk``
    experts at a time (a DeepSeek-V3 w1 is 15 GB in BF16)."""
    experts, rows, k = w.shape
    if k % GROUP:
        raise ValueError(f"quantize_int4: K={k} must be a multiple of {GROUP}")
    codes = torch.empty(experts, rows, k // 2, dtype=torch.uint8, device=w.device)
    scales = torch.empty(experts, rows, k // GROUP, dtype=torch.bfloat16, device=w.device)
    for first in range(0, experts, chunk):
        groups = w[first:first + chunk].float().unflatten(-1, (k // GROUP, GROUP))
        scale = (groups.abs().amax(-1) / 7).to(torch.bfloat16)
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        q = (torch.clamp(torch.round(groups / scale.float().unsqueeze(-1)), -8, 7) + 8).to(torch.uint8).flatten(-2)
        codes[first:first + chunk] = q[..., 0::2] | (q[..., 1::2] << 4)
        scales[first:first + chunk] = scale
    return codes, scales


def dequantize_int4(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 [..., N, K] of quantize_int4's codes [..., N, K/2] and scales [..., N, K/GROUP]."""
    q = torch.stack((codes & 0xF, codes >> 4), -1).flatten(-2).to(torch.float32) - 8
    return q * scales.float().repeat_interleave(GROUP, -1)


def reference_layer(x: torch.Tensor, ids: torch.Tensor, route_w: torch.Tensor, w1: Int4Tensor,
                    w2: Int4Tensor) -> torch.Tensor:
    """float32 [T, H]: out[t] = sum over slots s of route_w[t, s] * (silu(g) * u) @ W2[e]^T, where e = ids[t, s] and
    g, u are the first and second half of x[t] @ W1[e]^T, on the dequantized weights; float32 throughout."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert in torch.unique(ids).tolist():
        token, slot = (ids == expert).nonzero(as_tuple=True)
        h = x[token].float() @ dequantize_int4(w1[0][expert], w1[1][expert]).T
        half = h.shape[1] // 2
        act = F.silu(h[:, :half]) * h[:, half:]
        rows = act @ dequantize_int4(w2[0][expert], w2[1][expert]).T
        out.index_add_(0, token, rows * route_w[token, slot].float().unsqueeze(1))
    return out


@dataclass(frozen=True)
class Parts:
    """FlagGems' pieces of the W4A16 layer (load_parts)."""

    config: Callable[..., dict[str, Any]]  # try_get_optimal_moe_config
    align: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # moe_align_block_size
    gemm: Callable[..., None]  # invoke_fused_moe_wna16_triton_kernel
    activation: Callable[[torch.Tensor, torch.Tensor], object]  # SiLU-and-mul (output, input)
    sum: Callable[[torch.Tensor, torch.Tensor], None]  # moe_sum (input [T, k, H], output [T, H])
    compute_type: Any  # triton.language.bfloat16


def load_parts() -> tuple[Parts | None, str]:
    """(FlagGems' W4A16 parts, its version) where flag_gems imports, else (None, why not)."""
    try:
        import flag_gems  # type: ignore[import-not-found]
        import triton.language as tl  # type: ignore[import-not-found]
        from flag_gems.fused import fused_moe as module  # type: ignore[import-not-found]
    except Exception as exc:  # noqa: BLE001 - any import failure only removes the column
        return None, reason(exc)
    silu = module.MoEActivation.SILU
    parts = Parts(module.try_get_optimal_moe_config, module.moe_align_block_size,
                  module.invoke_fused_moe_wna16_triton_kernel,
                  lambda out, h: module.apply_moe_activation(silu, out, h), module.moe_sum, tl.bfloat16)
    return parts, str(getattr(flag_gems, "__version__", "?"))


def int4_layer(parts: Parts, x: torch.Tensor, ids: torch.Tensor, route_w: torch.Tensor, w1: Int4Tensor,
               w2: Int4Tensor) -> torch.Tensor:
    """bfloat16 [T, H]: the W4A16 layer on x bfloat16 [T, H], ids int32 [T, k], route_w float32 [T, k] and
    quantize_int4's w1 [E, 2I, H] and w2 [E, H, I], as vLLM's Triton fused_experts runs it (module docstring)."""
    tokens, top_k = ids.shape
    experts, n, _ = w1[0].shape
    block = [0, GROUP]
    # FlagGems 5.0.2's W4A16 kernel declares a SPLIT_K meta-parameter (its body never reads it) that neither the
    # config lookup nor the WNA16 launcher sets; vLLM's kernel has none. 1 is the only value its loop is right for.
    config = {**parts.config(w1[0].size(), w2[0].size(), top_k, "int4_w4a16", tokens, experts, block), "SPLIT_K": 1}
    sorted_ids, expert_ids, padded = parts.align(ids, config["BLOCK_SIZE_M"], experts)
    h = torch.empty(tokens, top_k, n, dtype=torch.bfloat16, device=x.device)
    parts.gemm(x, w1[0], h, w1[1], None, route_w, sorted_ids, expert_ids, padded, False, top_k, config,
               parts.compute_type, False, True, block)
    act = torch.empty(tokens * top_k, n // 2, dtype=torch.bfloat16, device=x.device)
    parts.activation(act, h.view(-1, n))
    rows = torch.empty(tokens, top_k, x.shape[1], dtype=torch.bfloat16, device=x.device)
    parts.gemm(act, w2[0], rows, w2[1], None, route_w, sorted_ids, expert_ids, padded, True, 1, config,
               parts.compute_type, False, True, block)
    out = torch.empty_like(x)
    parts.sum(rows, out)
    return out


class Int4Peer:
    """The W4A16 layer's cell for one batch, or why it did not run; prepare() quantizes each model's weights once."""

    def __init__(self, report: Report) -> None:
        self.report = report
        self.parts, self.version = load_parts()
        self.weights: tuple[Int4Tensor, Int4Tensor] | None = None
        if self.parts is None:
            report.note(f"INT4 peer (FlagGems' W4A16 Triton kernel) not run: {self.version}")
        else:
            report.note(f"INT4 peer: FlagGems {self.version} fused_moe_kernel_gptq_awq, INT4 weights with a BF16 scale "
                        f"per {GROUP} (symmetric), BF16 tokens, vLLM's Triton fused_experts path, captured in one CUDA "
                        "graph")

    def prepare(self, w1: torch.Tensor, w2: torch.Tensor) -> None:
        """Quantize a model's BF16 w1 [E, 2I, H] and w2 [E, H, I] for the batches that follow."""
        self.weights = None
        if self.parts is not None:
            self.weights = quantize_int4(w1), quantize_int4(w2)

    def time_us(self, timer: Timer, x: torch.Tensor, ids: torch.Tensor,
                route_w: torch.Tensor) -> tuple[float | None, str]:
        """(median us or None, cell text) of the layer on x bfloat16 [T, H], ids [T, k], route_w float32 [T, k] with
        the prepared weights; "wrong" where its output misses the reference (noted)."""
        parts, weights = self.parts, self.weights
        if parts is None or weights is None:
            return None, "-"
        ids32, where = ids.to(torch.int32), f"T={x.shape[0]}, H={x.shape[1]}"

        def call() -> torch.Tensor:
            return int4_layer(parts, x, ids32, route_w, *weights)

        try:
            got = call().float()  # outside any capture: compilation, autotuning and config lookups happen here
            want = reference_layer(x, ids, route_w, *weights)
            error = float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))
            if not error <= MAX_ERROR:  # NaN fails too
                self.report.note(f"INT4 peer, {where}: its output is off the float32 reference by {error:.3g} of the "
                                 f"largest value (bound {MAX_ERROR}); not timed")
                return None, "wrong"
            us = timer.median_us(capture(call).replay)
        except Exception as exc:  # noqa: BLE001 - a peer that cannot run a shape is reported, not fatal
            self.report.note(f"INT4 peer, {where}: {reason(exc)}")
            return None, failure_cell(exc)
        return us, fmt(us)
