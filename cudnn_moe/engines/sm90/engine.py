"""The SM90 engine (see the package docstring): layouts, support and the choice of kernel variant.

Variant per GEMM, from the rows a bucket can hold: the decode kernel (weights streamed straight into
registers, split-K across warps when CTAs would be few) with token tiles of 8 or 32 rows while
segments stay short, the wgmma kernel (128 or 256 features x up to 64 or 128 token rows per CTA, sm_90a)
once they average more than 32 rows. The wgmma kernel reads its token operand in tiled BF16 planes (one bulk
copy per stage; GEMM1 gathers the stage's natural rows instead), the mma.sync kernels token fragments:
``token_layout_for`` tells the permute and activation stages which to write.

The chain per bucket (``gemm1_fusion``, ``Sm90GemmEngine.stages``): on the wgmma kernel, the sort with the tokens
decoded into BF16 rows, GEMM1 gathering its rows through the routing with the activation in its epilogue, GEMM2;
on the decode kernel, sort + permute, then GEMM1 with the activation epilogue while the launch is small enough for
it to pay, else GEMM1 and the activation, then GEMM2, which also finalizes into the caller's output where the call's
launches know it and its CTAs fit in one wave or start behind the tile handoff (``can_finalize``). GEMM1 with the
epilogue hands each finished token tile to GEMM2 (``tile_handoff``), which then computes those tiles while GEMM1's
last CTAs still run.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ...arch import SM90, Arch, peak_dram_tbs
from ...kernels.codes import SORT_MAX_EXPERTS, TokenLayout
from ...kernels.l2_warm import CODE_CHUNK, LINE, L2Warm
from ..base import (
    NVFP4,
    OP_ALIGNED,
    OP_FUSED,
    OP_LOW_LATENCY,
    BlockCode,
    EarlyRouting,
    EngineSpec,
    Gemm1Fusion,
    GemmEngine,
    GemmOperands,
    GemmShape,
    LayerStages,
    Request,
    Service,
    Stage,
    Support,
    TileHandoff,
    WeightFormat,
    WeightLayout,
)
from .kernels import (
    FEATURE_MULTIPLE,
    ROUTE_MAX_SHARED_MEM,
    ROW_ALIGNMENT,
    DecodeVariant,
    GemmVariant,
    WgmmaVariant,
    decode_wave,
    gemm_grid,
    grouped_gemm,
    route_shared_mem,
)
from .layout import TILE_K, pack_int4_weight_tiles, pack_weight_tiles, unpack_weight_tiles

# Decode variants picked with benchmarks/tune_sm90.py on an H200 (benchmarks/RESULTS.md). Two m16 row
# blocks per warp halve the token-fragment loads per weight byte; 128 features per CTA when that
# still gives every SM two CTAs, else 64 features and two-way split-K for more CTAs, and four-way (eight warps)
# where even those would leave SMs with fewer than two CTAs (Qwen3-30B-A3B at one token).
_WIDE = DecodeVariant(mt=2, wm=4, wk=1, nt=1, prefetch=4)
_SPLIT = DecodeVariant(mt=2, wm=2, wk=2, nt=1, prefetch=4)
_SPLIT_DEEP = DecodeVariant(mt=2, wm=2, wk=4, nt=1, prefetch=4)
# GPUs whose peak DRAM bandwidth (arch.peak_dram_tbs) is below this many TB/s, such as the H100 (3.35; the H200: 4.9),
# take the two choices measured fastest there: GEMM1's move to _SPLIT below, and _L2_WARM_BLOCKS_SLOW_DRAM.
_SLOW_DRAM_TBS = 4.0
# GEMM1 past one wave of _WIDE takes _SPLIT where that fills its last wave of CTAs by _GEMM1_FILL_GAIN more and stays
# within the activation epilogue's CTAs (_DECODE_EPILOGUE_CTAS_PER_SM), on GPUs whose DRAM streams less than
# _SLOW_DRAM_TBS. Qwen3-30B-A3B T=8: 768 CTAs of _WIDE in 1.45 waves of 528, 1536 of _SPLIT in 2.91 (persistent
# behind the tile handoff). Whole chain, us, _SPLIT / _WIDE (benchmarks/RESULTS.md): H100 (3.35 TB/s), bench_moe.py
# in alternating trees, 72.8-75.0 / 76.4-76.5 (fifty-seventh session); H200 (4.9 TB/s), in-process A/B, 62.5-63.8 /
# 61.1-61.7, T=16 83.2-83.4 / 82.8-83.1 (fifty-sixth session). GEMM2 keeps _WIDE (the same move cost Qwen3-30B-A3B
# T=8's GEMM2 4 us), and so does every GEMM1 measured with less to gain (DeepSeek-V3 T=2 and T=4: 2-12 us slower on
# _SPLIT) or past the epilogue's CTAs (Mixtral-8x7B T=8: 3584 CTAs, the activation in its own launch, 198 -> 203 us).
_GEMM1_FILL_GAIN = 0.25
# GEMM2 of NVFP4 tiles past one wave of _WIDE CTAs takes the same 128-feature CTAs with four m16 blocks a warp and two
# k64 steps in flight (the same weight bytes in flight in half the ring steps; two warps a CTA held to 128 registers,
# eight CTAs an SM; can_finalize). GEMMs
# alone on the H200, us, _WIDE / _WIDE_MT4 (benchmarks/RESULTS.md, twenty-ninth session): Qwen3-30B-A3B T=8 24.4 /
# 23.2, T=64 45.2 / 40.7; DeepSeek-V3 T=8 135.4 / 132.2, T=64 517.6 / 508.4; in one wave it loses (DeepSeek-V3 T=1
# 29.6 / 37.0), and GEMM1 with its epilogue loses everywhere (Qwen3-30B-A3B T=8 41.9 on _SPLIT against 48.4).
_WIDE_MT4 = DecodeVariant(mt=4, wm=2, wk=1, nt=1, prefetch=2)
# NVFP4 tile GEMM1 on _SPLIT past one wave of _WIDE (below _SLOW_DRAM_TBS: _gemm1_splits) runs _WIDE's CTAs held to
# six an SM instead (80 registers, 8 bytes spilled, two ring steps, not persistent) where that holds all of them at
# once: Qwen3-30B-A3B T=8, 768 CTAs in 792 slots against 1536 of persistent _SPLIT in 2.91 waves of 528. Whole chain
# on an H100, us, persistent _SPLIT / this (benchmarks/RESULTS.md, sixty-second session): bench_moe.py in alternating
# trees 73.3-74.1 / 71.0-71.1; an in-process A/B 71.4-72.5 / 69.6-69.9, outputs bitwise equal, and five CTAs an SM
# (96 registers, 1.16 waves) 73.7-73.9. The same bucket serves T=5-8, whose tokens touch fewer experts (about 41 of
# 128 at T=6 on average), and there it gains nothing or loses: in-process A/B on an H100 (sixty-third session), us,
# T=7 64.2-64.5 / 64.2-64.4, T=6 56.3-56.4 / 58.2-58.3. Not measured on the H200, whose GEMM1 there keeps _WIDE.
_WIDE_ONE_WAVE = replace(_WIDE, prefetch=2, min_blocks=6)
# Behind a tile handoff (tile_handoff), GEMM2 takes _WIDE_MT4's CTAs with two-way split-K instead (four warps, each
# half the reduction: the same feature blocks and token tiles), finalizing in as many waves as it takes (can_finalize):
# its CTAs start as GEMM1's tiles finish, and each streams its share in half the time once its tile is ready. H100,
# probe_timeline.py, whole call, us, _WIDE_MT4 / this (benchmarks/RESULTS.md, fifty-fourth session, three rounds):
# Qwen3-30B-A3B T=8 73.3-73.7 / 72.1-72.4; DeepSeek-V3 T=4 320.2 / 317.4 (its finalize launch folded in), T=8 480.5 /
# 478.6. Split-K on two-block warps lost (Qwen3-30B-A3B T=8 75.3-75.4 with (2, 2, 2), 90.2-90.6 with (2, 2, 4));
# buckets within one wave of _WIDE keep it (T=4: 45.5-45.8 / 45.9-46.0 with this form).
_WIDE_MT4_SPLIT = DecodeVariant(mt=4, wm=2, wk=2, nt=1, prefetch=2)
# Passes of its threads the CTA that finalizes a feature block may take (can_finalize): two, for _WIDE_MT4 at T = 8.
_FINALIZE_PASSES = 2
# Row-major NVFP4 (BlockCode.NVFP4_ROWS) GEMM1 takes _SPLIT wherever the tiles take _WIDE: a CTA then reads 128
# contiguous bytes of each of its rows a step, not 64. GEMM1 alone on the H200 (benchmarks/RESULTS.md, twenty-sixth
# session), us, _WIDE / _SPLIT: Qwen3-30B-A3B T=8 51.5 / 44.8, T=64 101.1 / 96.0; DeepSeek-V3 T=8 369.2 / 339.8,
# T=64 1359.8 / 1432.5. GEMM2 keeps the tiles' choice (_SPLIT lost at four of six rows).
# 32-row token tiles for segments of 9-31 rows; long reductions keep the split-K.
_MID = DecodeVariant(mt=4, wm=2, wk=1, nt=4, prefetch=2)
_MID_LONG_K = DecodeVariant(mt=2, wm=2, wk=2, nt=4, prefetch=2)
_DECODE_MAX_ROWS, _LONG_K = 8, 4096
# Longer segments: wgmma (sm_90a). From 32 rows per expert on average: 64-row token tiles, two warpgroups
# (128 features), three CTAs per SM; from 64 rows: 128-row tiles, with four warpgroups (256 features:
# half the token reads per MAC) once N reaches 4096. A segment's last tile runs with the smallest of
# N = 32, 64, 128 that covers its rows. Measured with benchmarks/tune_sm90.py (benchmarks/RESULTS.md).
# A GEMM that reads a token operand (GEMM2: GEMM1 gathers natural rows, WgmmaVariant.gathering) reads it in the
# tiled planes, one bulk copy per stage.
_WGMMA_SHORT = WgmmaVariant(tile_rows=64, groups=2, stages=4, min_blocks=3, tiled_tokens=True)
_WGMMA = WgmmaVariant(tile_rows=128, groups=2, stages=4, min_blocks=2, tiled_tokens=True)  # 2-4% ahead of 5 stages
_WGMMA_WIDE = WgmmaVariant(tile_rows=128, groups=4, stages=5, tiled_tokens=True)
_WGMMA_MIN_ROWS, _WGMMA_LONG_ROWS, _WGMMA_WIDE_N = 32, 64, 4096
# The decode kernel's activation epilogue pays off while GEMM1 runs in few waves (it adds its latency to
# each wave). With the four-instruction sigmoid it cost Qwen3-30B-A3B T=64 (2112 CTAs) 4.9 us and DeepSeek-V3
# T=8 (2048 CTAs) 6.1 us over the plain GEMM1, about what the activation launch it replaces costs, and
# DeepSeek-V3 T=64 (16384 CTAs) 20 us (tune_sm90.py --forms, benchmarks/RESULTS.md). Fused up to this many
# CTAs per SM.
_DECODE_EPILOGUE_CTAS_PER_SM = 16
# Calls of at most this many tokens take early routing (EarlyRouting). H200, fused_moe, us (main / early): GEMM1
# after the sort launch, Qwen3-30B-A3B T=2 35.6 / 33.9, T=4 44.6 / 43.4, T=8 67.3 / 67.0; the low-latency NVFP4 layer
# T=8 64.6 / 65.7 (benchmarks/RESULTS.md, twenty-third session): no gain at T=8. GEMM2 behind the routed one-token
# GEMM1: Qwen3-30B-A3B T=1 23.6-24.0 / 23.1, DeepSeek-V3 T=1 75.8-80.4 / 74.9-79.5 (thirtieth session).
_EARLY_MAX_TOKENS = 4
# Buckets of at most this many slots (T x top_k) run GEMM1 and GEMM2 with a tile handoff (tile_handoff). H200, whole
# fused_moe call, us, main / handoff (benchmarks/RESULTS.md, twenty-eighth session): Qwen3-30B-A3B T=8 70.5 / 66.4-66.7,
# DeepSeek-V3 T=8 441.4-441.8 / 431.8-433.2; Qwen3-30B-A3B T=64 124.4-124.5 / 126.0-126.7, so not past 64 slots.
_HANDOFF_MAX_SLOTS = 64
# GEMM1 behind a tile handoff (NVFP4 or MXFP4 tiles, no route) past _PERSIST_MIN_WAVES waves of its CTAs runs
# persistent: each CTA issues this many ring steps of its next unit's weights before the epilogue and tile signal of the
# unit it finishes (DecodeVariant.persist), so its slot keeps loads in flight while the signal's fence waits. H100,
# probe_timeline.py, whole call, us, main / persistent with 2 steps ahead (benchmarks/RESULTS.md, fifty-second
# session): Qwen3-30B-A3B T=8 (1320 CTAs of _SPLIT, 2.5 waves) 75.3-76.7 / 73.8-74.3 (4 steps ahead: 75.2); within one
# wave it only adds the next unit's search before each epilogue: T=4 45.7 / 47.1, T=2 33.9-34.1 / 34.3-34.5.
# On GPUs where Qwen3-30B-A3B T=8's GEMM1 keeps _WIDE (768 CTAs, 1.45 waves: _SLOW_DRAM_TBS), it does not
# persist: the whole chain took 62.6-63.1 us with persistent _WIDE against 61.1-61.7 on the H200 (fifty-sixth session);
# DeepSeek-V3 T=8 (2048 CTAs of _WIDE) persists on every GPU.
_PERSIST_AHEAD = 2
_PERSIST_MIN_WAVES = 2


# L2 warming (L2Warm): before a decode GEMM1 of weight tiles that runs past one wave of its CTAs, the staged sort +
# permute launch (DRAM idle) asks L2 for this share of every row block's stream of the experts GEMM1's first wave
# computes, with this many extra blocks. Whole fused_moe chain on an H100, us, off / 0.15 / 0.3 / 0.45 / 0.6, the same
# kernel code (benchmarks/RESULTS.md, forty-fourth session): Qwen3-30B-A3B T=8 79.0 / 77.8 / 77.2 / 76.1 / 76.0,
# DeepSeek-V3 T=4 293.4 / - / - / 283.4 / 289.3, T=8 513.2 / 508.2 / 500.0 / 496.8 / 500.5, T=64 1962 / 1959 / 1952 /
# 1945 / -. The warming kernels cost 1-1.5 us over the plain ones where nothing is warmed (Qwen3-30B-A3B T=2 and T=4,
# against main), which warming did not win back in one wave there (384 CTAs: within the noise); DeepSeek-V3 T=2 (512
# CTAs, one wave) gained 4 us with them and is left out by this rule all the same. With 8 MB warmed at Qwen3-30B-A3B
# T=8, 8 / 16 / 32 blocks: 78.4 / 76.8 / 76.5. On the H200 with GEMM1 on _WIDE, whole chain, us, 32 / 64 / 96 / 128
# blocks (benchmarks/RESULTS.md, fifty-sixth session, three rounds): Qwen3-30B-A3B T=8 61.1-61.7 / 60.4-60.8 / 60.3-60.9
# / 60.5-61.2, DeepSeek-V3 T=8 369.0-370.1 / 366.6-367.1 / 363.9-364.3 / 363.7-364.0.
_L2_WARM_SHARE = 0.45
_L2_WARM_BLOCKS = 96
# Below _SLOW_DRAM_TBS the warming takes this many extra blocks instead. H100, bench_moe.py in alternating trees,
# Qwen3-30B-A3B T=8 (GEMM1 on persistent _SPLIT), us, 32 / 96 blocks: 72.8-75.0 / 80.1-80.2; DeepSeek-V3 T=8 493.2-493.4
# / 492.9-493.3 (benchmarks/RESULTS.md, fifty-seventh session). Below 4 TB/s the engine's choices are then those the
# H100 measured fastest before the fifty-sixth session.
_L2_WARM_BLOCKS_SLOW_DRAM = 32
# Past the tile-handoff buckets (_HANDOFF_MAX_SLOTS) warming pays only for long reductions (K >= _L2_WARM_LONG_K). H100,
# the whole chain, us, warming / none, three rounds alternating (benchmarks/RESULTS.md, forty-fifth session):
# Qwen3-30B-A3B (K = 2048) T=8 75.0 / 77.4, T=16 102.7 / 101.8, T=32 134.5 / 134.2, T=64 148.7 / 145.0; DeepSeek-V3
# (K = 7168) T=8 479.8 / 499.5, T=16 860.7 / 872.0, T=64 1890.2 / 1902.5. No K between those two was measured.
_L2_WARM_LONG_K = 4096


def _slots(rows: int, num_experts: int) -> int:
    """Slots S a bucket of row capacity ``rows`` holds: the capacity is S plus up to 7 padding rows
    for each of min(E, S) used experts, so S = rows - 7E once S >= E, else about rows / 8."""
    slots = rows - (ROW_ALIGNMENT - 1) * num_experts
    return slots if slots >= num_experts else max(1, rows // ROW_ALIGNMENT)


def _tickets(shape: GemmShape) -> int:
    """A finalizing decode GEMM's tickets at the start of its workspace: one per feature block of the narrowest
    variant (16 features), whichever variant runs."""
    return shape.n // 16


def _handoff_tiles(rows: int, num_experts: int) -> int:
    """Tiles of a decode GEMM over a bucket of ``rows`` rows at most (gemm_grid with 8-row tiles): a tile handoff's
    counters."""
    return gemm_grid(_WIDE, num_experts, FEATURE_MULTIPLE, rows)[1]


def rows_per_expert(rows: int, num_experts: int) -> float:
    """Average rows of a used expert segment when a bucket's row capacity is ``rows``."""
    slots = _slots(rows, num_experts)
    return slots / min(num_experts, slots)


def _last_wave_fill(ctas: int, variant: DecodeVariant, sm_count: int) -> float:
    """The share of the last wave's CTA slots that ``ctas`` CTAs of ``variant`` fill."""
    slots = decode_wave(variant, sm_count)
    return (ctas - 1) % slots / slots + 1 / slots


def _gemm1_splits(wide: int, split: int, sm_count: int, dram_tbs: float) -> bool:
    """Whether GEMM1 takes ``split`` CTAs of _SPLIT over ``wide`` of _WIDE (_GEMM1_FILL_GAIN): below
    _SLOW_DRAM_TBS, past one wave, a last wave fuller by that much, within the activation epilogue's CTAs."""
    if dram_tbs >= _SLOW_DRAM_TBS or wide <= decode_wave(_WIDE, sm_count):
        return False
    gain = _last_wave_fill(split, _SPLIT, sm_count) - _last_wave_fill(wide, _WIDE, sm_count)
    return gain >= _GEMM1_FILL_GAIN and split <= _DECODE_EPILOGUE_CTAS_PER_SM * sm_count


def _past_waves(rows: int, shape: GemmShape, variant: DecodeVariant, sm_count: int, waves: int = 1) -> bool:
    """Whether a decode GEMM of ``shape`` over a bucket of ``rows`` rows takes more CTAs of ``variant`` than ``waves``
    waves of them hold."""
    return decode_ctas(rows, shape, variant) > waves * decode_wave(variant, sm_count)


def choose_variant(rows: int, shape: GemmShape, sm_count: int, *, gemm: int, dram_tbs: float) -> GemmVariant:
    """The kernel variant for GEMM ``gemm`` (1 or 2) of ``shape`` over a bucket of ``rows`` rows on a GPU of
    ``sm_count`` SMs whose DRAM streams ``dram_tbs`` TB/s."""
    average = rows_per_expert(rows, shape.num_experts)
    if average >= _WGMMA_LONG_ROWS:
        return _WGMMA_WIDE if shape.n >= _WGMMA_WIDE_N else _WGMMA
    if average >= _WGMMA_MIN_ROWS:
        return _WGMMA_SHORT
    if average > _DECODE_MAX_ROWS:
        return _MID_LONG_K if shape.k >= _LONG_K else _MID
    used = min(shape.num_experts, _slots(rows, shape.num_experts))
    wide, split = shape.n // _WIDE.feature_block * used, shape.n // _SPLIT.feature_block * used
    if wide >= 2 * sm_count:
        return _SPLIT if gemm == 1 and _gemm1_splits(wide, split, sm_count, dram_tbs) else _WIDE
    return _SPLIT if split >= 2 * sm_count else _SPLIT_DEEP


def decode_ctas(rows: int, shape: GemmShape, variant: GemmVariant) -> int:
    """About how many CTAs a decode-kernel GEMM of a bucket with ``rows`` rows launches: used experts x their
    token tiles x feature blocks."""
    used = min(shape.num_experts, _slots(rows, shape.num_experts))
    tiles = -(-int(rows_per_expert(rows, shape.num_experts)) // variant.tile_rows)
    return used * max(1, tiles) * (shape.n // variant.feature_block)


def gemm1_fusion(rows: int, shape: GemmShape, activation: object, sm_count: int, dram_tbs: float) -> Gemm1Fusion:
    """How GEMM1 of ``shape`` runs on a bucket of ``rows`` rows with ``activation`` on a GPU of ``sm_count`` SMs and
    ``dram_tbs`` TB/s:
    wgmma buckets with the activation epilogue and the gather; decode buckets with the epilogue where it pays (the
    variant fits it and the launch stays within _DECODE_EPILOGUE_CTAS_PER_SM CTAs per SM); else neither."""
    variant = choose_variant(rows, shape, sm_count, gemm=1, dram_tbs=dram_tbs)
    if isinstance(variant, WgmmaVariant):
        return Gemm1Fusion(epilogue=True, gather=True)
    fits = isinstance(variant, DecodeVariant) and variant.epilogue_problem(activation) is None
    return Gemm1Fusion(epilogue=fits and decode_ctas(rows, shape, variant) <= _DECODE_EPILOGUE_CTAS_PER_SM * sm_count)


LOW_LATENCY_MAX_TOKENS = 8
# Weight-only formats of the low-latency op, with BF16 tokens: NVFP4, MXFP4 in its exact shifted form
# (cudnn_moe.formats.mxfp4_as_nvfp4, decided when the weights are prepared) in its own tiles (BlockCode.MXFP4: a scale
# byte per 32 values, the products of NVFP4 tiles), and MXINT4 in its own tiles (BlockCode.MXINT4: INT4 decoded
# exactly, BF16 block scales on FP32 partial sums).
_WEIGHT_ONLY = frozenset(f.value for f in (WeightFormat.NVFP4_WEIGHT_ONLY, WeightFormat.MXFP4_WEIGHT_ONLY,
                                           WeightFormat.MXINT4_WEIGHT_ONLY))
# BF16 layers of the low-latency op (BlockCode.BF16): one variant of the decode kernel's BF16 form at every T <= 8, one
# m16 block a warp, four k64 steps (8 KB) in flight, four warps along features, no split-K. GEMMs alone on the H200
# (benchmarks/RESULTS.md, twenty-fourth session): best or within 4% of the best of 14 forms at Qwen3-30B-A3B and
# DeepSeek-V3 T=1 and 8, e.g. DeepSeek-V3 T=8 GEMM1 899 us (3.9 TB/s) against 1067 with two m16 blocks and two steps.
_BF16_TOKENS = _WEIGHT_ONLY | {WeightFormat.BF16.value}
# The MXFP4 weight + MXFP8 activation pair, in its exact shifted form: prepared for SM90, its own MXFP4 tiles
# (BlockCode.MXFP4, the one copy, which the CUDA-core kernels read too), else its row-major tensors read in place
# (BlockCode.MXFP4_ROWS); its MXFP8 tokens decoded exactly to BF16 by the sort + permute and its intermediate
# quantized to MXFP8 per 32 values in the activation (IntermediateCode.MXFP8), both held as BF16 values, exact for
# block scales 2^-117 .. 2^119.
_MX_PAIR = WeightFormat.MXFP4_W_MXFP8_A.value
_MXFP4_FORMS = frozenset({WeightFormat.MXFP4_WEIGHT_ONLY.value, _MX_PAIR})
_BF16 = DecodeVariant(mt=1, wm=4, wk=1, nt=1, prefetch=4, bf16_weights=True)
# The codes whose forms read natural token rows (no staged fragments, so no route).
_NATURAL_ROWS = (BlockCode.BF16, BlockCode.NVFP4_ROWS, BlockCode.MXFP4_ROWS)


class Sm90GemmEngine(GemmEngine):
    """NVFP4 x NVFP4 grouped GEMMs with our own kernels on Hopper: the fused and aligned ops, and the
    low-latency op's 4-bit formats (finalized, BF16 out; NVFP4, MXFP4 or MXINT4 weight-only with BF16 tokens, the
    NVFP4 pair, or the MXFP4 pair with MXFP8 tokens), measured 1.3-3x faster than the CUDA-core kernels from two
    tokens on (at one token 1.9x faster on DeepSeek-V3, up to 10% slower on Qwen3-30B-A3B; the MXFP4 pair 1.2-1.9x
    faster at T = 1 and 8), so it takes every T; and its BF16 layers
    (BF16 tokens, finalized, BF16 out; the decode kernel's BF16 form), 1.17-1.43x faster than the CUDA cores on
    the H200 at T = 1 and 8 (benchmarks/RESULTS.md)."""

    name = "sm90"
    services = (
        Service(OP_FUSED, frozenset({NVFP4}), frozenset({SM90})),
        Service(OP_ALIGNED, frozenset({NVFP4}), frozenset({SM90})),
        Service(OP_LOW_LATENCY, _BF16_TOKENS | {WeightFormat.NVFP4_W_NVFP4_A.value, _MX_PAIR},
                frozenset({SM90}), max_tokens=LOW_LATENCY_MAX_TOKENS),
    )

    @classmethod
    def spec(cls, arch: Arch) -> EngineSpec:
        return EngineSpec(cls.name, arch, TokenLayout.BF16_FRAGMENTS, WeightLayout.SM90_TILES, ROW_ALIGNMENT)

    @classmethod
    def check(cls, request: Request) -> Support:
        for shape in request.shapes:
            if shape.n % FEATURE_MULTIPLE or shape.k % TILE_K:
                return Support(False, f"the sm90 kernels need N % {FEATURE_MULTIPLE} == 0 and K % {TILE_K} == 0, "
                                      f"got N={shape.n}, K={shape.k}")
        if request.op != OP_LOW_LATENCY:
            return Support(True)
        if request.finalize is False:
            return Support(False, "the sm90 engine returns finalized low-latency outputs only (raw rows: CUDA cores)")
        if request.out_dtype is not None and request.out_dtype != torch.bfloat16:
            return Support(False, "the sm90 engine writes BF16 low-latency outputs only")
        if request.num_experts is not None and request.num_experts > SORT_MAX_EXPERTS:
            return Support(False, f"the sm90 pipeline sorts at most {SORT_MAX_EXPERTS} experts")
        bf16_tokens = request.weight_format in _BF16_TOKENS
        if bf16_tokens and request.token_dtype is not None and request.token_dtype != torch.bfloat16:
            return Support(False, "the sm90 engine takes BF16 tokens for BF16 and 4-bit weight-only layers")
        if request.weight_format in _MXFP4_FORMS and request.nvfp4_problem is not None:
            return Support(False, f"the sm90 engine runs MXFP4 weights in their exact shifted form, which these lack: "
                                  f"{request.nvfp4_problem}")
        return Support(True)

    @classmethod
    def pack_weights(cls, arch: Arch, codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return pack_weight_tiles(codes, scales)

    @classmethod
    def unpack_weights(
        cls, arch: Arch, data: torch.Tensor, scales: torch.Tensor, n: int, k: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return unpack_weight_tiles(data, scales, n, k)

    @classmethod
    def pack_mxint4_weights(
        cls, arch: Arch, codes: torch.Tensor, scales: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return pack_int4_weight_tiles(codes, scales)

    def __init__(self, device: torch.device) -> None:
        super().__init__(device, SM90)
        self.sm_count = torch.cuda.get_device_properties(device).multi_processor_count
        self.dram_tbs = peak_dram_tbs(device)

    def gemm1_fusion(self, rows: int, shape: GemmShape, activation: object) -> Gemm1Fusion:
        """The module's gemm1_fusion on this GPU."""
        return gemm1_fusion(rows, shape, activation, self.sm_count, self.dram_tbs)

    def workspace_bytes(self, rows: int, shape: GemmShape) -> int:
        """A decode GEMM's finalize tickets (int32, one per feature block of the narrowest variant, from the start),
        and in buckets that may hand off (tile_handoff) two counters per tile (int32, at the end), all zero between
        launches."""
        handoff = _slots(rows, shape.num_experts) <= _HANDOFF_MAX_SLOTS
        return 4 * _tickets(shape) + (8 * _handoff_tiles(rows, shape.num_experts) if handoff else 0)

    def can_finalize(self, operands: GemmOperands, tokens: int) -> bool:
        """GEMM2 on the decode kernel (the variant ``gemm`` launches for these operands) in one wave of its own CTAs
        (decode_wave), or on _WIDE_MT4_SPLIT behind a tile handoff in any number, the CTA that finalizes a
        feature block needing at most _FINALIZE_PASSES passes of its threads (tokens x features / 8 pieces of 8
        features). Each CTA's ticket adds a GPU-scope atomic round trip to its end: once per launch in one wave, where
        it beats the finalize launch (H200: Qwen3-30B-A3B T=1 28.2 -> 27.4 us, DeepSeek-V3 T=1 81.8 -> 81.3), but once
        per wave in more (T=8: +0.7 and +2.9 us; benchmarks/RESULTS.md), unless the CTAs start as their tiles get
        ready (the handoff). _WIDE_MT4's two-warp CTAs fit one wave of their own where _WIDE's would not (DeepSeek-V3
        T=2), and finalize in two passes at eight tokens."""
        if operands.workspace is None:
            return False
        variant = self._launch_variant(operands)
        if not isinstance(variant, DecodeVariant):
            return False
        one_wave = not _past_waves(operands.rows, operands.shape, variant, self.sm_count)
        return ((one_wave or variant == _WIDE_MT4_SPLIT)
                and tokens * variant.feature_block // 8 <= _FINALIZE_PASSES * variant.threads)

    def tile_handoff(self, gemm1: GemmOperands, gemm2: GemmOperands) -> TileHandoff | None:
        """Both GEMMs on the decode kernel with the same token tiles, in buckets of at most _HANDOFF_MAX_SLOTS slots:
        the counters at the end of the bucket's workspace (workspace_bytes) and GEMM1's feature blocks as the producers
        of each tile. Not for row-major weights (the aligned op read in place: not measured, and its split-K finalizing
        GEMM2 would spill 36 bytes with the wait instead of 20)."""
        if (_slots(gemm2.rows, gemm2.shape.num_experts) > _HANDOFF_MAX_SLOTS
                or gemm2.weights.code.row_major):
            return None
        v1 = self.variant(gemm1.rows, gemm1.shape, gemm=1, code=gemm1.weights.code)
        v2 = self.variant(gemm2.rows, gemm2.shape, gemm=2, code=gemm2.weights.code)
        if not (isinstance(v1, DecodeVariant) and isinstance(v2, DecodeVariant)) or v1.tile_rows != v2.tile_rows:
            return None
        if gemm2.workspace is None:
            return None
        tiles = _handoff_tiles(gemm2.rows, gemm2.shape.num_experts)
        counters = gemm2.workspace.view(torch.int32)[-2 * tiles:]
        return TileHandoff(counters[:tiles], counters[tiles:], gemm1.shape.n // v1.feature_block)

    def can_route(self, operands: GemmOperands) -> bool:
        """GEMM1 of a one-token bucket on the decode kernel, whose token row (2K bytes) fits the dynamic shared memory
        every CTA has without an opt-in (grouped_gemm's ``route``); MXINT4 weights with BF16 tokens only (the MXINT4
        form with NVFP4 tokens, which no op calls, spills 32 bytes of the register ring at 128 registers); MXFP8
        tokens (the MXFP4 pair's) on the pair's MXFP4 tiles only; never the row-major forms (natural token rows)."""
        code = operands.weights.code
        if code in _NATURAL_ROWS:  # these forms read natural token rows, not staged fragments
            return False
        variant = self.variant(operands.rows, operands.shape, gemm=1)
        route = operands.route
        mxfp8 = route is not None and route.tokens.dtype == torch.float8_e4m3fn
        if mxfp8 and code is not BlockCode.MXFP4:
            return False
        tokens_fit = code is BlockCode.NVFP4 or mxfp8 or route is not None and route.token_scales is None
        return (isinstance(variant, DecodeVariant) and tokens_fit
                and route_shared_mem(operands.shape.k) <= ROUTE_MAX_SHARED_MEM)

    def stages(self, layer: LayerStages) -> list[Stage]:
        """As the bucket's gemm1_fusion says. Gathering: the sort, GEMM1 gathering its rows through the routing (from
        the BF16 rows the op's stage decoded the NVFP4 tokens into) with the activation in its epilogue, GEMM2. Otherwise: the
        sort and the permute (in one launch for decode-sized buckets; for a one-token bucket folded into GEMM1 with
        the activation epilogue where the layer offers it), GEMM1 with the activation epilogue or GEMM1 and the
        activation, GEMM2; after a sort launch, GEMM1 with the epilogue and GEMM2 as one stage sharing a tile handoff
        (layer.gemm1_gemm2)."""
        fusion = layer.gemm1_fusion
        if fusion.gather:
            return [layer.sort(), layer.gemm1_activation(gather=True), layer.gemm2()]

        def tail() -> Stage:  # GEMM2, finalizing where the layer offers it
            return layer.gemm2_finalize() or layer.gemm2()

        routed_gemm1 = layer.gemm1_routed() if fusion.epilogue else None
        if routed_gemm1 is not None:
            return [routed_gemm1, tail()]
        routed = layer.sort_permute()
        head = [routed] if routed is not None else [layer.sort(), layer.permute()]
        if not fusion.epilogue:
            return [*head, layer.gemm1(), layer.activation(), tail()]
        pair = layer.gemm1_gemm2()
        return [*head, pair] if pair is not None else [*head, layer.gemm1_activation(gather=False), tail()]

    def variant(self, rows: int, shape: GemmShape, *, gemm: int, code: BlockCode = BlockCode.NVFP4) -> GemmVariant:
        """The kernel variant GEMM ``gemm`` (1 or 2) of a bucket with ``rows`` rows runs: on the wgmma kernel, GEMM1
        reads natural BF16 rows (what its gather reads; the permute writes them where it does not gather) and GEMM2
        the tiled planes the activation writes (one bulk copy per stage). BF16 weights take the decode variant's BF16
        form (low-latency buckets: at most 8 rows per expert on average, so always a decode variant); row-major NVFP4
        and MXFP4 weights the row-major form of the variant (natural token rows on the decode kernel; MXFP4: decode
        variants only, as BF16), GEMM1 on _SPLIT where the tiles take _WIDE (the epilogue's fusion is still decided on
        the tiles' CTA count: gemm1_fusion)."""
        variant = choose_variant(rows, shape, self.sm_count, gemm=gemm, dram_tbs=self.dram_tbs)
        if code is BlockCode.BF16:
            if not isinstance(variant, DecodeVariant):
                raise ValueError(f"BF16 weights run on the decode kernel only; {rows} rows over {shape.num_experts} "
                                 f"experts need {variant}")
            return _BF16
        if code is BlockCode.MXFP4_ROWS and not isinstance(variant, DecodeVariant):
            raise ValueError(f"row-major MXFP4 weights run on the decode kernel only; {rows} rows over "
                             f"{shape.num_experts} experts need {variant}")
        if code.row_major:
            variant = replace(_SPLIT if gemm == 1 and variant == _WIDE else variant, row_major=True)
        elif (code in (BlockCode.NVFP4, BlockCode.MXFP4) and gemm == 2 and variant == _WIDE
              and _past_waves(rows, shape, _WIDE, self.sm_count)):
            variant = _WIDE_MT4
        elif (code is BlockCode.NVFP4 and gemm == 1 and variant == _SPLIT
              and _past_waves(rows, shape, _WIDE, self.sm_count)
              and not _past_waves(rows, shape, _WIDE_ONE_WAVE, self.sm_count)):
            variant = _WIDE_ONE_WAVE
        return variant.gathering() if isinstance(variant, WgmmaVariant) and gemm == 1 else variant

    def token_layout_for(self, rows: int, shape: GemmShape, *, gemm: int,
                         code: BlockCode = BlockCode.NVFP4) -> TokenLayout:
        """Token fragments for the mma.sync kernels (natural rows for BF16 and row-major NVFP4 weights); natural rows
        (GEMM1) or the tiled planes (GEMM2) for wgmma."""
        return self.variant(rows, shape, gemm=gemm, code=code).token_layout

    def gemm(self, operands: GemmOperands) -> None:
        """GEMM ``operands.gemm`` on the variant ``_launch_variant`` picks for it, in the fused forms the operands
        hold."""
        w, gather, epilogue, finalize = operands.weights, operands.gather, operands.epilogue, operands.finalize
        route = operands.route
        variant = self._launch_variant(operands)
        tickets = None if finalize is None else operands.workspace.view(torch.int32)[: _tickets(operands.shape)]
        grouped_gemm(w.data, w.scales, w.alpha, operands.tokens.data if gather is None and route is None else None,
                     operands.offsets, operands.out if epilogue is None else None, variant,
                     alpha_split=w.alpha_split, gather=gather, epilogue=epilogue, finalize=finalize, tickets=tickets,
                     route=route, early=self._early(operands, variant), handoff=operands.handoff,
                     code=w.code, swap_halves=w.halves_swapped, sm_count=self.sm_count)

    def l2_warm(self, gemm1: GemmOperands) -> L2Warm | None:
        """GEMM1's weight tiles (NVFP4, MXFP4 or MXINT4 on a decode variant past one wave of CTAs, in a bucket of at
        most _HANDOFF_MAX_SLOTS slots or with K >= _L2_WARM_LONG_K), each row block's stream being K/64 tiles of codes
        and of scales: the first _L2_WARM_SHARE of every row block of the experts of its first wave of CTAs."""
        w, shape = gemm1.weights, gemm1.shape
        if w.code not in (BlockCode.NVFP4, BlockCode.MXFP4, BlockCode.MXINT4):
            return None
        if _slots(gemm1.rows, shape.num_experts) > _HANDOFF_MAX_SLOTS and shape.k < _L2_WARM_LONG_K:
            return None
        variant = self.variant(gemm1.rows, shape, gemm=1, code=w.code)
        variant = _WIDE if variant == _WIDE_ONE_WAVE else variant  # what _WIDE's first wave reads (as measured)
        if (not isinstance(variant, DecodeVariant) or variant.row_major or variant.bf16_weights
                or not _past_waves(gemm1.rows, shape, variant, self.sm_count)):
            return None
        tiles = shape.k // TILE_K
        tile_scale_bytes = 32 if w.code is BlockCode.MXFP4 else 64
        row_blocks, code_row, scale_row = shape.n // 16, tiles * CODE_CHUNK, tiles * tile_scale_bytes
        experts = min(shape.num_experts, SORT_MAX_EXPERTS,
                      max(1, decode_wave(variant, self.sm_count) // (shape.n // variant.feature_block)))
        code_bytes = min(code_row, int(_L2_WARM_SHARE * tiles) * CODE_CHUNK)
        if code_bytes == 0 or scale_row % LINE or not (w.data.is_contiguous() and w.scales.is_contiguous()):
            return None
        warm_tiles = code_bytes // CODE_CHUNK
        scale_bytes = min(scale_row, -(-warm_tiles * tile_scale_bytes // LINE) * LINE)
        return L2Warm(w.data.view(torch.uint8), w.scales.view(torch.uint8), row_blocks, code_row, scale_row,
                      code_bytes, scale_bytes, experts,
                      _L2_WARM_BLOCKS if self.dram_tbs >= _SLOW_DRAM_TBS else _L2_WARM_BLOCKS_SLOW_DRAM)

    def _launch_variant(self, operands: GemmOperands) -> GemmVariant:
        """The variant ``gemm`` launches for ``operands``: the bucket's (``variant``), _WIDE_MT4_SPLIT for _WIDE_MT4
        behind a tile handoff, persistent where ``persists`` says."""
        variant = self.variant(operands.rows, operands.shape, gemm=operands.gemm, code=operands.weights.code)
        if operands.handoff is not None and variant == _WIDE_MT4:
            return _WIDE_MT4_SPLIT
        return replace(variant, persist=_PERSIST_AHEAD) if self.persists(operands, variant) else variant

    def persists(self, operands: GemmOperands, variant: GemmVariant) -> bool:
        """Whether GEMM1 runs ``variant``'s persistent form (_PERSIST_AHEAD): behind a tile handoff, with its
        activation epilogue and no route, on NVFP4 or MXFP4 tiles, past _PERSIST_MIN_WAVES waves of its CTAs."""
        return (operands.gemm == 1 and operands.handoff is not None and operands.route is None
                and operands.epilogue is not None and isinstance(variant, DecodeVariant)
                and operands.weights.code in (BlockCode.NVFP4, BlockCode.MXFP4)
                and _past_waves(operands.rows, operands.shape, variant, self.sm_count, _PERSIST_MIN_WAVES))

    def _early(self, operands: GemmOperands, variant: GemmVariant) -> EarlyRouting | None:
        """operands.early where the decode kernel takes it, for its first wave of CTAs: on a call of at most
        _EARLY_MAX_TOKENS tokens (and no more than a tile's rows: every used expert holds one tile), NVFP4 or MXINT4
        weights in tiles (not the row-major forms, whose split-K SwiGLU forms would spill 56 bytes; the BF16 form has
        no early form); not with a route, nor on a GEMM2 that waits for its tiles (a handoff) instead of for GEMM1."""
        early = operands.early
        if (early is None or not isinstance(variant, DecodeVariant) or variant.bf16_weights or variant.row_major
                or operands.route is not None or operands.handoff is not None and operands.epilogue is None
                or early.ids.shape[0] > min(_EARLY_MAX_TOKENS, variant.tile_rows)):
            return None
        return replace(early, ctas=decode_wave(variant, self.sm_count))
