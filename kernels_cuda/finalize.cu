// Combine the second GEMM's expert rows back into token order.
#include "common.cuh"

using namespace moe;

// One block per token t < B; each thread handles 8 consecutive hidden columns.
//   g2          BF16 [row_capacity, hidden]: the second GEMM's rows, expert global already applied;
//               16-byte aligned, hidden % 8 == 0
//   slot_to_row int32 [B * top_k]; weights FP32 [B * top_k]
//   out         BF16 [B, hidden]: out[t, h] = bf16(sum over slots s in order, skipping masked ones,
//               of w[t, s] * float(g2[r, h])): a separate FP32 multiply and add per slot
extern "C" __global__ void moe_finalize(const u16* __restrict__ g2, const int* __restrict__ slot_to_row,
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

// One block per output row r < R_out (R_out <= row_capacity).
//   g2       BF16 [row_capacity, hidden], 16-byte aligned, hidden % 8 == 0
//   rows_out BF16 [R_out, hidden]: g2[r] where row_to_slot[r] >= 0, else 0
extern "C" __global__ void moe_unfinalized_rows(const u16* __restrict__ g2, const int* __restrict__ row_to_slot,
                                                int hidden, u16* __restrict__ rows_out) {
  const i64 r = blockIdx.x;
  const bool used = row_to_slot[r] >= 0;
  for (int h = 8 * threadIdx.x; h < hidden; h += 8 * blockDim.x) {
    uint4 v{0u, 0u, 0u, 0u};
    if (used) v = *reinterpret_cast<const uint4*>(g2 + r * hidden + h);
    *reinterpret_cast<uint4*>(rows_out + r * hidden + h) = v;
  }
}
