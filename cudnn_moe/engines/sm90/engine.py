"""The SM90 engine (see the package docstring): layouts, support and the choice of kernel variant.

Variant per GEMM, from the rows a bucket can hold: the decode kernel (weights streamed straight into
registers, split-K across warps) with token tiles of 8 or 32 rows while segments stay short, the
prefill kernel (128 x 128 tiles through a cp.async pipeline) once they average more than 48 rows.
"""

from __future__ import annotations

import torch

from ...arch import SM90, Arch
from ...kernels.codes import TokenLayout
from ..base import EngineSpec, GemmEngine, GemmOperands, GemmShape, Support, WeightLayout
from .kernels import FEATURE_MULTIPLE, PREFILL, ROW_ALIGNMENT, DecodeVariant, GemmVariant, grouped_gemm
from .layout import TILE_K, pack_weight_tiles, unpack_weight_tiles

# (largest average rows per expert segment, variant), first match wins; PREFILL beyond. Picked from
# benchmarks/tune_sm90.py on an H200 (benchmarks/RESULTS.md): two m16 row blocks per warp halve the
# token-fragment loads per weight byte, and two-way split-K keeps enough CTAs in flight.
_DECODE_VARIANTS: tuple[tuple[int, DecodeVariant], ...] = (
    (8, DecodeVariant(mt=2, wm=2, wk=2, nt=1, prefetch=4)),
    (48, DecodeVariant(mt=2, wm=2, wk=2, nt=4, prefetch=2)),
)


def rows_per_expert(rows: int, num_experts: int) -> float:
    """Average rows of a used expert segment when a bucket's row capacity is ``rows``.

    The capacity holds S slots plus up to 7 padding rows for each of min(E, S) used experts, so
    S = rows - 7E once S >= E, else about rows / 8 slots with one expert each.
    """
    slots = rows - (ROW_ALIGNMENT - 1) * num_experts
    return slots / num_experts if slots >= num_experts else 1.0


def choose_variant(rows: int, shape: GemmShape) -> GemmVariant:
    """The kernel variant for a bucket of ``rows`` rows (see the module docstring)."""
    average = rows_per_expert(rows, shape.num_experts)
    for limit, variant in _DECODE_VARIANTS:
        if average <= limit:
            return variant
    return PREFILL


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
        w = operands.weights
        grouped_gemm(w.data, w.scales, w.alpha, operands.tokens.data, operands.offsets, operands.out,
                     choose_variant(operands.rows, operands.shape))
