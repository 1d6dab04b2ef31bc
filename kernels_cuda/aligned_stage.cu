// Stage of the aligned-plan op (contract 002): the caller's NVFP4 tokens, route weights, output
// scales and routing plan into the static bucket buffers the shared pipeline reads.
#include "common.cuh"

using namespace moe;

// One block per bucket row t < B (B >= M).
//   x            uint8 [M, row_bytes] packed E2M1 tokens, rows x_row_stride bytes apart (16-byte aligned
//                pointer and stride, checked on the host); x_scales uint8 [M, scale_bytes] E4M3, linear
//   topk_weights FP32 [M, top_k]; routed_scaling: a finite FP32 factor
//   xs, xss      [B, row_bytes], [B, scale_bytes]: rows >= M are left untouched
//   x_rows       bf16 [B, 2 * row_bytes] or null: when given, the tokens are decoded exactly into its rows t < M
//                instead of copied into xs / xss (stage_token_row)
//   ids_out      int32 [B, top_k]: -1 everywhere (moe_plan_routes then names the planned slots)
//   w_out        FP32 [B, top_k]: fp32(topk_weights * routed_scaling) for t < M, else 0
// Block 0 also copies the per-expert output scales: alpha1 [2E] = [up scales | gate scales] (the
// order of the repacked [up; gate] GEMM1 rows), alpha2 [E] = the down scales.
extern "C" __global__ void moe_stage_aligned(const u8* __restrict__ x, i64 x_row_stride, const u8* __restrict__ x_scales,
                                             const float* __restrict__ topk_weights, float routed_scaling,
                                             const float* __restrict__ up_scale, const float* __restrict__ gate_scale,
                                             const float* __restrict__ down_scale, int num_experts,
                                             u8* __restrict__ xs, u8* __restrict__ xss, u16* __restrict__ x_rows,
                                             int* __restrict__ ids_out,
                                             float* __restrict__ w_out, float* __restrict__ alpha1,
                                             float* __restrict__ alpha2, int M, int top_k, int row_bytes,
                                             int scale_bytes) {
  moe::grid_dependency_begin();
  const int t = blockIdx.x;
  if (t < M) stage_token_row(xs, xss, x_rows, x, x_row_stride, x_scales, t, row_bytes, scale_bytes, threadIdx.x,
                             blockDim.x);
  for (int s = threadIdx.x; s < top_k; s += blockDim.x) {
    const i64 i = static_cast<i64>(t) * top_k + s;
    ids_out[i] = -1;
    w_out[i] = t < M ? __fmul_rn(topk_weights[i], routed_scaling) : 0.0f;
  }
  if (t == 0) {
    for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {
      alpha1[e] = up_scale[e];
      alpha1[num_experts + e] = gate_scale[e];
      alpha2[e] = down_scale[e];
    }
  }
}

// One thread per plan entry r < capacity (runs after moe_stage_aligned on the same stream).
//   sorted_token_ids int32 [capacity]; expert_ids int32 [capacity / block_m, rounded up];
//   num_tokens_post_padded int32 [1]: block j is active when j * block_m < its value (read here, on
//   the device, so a graph replay follows the current plan)
//   ids_out          int32 [num_slots]: ids_out[i] = expert_ids[r / block_m] for every entry r of an
//                    active block holding a slot id i < num_slots; padding (i >= num_slots), negative
//                    entries and expert ids outside [0, num_experts) are skipped. A slot the plan names
//                    twice is a broken plan: one of its experts wins.
extern "C" __global__ void moe_plan_routes(const int* __restrict__ sorted_token_ids, const int* __restrict__ expert_ids,
                                           const int* __restrict__ num_tokens_post_padded, int capacity, int block_m,
                                           int num_slots, int num_experts, int* __restrict__ ids_out) {
  moe::grid_dependency_begin();
  const int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= capacity) return;
  const int block = r / block_m;
  if (static_cast<i64>(block) * block_m >= *num_tokens_post_padded) return;
  const int slot = sorted_token_ids[r];
  if (slot < 0 || slot >= num_slots) return;
  const int expert = expert_ids[block];
  if (expert < 0 || expert >= num_experts) return;
  ids_out[slot] = expert;
}
