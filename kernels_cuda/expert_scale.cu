// Epilogue of the cuDNN engine: apply each expert's global scale to an FP32 GEMM result and round once.
#include "common.cuh"

using namespace moe;

// Segment e with offsets[e] <= r < offsets[e + 1], for 0 <= r < offsets[num_experts].
__device__ __forceinline__ int segment_of_row(const int* offsets, int num_experts, int r) {
  int lo = 0, hi = num_experts;
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (offsets[mid] <= r) lo = mid;
    else hi = mid;
  }
  return lo;
}

// One block per row r < row_capacity; each thread handles 8 consecutive columns.
//   acc     FP32 [row_capacity, n]: the grouped GEMM's accumulators, 16-byte aligned, n % 8 == 0
//   alpha   FP32 [num_experts], or [2 num_experts] with alpha_split < n (a multiple of 8): columns
//           c >= alpha_split take alpha[num_experts + e]
//   offsets int32 [num_experts + 1] (segment starts, rows used last)
//   out     BF16 [row_capacity, n]: out[r, c] = bf16(a * acc[r, c]) for rows of segment e, a as above;
//           rows >= rows used are not written
extern "C" __global__ void moe_expert_scale(const float* __restrict__ acc, const float* __restrict__ alpha,
                                            const int* __restrict__ offsets, int num_experts, int n,
                                            int alpha_split, u16* __restrict__ out) {
  moe::grid_dependency_begin();
  const int r = blockIdx.x;
  if (r >= offsets[num_experts]) return;
  const int e = segment_of_row(offsets, num_experts, r);
  const float a_low = alpha[e];
  const float a_high = alpha_split < n ? alpha[num_experts + e] : a_low;
  for (int c = 8 * threadIdx.x; c < n; c += 8 * blockDim.x) {
    const float a = c >= alpha_split ? a_high : a_low;
    const float4 lo = *reinterpret_cast<const float4*>(acc + static_cast<i64>(r) * n + c);
    const float4 hi = *reinterpret_cast<const float4*>(acc + static_cast<i64>(r) * n + c + 4);
    const float v[8] = {a * lo.x, a * lo.y, a * lo.z, a * lo.w, a * hi.x, a * hi.y, a * hi.z, a * hi.w};
    store_bf16x8(out + static_cast<i64>(r) * n + c, v);
  }
}
