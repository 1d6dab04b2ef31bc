// Deterministic counting sort of routing slots into padded per-expert row segments: the body (sort_slots)
// of the sort kernels of sort.cu and of the fused sort + permute kernels of permute.cu.
//
// Two entry points of sort.cu share it: moe_sort, ONE block that sorts every slot (decode and
// small prefill: one launch, nothing else), and moe_sort_blocks, a grid of independent blocks that
// each sort a contiguous range of `block_slots` slots. A block of the grid needs two numbers per
// expert that depend on slots outside its range: the total count (for the segment starts) and the
// count in the slots before its range (for its first row in each segment). Every block gets them by
// counting all num_slots ids itself (16-byte loads, shared-memory atomics), so the blocks never
// communicate: no scratch memory, no second launch, no ordering between blocks, and the result is
// the single block's, row for row. Redundant counting costs gridDim.x * num_slots id reads (from L2);
// the wrapper caps the grid (cudnn_moe/kernels/sort.py) so that stays small next to the scatter.
#pragma once
#include "common.cuh"

namespace moe {

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

// Count id into before[e] (slot index below `begin`) or after[e] (the rest).
__device__ __forceinline__ void count_id(int id, int i, int begin, int local_start, int num_experts, int* before,
                                         int* after) {
  const int e = local_expert(id, local_start, num_experts);
  if (e >= 0) atomicAdd((i < begin ? before : after) + e, 1);
}

// The whole sort for logical block `block` of `blocks` (blockIdx.x of gridDim.x for the sort kernels);
// this block places slots [begin, end) with begin = block * block_slots (a multiple of SORT_THREADS),
// writes the rows r = block * SORT_THREADS + tid + n * blocks * SORT_THREADS of row_expert and the padding
// rows among them of row_to_slot; block 0 also writes offsets and counts. Outputs documented at moe_sort
// (sort.cu); written only when `write` is set. `slot_rows`, when not null (shared memory of num_slots
// ints), receives the row of every placed slot too, for the block's own use.
__device__ __forceinline__ void sort_slots(const int* __restrict__ ids, int num_slots, int local_start,
                                           int num_experts, int align, int row_capacity, int block_slots,
                                           int block, int blocks, bool write, int* slot_rows,
                                           int* __restrict__ offsets, int* __restrict__ slot_to_row,
                                           int* __restrict__ row_to_slot, int* __restrict__ row_expert,
                                           int* __restrict__ counts) {
  __shared__ int before[SORT_MAX_EXPERTS];    // slots of each expert before this block's range
  __shared__ int total[SORT_MAX_EXPERTS];     // slots from `begin` on, then all slots of each expert
  __shared__ int next[SORT_MAX_EXPERTS];      // next free row of each segment for this block
  __shared__ int seg[SORT_MAX_EXPERTS + 1];   // clamped segment starts
  __shared__ u16 warp_count[SORT_WARPS][SORT_MAX_EXPERTS];  // slots per (warp, expert) in the current chunk
  __shared__ int scratch[SORT_WARPS + 1];
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int begin = block * block_slots;
  const int end = min(num_slots, begin + block_slots);

  // Pass 1: count every slot, split at `begin`.
  for (int e = tid; e < num_experts; e += SORT_THREADS) before[e] = total[e] = 0;
  for (int i = tid; i < SORT_WARPS * SORT_MAX_EXPERTS; i += SORT_THREADS) (&warp_count[0][0])[i] = 0;
  __syncthreads();
  int tail = 0;  // slots [tail, num_slots) are counted one by one
  if ((reinterpret_cast<u64>(ids) & 15u) == 0) {
    const int quads = num_slots / 4;
    const int4* ids4 = reinterpret_cast<const int4*>(ids);
    int q = tid;
    for (; q + 3 * SORT_THREADS < quads; q += 4 * SORT_THREADS) {  // four 16-byte loads in flight
      int4 v[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) v[u] = ids4[q + u * SORT_THREADS];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int i = 4 * (q + u * SORT_THREADS);  // begin is a multiple of 4: one side for all four
        count_id(v[u].x, i, begin, local_start, num_experts, before, total);
        count_id(v[u].y, i, begin, local_start, num_experts, before, total);
        count_id(v[u].z, i, begin, local_start, num_experts, before, total);
        count_id(v[u].w, i, begin, local_start, num_experts, before, total);
      }
    }
    for (; q < quads; q += SORT_THREADS) {
      const int4 v = ids4[q];
      count_id(v.x, 4 * q, begin, local_start, num_experts, before, total);
      count_id(v.y, 4 * q, begin, local_start, num_experts, before, total);
      count_id(v.z, 4 * q, begin, local_start, num_experts, before, total);
      count_id(v.w, 4 * q, begin, local_start, num_experts, before, total);
    }
    tail = 4 * quads;
  }
  for (int i = tail + tid; i < num_slots; i += SORT_THREADS)
    count_id(ids[i], i, begin, local_start, num_experts, before, total);
  __syncthreads();

  // Padded exclusive scan (num_experts <= SORT_THREADS, one expert per thread).
  const int count = tid < num_experts ? before[tid] + total[tid] : 0;
  const int start = block_exclusive_scan((count + align - 1) / align * align, scratch);
  if (tid < num_experts) {
    total[tid] = count;
    seg[tid] = min(start, row_capacity);
    next[tid] = seg[tid] + before[tid];
    if (block == 0 && write) counts[tid] = count;
  }
  if (tid == 0) seg[num_experts] = min(scratch[SORT_WARPS], row_capacity);
  __syncthreads();
  const int rows_used = seg[num_experts];
  if (block == 0 && write)
    for (int e = tid; e <= num_experts; e += SORT_THREADS) offsets[e] = seg[e];
  // Row fill: every row's expert (-1 past the end) and -1 in row_to_slot for the rows no slot takes:
  // rows past the end and, in segment e, rows from seg[e] + count[e] on. The slots take exactly the
  // other rows (below), so the two sets of writes never meet and need no ordering.
  for (int r = block * SORT_THREADS + tid; write && r < row_capacity; r += blocks * SORT_THREADS) {
    int e = -1;
    if (r < rows_used) {
      e = segment_of(seg, num_experts, r);
      if (r - seg[e] >= total[e]) row_to_slot[r] = -1;
    } else {
      row_to_slot[r] = -1;
    }
    row_expert[r] = e;
  }

  // Pass 2: chunks of SORT_THREADS slots of [begin, end) in order. A slot's row is its segment's next
  // free row plus the number of earlier slots of the same expert in the chunk: those in earlier warps
  // (warp_count) and those in lower lanes of its own warp (match mask). A slot whose row would reach
  // the next (clamped) segment start is dropped.
  const u32 lower_lanes = (1u << lane) - 1u;
  for (int base = begin; base < end; base += SORT_THREADS) {
    const int i = base + tid;
    const int e = i < end ? local_expert(ids[i], local_start, num_experts) : -1;
    const u32 peers = __match_any_sync(0xFFFFFFFFu, e);
    const int rank = __popc(peers & lower_lanes);
    const bool leader = e >= 0 && rank == 0;
    if (leader) warp_count[warp][e] = static_cast<u16>(__popc(peers));
    __syncthreads();
    if (i < end) {
      int row = -1;
      if (e >= 0) {
        row = next[e] + rank;
        for (int w = 0; w < warp; ++w) row += warp_count[w][e];
        if (row >= seg[e + 1]) row = -1;
        else if (write) row_to_slot[row] = i;
      }
      if (write) slot_to_row[i] = row;
      if (slot_rows != nullptr) slot_rows[i] = row;
    }
    __syncthreads();
    if (leader) {
      warp_count[warp][e] = 0;
      atomicAdd(&next[e], __popc(peers));  // leaders of several warps may share e
    }
    __syncthreads();
  }
}

}  // namespace moe
