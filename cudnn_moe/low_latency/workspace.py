"""Workspaces of the low-latency call, allocated once per (weights, max tokens, top_k) and cached.

A call needs three scratch buffers on the weights' device:

- ``inter``: int16 [max_tokens * top_k, Ip], the 16-bit intermediate of every slot (BF16 or FP16 bits);
- ``rows``: int16 [max_tokens * top_k, H], the expert rows of every slot (output dtype bits) that the
  finalize combines;
- ``counters``: int32 [GEMM2 feature columns], zero between calls: the tickets by which the last CTA of
  each column of the GEMM2 launch knows it may combine that column (it resets the counter).

inter and rows are int16 storage so one set serves every input and output dtype. Two calls with the same
weights must not run concurrently on different streams (they would share this scratch). They are kept in a weak
dictionary keyed by the prepared weights object (dropped with it), so repeated calls, and calls
recorded into a CUDA graph, reuse the same memory and allocate nothing. A workspace is created on
the first call for its key; that call must not be inside a CUDA-graph capture (memory allocated
during a capture belongs to the graph's pool), so warm the layer up eagerly first, as with any torch
module, or call ``workspace_for`` beforehand.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

import torch

from .kernels import max_gemm2_columns
from .weights import LowLatencyWeights


@dataclass(frozen=True, eq=False)
class Workspace:
    """Scratch of one (weights, max_tokens, top_k): inter int16 [S, Ip], rows int16 [S, H] (S = max_tokens *
    top_k), counters int32 [columns] (zeros)."""

    inter: torch.Tensor
    rows: torch.Tensor
    counters: torch.Tensor
    max_tokens: int
    top_k: int


_lock = threading.Lock()
_workspaces: weakref.WeakKeyDictionary[LowLatencyWeights, dict[tuple[int, int, torch.device], Workspace]] = (
    weakref.WeakKeyDictionary()
)


def workspace_for(weights: LowLatencyWeights, max_tokens: int, top_k: int, device: torch.device) -> Workspace:
    """The cached workspace of these weights for calls of up to ``max_tokens`` tokens and this top_k
    (allocated on first use; raises RuntimeError when that first use happens inside a CUDA-graph capture)."""
    key = (max_tokens, top_k, device)
    per_weights = _workspaces.get(weights)
    found = per_weights.get(key) if per_weights is not None else None
    if found is not None:
        return found
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "the low-latency MoE call needs a workspace that does not exist yet, and the current stream is "
            "capturing a CUDA graph; run one call eagerly (same weights, max_num_tokens and top_k) before capturing"
        )
    slots = max_tokens * top_k
    workspace = Workspace(
        inter=torch.empty(slots, weights.padded_intermediate, dtype=torch.int16, device=device),
        rows=torch.empty(slots, weights.hidden_size, dtype=torch.int16, device=device),
        counters=torch.zeros(max_gemm2_columns(weights.hidden_size), dtype=torch.int32, device=device),
        max_tokens=max_tokens,
        top_k=top_k,
    )
    with _lock:
        per_weights = _workspaces.setdefault(weights, {})
        return per_weights.setdefault(key, workspace)
