"""GPU time of a callable (typically a CUDA graph's replay), as the tuner and the benchmarks measure it."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def median_us(fn: Callable[[], object], iters: int, *, warmup: int = 0, flush: torch.Tensor | None = None) -> float:
    """``warmup`` calls of fn, then the median over ``iters`` calls of the GPU time between a pair of CUDA events
    recorded around each, in microseconds, on torch's current stream. flush: a buffer zeroed before each timed
    call, outside its events (a few times the GPU's L2: every call then reads its operands from HBM, as a layer
    does in a model whose other layers pass through L2 in between). One synchronization, at the end."""
    for _ in range(warmup):
        fn()
    pairs = []
    for _ in range(iters):
        if flush is not None:
            flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        pairs.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in pairs) * 1e3
