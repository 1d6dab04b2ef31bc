// Combine the second GEMM's expert rows back into token order.
#include "common.cuh"
#include "finalize.cuh"

using namespace moe;

// Block (t, y) for token t < B and columns [8 y blockDim.x, 8 (y + 1) blockDim.x) (gridDim.y column groups;
// a group past H does nothing, H beyond the grid's columns is looped over); each thread handles 8 consecutive
// hidden columns.
//   g2          BF16 [row_capacity, hidden]: the second GEMM's rows, expert global already applied;
//               16-byte aligned, hidden % 8 == 0
//   slot_to_row int32 [B * top_k]; weights FP32 [B * top_k]
//   out         BF16 [B, hidden]: out[t, h] = bf16(sum over slots s in order, skipping masked ones,
//               of w[t, s] * float(g2[r, h])): a separate FP32 multiply and add per slot. With
//               accumulate != 0 the sum starts from float(out[t, h]) instead of zero.
// (finalize_columns, finalize.cuh.)
extern "C" __global__ void moe_finalize(const u16* __restrict__ g2, const int* __restrict__ slot_to_row,
                                        const float* __restrict__ weights, int top_k, int hidden,
                                        int accumulate, u16* __restrict__ out) {
  moe::grid_dependency_begin();
  const i64 t = blockIdx.x;
  const int step = 8 * static_cast<int>(blockDim.x * gridDim.y);
  for (int h = 8 * static_cast<int>(blockIdx.y * blockDim.x + threadIdx.x); h < hidden; h += step)
    finalize_columns(g2, slot_to_row + t * top_k, weights + t * top_k, top_k, hidden, t, h, accumulate != 0, out);
}

// One block per output row r < R_out (R_out <= row_capacity).
//   g2       BF16 [row_capacity, hidden], 16-byte aligned, hidden % 8 == 0
//   rows_out BF16 [R_out, hidden]: g2[r] where row_to_slot[r] >= 0, else 0
extern "C" __global__ void moe_unfinalized_rows(const u16* __restrict__ g2, const int* __restrict__ row_to_slot,
                                                int hidden, u16* __restrict__ rows_out) {
  moe::grid_dependency_begin();
  const i64 r = blockIdx.x;
  const bool used = row_to_slot[r] >= 0;
  for (int h = 8 * threadIdx.x; h < hidden; h += 8 * blockDim.x) {
    uint4 v{0u, 0u, 0u, 0u};
    if (used) v = *reinterpret_cast<const uint4*>(g2 + r * hidden + h);
    *reinterpret_cast<uint4*>(rows_out + r * hidden + h) = v;
  }
}
