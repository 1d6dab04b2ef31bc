"""The SM90 engine (see the package docstring): layouts, support and the choice of kernel variant."""

from __future__ import annotations

import torch

from ...arch import SM90, Arch
from ...kernels.codes import TokenLayout
from ..base import EngineSpec, GemmEngine, GemmOperands, GemmShape, Support, WeightLayout
from .layout import TILE_K, pack_weight_tiles, unpack_weight_tiles

FEATURE_MULTIPLE = 128  # output columns N per CTA of the widest kernel variant
ROW_ALIGNMENT = 8  # segments start on the 8-token side of the MMA


class Sm90GemmEngine(GemmEngine):
    """NVFP4 x NVFP4 grouped GEMMs with our own kernels on Hopper."""

    name = "sm90"
    archs = frozenset({SM90})

    @classmethod
    def spec(cls, arch: Arch) -> EngineSpec:
        return EngineSpec(cls.name, arch, TokenLayout.BF16_FRAGMENTS, WeightLayout.SM90_TILES, ROW_ALIGNMENT)

    @classmethod
    def supports(cls, arch: Arch, shape: GemmShape | None = None) -> Support:
        answer = super().supports(arch, shape)
        if not answer or shape is None:
            return answer
        if shape.n % FEATURE_MULTIPLE or shape.k % TILE_K:
            return Support(False, f"the sm90 kernels need N % {FEATURE_MULTIPLE} == 0 and K % {TILE_K} == 0, "
                                  f"got N={shape.n}, K={shape.k}")
        return answer

    @classmethod
    def pack_weights(cls, arch: Arch, codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return pack_weight_tiles(codes, scales)

    @classmethod
    def unpack_weights(
        cls, arch: Arch, data: torch.Tensor, scales: torch.Tensor, n: int, k: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return unpack_weight_tiles(data, scales, n, k)

    def __init__(self, device: torch.device) -> None:
        super().__init__(device, SM90)

    def gemm(self, operands: GemmOperands) -> None:
        raise NotImplementedError
