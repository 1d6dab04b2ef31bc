"""Sort: group routing slots by local expert into padded row segments (kernels_cuda/sort.cu), alone, or for decode
buckets in a BF16 token layout in one launch with the permute (kernels_cuda/permute.cu)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .codes import SORT_MAX_EXPERTS, SORT_THREADS, SORT_WARP_SLOTS, TokenLayout
from .l2_warm import L2Warm
from .loader import launch, ptr
from .permute import SOURCE as PERMUTE_SOURCE
from .permute import require_bf16_rows
from .stage import check_routing, routing_args

# Most blocks of one moe_sort_blocks launch. Every block counts all slot ids, so the grid is capped:
# up to SORT_MAX_BLOCKS * SORT_THREADS slots each block places one chunk of SORT_THREADS slots, beyond
# that each places several consecutive chunks.
SORT_MAX_BLOCKS = 128


def sort_grid(num_slots: int) -> tuple[int, int]:
    """(blocks, slots per block) of the sort of ``num_slots`` slots: (1, num_slots) up to SORT_THREADS slots
    (moe_sort, one block), else a grid of moe_sort_blocks with a multiple of SORT_THREADS slots per block."""
    chunks = -(-num_slots // SORT_THREADS)
    if chunks <= 1:
        return 1, num_slots
    per_block = -(-chunks // min(chunks, SORT_MAX_BLOCKS)) * SORT_THREADS
    return -(-num_slots // per_block), per_block


@dataclass(frozen=True)
class SortBuffers:
    """What the routing sort writes (int32 CUDA tensors), for B*k slots, E local experts and R rows: offsets
    [E + 1] segment starts (offsets[E] = rows used), slot_to_row [B*k] (-1 masked), row_to_slot [R] and row_expert
    [R] (every entry written: -1 for padding rows and rows past the end; row_expert is the segment's expert for
    padding rows inside a segment), counts [E] slots per local expert before padding. R = row_to_slot.numel()
    is the row capacity."""

    offsets: torch.Tensor
    slot_to_row: torch.Tensor
    row_to_slot: torch.Tensor
    row_expert: torch.Tensor
    counts: torch.Tensor

    @property
    def row_capacity(self) -> int:
        return self.row_to_slot.numel()

    def pointers(self) -> tuple[np.uint64, ...]:
        """The kernels' output arguments, in their order."""
        return ptr(self.offsets), ptr(self.slot_to_row), ptr(self.row_to_slot), ptr(self.row_expert), ptr(self.counts)


def sort_routing(ids_flat: torch.Tensor, top_k: int, local_start: int, num_local: int, align: int,
                 out: SortBuffers) -> None:
    """Group the B*k routing slots by local expert into segments padded to ``align`` rows, into ``out``.

    ids_flat int32 [B*k] (slot t*k+s); a slot is masked unless its id is in [local_start, local_start + num_local).
    Rows within a segment follow slot order. The row capacity R must cover the worst case
    roundup(B*k + min(num_local, B*k) * (align - 1), align); when it does not, offsets are clamped to R and
    slots past the end of their clamped segment are dropped (slot_to_row -1).
    One launch: up to SORT_THREADS slots one block (moe_sort), beyond that a grid of independent blocks
    (moe_sort_blocks, sort_grid) with the same outputs.
    """
    _check_operands(ids_flat, top_k, num_local, align, out)
    num_slots = ids_flat.numel()
    head = (ptr(ids_flat), np.int32(num_slots), np.int32(local_start), np.int32(num_local), np.int32(align),
            np.int32(out.row_capacity))
    tail = out.pointers()
    blocks, block_slots = sort_grid(num_slots)
    if blocks == 1:
        launch("sort.cu", "moe_sort", ids_flat.device, 1, SORT_THREADS, (*head, *tail))
    else:
        launch("sort.cu", "moe_sort_blocks", ids_flat.device, blocks, SORT_THREADS,
               (*head, np.int32(block_slots), *tail))


def _check_operands(ids_flat: torch.Tensor, top_k: int, num_local: int, align: int, out: SortBuffers) -> None:
    num_slots, row_capacity = ids_flat.numel(), out.row_capacity
    if not 1 <= num_local <= SORT_MAX_EXPERTS or align < 1 or top_k < 1 or num_slots % top_k:
        raise ValueError(
            f"sort needs 1 <= num_local <= {SORT_MAX_EXPERTS}, align >= 1 and top_k dividing the slot count; "
            f"got num_local={num_local}, align={align}, {num_slots} slots, top_k={top_k}"
        )
    if (ids_flat.dtype != torch.int32 or out.offsets.numel() != num_local + 1 or out.counts.numel() != num_local
            or out.row_expert.numel() != row_capacity or out.slot_to_row.numel() != num_slots):
        raise ValueError("sort operands: int32 ids, offsets [num_local + 1], counts [num_local], slot_to_row as "
                         "long as the ids, row_expert as long as row_to_slot")


SORT_PERMUTE_MAX_SLOTS = SORT_THREADS  # slots of a bucket whose sort and permute run in one launch
# Blocks of that launch (each sorts every slot itself): one per SORT_PERMUTE_BLOCK_PAIRS (slot, 32-column unit)
# pairs of the gather, a thread each (the decode of a unit is ALU-bound: spread over SMs, not packed into one), at
# most SORT_PERMUTE_MAX_BLOCKS (one wave on an H200's 132 SMs; pairs then strided over them).
SORT_PERMUTE_BLOCK_PAIRS = 256
SORT_PERMUTE_MAX_BLOCKS = 128


def sort_permute_blocks(num_slots: int, hidden: int) -> int:
    """Blocks of the sort + permute launch of ``num_slots`` slots of ``hidden`` columns."""
    pairs = num_slots * (hidden // 32)
    return max(1, min(-(-pairs // SORT_PERMUTE_BLOCK_PAIRS), SORT_PERMUTE_MAX_BLOCKS))


# The kernel of each token kind a sort + permute gathers, by the suffix its names carry (kernels_cuda/permute.cu).
_TOKEN_KERNELS = {"bf16": "_tokens", "nvfp4": "", "mxfp8": "_mxfp8"}


def _token_hidden(what: str, tokens: torch.Tensor, token_scales: torch.Tensor | None) -> tuple[int, str]:
    """(H, kind) of the tokens a sort + permute gathers: "bf16", bfloat16 [T, H] (``token_scales`` None); "nvfp4",
    codes uint8 [T, H/2] with 1-byte E4M3 scales [T, H/16]; or "mxfp8", E4M3 codes float8_e4m3fn [T, H] with 1-byte
    E8M0 scales [T, H/32]. ValueError naming ``what`` otherwise."""
    if token_scales is None:
        kind, hidden, scale_block = "bf16", tokens.shape[1], None
    elif tokens.dtype == torch.float8_e4m3fn:
        kind, hidden, scale_block = "mxfp8", tokens.shape[1], 32
    else:
        kind, hidden, scale_block = "nvfp4", 2 * tokens.shape[1], 16
    dtype = {"bf16": torch.bfloat16, "nvfp4": torch.uint8, "mxfp8": torch.float8_e4m3fn}[kind]
    if tokens.dtype != dtype or scale_block is not None and (
            token_scales.dtype.itemsize != 1 or tuple(token_scales.shape) != (tokens.shape[0], hidden // scale_block)):
        scales = "" if token_scales is None else f", scales {token_scales.dtype} {tuple(token_scales.shape)}"
        raise ValueError(f"{what}: BF16 tokens [T, H], uint8 NVFP4 codes [T, H/2] with 1-byte scales [T, H/16], or "
                         f"float8_e4m3fn MXFP8 codes [T, H] with 1-byte scales [T, H/32]; got "
                         f"{tokens.dtype} {tuple(tokens.shape)}{scales}")
    return hidden, kind


def sort_permute_bf16(
    ids_flat: torch.Tensor,
    top_k: int,
    local_start: int,
    num_local: int,
    align: int,
    out: SortBuffers,
    tokens: torch.Tensor,
    token_scales: torch.Tensor | None,
    xp: torch.Tensor,
    layout: TokenLayout = TokenLayout.BF16_FRAGMENTS,
) -> None:
    """``sort_routing`` and then the permute into BF16 token rows of the BF16 ``layout`` (``permute_tokens``,
    or ``permute_bf16_tokens``) in ONE launch, with the same outputs bit for bit;
    for at most SORT_PERMUTE_MAX_SLOTS slots. ``tokens``: bfloat16 [B, H] (``token_scales`` None), NVFP4
    codes uint8 [B, H/2] with linear E4M3 scales [B, H/16], or MXFP8 codes float8_e4m3fn [B, H] with E8M0 scales
    [B, H/32] (each element written as its BF16 value, exact for scales 2^-117 .. 2^119: IntermediateCode.MXFP8's
    rule); xp bfloat16 [R, H] (H % 64 == 0), 16-byte aligned.
    Each block sorts every slot itself in shared memory and block 0 writes the sort's outputs; the grid's threads
    share the (slot, unit) pairs of the gather, each loading its first unit before the sort
    (kernels_cuda/permute.cu moe_sort_permute_bf16*; sort_permute_blocks)."""
    _check_operands(ids_flat, top_k, num_local, align, out)
    num_slots = ids_flat.numel()
    if num_slots > SORT_PERMUTE_MAX_SLOTS:
        raise ValueError(f"sort + permute in one launch takes at most {SORT_PERMUTE_MAX_SLOTS} slots, got {num_slots}")
    hidden, kind = _token_hidden("sort + permute", tokens, token_scales)
    require_bf16_rows(xp, hidden, layout)
    blocks = sort_permute_blocks(num_slots, hidden)
    head = (ptr(ids_flat), np.int32(num_slots), np.int32(top_k), np.int32(local_start), np.int32(num_local),
            np.int32(align), np.int32(out.row_capacity), np.int32(hidden), np.int32(layout))
    tail = (*out.pointers(), ptr(xp, 16))
    sources = (ptr(tokens, 16),) if token_scales is None else (ptr(tokens, 16), ptr(token_scales))
    launch(PERMUTE_SOURCE, f"moe_sort_permute_bf16{_TOKEN_KERNELS[kind]}", tokens.device, blocks, SORT_THREADS,
           (*head, *sources, *tail))


def _warm_args(warm: L2Warm) -> tuple[np.generic, ...]:
    """The staged _warm kernels' warm_* parameters."""
    return (ptr(warm.codes), ptr(warm.scales), np.int64(warm.code_row), np.int64(warm.scale_row),
            np.int32(warm.row_blocks), np.int32(warm.code_bytes), np.int32(warm.scale_bytes), np.int32(warm.experts),
            np.int32(warm.blocks))


def check_staged_sort(what: str, tokens: torch.Tensor, token_scales: torch.Tensor | None, ids: torch.Tensor,
                      weights: torch.Tensor | None, routing_format: int, ids_out: torch.Tensor, w_out: torch.Tensor,
                      num_local: int, align: int, out: SortBuffers) -> tuple[int, str, int, int]:
    """Check the operands of a launch that stages the caller's routing and sorts it (stage_sort_permute_bf16, the SM90
    decode GEMM1's route): tokens as _token_hidden takes them, routing of T tokens (stage_inputs' formats) into
    ``ids_out`` int32 / ``w_out`` float32 [B, top_k] with T <= B, the sort's operands; returns (H, the tokens' kind,
    B * top_k, top_k). ValueError naming ``what`` or the operand otherwise."""
    hidden, kind = _token_hidden(what, tokens, token_scales)
    bucket, top_k = ids_out.shape
    check_routing(ids, weights, routing_format, tokens.shape[0], top_k, bucket)
    ids_flat = ids_out.view(-1)
    _check_operands(ids_flat, top_k, num_local, align, out)
    if w_out.dtype != torch.float32 or w_out.shape != ids_out.shape:
        raise ValueError(f"w_out must be float32 {tuple(ids_out.shape)}, got {w_out.dtype} {tuple(w_out.shape)}")
    return hidden, kind, ids_flat.numel(), top_k


def stage_sort_permute_bf16(
    tokens: torch.Tensor,
    token_scales: torch.Tensor | None,
    ids: torch.Tensor,
    weights: torch.Tensor | None,
    routing_format: int,
    ids_out: torch.Tensor,
    w_out: torch.Tensor,
    local_start: int,
    num_local: int,
    align: int,
    out: SortBuffers,
    xp: torch.Tensor,
    layout: TokenLayout = TokenLayout.BF16_FRAGMENTS,
    warm: L2Warm | None = None,
) -> None:
    """``stage_inputs`` (its routing half) and ``sort_permute_bf16`` of a bucket of B tokens in ONE launch, with the
    same outputs bit for bit, from the caller's tensors: ``tokens`` of a kind sort_permute_bf16 takes, 16-byte
    aligned, T <= B; routing ``ids`` / ``weights`` in ``routing_format`` (stage_inputs' formats). ``ids_out`` int32 [B, top_k] and ``w_out`` float32
    [B, top_k] receive the decoded routing (-1 / 0 past T), the sort's outputs and ``xp`` what sort_permute_bf16
    writes for the B * top_k slots; the bucket's token buffers are not needed (kernels_cuda/permute.cu
    moe_stage_sort_permute_bf16*). With ``warm``, the kernel's _warm form: ``warm.blocks`` more blocks warm L2 with the
    next GEMM's first weight bytes (cudnn_moe.kernels.l2_warm)."""
    num_tokens = tokens.shape[0]
    hidden, kind, num_slots, top_k = check_staged_sort("stage + sort + permute", tokens, token_scales, ids,
                                                       weights, routing_format, ids_out, w_out, num_local, align,
                                                       out)
    if num_slots > SORT_PERMUTE_MAX_SLOTS:
        raise ValueError(f"stage + sort + permute in one launch takes at most {SORT_PERMUTE_MAX_SLOTS} slots, "
                         f"got {num_slots}")
    require_bf16_rows(xp, hidden, layout)
    head = (*routing_args(ids, weights, routing_format), np.int32(num_tokens), np.int32(num_slots), np.int32(top_k),
            np.int32(local_start), np.int32(num_local), np.int32(align), np.int32(out.row_capacity),
            np.int32(hidden), np.int32(layout))
    tail = (ptr(ids_out), ptr(w_out), *out.pointers(), ptr(xp, 16))
    name = f"moe_stage_sort_permute_bf16{_TOKEN_KERNELS[kind]}"
    sources = (ptr(tokens, 16),) if token_scales is None else (ptr(tokens, 16), ptr(token_scales))
    if num_slots <= SORT_WARP_SLOTS:
        name += "_warp"
    blocks = sort_permute_blocks(num_slots, hidden)
    if warm is not None:  # the _warm kernel: warm.blocks more blocks, and what they warm
        name, blocks, tail = name + "_warm", blocks + warm.blocks, (*tail, *_warm_args(warm))
    launch(PERMUTE_SOURCE, name, tokens.device, blocks, SORT_THREADS, (*head, *sources, *tail),
           shared_mem=4 * num_slots)
