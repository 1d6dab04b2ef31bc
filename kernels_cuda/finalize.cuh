// The finalize's arithmetic, shared by moe_finalize (finalize.cu) and the SM90 decode GEMM2 that folds it in
// (sm90/grouped_gemm.cu, SM90_FINALIZE).
#pragma once

#include "common.cuh"

namespace moe {

// Add w * g2[r, h .. h + 7] to acc (a separate FP32 multiply and add per element) when r >= 0.
__device__ __forceinline__ void accumulate_row(float acc[8], int r, float w, const uint4& raw) {
  if (r < 0) return;
  const u32 words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    acc[2 * j] = __fadd_rn(acc[2 * j], __fmul_rn(w, __uint_as_float(words[j] << 16)));
    acc[2 * j + 1] = __fadd_rn(acc[2 * j + 1], __fmul_rn(w, __uint_as_float(words[j] & 0xFFFF0000u)));
  }
}

// out[t, h .. h + 7] = bf16(sum over slots s < top_k in order with r = rows[s] >= 0 of w[s] * float(g2[r, h ..])),
// a separate FP32 multiply and add per slot, starting from float(out[t, h ..]) with `accumulate`, else zero.
// rows / w: token t's top_k slots (slot_to_row and route weights from t * top_k on). The rows of up to eight slots
// are loaded together (eight 16-byte loads in flight), then added in slot order; the loads go through L2
// (ld.global.cg), so rows other blocks of the same grid wrote, once ordered before this thread (the decode GEMM2's
// tickets), are seen.
__device__ __forceinline__ void finalize_columns(const u16* g2, const int* rows, const float* w, int top_k,
                                                 int hidden, i64 t, int h, bool accumulate, u16* out) {
  constexpr int GROUP = 8;  // slots loaded together
  float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  if (accumulate) {
    const uint4 raw = *reinterpret_cast<const uint4*>(out + t * hidden + h);
    const u32 words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      acc[2 * j] = __uint_as_float(words[j] << 16);
      acc[2 * j + 1] = __uint_as_float(words[j] & 0xFFFF0000u);
    }
  }
  for (int s = 0; s < top_k; s += GROUP) {
    int r[GROUP];
    uint4 v[GROUP];
#pragma unroll
    for (int i = 0; i < GROUP; ++i) {
      r[i] = s + i < top_k ? rows[s + i] : -1;
      v[i] = r[i] >= 0 ? __ldcg(reinterpret_cast<const uint4*>(g2 + static_cast<i64>(r[i]) * hidden + h))
                       : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int i = 0; i < GROUP; ++i) accumulate_row(acc, r[i], r[i] >= 0 ? w[s + i] : 0.0f, v[i]);
  }
  store_bf16x8(out + t * hidden + h, acc);
}

}  // namespace moe
