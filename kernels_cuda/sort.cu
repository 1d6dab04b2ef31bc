// The routing sort kernels (the body, sort_slots, and its documentation: sort.cuh).
#include "sort.cuh"

using namespace moe;

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
  moe::grid_dependency_begin();
  if (blockDim.x != SORT_THREADS || gridDim.x != 1 || num_experts < 1 || num_experts > SORT_MAX_EXPERTS ||
      align < 1)
    return;
  sort_slots(ids, num_slots, local_start, num_experts, align, row_capacity, max(num_slots, 1), 0, 1,
             true, true, nullptr, offsets,
             slot_to_row, row_to_slot, row_expert, counts);
}

// The same sort and outputs as moe_sort, with blocks of SORT_THREADS threads: block b places the slots
// [b * block_slots, (b + 1) * block_slots) (block_slots a positive multiple of SORT_THREADS); launch
// ceil(num_slots / block_slots) blocks (at least one). Graph-capturable: nothing but the outputs is written.
extern "C" __global__ void __launch_bounds__(SORT_THREADS)
    moe_sort_blocks(const int* __restrict__ ids, int num_slots, int local_start, int num_experts, int align,
                    int row_capacity, int block_slots, int* __restrict__ offsets, int* __restrict__ slot_to_row,
                    int* __restrict__ row_to_slot, int* __restrict__ row_expert, int* __restrict__ counts) {
  moe::grid_dependency_begin();
  if (blockDim.x != SORT_THREADS || num_experts < 1 || num_experts > SORT_MAX_EXPERTS || align < 1 ||
      block_slots < 1 || block_slots % SORT_THREADS != 0)
    return;
  sort_slots(ids, num_slots, local_start, num_experts, align, row_capacity, block_slots, blockIdx.x,
             gridDim.x, true, false, nullptr, offsets, slot_to_row,
             row_to_slot, row_expert, counts);
}
