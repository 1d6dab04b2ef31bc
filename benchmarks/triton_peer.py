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

Tiles: FlagGems ships no tuned tile table for CUDA GPUs (it warns "No embedded MoE configs" and takes its
default tiles), where a serving stack runs vLLM's tuned ones. From TUNE_MIN_TOKENS tokens on, the peer is
timed with the fastest of its default tiles and CANDIDATES (vLLM's fused_moe config keys), each tried on the
batch with a few L2-flushed eager calls; the notes name the winner.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from common import Report, Timer, capture, failure_cell, fmt, reason

from cudnn_moe.timing import median_us

TUNE_MIN_TOKENS = 512
TUNE_ITERS = 5
# Tile configurations tried beside FlagGems' default at T >= TUNE_MIN_TOKENS: the shapes vLLM's tuned BF16
# tables hold for Hopper at large batches (M 64 or 128 rows, N 128 or 256, K 64 or 128).
CANDIDATES: tuple[dict[str, int], ...] = tuple(
    {"BLOCK_SIZE_M": m, "BLOCK_SIZE_N": n, "BLOCK_SIZE_K": k, "GROUP_SIZE_M": g, "num_warps": w, "num_stages": st}
    for m, n, k, g, w, st in (
        (64, 128, 64, 1, 4, 4), (64, 128, 64, 16, 4, 3), (64, 256, 64, 16, 8, 3), (128, 128, 64, 16, 8, 3),
        (128, 128, 64, 32, 8, 4), (128, 256, 64, 32, 8, 3), (128, 128, 128, 16, 8, 2),
    )
)


def describe(config: dict[str, int] | None) -> str:
    """A tile configuration in one line ("default" for FlagGems' own choice)."""
    if config is None:
        return "default"
    return (f"{config['BLOCK_SIZE_M']}x{config['BLOCK_SIZE_N']}x{config['BLOCK_SIZE_K']} group "
            f"{config['GROUP_SIZE_M']}, {config['num_warps']} warps, {config['num_stages']} stages")


@contextlib.contextmanager
def forced_config(config: dict[str, int] | None) -> Iterator[None]:
    """FlagGems' fused MoE takes ``config`` for every call inside (its config lookup replaced; None: unchanged)."""
    if config is None:
        yield
        return
    from flag_gems.fused import fused_moe as module  # type: ignore[import-not-found]

    original = module.try_get_optimal_moe_config
    module.try_get_optimal_moe_config = lambda *args, **kwargs: dict(config)
    try:
        yield
    finally:
        module.try_get_optimal_moe_config = original


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

        where = f"T={x.shape[0]}, H={x.shape[1]}"
        config = self.fastest_config(call, timer, where) if x.shape[0] >= TUNE_MIN_TOKENS else None
        try:
            with forced_config(config):
                call()  # outside any capture: compilation and config lookups happen here
                us = timer.median_us(capture(call).replay)
        except Exception as exc:  # noqa: BLE001 - a peer that cannot run a shape is reported, not fatal
            self.report.note(f"Triton BF16 peer, {where}: {reason(exc)}")
            return None, failure_cell(exc)
        return us, fmt(us)

    def fastest_config(self, call: Callable[[], torch.Tensor], timer: Timer, where: str) -> dict[str, int] | None:
        """The fastest of FlagGems' default tiles (None) and CANDIDATES on ``call``, by the median of TUNE_ITERS
        L2-flushed eager calls each; a candidate that fails to compile or run is left out. Noted in the report."""
        times: list[tuple[float, dict[str, Any] | None]] = []
        for config in (None, *CANDIDATES):
            try:
                with forced_config(config):
                    call()
                    times.append((median_us(call, TUNE_ITERS, flush=timer.flush), config))
            except Exception:  # noqa: BLE001, S112 - a tile the shape cannot take is simply not a candidate
                continue
        if not times:
            return None
        us, best = min(times, key=lambda item: item[0])
        self.report.note(f"Triton BF16 peer, {where}: tiles {describe(best)} ({fmt(us)} us eager, of {len(times)} "
                         f"tried)")
        return best
