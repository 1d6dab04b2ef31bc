"""The GEMM seam: the executor runs both grouped GEMMs of a layer through a `GemmEngine`.

An engine fixes the row alignment of expert segments and the scale layout the glue
kernels must write; the executor sizes buffers from it and calls `gemm`. Operands
(M = rows, the bucket's token capacity; E = num_experts):
    token_packed  uint8 [M, K/2]       token_scales  float8_e4m3fn, `token_scale_bytes` bytes
    weight_packed uint8 [E, N, K/2]    weight_scales float8_e4m3fn [E, N, K/16], or [E, Np * Kp]
                                       when swizzled (a 128x4 plane per expert; Np, Kp: N
                                       and K/16 rounded up to 128 and 4)
    offsets       int32 [E + 1]        segment starts, then the total row count
    out           bfloat16 [M, N]      workspace     uint8, `workspace_bytes` bytes (or None if 0)
"""

from __future__ import annotations

from typing import Protocol

import torch

from .arch import device_arch
from .cudnn.grouped_gemm import (
    GroupedGemmKey,
    graph_for,
    offsets_len_for,
    row_alignment,
    scale_layout_for,
    token_scale_bytes,
)
from .cudnn.handles import device_index
from .cudnn.probe import MIN_BACKEND, NATIVE_NVFP4_MOE_BACKEND, backend_version, require_cudnn
from .formats import ScaleLayout


class GemmEngine(Protocol):
    """What the executor needs from a grouped-GEMM backend."""

    name: str
    row_alignment: int  # every expert segment starts on a multiple of this many rows
    scale_layout: ScaleLayout  # the layout token and weight scales must be written in

    def workspace_bytes(self, rows: int, k: int, n: int, num_experts: int) -> int:
        """Prepare (build and cache) the GEMM for this shape; its workspace size in bytes."""
        ...

    def token_scale_bytes(self, rows: int, k: int, num_experts: int) -> int:
        """Bytes the token-scale buffer of a bucket must hold."""
        ...

    def gemm(
        self,
        rows: int,
        k: int,
        n: int,
        num_experts: int,
        token_packed: torch.Tensor,
        token_scales: torch.Tensor,
        weight_packed: torch.Tensor,
        weight_scales: torch.Tensor,
        offsets: torch.Tensor,
        out: torch.Tensor,
        workspace: torch.Tensor | None,
    ) -> None:
        """out = grouped NVFP4 GEMM, enqueued on the device's current torch stream."""
        ...


class CudnnGemmEngine:
    """Grouped GEMMs as cuDNN graphs: F8_128x4 scales and 128-row segments on SM100/SM103,
    linear scales and 8-row segments on SM90 (correct there, but slower than BF16)."""

    name = "cudnn"

    def __init__(self, device: int | str | torch.device) -> None:
        self.device = device_index(device)
        self.arch = device_arch(self.device)
        self.scale_layout = scale_layout_for(self.arch)
        require_cudnn(NATIVE_NVFP4_MOE_BACKEND if self.scale_layout is ScaleLayout.SWIZZLED_128X4 else MIN_BACKEND)
        self.backend = backend_version()
        self.row_alignment = row_alignment(self.arch)

    def key(self, rows: int, k: int, n: int, num_experts: int) -> GroupedGemmKey:
        return GroupedGemmKey(
            rows=rows,
            k=k,
            n=n,
            num_experts=num_experts,
            scale_layout=self.scale_layout,
            offsets_len=offsets_len_for(num_experts, self.arch, self.backend),
            device=self.device,
            arch=self.arch,
            backend=self.backend,
        )

    def workspace_bytes(self, rows: int, k: int, n: int, num_experts: int) -> int:
        return graph_for(self.key(rows, k, n, num_experts)).workspace_bytes

    def token_scale_bytes(self, rows: int, k: int, num_experts: int) -> int:
        return token_scale_bytes(rows, k, self.scale_layout, num_experts)

    def gemm(
        self,
        rows: int,
        k: int,
        n: int,
        num_experts: int,
        token_packed: torch.Tensor,
        token_scales: torch.Tensor,
        weight_packed: torch.Tensor,
        weight_scales: torch.Tensor,
        offsets: torch.Tensor,
        out: torch.Tensor,
        workspace: torch.Tensor | None,
    ) -> None:
        gemm = graph_for(self.key(rows, k, n, num_experts))
        stream = torch.cuda.current_stream(self.device).cuda_stream
        gemm.execute(
            token_packed,
            token_scales,
            weight_packed,
            weight_scales,
            offsets[: gemm.key.offsets_len],  # E starts where the backend takes no end boundary
            out,
            workspace,
            stream,
        )
