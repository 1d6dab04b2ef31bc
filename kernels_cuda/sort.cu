// The routing sort kernels (the body, sort_slots, and its documentation: sort.cuh), and the sort with the token
// rows of a gathering GEMM1 in one launch.
#include "sort.cuh"

using namespace moe;

// Block `block` of a grid decoding NVFP4 tokens exactly into natural BF16 rows in token order (the rows the
// wgmma GEMM gathers from): xs uint8 [num_tokens, H/2] packed E2M1 (element 2i in the low nibble), 16-byte
// aligned; xss uint8 [num_tokens, H/16] E4M3 scales, linear; x bf16 [num_tokens, H], 16-byte aligned. A thread
// handles units of 32 columns, H / 32 per token, blockDim.x / (H / 32) tokens per block (at least one).
// Requires H % 64 == 0.
__device__ __forceinline__ void decode_token_rows(const u8* __restrict__ xs, const u8* __restrict__ xss,
                                                  int num_tokens, int hidden, u16* __restrict__ x, int block) {
  const int units = hidden / 32;
  const int tokens_per_block = max(1, static_cast<int>(blockDim.x) / units);
  const int sub = threadIdx.x / units;  // the block's token of this thread
  if (sub >= tokens_per_block) return;
  const i64 t = static_cast<i64>(block) * tokens_per_block + sub;
  if (t >= num_tokens) return;
  const int stride = tokens_per_block == 1 ? static_cast<int>(blockDim.x) : units;
  for (int u = threadIdx.x - sub * units; u < units; u += stride) {
    uint4 piece[4];
    decode_fragment_unit(xs + t * (hidden / 2), xss + t * (hidden / 16), u, piece);
    store_natural_unit(x + t * hidden, u, piece);
  }
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
  moe::grid_dependency_begin();
  if (blockDim.x != SORT_THREADS || gridDim.x != 1 || num_experts < 1 || num_experts > SORT_MAX_EXPERTS ||
      align < 1)
    return;
  sort_slots(ids, num_slots, local_start, num_experts, align, row_capacity, max(num_slots, 1), 0, 1,
             true, nullptr, offsets,
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
             gridDim.x, true, nullptr, offsets, slot_to_row,
             row_to_slot, row_expert, counts);
}

// The sort of moe_sort / moe_sort_blocks and the NVFP4 tokens decoded into natural BF16 rows (decode_token_rows),
// in one launch of blocks of SORT_THREADS threads: blocks [0, sort_blocks) sort as moe_sort_blocks
// with gridDim.x = sort_blocks (block_slots: max(num_slots, 1) for one block, else as there), the blocks after
// them decode xs / xss [num_tokens] into x_rows. The two parts share nothing: the outputs are those of the two
// launches, bit for bit.
extern "C" __global__ void __launch_bounds__(SORT_THREADS)
    moe_sort_token_rows(const int* __restrict__ ids, int num_slots, int local_start, int num_experts, int align,
                        int row_capacity, int block_slots, int sort_blocks, int* __restrict__ offsets,
                        int* __restrict__ slot_to_row, int* __restrict__ row_to_slot, int* __restrict__ row_expert,
                        int* __restrict__ counts, const u8* __restrict__ xs, const u8* __restrict__ xss,
                        int num_tokens, int hidden, u16* __restrict__ x_rows) {
  moe::grid_dependency_begin();
  if (blockDim.x != SORT_THREADS || num_experts < 1 || num_experts > SORT_MAX_EXPERTS || align < 1 ||
      block_slots < 1 || sort_blocks < 1 || hidden % 64)
    return;
  const int block = static_cast<int>(blockIdx.x);
  if (block < sort_blocks) {
    sort_slots(ids, num_slots, local_start, num_experts, align, row_capacity, block_slots, block, sort_blocks, true,
               nullptr, offsets, slot_to_row, row_to_slot, row_expert, counts);
  } else {
    decode_token_rows(xs, xss, num_tokens, hidden, x_rows, block - sort_blocks);
  }
}
