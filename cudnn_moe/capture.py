"""The one warm-before-capture rule: whatever allocates, compiles or lays weights out does it on a first call
outside a CUDA-graph capture, and refuses (RuntimeError, saying what to warm up) inside one."""

from __future__ import annotations

import torch


def capturing() -> bool:
    """Whether torch's current stream is capturing a CUDA graph (False without CUDA)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def refuse_during_capture(what: str, remedy: str) -> None:
    """Raise RuntimeError("<what>, and the current stream is capturing a CUDA graph; <remedy>") when capturing."""
    if capturing():
        raise RuntimeError(f"{what}, and the current stream is capturing a CUDA graph; {remedy}")
