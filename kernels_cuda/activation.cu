// Activation of the first GEMM's output, requantized to NVFP4 for the second GEMM (inter_code INTER_NVFP4), or
// rounded to BF16 (INTER_BF16, the BF16 layouts only) for a second GEMM on BF16 tokens, or quantized to MXFP8 per 32
// values and written as the BF16 values of its elements (INTER_MXFP8, the BF16 layouts only: the MX pair).
#include "activation_unit.cuh"

using namespace moe;

// Activation codes ACT_* come from cudnn_moe.activations.ActivationKind (through cudnn_moe.kernels.codes);
// the scalar activation math (act_fn, act_gated_all) lives in activation_math.cuh, shared with the low-latency
// kernels, and the per-unit activate + requantize + store in activation_unit.cuh, shared with the wgmma GEMM's
// activation epilogue.

// The units u = first, first + stride, ... < inter / 32 of row r.
template <int ACT, bool GATED, bool MX>
__device__ __forceinline__ void activate_row(const u16* row, bool padding, i64 r, int first, int stride, int inter,
                                             int rows, int act, float alpha, float beta, float limit, int layout,
                                             int inter_code, u8* out, u8* out_scales) {
  for (int u = first; u < inter / 32; u += stride)
    activate_store_unit<ACT, GATED, MX>(row + 32 * u, inter, padding, r, u, inter, rows, act, alpha, beta, limit,
                                        layout, inter_code, out, out_scales);
}

// Rows r < row_capacity; a thread handles units of 32 values (two 16-value quantization blocks):
// inter / 32 units per row, blockDim.x / (inter / 32) rows per block (at least one; launch
// ceil(row_capacity / rows per block) blocks).
//   g1          BF16 [row_capacity, N1]: the first GEMM's output, expert global already applied;
//               N1 = 2 * inter when gated (columns [0, inter) up, [inter, 2 * inter) gate), else inter;
//               16-byte aligned
//   row_to_slot int32 [row_capacity]; offsets int32 [num_experts + 1] (rows used = offsets[num_experts])
//   layout      TOKENS_*: NVFP4 codes (uint8 [row_capacity, inter / 2], element 2i in the low nibble)
//               + E4M3 scales of the inter / 16 blocks per row, linear or 128x4 swizzled; or BF16
//               fragments / natural rows / tiled planes (BF16 [rows, inter] storage, 16-byte aligned, out_scales
//               unused; tiled: rows a multiple of 8)
//   rows        the output's rows R (>= offsets[num_experts]; where the tiled layout's planes start)
// Per block: y = activation(float(g1)) in FP32, s = e4m3(amax(|y|) / 6), code_i = e2m1(y_i / float(s)),
// all codes 0 when float(s) == 0 (inter_code INTER_NVFP4); with INTER_BF16 (BF16 layouts only) the values are
// bf16_rne(y) instead. Padding rows (r < total, row_to_slot[r] < 0) are written as zeros; rows >= total are not
// written. inter must be a multiple of 64.
extern "C" __global__ void moe_activation(const u16* __restrict__ g1, const int* __restrict__ row_to_slot,
                                          const int* __restrict__ offsets, int num_experts, int act, int gated,
                                          float alpha, float beta, float limit, int inter, int layout, int inter_code,
                                          int rows, u8* __restrict__ out, u8* __restrict__ out_scales) {
  moe::grid_dependency_begin();
  const int units = inter / 32;
  const int rows_per_block = max(1, static_cast<int>(blockDim.x) / units);
  const int sub = threadIdx.x / units;  // the block's row of this thread
  if (sub >= rows_per_block) return;
  const int r = blockIdx.x * rows_per_block + sub;
  if (r >= offsets[num_experts]) return;
  const int first = threadIdx.x - sub * units;
  const int stride = rows_per_block == 1 ? static_cast<int>(blockDim.x) : units;
  const bool padding = row_to_slot[r] < 0;
  const u16* row = g1 + static_cast<i64>(r) * (gated ? 2 * inter : inter);
// SwiGLU (the gated activation of the common MoE models) is compiled on its own; the other activations
// share one body that switches on `act` (fewer instantiations, shorter NVRTC builds).
// The MXFP8 intermediate (the MX pair's) has forms of its own (activate_store_unit's MX).
#define MOE_ACTIVATE_ROW(ACT, GATED, MX) \
  activate_row<ACT, GATED, MX>(row, padding, r, first, stride, inter, rows, act, alpha, beta, limit, layout, \
                               inter_code, out, out_scales)
  if (inter_code == INTER_MXFP8) {
    if (gated) MOE_ACTIVATE_ROW(-1, true, true);
    else MOE_ACTIVATE_ROW(-1, false, true);
  } else if (act == ACT_SWIGLU && gated) MOE_ACTIVATE_ROW(ACT_SWIGLU, true, false);
  else if (gated) MOE_ACTIVATE_ROW(-1, true, false);
  else MOE_ACTIVATE_ROW(-1, false, false);
#undef MOE_ACTIVATE_ROW
}
