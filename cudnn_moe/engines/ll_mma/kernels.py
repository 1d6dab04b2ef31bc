"""The tensor-core tactic of the low-latency kernels: ll_moe.cu built with ``-DLL_MMA=1``
(kernels_cuda/low_latency/mma_gemm.cuh: mma.sync.m16n8k16 with FP32 accumulators), launched by the wrappers of
cudnn_moe.engines.cuda_cores.kernels (same kernels, arguments and epilogues; only the geometry differs).

Geometry. A warp covers a tile pair, LL_MMA_WARP_ROWS = 32 weight rows (two m16 tiles: GEMM1 gated, 16
features' up and gate rows; non-gated GEMM1 and GEMM2, 32 rows), and a share of K: K is cut into units of
UNIT = 128 values, and ``split`` warps of a pair (the kernels' lanes_per_row argument) take every split-th unit,
their sums added in shared memory. A CTA (LL_THREADS / 32 warps) holds WARPS / split pairs per feature block,
``rounds`` blocks one after the other (cuda_cores.kernels.choose_rounds, as the CUDA-core tactic). Dynamic
shared memory: each warp's ring of LL_MMA_STAGES k64 steps, per lane 16 bytes per item (the weight chunks: 4 for
E4M3 weights, 2 for the E2M1 weights of the MXFP4 pair; the token chunks: 1 for E4M3 / MXFP8 tokens, 2 for 16-bit
ones; a scale item for DeepSeek FP8 and the MX pairs).

The MX pairs' GEMM1 quantizes its intermediate per 32 features inside the launch (ll_moe.cu mx_quantize_block),
so a CTA must cover exactly 32 features: ``mx_gemm1_cut`` raises the split to WARPS / (32 / pair features) and
sets rounds to fill the block.

H and Ip must be multiples of UNIT (the FP8 formats' and the MX pairs' preparation guarantees it: H % 128, I
padded to 128).
"""

from __future__ import annotations

from typing import Any

from ...kernels.codes import LL_MMA_STAGES, LL_MMA_WARP_ROWS, LL_THREADS
from ...kernels.codes import LowLatencyInputCode as InputCode
from ..base import MX_PAIRS, WeightFormat
from ..cuda_cores.kernels import MX_BLOCK, Geometry, Tactic, choose_rounds

WARPS = LL_THREADS // 32
UNIT = 128  # K values per unit (ll_moe.cu's MMA_UNIT): two k64 steps, one DeepSeek scale block
MIN_UNITS_PER_WARP = 2  # units a warp should stream at least: the ring (LL_MMA_STAGES = 4 k64 steps) stays full
OPTION = "-DLL_MMA=1"


def choose_split(units: int) -> int:
    """Warps splitting K of a tile pair (8, 4, 2 or 1): the most that leave each at least MIN_UNITS_PER_WARP of
    the row's ``units`` (DeepSeek-V3: H = 7168, 56 units -> 8; Ip = 2048, 16 units -> 8; Qwen3-30B-A3B's
    Ip = 768, 6 units -> 2). More warps per pair mean fewer rows per CTA, so more CTAs for the same weights."""
    split = WARPS
    while split > 1 and units < MIN_UNITS_PER_WARP * split:
        split //= 2
    return split


def ring_items(x_kind: InputCode, fmt: WeightFormat) -> int:
    """16-byte ring items per lane and k64 step for ``fmt`` weights and tokens of ``x_kind`` (mma_gemm.cuh's
    mma_items)."""
    weight_items = 2 if fmt is WeightFormat.MXFP4_W_MXFP8_A else 4
    token_bytes = 1 if x_kind in (InputCode.FP8, InputCode.FP8_BLOCK, InputCode.MXFP8) else 2
    return weight_items + token_bytes + (1 if x_kind in (InputCode.FP8_BLOCK, InputCode.MXFP8) else 0)


def shared_bytes(x_kind: InputCode, fmt: WeightFormat) -> int:
    """Dynamic shared memory of one CTA (mma_gemm.cuh's mma_smem_bytes): every warp's ring."""
    return WARPS * LL_MMA_STAGES * ring_items(x_kind, fmt) * 32 * 16


def gemm1_features(gated: bool) -> int:
    """GEMM1 features of a tile pair."""
    return LL_MMA_WARP_ROWS // 2 if gated else LL_MMA_WARP_ROWS


def mx_gemm1_cut(split: int, features: int) -> tuple[int, int]:
    """(split, rounds) of the MX pairs' GEMM1 from the chosen ``split`` and the ``features`` of a tile pair (16
    gated, 32 not): at most MX_BLOCK / features pairs a CTA (so split >= WARPS * features / MX_BLOCK), and rounds
    making the CTA's block exactly MX_BLOCK features (one MXFP8 block: the CTA quantizes it)."""
    split = max(split, WARPS * features // MX_BLOCK)
    return split, MX_BLOCK // ((WARPS // split) * features)


class MmaTactic(Tactic):
    """ll_moe.cu with the tensor-core dot products (module docstring)."""

    options = (OPTION,)

    def gemm1_geometry(self, weights: Any, x_kind: InputCode, slots: int, sms: int) -> Geometry:
        fmt, features = weights.format, gemm1_features(weights.gated)
        split = choose_split(weights.hidden_size // UNIT)
        if fmt in MX_PAIRS:
            split, rounds = mx_gemm1_cut(split, features)
        columns = -(-weights.padded_intermediate // ((WARPS // split) * features))
        if fmt not in MX_PAIRS:
            rounds = choose_rounds(columns, slots, sms, (WARPS // split) * LL_MMA_WARP_ROWS * weights.hidden_size)
        return Geometry((-(-columns // rounds), slots), split, rounds, shared_bytes(x_kind, fmt))

    def gemm2_geometry(self, weights: Any, x_kind: InputCode, slots: int, sms: int) -> Geometry:
        split = choose_split(weights.padded_intermediate // UNIT)
        pairs = WARPS // split
        columns = -(-weights.hidden_size // (pairs * LL_MMA_WARP_ROWS))
        rounds = choose_rounds(columns, slots, sms, pairs * LL_MMA_WARP_ROWS * weights.padded_intermediate)
        return Geometry((-(-columns // rounds), slots), split, rounds, shared_bytes(x_kind, weights.format))

    def max_gemm2_columns(self, hidden: int) -> int:
        return -(-hidden // LL_MMA_WARP_ROWS)  # one pair per CTA, one round


MMA = MmaTactic()
