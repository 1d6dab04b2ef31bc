// Activation of the first GEMM's output, requantized to NVFP4 for the second GEMM.
#include "common.cuh"

using namespace moe;

// Activation codes ACT_* come from cudnn_moe.activations.ActivationKind (through cudnn_moe.kernels.codes).

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// 0.5 x (1 + erf(x / sqrt(2)))
__device__ __forceinline__ float gelu_erf(float x) { return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f)); }

// 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))
__device__ __forceinline__ float gelu_tanh(float x) {
  return 0.5f * x * (1.0f + tanhf(0.79788456080286536f * (x + 0.044715f * x * x * x)));
}

// The scalar function f of an activation: y = f(x) when not gated, y = f(gate) * up when gated.
__device__ __forceinline__ float act_fn(int act, float x) {
  switch (act) {
    case ACT_RELU: return fmaxf(x, 0.0f);
    case ACT_GELU:
    case ACT_GEGLU: return gelu_erf(x);
    case ACT_SILU: return x * sigmoid(x);
    case ACT_RELU2: {
      const float r = fmaxf(x, 0.0f);
      return r * r;
    }
    case ACT_GEGLU_TANH: return gelu_tanh(x);
    default: return x;  // ACT_IDENTITY
  }
}

// SwiGLU with clamping: gate = min(gate, limit), up = clamp(up, -limit, limit),
// y = gate * sigmoid(alpha * gate) * (up + beta). Other gated codes: f(gate) * up.
__device__ __forceinline__ float act_gated(int act, float up, float gate, float alpha, float beta, float limit) {
  if (act != ACT_SWIGLU) return act_fn(act, gate) * up;
  gate = fminf(gate, limit);
  up = fminf(fmaxf(up, -limit), limit);
  return gate * sigmoid(alpha * gate) * (up + beta);
}

// Write one requantized 16-value block g of row r in the token layout of the second GEMM.
// NVFP4 layouts: 8 bytes of codes at out + r * inter/2 + 8g and the scale byte (linear or 128x4).
// TOKENS_BF16_FRAGMENTS: the 16 decoded values (code * scale, exact in BF16) into the BF16 row
// out + r * inter (2 bytes each) in the SM90 token-fragment column order: the block is k16 step
// s = g % 4 of the 64-column block g / 4, and lane group q there holds columns 2q, 2q+1, 2q+8, 2q+9
// of the block, stored together at position 16q + 4s.
__device__ __forceinline__ void store_block(int layout, u8* out, u8* out_scales, i64 r, int g, int groups,
                                           const u8 codes[16], u8 scale) {
  if (layout == TOKENS_BF16_FRAGMENTS) {
    const float sf = e4m3_to_float(scale);
    u16* row = reinterpret_cast<u16*>(out) + r * (16 * groups) + 64 * (g / 4) + 4 * (g % 4);
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      uint2 v;
      v.x = static_cast<u32>(float_to_bf16(e2m1_to_float(codes[2 * q]) * sf)) |
            (static_cast<u32>(float_to_bf16(e2m1_to_float(codes[2 * q + 1]) * sf)) << 16);
      v.y = static_cast<u32>(float_to_bf16(e2m1_to_float(codes[2 * q + 8]) * sf)) |
            (static_cast<u32>(float_to_bf16(e2m1_to_float(codes[2 * q + 9]) * sf)) << 16);
      *reinterpret_cast<uint2*>(row + 16 * q) = v;
    }
    return;
  }
  uint2 packed{0u, 0u};
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    packed.x |= static_cast<u32>(codes[j]) << (4 * j);
    packed.y |= static_cast<u32>(codes[j + 8]) << (4 * j);
  }
  *reinterpret_cast<uint2*>(out + r * (8 * groups) + 8 * g) = packed;
  out_scales[scale_offset(r, g, groups, layout == TOKENS_NVFP4_SWIZZLED_128X4)] = scale;
}

// One block per row r < row_capacity; each thread handles 16-value quantization blocks.
//   g1          BF16 [row_capacity, N1]: the first GEMM's output, expert global already applied;
//               N1 = 2 * inter when gated (columns [0, inter) up, [inter, 2 * inter) gate), else inter;
//               16-byte aligned
//   row_to_slot int32 [row_capacity]; offsets int32 [num_experts + 1] (rows used = offsets[num_experts])
//   layout      TOKENS_*: NVFP4 codes (uint8 [row_capacity, inter / 2], element 2i in the low nibble)
//               + E4M3 scales of the inter / 16 blocks per row, linear or 128x4 swizzled; or BF16
//               fragments (BF16 [row_capacity, inter], out_scales unused)
// Per block: y = activation(float(g1)) in FP32, s = e4m3(amax(|y|) / 6), code_i = e2m1(y_i / float(s)),
// all codes 0 when float(s) == 0. Padding rows (r < total, row_to_slot[r] < 0) are written as zeros;
// rows >= total are not written. inter must be a multiple of 64.
extern "C" __global__ void moe_activation(const u16* __restrict__ g1, const int* __restrict__ row_to_slot,
                                          const int* __restrict__ offsets, int num_experts, int act, int gated,
                                          float alpha, float beta, float limit, int inter, int layout,
                                          u8* __restrict__ out, u8* __restrict__ out_scales) {
  const int r = blockIdx.x;
  if (r >= offsets[num_experts]) return;
  const int groups = inter / 16;
  const bool padding = row_to_slot[r] < 0;
  const u16* row = g1 + static_cast<i64>(r) * (gated ? 2 * inter : inter);
  for (int g = threadIdx.x; g < groups; g += blockDim.x) {
    u8 codes[16];
    u8 s = 0;
    if (padding) {
#pragma unroll
      for (int j = 0; j < 16; ++j) codes[j] = 0;
    } else {
      float y[16];
      load_bf16x8(row + 16 * g, y);
      load_bf16x8(row + 16 * g + 8, y + 8);
      if (gated) {
        float gate[16];
        load_bf16x8(row + inter + 16 * g, gate);
        load_bf16x8(row + inter + 16 * g + 8, gate + 8);
#pragma unroll
        for (int j = 0; j < 16; ++j) y[j] = act_gated(act, y[j], gate[j], alpha, beta, limit);
      } else {
#pragma unroll
        for (int j = 0; j < 16; ++j) y[j] = act_fn(act, y[j]);
      }
      float amax = 0.0f;
#pragma unroll
      for (int j = 0; j < 16; ++j) amax = fmaxf(amax, fabsf(y[j]));
      s = float_to_e4m3(amax / 6.0f);
      const float sf = e4m3_to_float(s);
#pragma unroll
      for (int j = 0; j < 16; ++j) codes[j] = sf != 0.0f ? float_to_e2m1(y[j] / sf) : 0;
    }
    store_block(layout, out, out_scales, r, g, groups, codes, s);
  }
}
