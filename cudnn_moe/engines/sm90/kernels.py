"""Launch wrappers of the SM90 kernels (kernels_cuda/sm90/): the grouped NVFP4 x BF16 GEMM over
ragged expert segments, in a decode and a prefill variant on ``mma.sync`` and a wgmma variant (sm_90a).
(The tokens enter in the layout the variant names, written by the permute and activation stages,
cudnn_moe.kernels: BF16 fragments for the mma.sync kernels, natural BF16 rows for wgmma.)

Every argument is checked on the host before anything is launched (ValueError naming it); work is
derived from device data only (``offsets``), the grid from capacities, so the launches are
CUDA-graph safe. Kernels go on torch's current stream.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from ...kernels.activate import check_activation_output
from ...kernels.codes import (
    SM90_ROWS_STEP_K,
    SORT_MAX_EXPERTS,
    SORT_WARP_SLOTS,
    IntermediateCode,
    RoutingFormat,
    TokenLayout,
)
from ...kernels.loader import ARCH_SPECIFIC, launch, ptr
from ...kernels.sort import check_staged_sort
from ...kernels.stage import routing_args
from ...validate import require_contiguous, require_shape, require_tensor
from ..base import (
    ActivationEpilogue, BlockCode, EarlyRouting, FinalizeEpilogue, RoutePrologue, RowGather, TileHandoff, TokenOperand,
)
from .layout import TILE_K

GEMM_SOURCE = "sm90/grouped_gemm.cu"
WGMMA_SOURCE = "sm90/wgmma_gemm.cu"
FEATURE_MULTIPLE = 128  # N % 128 == 0: every feature block divides it, or (256) overhangs N by 128 that the kernel skips
ROW_ALIGNMENT = 8  # segment starts (offsets) are multiples of 8
MAX_GRID_Y = 65535
# Threads of decode CTAs an SM holds at once: 128 registers a thread (what the decode variants use) in 64K.
DECODE_THREADS_PER_SM = 512

_MAX_DYNAMIC_SMEM = 227 * 1024  # per block on SM90
# A routed GEMM1 (grouped_gemm's ``route``) stages its token row in dynamic shared memory: at most what a launch gets
# without the opt-in attribute.
ROUTE_MAX_SHARED_MEM = 48 * 1024


def route_shared_mem(k: int) -> int:
    """Dynamic shared memory of a routed GEMM1 with K = k: the token row, k BF16 values."""
    return 2 * k


@dataclass(frozen=True)
class DecodeVariant:
    """``sm90_gemm_decode``: WM x WK warps (features x split-K), each MT m16 feature tiles x NT n8
    token tiles, weights prefetched PREFETCH k64 steps ahead in registers. Tiles of 8 NT rows,
    CTAs of 16 MT WM features. For segments of up to ~64 rows. bf16_weights: the form reading row-major
    BF16 weights in place (``-DSM90_W_BF16``), whose tokens are natural rows (BF16_ROWS) instead of fragments.
    row_major: the form reading NVFP4 (or, with -DSM90_W_MXFP4, MXFP4) weights in their canonical row-major layout in
    place (``-DSM90_W_ROWS``), whose tokens are natural rows too.
    persist: 1..prefetch for the persistent GEMM1 (``-DSM90_PERSIST``: a grid of the CTAs the SMs hold at once, each
    taking units a grid apart and issuing its next unit's first ``persist`` ring steps of weights before the unit's
    epilogue and tile signal); with the activation epilogue, on weight tiles, without a route. 0: one unit a CTA.
    min_blocks: CTAs an SM the launch bounds ask the register allocation for (``-DSM90_MIN_BLOCKS``), more than
    DECODE_THREADS_PER_SM threads give; 0: the kernel's own rule (DECODE_THREADS_PER_SM threads an SM, or no bound)."""

    mt: int = 1
    wm: int = 2
    wk: int = 4
    nt: int = 1
    prefetch: int = 4
    bf16_weights: bool = False
    row_major: bool = False
    persist: int = 0
    min_blocks: int = 0

    kernel = "sm90_gemm_decode"
    source = GEMM_SOURCE

    def __post_init__(self) -> None:
        if self.mt < 1 or self.wm < 1 or 16 * self.mt * self.wm not in (16, 32, 64, 128):
            raise ValueError(f"decode variant: 16 * MT * WM must be 16, 32, 64 or 128, got MT={self.mt}, WM={self.wm}")
        if self.wk < 1 or not 1 <= self.wm * self.wk <= 32:
            raise ValueError(f"decode variant: WM * WK must be 1..32 warps, got WM={self.wm}, WK={self.wk}")
        if not 1 <= self.nt <= 8 or not 1 <= self.prefetch <= 16:
            raise ValueError(f"decode variant: NT must be 1..8 and PREFETCH 1..16, got {self.nt}, {self.prefetch}")
        if self.wk * self.tile_rows * (self.feature_block + 4) * 4 > 48 * 1024:
            raise ValueError(f"decode variant {self}: the split-K buffer exceeds 48 KB of shared memory")
        if self.bf16_weights and self.row_major:
            raise ValueError(f"decode variant {self}: bf16_weights and row_major are two forms")
        if not 0 <= self.persist <= self.prefetch or self.persist and (self.bf16_weights or self.row_major):
            raise ValueError(f"decode variant {self}: persist must be 0..PREFETCH, and 0 with bf16_weights or "
                             f"row_major")
        if self.min_blocks and not DECODE_THREADS_PER_SM < self.min_blocks * self.threads <= 2048:
            raise ValueError(f"decode variant {self}: min_blocks CTAs of {self.threads} threads must be 0 or more than "
                             f"{DECODE_THREADS_PER_SM} threads and at most 2048")

    @property
    def token_layout(self) -> TokenLayout:
        return TokenLayout.BF16_ROWS if self.bf16_weights or self.row_major else TokenLayout.BF16_FRAGMENTS

    @property
    def tile_rows(self) -> int:
        return 8 * self.nt

    @property
    def feature_block(self) -> int:
        return 16 * self.mt * self.wm

    @property
    def alpha_block(self) -> int:
        """alpha_split must be a multiple of this many features (one alpha per CTA)."""
        return self.feature_block

    @property
    def threads(self) -> int:
        return 32 * self.wm * self.wk

    @property
    def shared_mem(self) -> int:
        return 0  # static shared memory only

    def options(self) -> tuple[str, ...]:
        return (f"-DSM90_MT={self.mt}", f"-DSM90_WM={self.wm}", f"-DSM90_WK={self.wk}", f"-DSM90_NT={self.nt}",
                f"-DSM90_PREFETCH={self.prefetch}", *(("-DSM90_W_BF16=1",) if self.bf16_weights else ()),
                *(("-DSM90_W_ROWS=1",) if self.row_major else ()),
                *((f"-DSM90_PERSIST={self.persist}",) if self.persist else ()),
                *((f"-DSM90_MIN_BLOCKS={self.min_blocks}",) if self.min_blocks else ()))

    def epilogue_problem(self, activation: Any, fp32_preactivation: bool = False) -> str | None:
        """Why this variant cannot run ``activation``'s epilogue (grouped_gemm.cu's static checks), or None.
        fp32_preactivation: the C tile holds FP32 values (MXINT4) instead of BF16."""
        outputs = self.feature_block // 2 if activation.gated else self.feature_block
        if activation.gated and self.wm % 2:
            return f"a gated activation epilogue pairs warps: WM must be even, got {self.wm}"
        if outputs % 32:
            return f"the activation epilogue needs units of 32 outputs per CTA, {self}: {outputs}"
        split_k = self.wk * self.tile_rows * (self.feature_block + 4) * 4
        c_tile = self.tile_rows * ((self.feature_block + 4) * 4 if fp32_preactivation else (self.feature_block + 8) * 2)
        if split_k + c_tile > 48 * 1024:
            return f"{self}: the split-K buffer and the C tile exceed 48 KB of shared memory"
        return None


@dataclass(frozen=True)
class PrefillVariant:
    """``sm90_gemm_prefill``: CTA tile ``feature_block`` features x ``tile_rows`` token rows, k64 per
    stage, STAGES-deep cp.async pipeline; warps of 32 features x 64 tokens (feature_block / 32 x
    tile_rows / 64 of them). For large segments.
    min_blocks: CTAs per SM the register allocation must allow (2 x 256 threads: at most 128 registers).
    stmatrix: stage the C tile with stmatrix.trans (False: 16-bit shared stores, a fallback).
    feature_block: 64, 128 or 256 (256: a last CTA past N, a multiple of 128 only, skips the rest).
    tile_rows: 64 or 128 (64 wastes fewer padding rows on segments of ~100-200 rows).
    adec: decode each k64 weight tile once per CTA into shared memory (one warp per m16 tile, one
    step ahead of the mma) instead of once per token warp; needs tile_rows 128 and >= 3 stages."""

    stages: int = 4
    min_blocks: int = 2
    stmatrix: bool = True
    feature_block: int = 128
    tile_rows: int = 128
    adec: bool = False

    kernel = "sm90_gemm_prefill"
    source = GEMM_SOURCE
    token_layout = TokenLayout.BF16_FRAGMENTS

    def __post_init__(self) -> None:
        if not 2 <= self.stages <= 8:
            raise ValueError(f"prefill variant: STAGES must be 2..8, got {self.stages}")
        if self.feature_block not in (64, 128, 256):
            raise ValueError(f"prefill variant: feature_block must be 64, 128 or 256, got {self.feature_block}")
        if self.tile_rows not in (64, 128):
            raise ValueError(f"prefill variant: tile_rows must be 64 or 128, got {self.tile_rows}")
        if not 1 <= self.min_blocks <= 4 or self.threads * self.min_blocks > 1024:
            raise ValueError(f"prefill variant: MIN_BLOCKS must be 1..4 with at most 1024 threads per SM, got "
                             f"{self.min_blocks} x {self.threads}")
        if self.adec and (self.tile_rows != 128 or self.stages < 3):
            raise ValueError(f"prefill variant: adec needs tile_rows 128 and >= 3 stages, got {self}")
        if self.shared_mem > _MAX_DYNAMIC_SMEM:
            raise ValueError(f"prefill variant {self}: {self.shared_mem} bytes of shared memory exceed the limit")

    @property
    def threads(self) -> int:
        return self.feature_block * self.tile_rows // 64

    @property
    def alpha_block(self) -> int:
        """alpha_split must be a multiple of this many features (one alpha per CTA)."""
        return self.feature_block

    @property
    def stage_bytes(self) -> int:
        return self.feature_block * 36 + self.tile_rows * 144  # grouped_gemm.cu PF_STAGE_BYTES

    @property
    def shared_mem(self) -> int:
        pipeline = self.stages * self.stage_bytes + int(self.adec) * 2 * self.feature_block * 128  # + PF_D_BYTES x 2
        return max(pipeline, self.tile_rows * (2 * self.feature_block + 16))  # PF_C_BYTES

    def epilogue_problem(self, activation: Any, fp32_preactivation: bool = False) -> str | None:
        """The mma.sync prefill kernel has no activation epilogue."""
        return "the mma.sync prefill kernel has no activation epilogue"

    def options(self) -> tuple[str, ...]:
        return (f"-DSM90_PF_STAGES={self.stages}", f"-DSM90_PF_MIN_BLOCKS={self.min_blocks}",
                f"-DSM90_PF_STMATRIX={int(self.stmatrix)}", f"-DSM90_PF_FB={self.feature_block}",
                f"-DSM90_PF_TB={self.tile_rows}", f"-DSM90_PF_ADEC={int(self.adec)}")


@dataclass(frozen=True)
class WgmmaVariant:
    """``sm90_gemm_wgmma`` (sm_90a): CTA tile 64 ``groups`` features x ``tile_rows`` token rows; each
    warpgroup owns 64 features and issues register-sourced ``wgmma.m64n<tile_rows>k16`` on the exactly
    decoded weights, with the tokens as the shared-memory B operand; k64 per stage through a ``stages``-deep
    ring (loads run stages - 2 ahead), up to four wgmma in flight per warpgroup. For large segments.
    groups: 2 (128 features, 256 threads) or 4 (256 features, 512 threads: half the token reads per MAC).
    min_blocks: CTAs per SM the register allocation must allow.
    tiled_tokens: the tokens in BF16_TILED planes, one bulk copy per stage issued by one thread (the second GEMM,
    whose tokens the activation writes); else natural BF16 rows copied by every thread with cp.async (what a
    gather reads: the first GEMM).
    row_major: NVFP4 weights in their canonical row-major layout, read in place (``-DSM90_WG_W_ROWS``); the
    values and the token layout are the tile form's."""

    tile_rows: int = 128
    groups: int = 4
    stages: int = 5
    min_blocks: int = 1
    tiled_tokens: bool = False
    row_major: bool = False

    kernel = "sm90_gemm_wgmma"
    source = WGMMA_SOURCE
    alpha_block = 16  # each warp applies its own features' alpha: alpha_split needs a multiple of 16 only

    def epilogue_problem(self, activation: Any, fp32_preactivation: bool = False) -> str | None:
        """Every activation epilogue of BF16 preactivations fits (the kernel's C tile is the pipeline's ring)."""
        return "the wgmma kernel keeps BF16 preactivations only" if fp32_preactivation else None

    def __post_init__(self) -> None:
        if self.tile_rows not in (64, 128):
            raise ValueError(f"wgmma variant: tile_rows must be 64 or 128, got {self.tile_rows}")
        if self.groups not in (2, 4):
            raise ValueError(f"wgmma variant: groups must be 2 or 4, got {self.groups}")
        if not 3 <= self.stages <= 8:
            raise ValueError(f"wgmma variant: STAGES must be 3..8, got {self.stages}")
        if not 1 <= self.min_blocks <= 4 or self.threads * self.min_blocks > 2048:
            raise ValueError(f"wgmma variant: MIN_BLOCKS must be 1..4 with at most 2048 threads per SM, got "
                             f"{self.min_blocks} x {self.threads}")
        if self.shared_mem > _MAX_DYNAMIC_SMEM:
            raise ValueError(f"wgmma variant {self}: {self.shared_mem} bytes of shared memory exceed the limit")

    @property
    def token_layout(self) -> TokenLayout:
        return TokenLayout.BF16_TILED if self.tiled_tokens else TokenLayout.BF16_ROWS

    def gathering(self) -> WgmmaVariant:
        """This variant reading natural rows, as a gather needs."""
        return replace(self, tiled_tokens=False)

    @property
    def feature_block(self) -> int:
        return 64 * self.groups

    @property
    def threads(self) -> int:
        return 128 * self.groups

    @property
    def stage_bytes(self) -> int:
        tiles = 4 * self.groups
        return -(-(self.tile_rows * 128 + tiles * (512 + 64)) // 1024) * 1024  # wgmma_gemm.cu WG_STAGE_BYTES

    @property
    def shared_mem(self) -> int:
        """wgmma_gemm.cu WG_SMEM_BYTES: the ring, or the epilogue's C tile (1024-byte rounded) and its image of up to
        feature_block / 64 tiled planes, plus 1024 to align."""
        c_tile = -(-self.tile_rows * (2 * self.feature_block + 16) // 1024) * 1024
        epilogue = c_tile + self.tile_rows * 128 * (self.feature_block // 64)
        return max(self.stages * self.stage_bytes, epilogue) + 1024

    def options(self) -> tuple[str, ...]:
        return (f"-DSM90_WG_TB={self.tile_rows}", f"-DSM90_WG_GROUPS={self.groups}", f"-DSM90_WG_STAGES={self.stages}",
                f"-DSM90_WG_MIN_BLOCKS={self.min_blocks}", f"-DSM90_WG_TILED_X={int(self.tiled_tokens)}",
                *(("-DSM90_WG_W_ROWS=1",) if self.row_major else ()), ARCH_SPECIFIC)


GemmVariant = DecodeVariant | PrefillVariant | WgmmaVariant
DECODE = DecodeVariant()
PREFILL = PrefillVariant()


def _tensor(name: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def _check(name: str, t: torch.Tensor, dtypes: tuple[torch.dtype, ...], shape: tuple[int, ...]) -> None:
    """The validation dialect of cudnn_moe.validate: TypeError for a dtype, ValueError for a shape or layout."""
    require_tensor(name, t, dtypes)
    require_shape(name, t, shape)
    require_contiguous(**{name: t})


def _check_device(named: dict[str, torch.Tensor], align: dict[str, int]) -> None:
    """Every tensor on one CUDA device, each aligned to align[name] bytes."""
    devices = {t.device for t in named.values()}
    for name, t in named.items():
        if not t.is_cuda:
            raise ValueError(f"{name} must be a CUDA tensor, got {t.device}")
    if len(devices) != 1:
        raise ValueError(f"all operands must be on one device, got {sorted(str(d) for d in devices)}")
    for name, t in named.items():
        if t.numel() and t.data_ptr() % align.get(name, 1):
            raise ValueError(f"{name} must be {align[name]}-byte aligned, got address {t.data_ptr():#x}")


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    a0, b0 = a.data_ptr(), b.data_ptr()
    a1, b1 = a0 + a.numel() * a.element_size(), b0 + b.numel() * b.element_size()
    return a0 < b1 and b0 < a1


def decode_wave(variant: DecodeVariant, sm_count: int) -> int:
    """CTAs of ``variant`` that ``sm_count`` SMs hold at once (min_blocks an SM, else DECODE_THREADS_PER_SM threads'
    worth): one wave."""
    return sm_count * (variant.min_blocks or DECODE_THREADS_PER_SM // variant.threads)


def gemm_grid(variant: GemmVariant, num_experts: int, n: int, row_capacity: int) -> tuple[int, int]:
    """(feature blocks, upper bound on tiles): non-empty segments hold >= 8 rows each, so at most
    min(E, R/8) of them, and sum ceil(len/TB) <= R/TB + that count. A feature block wider than 128
    may overhang N (a multiple of 128): the kernel skips the features past N."""
    tiles = min(num_experts, row_capacity // ROW_ALIGNMENT) + -(-row_capacity // variant.tile_rows)
    return -(-n // variant.feature_block), tiles


def grouped_gemm(
    w_tiles: torch.Tensor,
    w_tile_scales: torch.Tensor,
    alpha: torch.Tensor,
    x: torch.Tensor | None,
    offsets: torch.Tensor,
    out: torch.Tensor | None,
    variant: GemmVariant = DECODE,
    alpha_split: int | None = None,
    *,
    gather: RowGather | None = None,
    epilogue: ActivationEpilogue | None = None,
    finalize: FinalizeEpilogue | None = None,
    tickets: torch.Tensor | None = None,
    route: RoutePrologue | None = None,
    early: EarlyRouting | None = None,
    handoff: TileHandoff | None = None,
    code: BlockCode | None = None,
    swap_halves: bool = False,
    sm_count: int | None = None,
) -> None:
    """out[r, :N] = bf16(float32(alpha[e] * 256) * (x[r] @ W_e^T * 2^-8)) for the rows r of each segment e.
    With ``alpha_split`` (a multiple of ``variant.alpha_block``, below N) alpha is [2E] and
    features f >= alpha_split use alpha[E + e].

    w_tiles uint8 [E, N*K/2] and w_tile_scales uint8 (or float8_e4m3fn) [E, N*K/16]: NVFP4 weights in
    the fragment-tile layout (layout.pack_weight_tiles), or for a variant with ``row_major`` each expert's codes
    [N, K/2] and linear scales [N, K/16] as they are (K a multiple of SM90_ROWS_STEP_K on the decode kernel, whose sums then
    run in another k order: the same values up to FP32 rounding; bit for bit on wgmma); alpha float32 [E]; x bfloat16 [R, K] in
    ``variant.token_layout`` (token-fragment column order; natural rows or tiled planes for the wgmma variant);
    offsets int32 [E + 1] on the device (segment e = rows offsets[e]..offsets[e+1], each a multiple of 8,
    offsets[E] <= R); out bfloat16 [R, N], rows outside every segment untouched. N % 128 == 0, K % 64 == 0.

    The fused forms:
    gather (a WgmmaVariant): x is None and row r reads row gather.row_to_slot[r] // gather.top_k of
    gather.source (bfloat16 [B, K], natural rows), zeros for padding rows; R = gather.row_to_slot.numel().
    epilogue (a WgmmaVariant, or a DecodeVariant whose ``epilogue_problem`` is None): out is None;
    epilogue.out receives the activation stage's output for the segments' rows (cudnn_moe.kernels.activate_quantize
    of what out would hold, bit for bit). Gated activations need W's rows as [up; gate] (N / 2 each).
    finalize (a DecodeVariant, no epilogue): out as above, then finalize.out receives the finalize of out's rows
    (cudnn_moe.kernels.finalize, bit for bit), by the CTA of each feature block that finishes last; tickets int32
    [>= N / feature_block], zero before the launch (and after it).
    route (a DecodeVariant with an epilogue; x None): the op's stage and the routing sort of a one-token bucket in
    the kernel's prologue (RoutePrologue): every CTA sorts route.ids itself and reads the token row route.tokens (BF16,
    or NVFP4 decoded exactly, into its fragment order in shared memory: route_shared_mem bytes); R is
    route.sorted's row capacity; offsets must be route.sorted.offsets and epilogue.row_to_slot route.sorted.row_to_slot,
    which the launch writes (with the rest of the sort's outputs and route.ids_out / route.w_out) instead of reading.
    early (a DecodeVariant, no route, no handoff to wait for): before its dependency wait each of the launch's first
    early.ctas CTAs guesses its tile's expert from early.ids (the t-th local expert any slot routes to: right where
    every used expert holds one tile) and issues its first weight loads, so that they stream while the launch before
    it (the sort before GEMM1, the routed GEMM1 before GEMM2) runs; the results do not depend on it.
    handoff (a DecodeVariant, no route): with an epilogue (GEMM1), each CTA adds one to handoff.done[tile] once its
    rows of the tile are written; without (GEMM2, launched right behind that GEMM1), the launch does not wait for the
    launch before it to complete: each CTA waits until handoff.done[tile] holds handoff.producers (GEMM1's feature
    blocks), and the tile's last CTA zeroes handoff.done[tile] and handoff.passed[tile] (int32, at least the grid's
    tiles each, zero before GEMM1). Both GEMMs must cut the same tiles (the same tile rows), and everything GEMM2 reads
    but its tokens must have been written before GEMM1 passed its own dependency wait (the sort before GEMM1).
    A DecodeVariant with ``bf16_weights``: W_e is BF16, w_tiles bfloat16 [E, N*K] (each expert's [N, K] row-major,
    read in place), w_tile_scales ignored (any tensor), x in natural rows: out[r] = bf16(float32(alpha[e] * 256) *
    acc), acc the FP32 sum of x[r, k] W_e[f, k] (pass alpha = 1/256 for the plain sum); no route or early routing.
    sm_count (a DecodeVariant with ``persist``): the device's SMs; the launch then runs as many CTAs as they hold.
    swap_halves (DecodeVariant, WgmmaVariant): W's stored rows are [second half; first half] of N / 2 rows each
    (the aligned op's raw w1, [gate; up]); the kernel reads them as [first; second].
    code: what W holds. None takes it from the variant (BlockCode.BF16 for ``bf16_weights``, NVFP4_ROWS for
    ``row_major``, else NVFP4 tiles); given, it must agree with the variant.
    BlockCode.MXINT4 (a DecodeVariant): W_e is MXINT4 in the SM90 MXINT4 tiles (layout.pack_int4_weight_tiles: INT4 codes,
    w_tile_scales the BF16 scales per 32 k as bytes): out[r] = bf16(float32(alpha[e] * 256) * acc), acc the FP32
    sum over the k32 blocks b of fma(partial_b, scale_b, acc), partial_b the FP32 sum of the block's exact products
    int4 * x (pass alpha = 1/256 for the plain sum). With an epilogue it hands the activation float32(alpha * 256)
    * acc unrounded (the MXINT4 preactivation) and needs a BF16 layout and a BF16 intermediate.
    BlockCode.MXFP4 (a DecodeVariant): W_e is MXFP4 in its exact shifted form in the SM90 MXFP4 tiles
    (layout.pack_mxfp4_weight_tiles: the NVFP4 tiles' codes, w_tile_scales uint8 [E, N*K/32] one byte per k32 block),
    alpha its globals 2^a: the products, sums and output of the NVFP4 tiles of that form (E4M3 scales 2^(j - a)).
    BlockCode.MXFP4_ROWS (a row-major DecodeVariant): W_e is MXFP4 in its canonical layout read in place, codes [N, K/2]
    and E8M0 scales [N, K/32] as bytes, alpha its globals 2^a of the exact shifted form: each scale byte j + 127 becomes
    the multiplier 2^(j - a) in the kernel (the expert's a read off alpha), the products of the MXFP4 tiles of that form.
    """
    if not isinstance(variant, (DecodeVariant, PrefillVariant, WgmmaVariant)):
        raise ValueError(f"variant must be a DecodeVariant, PrefillVariant or WgmmaVariant, got {type(variant).__name__}")
    code = _weight_code(variant, code)
    bf16_weights = code is BlockCode.BF16
    mxint4 = code is BlockCode.MXINT4
    if bf16_weights and (route is not None or early is not None):
        raise ValueError(f"BF16 weights ({variant}) run without a route or early routing")
    if code.row_major and route is not None:
        raise ValueError(f"row-major weights ({variant}) run without a route")
    if swap_halves and isinstance(variant, PrefillVariant):
        raise ValueError(f"swap_halves needs a DecodeVariant or WgmmaVariant, got {variant}")
    if (code is BlockCode.MXINT4 or code.e8m0) and not isinstance(variant, DecodeVariant):
        raise ValueError(f"{code.name} weights run on a DecodeVariant, got {variant}")
    intermediate = None if epilogue is None else epilogue.intermediate
    if intermediate is IntermediateCode.MXFP8 and not isinstance(variant, DecodeVariant):
        raise ValueError(f"an MXFP8 intermediate (the MX pair's) is written by the decode kernel's epilogue only, not "
                         f"by {variant}")
    if mxint4 and epilogue is not None and (intermediate is not IntermediateCode.BF16 or not epilogue.out.layout.is_bf16):
        raise ValueError("MXINT4 weights take an activation epilogue writing BF16 rows of a BF16 intermediate only")
    if gather is not None and not isinstance(variant, WgmmaVariant):
        raise ValueError(f"a gather needs a WgmmaVariant, got {variant}")
    if gather is not None and variant.token_layout is TokenLayout.BF16_TILED:
        raise ValueError(f"a gather reads natural rows: use {variant.gathering()}, not {variant}")
    if epilogue is not None:
        problem = variant.epilogue_problem(epilogue.activation, fp32_preactivation=mxint4)
        if variant.token_layout is TokenLayout.BF16_TILED:
            problem = f"the epilogue runs on GEMM1, which reads natural rows ({variant.gathering()})"
        if problem is not None:
            raise ValueError(f"the activation epilogue needs a WgmmaVariant or a DecodeVariant that fits it, got "
                             f"{variant}: {problem}")
    if finalize is not None and (not isinstance(variant, DecodeVariant) or epilogue is not None):
        raise ValueError(f"a finalize needs a DecodeVariant and no activation epilogue, got {variant}"
                         f"{' with an epilogue' if epilogue is not None else ''}")
    if (tickets is None) != (finalize is None):
        raise ValueError("tickets go with a finalize, and only with one")
    if route is not None and (not isinstance(variant, DecodeVariant) or epilogue is None or x is not None):
        raise ValueError(f"a route needs a DecodeVariant, an activation epilogue and x None, got {variant}"
                         f"{'' if epilogue is not None else ' without an epilogue'}{'' if x is None else ' with x'}")
    awaits = handoff is not None and epilogue is None  # GEMM2 waiting for its tiles, not for the launch before
    if early is not None and (not isinstance(variant, DecodeVariant) or route is not None or awaits):
        raise ValueError(f"early routing needs a DecodeVariant, no route and no handoff to wait for, got {variant}"
                         f"{'' if route is None else ' with a route'}{' awaiting a handoff' if awaits else ''}")
    if handoff is not None and (not isinstance(variant, DecodeVariant) or route is not None):
        raise ValueError(f"a tile handoff needs a DecodeVariant and no route, got {variant}"
                         f"{'' if route is None else ' with a route'}")
    w_tiles = _tensor("w_tiles", w_tiles)
    w_tile_scales = _tensor("w_tile_scales", w_tile_scales)
    alpha, offsets = _tensor("alpha", alpha), _tensor("offsets", offsets)
    if route is not None:
        tokens = _tensor("route.tokens", route.tokens)
        if tokens.dtype == torch.float8_e4m3fn and code is not BlockCode.MXFP4:
            raise ValueError(f"route.tokens: a route stages MXFP8 tokens (the MXFP4 pair's) on MXFP4 tiles only, not "
                             f"on {code.value} weights")
    elif gather is None:
        x = tokens = _tensor("x", x)
    elif x is not None:
        raise ValueError("x must be None with a gather (the rows come from gather.source)")
    else:
        tokens = _tensor("gather.source", gather.source)
    if epilogue is None:
        out = _tensor("out", out)
    elif out is not None:
        raise ValueError("out must be None with an epilogue (epilogue.out receives the output)")
    if tokens.dim() != 2 or w_tiles.dim() != 2 or (out is not None and out.dim() != 2):
        raise ValueError(f"x (or gather.source), out and w_tiles must be 2-D, got {list(tokens.shape)}, "
                         f"{None if out is None else list(out.shape)}, {list(w_tiles.shape)}")
    route_code = None if route is None else _route_code(route)
    k = 2 * tokens.shape[1] if route_code == 2 else tokens.shape[1]  # NVFP4 tokens: two codes a byte
    experts = w_tiles.shape[0]
    if k <= 0 or k % TILE_K:
        raise ValueError(f"x: K = {k} must be a positive multiple of {TILE_K}")
    if isinstance(variant, DecodeVariant) and variant.row_major and k % SM90_ROWS_STEP_K:
        raise ValueError(f"x: K = {k} must be a multiple of {SM90_ROWS_STEP_K} for row-major weights on the decode "
                         "kernel")
    if experts < 1:
        raise ValueError("w_tiles: need at least one expert")
    n = _output_columns(out, epilogue)
    named = {"w_tiles": w_tiles, "w_tile_scales": w_tile_scales, "alpha": alpha, "offsets": offsets}
    align = {"w_tiles": 16, "w_tile_scales": 16, "alpha": 4, "offsets": 4}
    if route is not None:
        rows = _check_route(route, k, experts)
        named.update({"route.tokens": tokens, "route.ids": route.ids, "route.ids_out": route.ids_out,
                      "route.w_out": route.w_out})
        align.update({"route.tokens": 16, "route.ids": 4, "route.ids_out": 4, "route.w_out": 4})
        if offsets.data_ptr() != route.sorted.offsets.data_ptr() or (
                epilogue.row_to_slot.data_ptr() != route.sorted.row_to_slot.data_ptr()):
            raise ValueError("with a route, offsets and epilogue.row_to_slot must be route.sorted's (the launch writes "
                             "them)")
    elif gather is None:
        rows = tokens.shape[0]
        _check("x", tokens, (torch.bfloat16,), (rows, k))
        if rows % variant.token_layout.row_multiple:
            layout = variant.token_layout
            raise ValueError(f"x: {layout.name} rows come in groups of {layout.row_multiple}, got R = {rows}")
        named["x"], align["x"] = tokens, 16
    else:
        rows = _check_gather(gather, k)
        named.update({"gather.source": tokens, "gather.row_to_slot": gather.row_to_slot})
        align.update({"gather.source": 16, "gather.row_to_slot": 4})
    if out is not None:
        _check("out", out, (torch.bfloat16,), (rows, n))
        named["out"], align["out"] = out, 16
    if bf16_weights:
        _check("w_tiles", w_tiles, (torch.bfloat16,), (experts, n * k))
        w_tile_scales = w_tiles  # not read
        named["w_tile_scales"] = w_tiles
    else:
        _check("w_tiles", w_tiles, (torch.uint8,), (experts, n * k // 2))
        scale_bytes = n * k // (32 if code.e8m0 else 16)
        _check("w_tile_scales", w_tile_scales, (torch.uint8, torch.float8_e4m3fn), (experts, scale_bytes))
    split = n if alpha_split is None else alpha_split
    if alpha_split is not None and not (0 < split < n and split % variant.alpha_block == 0):
        raise ValueError(f"alpha_split must lie in (0, N = {n}) and be a multiple of {variant.alpha_block} (the "
                         f"variant applies alpha per {variant.alpha_block} features), got {alpha_split}")
    _check("alpha", alpha, (torch.float32,), (experts if alpha_split is None else 2 * experts,))
    _check("offsets", offsets, (torch.int32,), (experts + 1,))
    if early is not None:
        named["early.ids"], align["early.ids"] = _check_early(early, experts), 4
    if epilogue is not None:
        for name, (t, alignment) in _check_epilogue(epilogue, rows, n).items():
            named[name], align[name] = t, alignment
    grid = gemm_grid(variant, experts, n, rows)
    persistent = isinstance(variant, DecodeVariant) and variant.persist > 0
    if persistent:
        if epilogue is None or route is not None:
            raise ValueError(f"variant {variant}: the persistent form runs GEMM1 with an epilogue and without a route")
        if not isinstance(sm_count, int) or sm_count < 1:
            raise ValueError(f"sm_count must be the device's SM count for a persistent variant, got {sm_count!r}")
    if finalize is not None:
        for name, (t, alignment) in _check_finalize(finalize, _tensor("tickets", tickets), n, grid[0]).items():
            named[name], align[name] = t, alignment
    if handoff is not None:
        for name, (t, alignment) in _check_handoff(handoff, grid, epilogue is not None).items():
            named[name], align[name] = t, alignment
    if grid[1] > MAX_GRID_Y:
        raise ValueError(f"x: R = {rows} rows need up to {grid[1]} tiles of {variant.tile_rows} rows, more than the "
                         f"grid's {MAX_GRID_Y}; use a variant with larger tiles")
    if variant.shared_mem > _MAX_DYNAMIC_SMEM:
        raise ValueError(f"variant {variant} needs {variant.shared_mem} bytes of shared memory")
    _check_device(named, align)
    written = [t for name, t in named.items() if name == "out" or name.startswith("epilogue.out")]
    for name in ("x", "gather.source", "route.tokens"):
        if name in named and rows and any(_overlap(named[name], t) for t in written):
            raise ValueError(f"the output must not overlap {name}")
    if finalize is not None and any(_overlap(finalize.out, named[name]) for name in named if name != "finalize.out"):
        raise ValueError("finalize.out must not overlap the GEMM's other tensors")
    for counter in ("handoff.done", "handoff.passed"):
        if counter in named and any(_overlap(named[counter], t) for name, t in named.items() if name != counter):
            raise ValueError(f"{counter} must not overlap the GEMM's other tensors")
    if rows == 0:
        return
    args = (ptr(w_tiles, 16), ptr(w_tile_scales, 16), ptr(alpha, 4), ptr(None if route is not None else tokens, 16),
            ptr(offsets, 4), np.int32(experts), np.int32(n), np.int32(k), np.int32(rows), np.int32(split), ptr(out, 16))
    shared_mem = variant.shared_mem
    options = variant.options()
    if not isinstance(variant, PrefillVariant):
        args += (*_fused_args(gather, epilogue, tokens.shape[0]), np.int32(swap_halves))
        if epilogue is not None:
            options += epilogue_options(epilogue.activation)
    if isinstance(variant, DecodeVariant):
        args += _finalize_args(finalize, tickets)
        if finalize is not None:
            options += ("-DSM90_FINALIZE=1",)
        if mxint4:
            options += ("-DSM90_W_INT4=1",)
        if intermediate is IntermediateCode.MXFP8:
            options += ("-DSM90_ACT_MXFP8=1",)
        if code.e8m0:
            options += ("-DSM90_W_MXFP4=1",)
        if route is not None:
            args += _route_args(route)
            options += (f"-DSM90_ROUTE={route_code}",)
            shared_mem = route_shared_mem(k)
        if early is not None:
            args += _early_args(early)
            options += ("-DSM90_EARLY=1",)
        if handoff is not None:
            args += _handoff_args(handoff, signals=epilogue is not None)
            options += ("-DSM90_SIGNAL=1",) if epilogue is not None else ("-DSM90_AWAIT=1",)
    if persistent:  # the CTAs the SMs hold at once, a unit a grid apart
        grid = (min(grid[0] * grid[1], decode_wave(variant, sm_count)), 1)
    launch(variant.source, variant.kernel, tokens.device, grid, variant.threads, args,
           shared_mem=shared_mem, extra_options=options)


def _weight_code(variant: GemmVariant, code: BlockCode | None) -> BlockCode:
    """What W holds: ``code``, or None read from the variant's form (its first code); ValueError where they
    disagree. The row-major form reads NVFP4 or (decode variants) MXFP4 rows."""
    decode = isinstance(variant, DecodeVariant)
    forms: tuple[BlockCode, ...] = ()
    if decode and variant.bf16_weights:
        forms = (BlockCode.BF16,)
    elif not isinstance(variant, PrefillVariant) and variant.row_major:
        forms = (BlockCode.NVFP4_ROWS, BlockCode.MXFP4_ROWS) if decode else (BlockCode.NVFP4_ROWS,)
    if code is None:
        return forms[0] if forms else BlockCode.NVFP4
    if not isinstance(code, BlockCode):
        raise ValueError(f"code must be a BlockCode, got {code!r}")
    if forms and code not in forms or not forms and (code is BlockCode.BF16 or code.row_major):
        raise ValueError(f"{code.value} weights run on {'another form' if forms else 'a form'} of the variant, not "
                         f"on {variant}")
    return code


def epilogue_options(activation: Any) -> tuple[str, ...]:
    """The decode / wgmma module options that compile an activation epilogue in (its kind and gating)."""
    return f"-DSM90_ACT={int(activation.kind)}", f"-DSM90_ACT_GATED={int(activation.gated)}"


def _output_columns(out: torch.Tensor | None, epilogue: ActivationEpilogue | None) -> int:
    """N: out's columns, or with an epilogue the GEMM1 columns its output's values per row come from."""
    if out is not None:
        n = out.shape[1]
    else:
        operand = epilogue.out
        if not isinstance(operand, TokenOperand) or operand.data.dim() != 2:
            raise ValueError(f"epilogue.out must be a TokenOperand of 2-D rows, got {operand!r}")
        inter = operand.data.shape[1] * (1 if operand.layout.is_bf16 else 2)
        n = epilogue.activation.gemm1_columns(inter)
    if n <= 0 or n % FEATURE_MULTIPLE:
        raise ValueError(f"out: N = {n} must be a positive multiple of {FEATURE_MULTIPLE}")
    return n


def _check_gather(gather: RowGather, k: int) -> int:
    """Check a RowGather against K; returns R (the rows of row_to_slot)."""
    source, row_to_slot = gather.source, _tensor("gather.row_to_slot", gather.row_to_slot)
    _check("gather.source", source, (torch.bfloat16,), (source.shape[0], k))
    _check("gather.row_to_slot", row_to_slot, (torch.int32,), (row_to_slot.numel(),))
    if not isinstance(gather.top_k, int) or gather.top_k < 1:
        raise ValueError(f"gather.top_k must be a positive int, got {gather.top_k!r}")
    if source.numel() * 2 >= 1 << 32:
        raise ValueError(f"gather.source: {tuple(source.shape)} holds 4 GiB or more (the kernel's 32-bit row offsets)")
    return row_to_slot.numel()


def _check_epilogue(epilogue: ActivationEpilogue, rows: int, n: int) -> dict[str, tuple[torch.Tensor, int]]:
    """Check an ActivationEpilogue for R = rows and GEMM1's N; returns its device tensors by name, each with the
    byte alignment the kernel needs."""
    activation, operand = epilogue.activation, epilogue.out
    inter = n // 2 if activation.gated else n
    check_activation_output(_tensor("epilogue.out", operand.data), operand.scales, operand.layout, rows, inter,
                            epilogue.intermediate)
    row_to_slot = _tensor("epilogue.row_to_slot", epilogue.row_to_slot)
    _check("epilogue.row_to_slot", row_to_slot, (torch.int32,), (rows,))
    named = {"epilogue.out": (operand.data, 16 if operand.layout.is_bf16 else 8),
             "epilogue.row_to_slot": (row_to_slot, 4)}
    if operand.scales is not None and not operand.layout.is_bf16:
        named["epilogue.out_scales"] = (operand.scales, 1)
    return named


def _check_finalize(finalize: FinalizeEpilogue, tickets: torch.Tensor, n: int,
                    blocks: int) -> dict[str, tuple[torch.Tensor, int]]:
    """Check a FinalizeEpilogue for GEMM2's N and its ``blocks`` feature blocks (the tickets); returns its device
    tensors by name, each with the byte alignment the kernel needs."""
    out = _tensor("finalize.out", finalize.out)
    if out.dim() != 2:
        raise ValueError(f"finalize.out must be 2-D [T, N], got {tuple(out.shape)}")
    _check("finalize.out", out, (torch.bfloat16,), (out.shape[0], n))
    top_k = finalize.top_k
    if not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"finalize.top_k must be a positive int, got {top_k!r}")
    slots = out.shape[0] * top_k
    vectors = (("finalize.slot_to_row", finalize.slot_to_row, torch.int32, slots),
               ("finalize.weights", finalize.weights, torch.float32, slots), ("tickets", tickets, torch.int32, blocks))
    for name, t, dtype, need in vectors:
        t = _tensor(name, t)
        _check(name, t, (dtype,), (t.numel(),))
        if t.numel() < need:
            raise ValueError(f"{name}: need at least {need} elements ({out.shape[0]} tokens x top-{top_k} slots, or "
                             f"the launch's {blocks} feature blocks), got {t.numel()}")
    return {"finalize.out": (out, 16), "finalize.slot_to_row": (finalize.slot_to_row, 4),
            "finalize.weights": (finalize.weights, 4), "tickets": (tickets, 4)}


def _check_route(route: RoutePrologue, k: int, experts: int) -> int:
    """Check a RoutePrologue of K = k (its tokens' H) against the layer's experts; returns R (the sort's row
    capacity)."""
    if not isinstance(route.local_start, int) or not isinstance(route.align, int):
        raise ValueError(f"route.local_start and route.align must be ints, got {route.local_start!r}, {route.align!r}")
    _, _, slots, _ = check_staged_sort("route", route.tokens, route.token_scales, route.ids, route.weights,
                                    route.routing_format, route.ids_out, route.w_out, experts, route.align,
                                    route.sorted)
    if route.ids_out.shape[0] != 1 or slots > SORT_WARP_SLOTS:
        raise ValueError(f"a route sorts a one-token bucket of at most {SORT_WARP_SLOTS} slots, got "
                         f"route.ids_out {tuple(route.ids_out.shape)}")
    if route_shared_mem(k) > ROUTE_MAX_SHARED_MEM:
        raise ValueError(f"a route stages the token row in {route_shared_mem(k)} bytes of shared memory, more than "
                         f"{ROUTE_MAX_SHARED_MEM}")
    return route.sorted.row_capacity


def _route_code(route: RoutePrologue) -> int:
    """The decode kernel's SM90_ROUTE of a route's tokens: 1 BF16, 2 NVFP4 (two codes a byte), 3 MXFP8."""
    if route.token_scales is None:
        return 1
    return 3 if route.tokens.dtype == torch.float8_e4m3fn else 2


def _route_args(route: RoutePrologue) -> tuple:
    """The decode kernel's SM90_ROUTE arguments (after the finalize's)."""
    top_k = route.ids_out.shape[1]
    return (*routing_args(route.ids, route.weights, route.routing_format), np.int32(route.tokens.shape[0]),
            np.int32(route.ids_out.numel()), np.int32(top_k), np.int32(route.local_start), np.int32(route.align),
            ptr(route.tokens, 16), ptr(route.token_scales), ptr(route.ids_out), ptr(route.w_out),
            *route.sorted.pointers())


def _check_early(early: EarlyRouting, experts: int) -> torch.Tensor:
    """Check an EarlyRouting against the layer's experts; returns its ids tensor."""
    ids = _tensor("early.ids", early.ids)
    packed = early.routing_format == RoutingFormat.PACKED
    if early.routing_format not in tuple(RoutingFormat):
        raise ValueError(f"early.routing_format must be a RoutingFormat code, got {early.routing_format!r}")
    if ids.dim() != 2 or ids.dtype not in ((torch.int32,) if packed else (torch.int32, torch.int64)):
        raise ValueError(f"early.ids must be 2-D int32{'' if packed else ' or int64'} [T, top_k], got "
                         f"{ids.dtype} {list(ids.shape)}")
    require_contiguous(**{"early.ids": ids})
    if not isinstance(early.local_start, int) or early.local_start < 0:
        raise ValueError(f"early.local_start must be an int >= 0, got {early.local_start!r}")
    if not isinstance(early.ctas, int) or early.ctas < 0:
        raise ValueError(f"early.ctas must be an int >= 0, got {early.ctas!r}")
    if experts > SORT_MAX_EXPERTS:
        raise ValueError(f"early routing handles at most {SORT_MAX_EXPERTS} local experts, got {experts}")
    return ids


def _early_args(early: EarlyRouting) -> tuple:
    """The decode kernel's SM90_EARLY arguments (after the route's place; a route and early routing exclude each
    other)."""
    ids = early.ids
    return (ptr(ids, 4), np.int32(early.routing_format), np.int32(ids.dtype == torch.int64), np.int32(ids.numel()),
            np.int32(early.local_start), np.int32(early.ctas))


def _check_handoff(handoff: TileHandoff, grid: tuple[int, int], signals: bool) -> dict[str, tuple[torch.Tensor, int]]:
    """The handoff's counters, checked against the launch's grid (tiles; GEMM1: its CTAs per tile); grouped_gemm
    checks that they overlap nothing."""
    named = {}
    for name in ("done", "passed"):
        t = _tensor(f"handoff.{name}", getattr(handoff, name))
        _check(f"handoff.{name}", t, (torch.int32,), tuple(t.shape))  # dtype, contiguity
        if t.dim() != 1 or t.shape[0] < grid[1]:
            raise ValueError(f"handoff.{name} must be contiguous int32 [>= {grid[1]}] (a counter per tile), got "
                             f"{list(t.shape)}")
        named[f"handoff.{name}"] = (t, 4)
    if not isinstance(handoff.producers, int) or handoff.producers < 1 or (signals and handoff.producers != grid[0]):
        expected = f"this GEMM1's {grid[0]} feature blocks" if signals else "GEMM1's CTAs per tile, >= 1"
        raise ValueError(f"handoff.producers must be {expected}, got {handoff.producers!r}")
    return named


def _handoff_args(handoff: TileHandoff, signals: bool) -> tuple:
    """The decode kernel's DEC_HANDOFF_PARAMS: GEMM1's counter, or GEMM2's two and GEMM1's CTAs per tile."""
    if signals:
        return (ptr(handoff.done, 4),)
    return ptr(handoff.done, 4), ptr(handoff.passed, 4), np.int32(handoff.producers)


def _finalize_args(finalize: FinalizeEpilogue | None, tickets: torch.Tensor | None) -> tuple:
    """The decode kernel's finalize arguments (zeros / null without one)."""
    if finalize is None:
        return ptr(None), ptr(None), np.int32(0), np.int32(0), ptr(None), ptr(None)
    return (ptr(finalize.slot_to_row, 4), ptr(finalize.weights, 4), np.int32(finalize.top_k),
            np.int32(finalize.out.shape[0]), ptr(finalize.out, 16), ptr(tickets, 4))


def _fused_args(gather: RowGather | None, epilogue: ActivationEpilogue | None, source_rows: int) -> tuple:
    """The decode and wgmma kernels' arguments past out: the gather's, then the epilogue's (zeros / null when
    absent)."""
    row_to_slot = gather.row_to_slot if gather is not None else epilogue.row_to_slot if epilogue is not None else None
    if gather is not None and epilogue is not None and gather.row_to_slot.data_ptr() != epilogue.row_to_slot.data_ptr():
        raise ValueError("gather.row_to_slot and epilogue.row_to_slot must be one tensor (the sort's)")
    head = (ptr(row_to_slot, 4), np.int32(gather.top_k if gather is not None else 0),
            np.int32(source_rows if gather is not None else 0))
    if epilogue is None:
        return (*head, np.float32(0), np.float32(0), np.float32(0), np.int32(0), np.int32(0), ptr(None), ptr(None))
    a, b, limit = epilogue.activation.params()
    out = epilogue.out
    scales = out.scales if not out.layout.is_bf16 else None
    return (*head, np.float32(a), np.float32(b), np.float32(limit), np.int32(out.layout), np.int32(epilogue.intermediate),
            ptr(out.data, 16 if out.layout.is_bf16 else 8), ptr(scales))
