"""The Triton BF16 MoE layer the fused-layer benchmark sets beside ours (bench_moe.py --triton-peer).

FlagGems' ``fused_experts_impl`` (vLLM's Triton ``fused_moe`` kernels: align the routing into blocks of
BLOCK_M slots per expert, GEMM1 gathering the token rows, SiLU-and-mul, GEMM2 with the route weight, sum
over the top-k), BF16 weights and tokens. It is not a dependency of the project: the column appears where
``flag_gems`` imports (``pip install flag-gems``; on the GPU machine, carry its wheel with SQLAlchemy's
and greenlet's in ``.whl/``), and the notes say why it is missing otherwise.

The peer gets the benchmark's own BF16 tensors: w1 [E, 2I, H] (it applies SiLU to the first half of the
rows, we to the second: the same work, different values, so its output is timed, never compared) and
w2 [E, H, I], the same routing. Timed like every contender (common.py): one warm-up call, ONE call
captured in a CUDA graph, median of L2-flushed replays.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from common import Report, Timer, capture, failure_cell, fmt, reason


def load_fused_experts() -> tuple[Callable[..., torch.Tensor] | None, str]:
    """(FlagGems' fused_experts_impl, its version) where flag_gems imports, else (None, why not)."""
    try:
        import flag_gems  # type: ignore[import-not-found]
        from flag_gems.fused.fused_moe import fused_experts_impl  # type: ignore[import-not-found]
    except Exception as exc:  # noqa: BLE001 - any import failure only removes the column
        return None, reason(exc)
    return fused_experts_impl, str(getattr(flag_gems, "__version__", "?"))


class TritonPeer:
    """The Triton BF16 layer's cell for one batch, or why it did not run."""

    def __init__(self, report: Report) -> None:
        self.report = report
        self.layer, self.version = load_fused_experts()
        if self.layer is None:
            report.note(f"Triton BF16 peer (FlagGems fused_experts_impl) not run: {self.version}")
        else:
            report.note(f"Triton BF16 peer: FlagGems {self.version} fused_experts_impl (vLLM's Triton fused_moe "
                        "kernels), BF16, captured in one CUDA graph")

    @property
    def available(self) -> bool:
        return self.layer is not None

    def time_us(self, timer: Timer, x: torch.Tensor, ids: torch.Tensor, route_w: torch.Tensor, w1: torch.Tensor,
                w2: torch.Tensor) -> tuple[float | None, str]:
        """(median us or None, cell text) of the layer on x BF16 [T, H], ids [T, k], route_w FP32 [T, k],
        w1 BF16 [E, 2I, H], w2 BF16 [E, H, I]."""
        layer = self.layer
        if layer is None:
            return None, "-"
        ids32 = ids.to(torch.int32)

        def call() -> torch.Tensor:
            return layer(x, w1, w2, route_w, ids32, inplace=False, activation="silu")

        try:
            call()  # outside any capture: autotuning and config lookups happen here
            us = timer.median_us(capture(call).replay)
        except Exception as exc:  # noqa: BLE001 - a peer that cannot run a shape is reported, not fatal
            self.report.note(f"Triton BF16 peer, T={x.shape[0]}, H={x.shape[1]}: {reason(exc)}")
            return None, failure_cell(exc)
        return us, fmt(us)
