// Activation of the first GEMM's output, quantized to NVFP4 for the second GEMM.
#include "common.cuh"

using namespace moe;

// Activation codes; the Python enum uses the same values.
#define ACT_IDENTITY 0
#define ACT_RELU 1
#define ACT_GELU 2        // erf form
#define ACT_SILU 3
#define ACT_RELU2 4
#define ACT_SWIGLU 10     // gated, with alpha / beta / limit
#define ACT_GEGLU 11      // gated, erf GELU
#define ACT_GEGLU_TANH 12 // gated, tanh GELU

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

// One block per row r < row_capacity; each thread handles 16-value quantization blocks.
//   g1          BF16 [row_capacity, N1]: N1 = 2 * inter when gated (columns [0, inter) up,
//               [inter, 2 * inter) gate), N1 = inter otherwise; 16-byte aligned
//   alpha1      FP32 [num_experts]: value = float(g1) * alpha1[row_expert[r]]
//   row_to_slot, row_expert  int32 [row_capacity]; offsets int32 [num_experts + 1] (total = offsets[num_experts])
//   out         uint8 [row_capacity, inter / 2]: E2M1 codes, element 2i in the low nibble of byte i
//   out_scales  E4M3 scales of inter / 16 blocks per row, linear or 128x4 swizzled (swizzled != 0)
// Per block: s = e4m3(amax / 6), code_i = e2m1(y_i / float(s)), all codes 0 when float(s) == 0.
// Padding rows (r < total, row_to_slot[r] < 0) are written as zeros; rows >= total are not written.
// inter must be a multiple of 16.
extern "C" __global__ void moe_activation(const u16* __restrict__ g1, const float* __restrict__ alpha1,
                                          const int* __restrict__ row_to_slot, const int* __restrict__ row_expert,
                                          const int* __restrict__ offsets, int num_experts, int act, int gated,
                                          float alpha, float beta, float limit, int inter, int swizzled,
                                          u8* __restrict__ out, u8* __restrict__ out_scales) {
  const int r = blockIdx.x;
  if (r >= offsets[num_experts]) return;
  const int groups = inter / 16;
  u8* out_row = out + static_cast<i64>(r) * (inter / 2);
  if (row_to_slot[r] < 0) {
    for (int g = threadIdx.x; g < groups; g += blockDim.x) {
      *reinterpret_cast<uint2*>(out_row + 8 * g) = uint2{0u, 0u};
      out_scales[scale_offset(r, g, groups, swizzled)] = 0;
    }
    return;
  }
  const float scale_in = alpha1[row_expert[r]];
  const u16* row = g1 + static_cast<i64>(r) * (gated ? 2 * inter : inter);
  for (int g = threadIdx.x; g < groups; g += blockDim.x) {
    float y[16];
    load_bf16x8(row + 16 * g, y);
    load_bf16x8(row + 16 * g + 8, y + 8);
    if (gated) {
      float gate[16];
      load_bf16x8(row + inter + 16 * g, gate);
      load_bf16x8(row + inter + 16 * g + 8, gate + 8);
#pragma unroll
      for (int j = 0; j < 16; ++j) y[j] = act_gated(act, y[j] * scale_in, gate[j] * scale_in, alpha, beta, limit);
    } else {
#pragma unroll
      for (int j = 0; j < 16; ++j) y[j] = act_fn(act, y[j] * scale_in);
    }
    float amax = 0.0f;
#pragma unroll
    for (int j = 0; j < 16; ++j) amax = fmaxf(amax, fabsf(y[j]));
    const u8 s = float_to_e4m3(amax / 6.0f);
    const float sf = e4m3_to_float(s);
    uint2 packed{0u, 0u};
    if (sf != 0.0f) {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        packed.x |= static_cast<u32>(float_to_e2m1(y[j] / sf)) << (4 * j);
        packed.y |= static_cast<u32>(float_to_e2m1(y[j + 8] / sf)) << (4 * j);
      }
    }
    *reinterpret_cast<uint2*>(out_row + 8 * g) = packed;
    out_scales[scale_offset(r, g, groups, swizzled)] = s;
  }
}
