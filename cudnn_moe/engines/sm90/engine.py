"""The SM90 engine (see the package docstring): layouts, support and the choice of kernel variant.

Variant per GEMM, from the rows a bucket can hold: the decode kernel (weights streamed straight into
registers, split-K across warps when CTAs would be few) with token tiles of 8 or 32 rows while
segments stay short, the prefill kernel (128 features x 64 token rows per CTA through a cp.async
pipeline) once they average more than 48 rows.
"""

from __future__ import annotations

import torch

from ...arch import SM90, Arch
from ...kernels.codes import TokenLayout
from ..base import EngineSpec, GemmEngine, GemmOperands, GemmShape, Support, WeightLayout
from .kernels import FEATURE_MULTIPLE, ROW_ALIGNMENT, DecodeVariant, GemmVariant, PrefillVariant, grouped_gemm
from .layout import TILE_K, pack_weight_tiles, unpack_weight_tiles

# Decode variants picked with benchmarks/tune_sm90.py on an H200 (benchmarks/RESULTS.md). Two m16 row
# blocks per warp halve the token-fragment loads per weight byte; 128 features per CTA when that
# still gives every SM two CTAs, else 64 features and two-way split-K for more CTAs.
_WIDE = DecodeVariant(mt=2, wm=4, wk=1, nt=1, prefetch=4)
_SPLIT = DecodeVariant(mt=2, wm=2, wk=2, nt=1, prefetch=4)
# 32-row token tiles for segments of 9-48 rows; long reductions keep the split-K.
_MID = DecodeVariant(mt=4, wm=2, wk=1, nt=4, prefetch=2)
_MID_LONG_K = DecodeVariant(mt=2, wm=2, wk=2, nt=4, prefetch=2)
_DECODE_MAX_ROWS, _MID_MAX_ROWS, _LONG_K = 8, 48, 4096
# Longer segments: 128 features x 64 token rows per CTA (less padding than 128-row tiles when
# segments hold about 128 rows), 4 CTAs per SM, 4-stage cp.async pipeline.
_PREFILL = PrefillVariant(stages=4, min_blocks=4, feature_block=128, tile_rows=64)


def _slots(rows: int, num_experts: int) -> int:
    """Slots S a bucket of row capacity ``rows`` holds: the capacity is S plus up to 7 padding rows
    for each of min(E, S) used experts, so S = rows - 7E once S >= E, else about rows / 8."""
    slots = rows - (ROW_ALIGNMENT - 1) * num_experts
    return slots if slots >= num_experts else max(1, rows // ROW_ALIGNMENT)


def rows_per_expert(rows: int, num_experts: int) -> float:
    """Average rows of a used expert segment when a bucket's row capacity is ``rows``."""
    slots = _slots(rows, num_experts)
    return slots / min(num_experts, slots)


def choose_variant(rows: int, shape: GemmShape, sm_count: int) -> GemmVariant:
    """The kernel variant for a bucket of ``rows`` rows on a GPU of ``sm_count`` SMs."""
    average = rows_per_expert(rows, shape.num_experts)
    if average > _MID_MAX_ROWS:
        return _PREFILL
    if average > _DECODE_MAX_ROWS:
        return _MID_LONG_K if shape.k >= _LONG_K else _MID
    used = min(shape.num_experts, _slots(rows, shape.num_experts))
    return _WIDE if shape.n // _WIDE.feature_block * used >= 2 * sm_count else _SPLIT


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
        self.sm_count = torch.cuda.get_device_properties(device).multi_processor_count

    def variant(self, rows: int, shape: GemmShape) -> GemmVariant:
        """The kernel variant a GEMM of a bucket with ``rows`` rows runs."""
        return choose_variant(rows, shape, self.sm_count)

    def gemm(self, operands: GemmOperands) -> None:
        w = operands.weights
        grouped_gemm(w.data, w.scales, w.alpha, operands.tokens.data, operands.offsets, operands.out,
                     self.variant(operands.rows, operands.shape), alpha_split=w.alpha_split)
