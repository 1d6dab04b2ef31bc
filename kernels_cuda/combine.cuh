// The finalize's arithmetic (the weighted sum of a token's expert rows), shared by the finalize kernel
// (finalize.cu) and GEMM2's combine epilogue (sm90/wgmma_gemm.cu), so both give the same bits.
#pragma once

#include "common.cuh"

namespace moe {

// Add w * row[h .. h + 7] (8 BF16 values in raw) to acc: a separate FP32 multiply and add per element, never
// fused, as the finalize contract states.
__device__ __forceinline__ void accumulate_row(float acc[8], float w, const uint4& raw) {
  const u32 words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    acc[2 * j] = __fadd_rn(acc[2 * j], __fmul_rn(w, __uint_as_float(words[j] << 16)));
    acc[2 * j + 1] = __fadd_rn(acc[2 * j + 1], __fmul_rn(w, __uint_as_float(words[j] & 0xFFFF0000u)));
  }
}

// 16 bytes from L2 (ld.global.cg: not from this SM's L1, which may hold stale lines of rows other CTAs of the
// same grid wrote).
__device__ __forceinline__ uint4 load_l2_v4(const void* p) {
  uint4 v;
  asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

}  // namespace moe
