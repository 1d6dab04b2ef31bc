// Gather token rows into expert-sorted rows for the first grouped GEMM.
#include "common.cuh"

using namespace moe;

// One block per slot (grid = num_slots = B * top_k); slot i belongs to token i / top_k.
//   xs          uint8 [B, row_bytes]     packed FP4 rows (row_bytes = H/2)
//   xss         uint8 [B, scale_cols]    E4M3 scales, linear (scale_cols = H/16)
//   slot_to_row int32 [num_slots]        destination row, -1 when the slot is masked
//   xp          uint8 [row_capacity, row_bytes]
//   xps         E4M3 scales of xp: linear [row_capacity, scale_cols], or the 128x4
//               swizzle of a row_capacity x scale_cols matrix when swizzled != 0
// Rows no slot maps to are not written.
extern "C" __global__ void moe_permute(const u8* __restrict__ xs, const u8* __restrict__ xss,
                                       const int* __restrict__ slot_to_row, int top_k, int row_bytes,
                                       int scale_cols, int swizzled, u8* __restrict__ xp,
                                       u8* __restrict__ xps) {
  const int r = slot_to_row[blockIdx.x];
  if (r < 0) return;
  const i64 t = blockIdx.x / top_k;
  block_copy_bytes(xp + static_cast<i64>(r) * row_bytes, xs + t * row_bytes, row_bytes, threadIdx.x, blockDim.x);
  const u8* src = xss + t * scale_cols;
  if (swizzled) {
    for (int c = threadIdx.x; c < scale_cols; c += blockDim.x) xps[swizzle_128x4_offset(r, c, scale_cols)] = src[c];
  } else {
    block_copy_bytes(xps + static_cast<i64>(r) * scale_cols, src, scale_cols, threadIdx.x, blockDim.x);
  }
}
