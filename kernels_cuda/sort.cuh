// Deterministic counting sort of routing slots into padded per-expert row segments: the body (sort_slots)
// of the sort kernels of sort.cu and of the fused sort + permute kernels of permute.cu.
//
// Two entry points of sort.cu share it: moe_sort, ONE block that sorts every slot (decode and small prefill: one
// launch, nothing else; up to SORT_WARP_SLOTS slots in one warp, sort_slots_warp), and moe_sort_blocks, a grid of
// independent blocks that each sort a contiguous range of `block_slots` slots. A block of the grid needs two numbers
// per expert that depend on slots outside its range: the total count (for the segment starts) and the count in the
// slots before its range (for its first row in each segment). Every block gets them by counting all num_slots ids
// itself (16-byte loads, shared-memory atomics), so the blocks never communicate: no scratch memory, no second
// launch, no ordering between blocks, and the result is the single block's, row for row. Redundant counting costs
// gridDim.x * num_slots id reads (from L2); the wrapper caps the grid (cudnn_moe/kernels/sort.py) so that stays
// small next to the scatter.
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

// A segment's rows: count rounded up to a multiple of align.
__device__ __forceinline__ int padded_count(int count, int align) { return (count + align - 1) / align * align; }

// Count id into before[e] (slot index below `begin`) or after[e] (the rest).
__device__ __forceinline__ void count_id(int id, int i, int begin, int local_start, int num_experts, int* before,
                                         int* after) {
  const int e = local_expert(id, local_start, num_experts);
  if (e >= 0) atomicAdd((i < begin ? before : after) + e, 1);
}

// The sort of at most SORT_WARP_SLOTS slots by one warp (sort_slots' outputs, bit for bit, for a single block):
// lane L holds slots L and L + 32. A slot's rank among the earlier slots of its expert and its expert's count
// come from match masks inside each half of 32 slots and a 32-step comparison across the halves, so the block
// needs no barrier. The first slot of each expert stores the count in counts_smem (num_experts ints); a warp scan
// of the padded counts gives the segment starts (seg, num_experts + 1 ints). Every row below row_capacity is
// written once: a slot's row by that slot, the padding rows of a segment by its expert's first slot, the rows
// past the last segment by all lanes. SORT_WARP_SLOTS (64: two slots a lane) comes from cudnn_moe.kernels.codes.
__device__ __forceinline__ void sort_slots_warp(const int* __restrict__ ids, int num_slots, int local_start,
                                                int num_experts, int align, int row_capacity, bool write,
                                                int* slot_rows, int* counts_smem, int* seg,
                                                int* __restrict__ offsets, int* __restrict__ slot_to_row,
                                                int* __restrict__ row_to_slot, int* __restrict__ row_expert,
                                                int* __restrict__ counts) {
  const int lane = threadIdx.x & 31;
  const int e0 = lane < num_slots ? local_expert(ids[lane], local_start, num_experts) : -1;
  const int e1 = lane + 32 < num_slots ? local_expert(ids[lane + 32], local_start, num_experts) : -1;
  for (int e = lane; e < num_experts; e += 32) counts_smem[e] = 0;
  // Slots of the other half with the same expert: of the first half before slot L + 32, of the second after L.
  int first_half = 0, second_half = 0;
  for (int j = 0; j < 32; ++j) {
    first_half += __shfl_sync(0xFFFFFFFFu, e0, j) == e1;
    second_half += __shfl_sync(0xFFFFFFFFu, e1, j) == e0;
  }
  const u32 lower = (1u << lane) - 1u;
  const u32 peers0 = __match_any_sync(0xFFFFFFFFu, e0);
  const u32 peers1 = __match_any_sync(0xFFFFFFFFu, e1);
  const int rank0 = __popc(peers0 & lower);
  const int rank1 = first_half + __popc(peers1 & lower);
  __syncwarp();
  if (e0 >= 0 && rank0 == 0) counts_smem[e0] = __popc(peers0) + second_half;
  if (e1 >= 0 && rank1 == 0) counts_smem[e1] = first_half + __popc(peers1);
  __syncwarp();
  // Segment starts: lane L scans experts [L * per, + per) after a warp scan of the lanes' padded totals.
  const int per = (num_experts + 31) >> 5;
  const int begin = min(lane * per, num_experts);
  const int end = min(begin + per, num_experts);
  int sum = 0;
  for (int e = begin; e < end; ++e) sum += padded_count(counts_smem[e], align);
  int inclusive = sum;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int v = __shfl_up_sync(0xFFFFFFFFu, inclusive, d);
    if (lane >= d) inclusive += v;
  }
  int start = inclusive - sum;
  for (int e = begin; e < end; ++e) {
    const int count = counts_smem[e];
    seg[e] = min(start, row_capacity);
    if (write) {
      offsets[e] = seg[e];
      counts[e] = count;
    }
    start += padded_count(count, align);
  }
  if (lane == 31) {
    seg[num_experts] = min(inclusive, row_capacity);
    if (write) offsets[num_experts] = seg[num_experts];
  }
  __syncwarp();
  const int rows_used = seg[num_experts];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int i = lane + 32 * h;
    const int e = h ? e1 : e0;
    const int rank = h ? rank1 : rank0;
    if (i >= num_slots) continue;
    int row = -1;
    if (e >= 0) {
      row = seg[e] + rank;
      if (row >= seg[e + 1]) {
        row = -1;
      } else if (write) {
        row_to_slot[row] = i;
        row_expert[row] = e;
      }
      if (rank == 0 && write) {  // the segment's padding rows
        for (int r = seg[e] + counts_smem[e]; r < seg[e + 1]; ++r) {
          row_to_slot[r] = -1;
          row_expert[r] = e;
        }
      }
    }
    if (write) slot_to_row[i] = row;
    if (slot_rows != nullptr) slot_rows[i] = row;
  }
  for (int r = rows_used + lane; write && r < row_capacity; r += 32) {
    row_to_slot[r] = -1;
    row_expert[r] = -1;
  }
}

// The whole sort for logical block `block` of `blocks` (blockIdx.x of gridDim.x for the sort kernels);
// this block places slots [begin, end) with begin = block * block_slots (a multiple of SORT_THREADS),
// writes the rows r = block * SORT_THREADS + tid + n * blocks * SORT_THREADS of row_expert and the padding
// rows among them of row_to_slot; block 0 also writes offsets and counts. Outputs documented at moe_sort
// (sort.cu); written only when `write` is set. `slot_rows`, when not null (shared memory of num_slots
// ints), receives the row of every placed slot too, for the block's own use. `warp_path` (a constant of the
// caller): a single block of at most SORT_WARP_SLOTS slots sorts in one warp (sort_slots_warp).
__device__ __forceinline__ void sort_slots(const int* __restrict__ ids, int num_slots, int local_start,
                                           int num_experts, int align, int row_capacity, int block_slots,
                                           int block, int blocks, bool write, bool warp_path, int* slot_rows,
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
  if (warp_path && blocks == 1 && num_slots <= SORT_WARP_SLOTS) {  // few slots (decode): one warp, no block barriers
    if (warp == 0)
      sort_slots_warp(ids, num_slots, local_start, num_experts, align, row_capacity, write, slot_rows, total, seg,
                      offsets, slot_to_row, row_to_slot, row_expert, counts);
    __syncthreads();  // slot_rows for the block
    return;
  }

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
  const int start = block_exclusive_scan(padded_count(count, align), scratch);
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
