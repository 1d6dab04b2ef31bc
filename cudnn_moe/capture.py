"""The one warm-before-capture rule: whatever allocates, compiles or lays weights out does it on a first call
outside a CUDA-graph capture, and refuses (RuntimeError, saying what to warm up) inside one; and the capture
of one such warmed call into a CUDA graph (``capture_graph``: the tuner and the benchmarks time those)."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator

import torch


def capturing() -> bool:
    """Whether torch's current stream is capturing a CUDA graph (False without CUDA)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def refuse_during_capture(what: str, remedy: str) -> None:
    """Raise RuntimeError("<what>, and the current stream is capturing a CUDA graph; <remedy>") when capturing."""
    if capturing():
        raise RuntimeError(f"{what}, and the current stream is capturing a CUDA graph; {remedy}")


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Keep Python's cyclic GC from running inside a capture: freeing another object's CUDA memory or graph
    there would invalidate the capture."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def capture_graph(fn: Callable[[], object], keep_graph: bool = False) -> torch.cuda.CUDAGraph:
    """fn() once eagerly (the warm-up: kernels compiled, workspaces allocated, weights laid out), then ONE call
    captured in a CUDA graph on torch's current stream and replayed once (the upload); synchronizes the device.
    keep_graph: keep the cudaGraph_t (``graph.raw_cuda_graph()``, to inspect its nodes)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph(keep_graph=True) if keep_graph else torch.cuda.CUDAGraph()
    stream = torch.cuda.current_stream()
    try:
        with gc_paused(), torch.cuda.graph(graph):
            fn()
    finally:
        torch.cuda.set_stream(stream)  # a failed capture_end leaves the capture stream current
    graph.replay()
    torch.cuda.synchronize()
    return graph
