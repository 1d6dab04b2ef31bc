// Copy the caller's activations and routing into the static bucket buffers.
#include "common.cuh"

using namespace moe;

// Routing formats ROUTING_PACKED / ROUTING_FP32 / ROUTING_BF16 come from cudnn_moe.kernels.codes.RoutingFormat.

// One block per bucket row t < B.
//   x        uint8 [T, row_bytes]    packed FP4 activations (row_bytes = H/2)
//   x_scales uint8 [T, scale_bytes]  E4M3 block scales, linear (scale_bytes = H/16)
//   ids      [T, top_k] int32 (packed or plain) or int64 (plain, ids_int64 != 0)
//   weights  [T, top_k] FP32 or BF16 (unused for ROUTING_PACKED)
//   xs, xss  [B, row_bytes], [B, scale_bytes]: rows >= T are left untouched
//   x_rows   bf16 [B, 2 * row_bytes] or null: when given, the tokens are decoded exactly into its rows t < T
//            (natural BF16 rows, what a gathering GEMM1 reads) instead of copied into xs / xss
//   ids_out  int32 [B, top_k], w_out FP32 [B, top_k]: the routing as decode_route (common.cuh) reads it; rows >= T
//            get id -1, weight 0
extern "C" __global__ void moe_stage_inputs(const u8* __restrict__ x, const u8* __restrict__ x_scales,
                                            const void* __restrict__ ids, const void* __restrict__ weights,
                                            int routing_format, int ids_int64, u8* __restrict__ xs,
                                            u8* __restrict__ xss, u16* __restrict__ x_rows, int* __restrict__ ids_out,
                                            float* __restrict__ w_out, int T, int top_k, int row_bytes,
                                            int scale_bytes) {
  moe::grid_dependency_begin();
  const int t = blockIdx.x;
  if (t < T) stage_token_row(xs, xss, x_rows, x, row_bytes, x_scales, t, row_bytes, scale_bytes, threadIdx.x, blockDim.x);
  for (int s = threadIdx.x; s < top_k; s += blockDim.x) {
    const i64 i = static_cast<i64>(t) * top_k + s;
    int id;
    float w;
    decode_route(ids, weights, routing_format, ids_int64, i, t < T, id, w);
    ids_out[i] = id;
    w_out[i] = w;
  }
}
