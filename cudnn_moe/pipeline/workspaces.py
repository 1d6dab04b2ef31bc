"""Workspaces a layer engine declares (cudnn_moe.engines.base.LayerEngine.workspace_spec) and the pipeline
allocates: zero-filled once per (prepared weights object, key) on the first call outside a capture, kept
while the weights live (cudnn_moe.pipeline.lifetime), shared by every call of that key and ordered across
streams (cudnn_moe.pipeline.order)."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import torch

from ..capture import refuse_during_capture
from .lifetime import cached
from .order import StreamOrder


@dataclass(frozen=True, eq=False)
class Workspace:
    """Named scratch buffers on one device, and their ordering across streams."""

    buffers: dict[str, torch.Tensor]
    order: StreamOrder


def workspace_for(owner: object, key: Hashable, spec: dict[str, tuple[tuple[int, ...], torch.dtype]],
                  device: torch.device) -> Workspace:
    """The workspace of ``owner`` (the prepared weights) under ``key``, allocated from ``spec`` on first use."""

    def make() -> Workspace:
        refuse_during_capture("this call needs a workspace that does not exist yet",
                              "run one call eagerly (same weights, max_num_tokens and top_k) before capturing")
        buffers = {name: torch.zeros(shape, dtype=dtype, device=device) for name, (shape, dtype) in spec.items()}
        return Workspace(buffers, StreamOrder(device))

    return cached(owner, ("workspace", key, device), make)
