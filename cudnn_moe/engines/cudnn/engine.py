"""The cuDNN engine: each grouped GEMM is one cuDNN frontend graph (grouped_gemm.py) writing FP32,
followed by the expert-scale kernel (kernels_cuda/expert_scale.cu) that applies the expert globals
and rounds once to BF16.

SM100/SM103: cuDNN's native NVFP4 engines, F8_128x4 scales and 128-row segments (backend >= 9.21).
SM90: the dequantizing graph (FP4 -> BF16 -> MMA), linear scales and 8-row segments; correct but
slow there: the fallback behind the SM90 kernels.
"""

from __future__ import annotations

import numpy as np
import torch

from ...arch import SM90, SM100, SM103, Arch, device_arch, is_blackwell
from ...formats import ScaleLayout, swizzle_128x4, unswizzle_128x4
from ...formats.scale_layout import SWIZZLE_ROWS
from ...kernels.codes import ROW_THREADS, TokenLayout
from ...kernels.loader import launch, ptr
from ..base import (
    NVFP4,
    OP_ALIGNED,
    OP_FUSED,
    EngineSpec,
    GemmEngine,
    GemmOperands,
    GemmShape,
    Service,
    WeightLayout,
    alpha_split,
)
from .grouped_gemm import GroupedGemmKey, offsets_len_for, token_scale_bytes
from .plan_cache import graph_for
from .probe import MIN_BACKEND, NATIVE_NVFP4_MOE_BACKEND, backend_version, require_cudnn

# SM90: the dequantizing engine reads linear scales and has no row tile the offsets must meet; 8 rows
# keep every segment start 16-byte aligned in each operand at a cost of at most 7 padding rows per expert.
_SM90_ROW_ALIGNMENT = 8


class CudnnGemmEngine(GemmEngine):
    """Grouped NVFP4 GEMMs as cuDNN graphs (see the module docstring)."""

    name = "cudnn"
    services = (
        Service(OP_FUSED, frozenset({NVFP4}), frozenset({SM90, SM100, SM103})),
        Service(OP_ALIGNED, frozenset({NVFP4}), frozenset({SM90, SM100, SM103})),
    )

    @classmethod
    def environment_problem(cls) -> str | None:
        """A missing or too old cuDNN (frontend or backend), or None."""
        try:
            require_cudnn()
        except (ImportError, RuntimeError) as exc:
            return f"the cudnn engine cannot use cuDNN: {exc}"
        return None

    @classmethod
    def spec(cls, arch: Arch) -> EngineSpec:
        if is_blackwell(arch):
            # 128 rows: the native engine's M tile and the height of a 128x4 scale atom, so every
            # segment starts on a fresh atom.
            return EngineSpec(cls.name, arch, TokenLayout.NVFP4_SWIZZLED_128X4, WeightLayout.SWIZZLED_128X4, SWIZZLE_ROWS)
        return EngineSpec(cls.name, arch, TokenLayout.NVFP4_LINEAR, WeightLayout.LINEAR, _SM90_ROW_ALIGNMENT)

    @classmethod
    def pack_weights(cls, arch: Arch, codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if cls.spec(arch).weight_layout is WeightLayout.SWIZZLED_128X4:
            return codes, swizzle_128x4(scales)
        return codes, scales

    @classmethod
    def unpack_weights(
        cls, arch: Arch, data: torch.Tensor, scales: torch.Tensor, n: int, k: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if cls.spec(arch).weight_layout is WeightLayout.SWIZZLED_128X4:
            return data, unswizzle_128x4(scales, n, k // 16)
        return data, scales

    def __init__(self, device: torch.device) -> None:
        arch = device_arch(device)
        super().__init__(device, arch)
        self.arch = arch
        self.scale_layout = ScaleLayout.SWIZZLED_128X4 if is_blackwell(arch) else ScaleLayout.LINEAR
        require_cudnn(NATIVE_NVFP4_MOE_BACKEND if self.scale_layout is ScaleLayout.SWIZZLED_128X4 else MIN_BACKEND)
        self.backend = backend_version()

    def key(self, rows: int, shape: GemmShape) -> GroupedGemmKey:
        return GroupedGemmKey(
            rows=rows,
            k=shape.k,
            n=shape.n,
            num_experts=shape.num_experts,
            scale_layout=self.scale_layout,
            offsets_len=offsets_len_for(shape.num_experts, self.arch, self.backend),
            device=self.device.index,
            arch=self.arch,
            backend=self.backend,
        )

    def token_buffers(self, rows: int, k: int, num_experts: int) -> tuple[tuple[int, ...], torch.dtype, int]:
        return (rows, k // 2), torch.uint8, token_scale_bytes(rows, k, self.scale_layout, num_experts)

    def workspace_bytes(self, rows: int, shape: GemmShape) -> int:
        """The graph's own workspace, then the FP32 result [rows, N] (16-byte aligned)."""
        graph_bytes = -(-graph_for(self.key(rows, shape)).workspace_bytes // 16) * 16
        return graph_bytes + rows * shape.n * 4

    def gemm(self, operands: GemmOperands) -> None:
        rows, shape = operands.rows, operands.shape
        gemm = graph_for(self.key(rows, shape))
        graph_bytes = -(-gemm.workspace_bytes // 16) * 16
        workspace = operands.workspace
        if workspace is None or workspace.numel() < graph_bytes + rows * shape.n * 4:
            raise ValueError(f"the cuDNN engine needs a workspace of {self.workspace_bytes(rows, shape)} bytes")
        acc = workspace[graph_bytes : graph_bytes + rows * shape.n * 4].view(torch.float32).view(rows, shape.n)
        stream = torch.cuda.current_stream(self.device).cuda_stream
        gemm.execute(
            operands.tokens.data,
            operands.tokens.scales,
            operands.weights.data,
            operands.weights.scales,
            operands.offsets[: gemm.key.offsets_len],  # E starts where the backend takes no end boundary
            acc,
            workspace[:graph_bytes] if graph_bytes else None,
            stream,
        )
        launch(
            "expert_scale.cu", "moe_expert_scale", self.device, rows, ROW_THREADS,
            (
                ptr(acc, 16), ptr(operands.weights.alpha), ptr(operands.offsets), np.int32(shape.num_experts),
                np.int32(shape.n), np.int32(alpha_split(operands.weights, shape.n)), ptr(operands.out, 16),
            ),
        )
