"""GPU equivalence of the rewritten glue kernels with the kernels they replaced, bit for bit.

The previous kernels (sort.cu, finalize.cu and sm90/tokens.cu as of commit 8e4b6dd, renamed ref_*) are
compiled from the copy below and run on the same inputs as the current ones, on poisoned output buffers,
so a differing value, a missing write and a stray write all show. Covers the multi-block sort (1 .. 40000
slots, 1 .. 512 experts, align 8 / 128, local ranges, capacity clamping, forced small blocks, unaligned
ids), the token-major BF16 permute (against the per-slot kernels, NaN scale bytes, masked slots and
tokens) and the finalize (top_k 1 .. 10). The activation kernel is not compared here: its FP32
arithmetic may contract differently from the old one (one FP32 unit, which can move an NVFP4 code at a
tie); tests/test_kernels_gpu.py checks it against torch with a tie allowance."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from cudnn_moe import kernels
from cudnn_moe.pipeline.executor import row_capacity
from cudnn_moe.kernels import SORT_THREADS, TokenLayout
from cudnn_moe.kernels.sort import sort_grid
from test_kernels_gpu import sort_reference

pytestmark = pytest.mark.gpu

DEV = torch.device("cuda")
POISON_INT = -7
POISON_BYTE = 0xA5

# The kernels before the rewrite (verbatim but for the ref_ names; each file in its own namespace).
REFERENCE_SOURCE = r"""
#include "common.cuh"
using namespace moe;

namespace ref_sort {
// Deterministic counting sort of routing slots into padded per-expert row segments.

// SORT_THREADS and SORT_MAX_EXPERTS come from cudnn_moe.kernels.codes.
#define SORT_WARPS (SORT_THREADS / 32)

// Local expert of an id, or -1 when it lies outside [local_start, local_start + num_experts).
// The subtraction wraps in unsigned arithmetic, so ids below local_start become huge.
__device__ __forceinline__ int local_expert(int id, int local_start, int num_experts) {
  const u32 e = static_cast<u32>(id) - static_cast<u32>(local_start);
  return e < static_cast<u32>(num_experts) ? static_cast<int>(e) : -1;
}

// Exclusive prefix sum of one value per thread over the SORT_THREADS threads of the block.
// `scratch` is shared memory of SORT_WARPS + 1 ints; the block total ends up in scratch[SORT_WARPS].
__device__ int block_exclusive_scan(int v, int* scratch) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  int inc = v;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int n = __shfl_up_sync(0xFFFFFFFFu, inc, d);
    if (lane >= d) inc += n;
  }
  if (lane == 31) scratch[warp] = inc;
  __syncthreads();
  if (warp == 0) {
    const int w = scratch[lane];
    int winc = w;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int n = __shfl_up_sync(0xFFFFFFFFu, winc, d);
      if (lane >= d) winc += n;
    }
    scratch[lane] = winc - w;
    if (lane == 31) scratch[SORT_WARPS] = winc;
  }
  __syncthreads();
  return scratch[warp] + inc - v;
}

// Segment e with seg[e] <= r < seg[e + 1], for 0 <= r < seg[num_experts].
__device__ __forceinline__ int segment_of(const int* seg, int num_experts, int r) {
  int lo = 0, hi = num_experts;
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (seg[mid] <= r) lo = mid;
    else hi = mid;
  }
  return lo;
}

// Launch with ONE block of SORT_THREADS threads.
//   ids         int32 [num_slots]        expert id of slot t * top_k + s
//   offsets     int32 [num_experts + 1]  segment starts; each count rounded up to `align`;
//                                        offsets[num_experts] = total rows used
//   slot_to_row int32 [num_slots]        row of each slot, -1 when masked
//   row_to_slot int32 [row_capacity]     slot of each row, -1 for padding rows and rows >= total
//   row_expert  int32 [row_capacity]     local expert of the segment holding the row, -1 for rows >= total
//   counts      int32 [num_experts]      slots routed to each local expert (before padding)
// Inside a segment, rows follow slot order. Requires 1 <= num_experts <= SORT_MAX_EXPERTS and align >= 1.
// The caller sizes row_capacity for the worst case; should it still be short, offsets are clamped to it and
// slots that would land past the end of their clamped segment are dropped (slot_to_row = -1).
extern "C" __global__ void __launch_bounds__(SORT_THREADS)
    ref_moe_sort(const int* __restrict__ ids, int num_slots, int local_start, int num_experts, int align,
             int row_capacity, int* __restrict__ offsets, int* __restrict__ slot_to_row,
             int* __restrict__ row_to_slot, int* __restrict__ row_expert, int* __restrict__ counts) {
  __shared__ int count[SORT_MAX_EXPERTS];     // histogram, then next free row of each segment
  __shared__ int seg[SORT_MAX_EXPERTS + 1];   // clamped segment starts
  __shared__ u16 warp_count[SORT_WARPS][SORT_MAX_EXPERTS];  // slots per (warp, expert) in the current chunk
  __shared__ int scratch[SORT_WARPS + 1];
  if (blockDim.x != SORT_THREADS || num_experts < 1 || num_experts > SORT_MAX_EXPERTS || align < 1) return;
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;

  // Pass 1: histogram.
  for (int e = tid; e < num_experts; e += SORT_THREADS) count[e] = 0;
  for (int i = tid; i < SORT_WARPS * SORT_MAX_EXPERTS; i += SORT_THREADS) (&warp_count[0][0])[i] = 0;
  __syncthreads();
  for (int i = tid; i < num_slots; i += SORT_THREADS) {
    const int e = local_expert(ids[i], local_start, num_experts);
    if (e >= 0) atomicAdd(&count[e], 1);
  }
  __syncthreads();

  // Padded exclusive scan (num_experts <= SORT_THREADS, one expert per thread).
  const int padded = tid < num_experts ? (count[tid] + align - 1) / align * align : 0;
  const int start = block_exclusive_scan(padded, scratch);
  if (tid < num_experts) {
    counts[tid] = count[tid];
    seg[tid] = min(start, row_capacity);
    count[tid] = seg[tid];
  }
  if (tid == 0) seg[num_experts] = min(scratch[SORT_WARPS], row_capacity);
  __syncthreads();
  const int total = seg[num_experts];
  for (int e = tid; e <= num_experts; e += SORT_THREADS) offsets[e] = seg[e];
  for (int r = tid; r < row_capacity; r += SORT_THREADS) {
    row_to_slot[r] = -1;
    row_expert[r] = r < total ? segment_of(seg, num_experts, r) : -1;
  }
  __syncthreads();  // the -1 fill above must land before the scatter below

  // Pass 2: chunks of SORT_THREADS slots in order. A slot's row is its segment's next free row plus the
  // number of earlier slots of the same expert in the chunk: those in earlier warps (warp_count) and
  // those in lower lanes of its own warp (match mask).
  const u32 lower_lanes = (1u << lane) - 1u;
  for (int base = 0; base < num_slots; base += SORT_THREADS) {
    const int i = base + tid;
    const int e = i < num_slots ? local_expert(ids[i], local_start, num_experts) : -1;
    const u32 peers = __match_any_sync(0xFFFFFFFFu, e);
    const int rank = __popc(peers & lower_lanes);
    const bool leader = e >= 0 && rank == 0;
    if (leader) warp_count[warp][e] = static_cast<u16>(__popc(peers));
    __syncthreads();
    if (i < num_slots) {
      int row = -1;
      if (e >= 0) {
        row = count[e] + rank;
        for (int w = 0; w < warp; ++w) row += warp_count[w][e];
        if (row < seg[e + 1]) row_to_slot[row] = i;
        else row = -1;
      }
      slot_to_row[i] = row;
    }
    __syncthreads();
    if (leader) {
      warp_count[warp][e] = 0;
      atomicAdd(&count[e], __popc(peers));  // leaders of several warps may share e
    }
    __syncthreads();
  }
}
}  // namespace ref_sort

namespace ref_finalize {
// Combine the second GEMM's expert rows back into token order.

// One block per token t < B; each thread handles 8 consecutive hidden columns.
//   g2          BF16 [row_capacity, hidden]: the second GEMM's rows, expert global already applied;
//               16-byte aligned, hidden % 8 == 0
//   slot_to_row int32 [B * top_k]; weights FP32 [B * top_k]
//   out         BF16 [B, hidden]: out[t, h] = bf16(sum over slots s in order, skipping masked ones,
//               of w[t, s] * float(g2[r, h])): a separate FP32 multiply and add per slot
extern "C" __global__ void ref_moe_finalize(const u16* __restrict__ g2, const int* __restrict__ slot_to_row,
                                        const float* __restrict__ weights, int top_k, int hidden,
                                        u16* __restrict__ out) {
  const i64 t = blockIdx.x;
  for (int h = 8 * threadIdx.x; h < hidden; h += 8 * blockDim.x) {
    float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    for (int s = 0; s < top_k; ++s) {
      const i64 i = t * top_k + s;
      const int r = slot_to_row[i];
      if (r < 0) continue;
      const float w = weights[i];
      float v[8];
      load_bf16x8(g2 + static_cast<i64>(r) * hidden + h, v);
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[j] = __fadd_rn(acc[j], __fmul_rn(w, v[j]));
    }
    store_bf16x8(out + t * hidden + h, acc);
  }
}
}  // namespace ref_finalize

namespace ref_tokens {
// Gather NVFP4 tokens into expert-sorted rows of exact BF16 values in the SM90 token-fragment order
// (cudnn_moe/engines/sm90/layout.py): inside each block of 64 columns, position 16q + 4s + 2b + e
// holds k = 16s + 8b + 2q + e.

// One block per routing slot (grid = num_slots = B * top_k); slot i belongs to token t = i / top_k.
//   xs          uint8 [B, H/2]        packed E2M1 (element 2i in the low nibble)
//   xss         uint8 [B, H/16]       E4M3 scales, linear
//   slot_to_row int32 [num_slots]     destination row, -1 when the slot is masked (nothing written)
//   xp          bf16 [rows, H]        row r = slot_to_row[i] gets E2M1 value x E4M3 scale, exact
//                                     (a NaN scale byte 0x7F / 0xFF gives NaN values)
// Requires H % 64 == 0, xs and xp 16-byte aligned. Thread c of the row writes the 16-byte piece c
// (positions 8c .. 8c + 7): k64 block j = c / 8, q = (c % 8) / 2, h = c % 2; its element 2w + e
// (w = 2s' + b) is k = 32h + 16s' + 8b + 2q + e, i.e. nibble e of byte q of word w of the 16 bytes
// at 32j + 16h of the packed row, scale byte 4j + 2h + s'.
extern "C" __global__ void ref_sm90_permute_decode(const u8* __restrict__ xs, const u8* __restrict__ xss,
                                               const int* __restrict__ slot_to_row, int top_k, int hidden,
                                               u16* __restrict__ xp) {
  const int r = slot_to_row[blockIdx.x];
  if (r < 0) return;
  const i64 t = blockIdx.x / top_k;
  const u8* codes = xs + t * (hidden / 2);
  const u8* scales = xss + t * (hidden / 16);
  u16* dst = xp + static_cast<i64>(r) * hidden;
  for (int c = threadIdx.x; c < hidden / 8; c += blockDim.x) {
    const int j = c >> 3;
    const int q = (c >> 1) & 3;
    const int h = c & 1;
    const uint4 packed = *reinterpret_cast<const uint4*>(codes + 32 * j + 16 * h);
    const float s0 = e4m3_to_float(scales[4 * j + 2 * h]);
    const float s1 = e4m3_to_float(scales[4 * j + 2 * h + 1]);
    const u32 words[4] = {packed.x, packed.y, packed.z, packed.w};
    u32 out[4];
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const u32 byte = (words[w] >> (8 * q)) & 0xFFu;
      const float s = w < 2 ? s0 : s1;
      // Each product is exact in FP32 and in BF16, so the rounding below changes nothing.
      const float lo = e2m1_to_float(static_cast<u8>(byte & 0xFu)) * s;
      const float hi = e2m1_to_float(static_cast<u8>(byte >> 4)) * s;
      out[w] = static_cast<u32>(float_to_bf16(lo)) | (static_cast<u32>(float_to_bf16(hi)) << 16);
    }
    uint4 v;
    v.x = out[0];
    v.y = out[1];
    v.z = out[2];
    v.w = out[3];
    *reinterpret_cast<uint4*>(dst + 8 * c) = v;
  }
}
}  // namespace ref_tokens
"""


@pytest.fixture(scope="module")
def reference() -> Callable[[str, tuple[int, ...], int, tuple], None]:
    """Runs kernel ``name`` of REFERENCE_SOURCE with grid and block, and waits for it."""
    import cupy

    module = cupy.RawModule(code=REFERENCE_SOURCE, options=kernels.compile_options())

    def run(name: str, grid: tuple[int, ...], block: int, args: tuple) -> None:
        torch.cuda.synchronize()
        if min(grid) > 0:
            with cupy.cuda.Device(torch.cuda.current_device()):
                module.get_function(name)(grid, (block,), args)
                cupy.cuda.Device().synchronize()

    return run


def _ptr(t: torch.Tensor | None) -> np.uint64:
    return np.uint64(0 if t is None else t.data_ptr())


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _same_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, what
    g, w = got.contiguous().view(torch.uint8).cpu(), want.contiguous().view(torch.uint8).cpu()
    if not torch.equal(g, w):
        bad = (g != w).nonzero()
        raise AssertionError(f"{what}: {bad.shape[0]} bytes differ, first at byte {bad[0].tolist()}")


# ---------------------------------------------------------------------------------------------------------------
# sort
# ---------------------------------------------------------------------------------------------------------------

SORT_OUTPUTS = ("offsets", "slot_to_row", "row_to_slot", "row_expert", "counts")


def _sort_ids(slots: int, local_start: int, experts: int, seed: int, hot: bool) -> torch.Tensor:
    ids = torch.randint(local_start - 3, local_start + experts + 3, (slots,), generator=_gen(seed))
    if hot:  # most slots on one expert: long segments, clamping bites there
        ids = torch.where(torch.rand(slots, generator=_gen(seed + 1)) < 0.8, torch.full_like(ids, local_start), ids)
    return ids.to(torch.int32).to(DEV)


def _sort_buffers(slots: int, experts: int, capacity: int) -> dict[str, torch.Tensor]:
    sizes = {"offsets": experts + 1, "slot_to_row": slots, "row_to_slot": capacity, "row_expert": capacity,
             "counts": experts}
    return {name: torch.full((n,), POISON_INT, dtype=torch.int32, device=DEV) for name, n in sizes.items()}


def _reference_sort(reference, ids: torch.Tensor, local_start: int, experts: int, align: int, capacity: int):
    out = _sort_buffers(ids.numel(), experts, capacity)
    reference("ref_moe_sort", (1,), SORT_THREADS, (
        _ptr(ids), np.int32(ids.numel()), np.int32(local_start), np.int32(experts), np.int32(align),
        np.int32(capacity), *(_ptr(out[name]) for name in SORT_OUTPUTS)))
    return out


def _launch_sort(name: str, grid: int, ids: torch.Tensor, local_start: int, experts: int, align: int,
                 capacity: int, block_slots: int | None = None) -> dict[str, torch.Tensor]:
    out = _sort_buffers(ids.numel(), experts, capacity)
    extra = () if block_slots is None else (np.int32(block_slots),)
    kernels.launch("sort.cu", name, DEV, grid, SORT_THREADS, (
        kernels.ptr(ids), np.int32(ids.numel()), np.int32(local_start), np.int32(experts), np.int32(align),
        np.int32(capacity), *extra, *(kernels.ptr(out[n]) for n in SORT_OUTPUTS)))
    torch.cuda.synchronize()
    return out


SORT_SIZES = [1, 7, 64, 1023, 1024, 1025, 2051, 4096, 8191, 12288, 32768, 40000]
SORT_EXPERTS = [1, 2, 128, 256, 512]


def _sort_cases() -> list[tuple[int, int, int, int, str, bool]]:
    """(slots, experts, align, local_start, capacity kind, hot) over sizes x experts, varying the rest."""
    cases = []
    for i, slots in enumerate(SORT_SIZES):
        for j, experts in enumerate(SORT_EXPERTS):
            align = (8, 128)[(i + j) % 2]
            local_start = (0, 5, 100)[(i + 2 * j) % 3]
            capacity = ("full", "full", "half", "tiny")[(i + j) % 4]
            cases.append((slots, experts, align, local_start, capacity, (i * j) % 3 == 1))
    return cases


def _capacity(kind: str, slots: int, experts: int, align: int) -> int:
    full = row_capacity(slots, 1, experts, align)
    return {"full": full, "half": full // 2, "tiny": min(full, 24)}[kind]


@pytest.mark.parametrize("case", _sort_cases(), ids=lambda c: "-".join(map(str, c)))
def test_sort_matches_single_block_reference(reference, case) -> None:
    """sort_routing (one block or a grid) equals the previous single-block kernel, clamping included."""
    slots, experts, align, local_start, capacity_kind, hot = case
    capacity = _capacity(capacity_kind, slots, experts, align)
    ids = _sort_ids(slots, local_start, experts, seed=slots + experts, hot=hot)
    want = _reference_sort(reference, ids, local_start, experts, align, capacity)
    got = _sort_buffers(slots, experts, capacity)
    for _ in range(2):  # a second run over the first's outputs gives the same result
        kernels.sort_routing(ids, 1, local_start, experts, align, *got.values())
        torch.cuda.synchronize()
        for name in SORT_OUTPUTS:
            _same_bits(got[name], want[name], f"{name} ({sort_grid(slots)[0]} blocks)")
    if capacity_kind == "full" and slots <= 4096:
        ref = sort_reference(ids.tolist(), local_start, experts, align, capacity).tensors()
        for name in SORT_OUTPUTS:
            _same_bits(got[name], ref[name], f"{name} vs the Python statement")


@pytest.mark.parametrize("slots", [1025, 5000, 40000])
@pytest.mark.parametrize("chunks_per_block", [1, 2, 7])
def test_sort_blocks_any_block_size(reference, slots: int, chunks_per_block: int) -> None:
    """moe_sort_blocks with several chunks per block, and moe_sort (one block) on many slots, equal the reference."""
    experts, align, local_start = 64, 8, 3
    capacity = row_capacity(slots, 1, experts, align)
    ids = _sort_ids(slots, local_start, experts, seed=slots, hot=False)
    want = _reference_sort(reference, ids, local_start, experts, align, capacity)
    block_slots = chunks_per_block * SORT_THREADS
    grids = {
        "blocks": _launch_sort("moe_sort_blocks", -(-slots // block_slots), ids, local_start, experts, align,
                               capacity, block_slots),
        "single": _launch_sort("moe_sort", 1, ids, local_start, experts, align, capacity),
    }
    for label, got in grids.items():
        for name in SORT_OUTPUTS:
            _same_bits(got[name], want[name], f"{label} {name}")


def test_sort_unaligned_ids(reference) -> None:
    """ids not 16-byte aligned (the kernel counts them one by one) give the same result."""
    slots, experts, align = 9001, 32, 128
    base = _sort_ids(slots + 1, 0, experts, seed=5, hot=False)
    ids = base[1:]  # 4-byte offset
    capacity = row_capacity(slots, 1, experts, align)
    want = _reference_sort(reference, ids, 0, experts, align, capacity)
    got = _sort_buffers(slots, experts, capacity)
    kernels.sort_routing(ids, 1, 0, experts, align, *got.values())
    torch.cuda.synchronize()
    for name in SORT_OUTPUTS:
        _same_bits(got[name], want[name], name)


def test_sort_grid_shape() -> None:
    assert sort_grid(0) == (1, 0) and sort_grid(SORT_THREADS) == (1, SORT_THREADS)
    assert sort_grid(SORT_THREADS + 1) == (2, SORT_THREADS)
    assert sort_grid(32768) == (32, SORT_THREADS)
    blocks, per_block = sort_grid(1 << 20)
    assert blocks <= 128 and per_block % SORT_THREADS == 0 and blocks * per_block >= 1 << 20


# ---------------------------------------------------------------------------------------------------------------
# permute (BF16 token fragments)
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("hidden", [64, 2048, 7168, 8256])
@pytest.mark.parametrize("top_k", [1, 3, 8])
def test_permute_bf16_matches_previous_kernel(reference, hidden: int, top_k: int) -> None:
    tokens = 37
    slots = tokens * top_k
    gen = _gen(hidden + top_k)
    xs = torch.randint(0, 256, (tokens, hidden // 2), generator=gen, dtype=torch.uint8).to(DEV)
    xss = torch.randint(0, 256, (tokens, hidden // 16), generator=gen, dtype=torch.uint8)  # NaN bytes included
    xss[0, 0], xss[1, -1] = 0x7F, 0xFF
    xss = xss.to(DEV)
    capacity = slots + 5
    rows = torch.randperm(capacity, generator=gen)[:slots].to(torch.int32)
    rows[torch.rand(slots, generator=gen) < 0.2] = -1  # masked slots
    rows[2 * top_k : 4 * top_k] = -1  # tokens 2 and 3 fully masked
    slot_to_row = rows.to(DEV)
    blank = torch.full((capacity, hidden), POISON_INT, dtype=torch.int16, device=DEV).view(torch.bfloat16)
    want, got = blank.clone(), blank.clone()
    reference("ref_sm90_permute_decode", (slots,), kernels.ROW_THREADS, (
        _ptr(xs), _ptr(xss), _ptr(slot_to_row), np.int32(top_k), np.int32(hidden), _ptr(want)))
    kernels.permute_tokens(xs, xss, slot_to_row, slots, top_k, TokenLayout.BF16_FRAGMENTS, got, None)
    torch.cuda.synchronize()
    _same_bits(got, want, "moe_permute_bf16")
    # Fewer slots than the tokens hold (the last token partly): slots >= num_slots are left alone.
    part = slots - 1 if top_k > 1 else slots - 2
    want, got = blank.clone(), blank.clone()
    reference("ref_sm90_permute_decode", (part,), kernels.ROW_THREADS, (
        _ptr(xs), _ptr(xss), _ptr(slot_to_row), np.int32(top_k), np.int32(hidden), _ptr(want)))
    kernels.permute_tokens(xs, xss, slot_to_row, part, top_k, TokenLayout.BF16_FRAGMENTS, got, None)
    torch.cuda.synchronize()
    _same_bits(got, want, "moe_permute_bf16, partial")


# ---------------------------------------------------------------------------------------------------------------
# finalize
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("hidden", [8, 256, 7168])
@pytest.mark.parametrize("top_k", [1, 3, 4, 8, 10])
def test_finalize_matches_previous_kernel(reference, hidden: int, top_k: int) -> None:
    tokens, capacity = 29, 29 * top_k + 7
    gen = _gen(hidden * top_k)
    g2 = (torch.randn(capacity, hidden, generator=gen) * 10).to(torch.bfloat16).to(DEV)
    rows = torch.randperm(capacity, generator=gen)[: tokens * top_k].to(torch.int32)
    rows[torch.rand(tokens * top_k, generator=gen) < 0.25] = -1
    weights = torch.rand(tokens * top_k, generator=gen) * 2 - 0.5
    slot_to_row, weights = rows.to(DEV), weights.to(DEV)
    want = torch.full((tokens, hidden), POISON_INT, dtype=torch.int16, device=DEV).view(torch.bfloat16)
    got = want.clone()
    reference("ref_moe_finalize", (tokens,), kernels.ROW_THREADS, (
        _ptr(g2), _ptr(slot_to_row), _ptr(weights), np.int32(top_k), np.int32(hidden), _ptr(want)))
    kernels.finalize(g2, slot_to_row, weights, top_k, got)
    torch.cuda.synchronize()
    _same_bits(got, want, "finalize")
