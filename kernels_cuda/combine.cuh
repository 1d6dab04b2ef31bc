// The combine of the second GEMM's expert rows into token rows: the finalize kernel (finalize.cu) and GEMM2's
// combine epilogue (sm90/wgmma_gemm.cu) both sum through this, so both give the same bits.
#pragma once

#include "common.cuh"

namespace moe {

// Add w * g2 row chunk `raw` (8 BF16) to acc: a separate FP32 multiply and add per element.
__device__ __forceinline__ void accumulate_row(float acc[8], float w, const uint4& raw) {
  const u32 words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    acc[2 * j] = __fadd_rn(acc[2 * j], __fmul_rn(w, __uint_as_float(words[j] << 16)));
    acc[2 * j + 1] = __fadd_rn(acc[2 * j + 1], __fmul_rn(w, __uint_as_float(words[j] & 0xFFFF0000u)));
  }
}

// acc[i] += w[s] * float(g2[rows[s], h + i]) for the token's slots s = 0 .. top_k - 1 in order, skipping slots with
// rows[s] < 0 (experts that are not local). g2: BF16 [., hidden], 16-byte aligned, hidden % 8 == 0. The rows of up to
// eight slots are loaded together (eight 16-byte loads in flight), then added in slot order. FRESH: g2's rows were
// written by other CTAs of the running kernel, so the loads go to L2 (ld.global.cg), not a possibly stale L1.
template <bool FRESH>
__device__ __forceinline__ void add_slot_rows(float acc[8], const u16* __restrict__ g2, const int* rows, const float* w,
                                              int top_k, int hidden, int h) {
  constexpr int GROUP = 8;
  for (int s = 0; s < top_k; s += GROUP) {
    int r[GROUP];
    uint4 v[GROUP];
#pragma unroll
    for (int i = 0; i < GROUP; ++i) {
      r[i] = s + i < top_k ? rows[s + i] : -1;
      const uint4* src = reinterpret_cast<const uint4*>(g2 + static_cast<i64>(r[i]) * hidden + h);
      v[i] = r[i] < 0 ? make_uint4(0u, 0u, 0u, 0u) : FRESH ? __ldcg(src) : *src;
    }
#pragma unroll
    for (int i = 0; i < GROUP; ++i)
      if (r[i] >= 0) accumulate_row(acc, w[s + i], v[i]);
  }
}

}  // namespace moe
