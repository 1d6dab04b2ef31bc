// Deterministic counting sort of routing slots into padded per-expert row segments.
#include "common.cuh"

using namespace moe;

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
    moe_sort(const int* __restrict__ ids, int num_slots, int local_start, int num_experts, int align,
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
