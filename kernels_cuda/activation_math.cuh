// The ten typed activations in FP32, shared by the NVFP4 pipeline's activation kernel (activation.cu)
// and the low-latency kernels (low_latency/ll_moe.cu): one device implementation per kind.
//
// Codes ACT_* come from cudnn_moe.activations.ActivationKind (through cudnn_moe.kernels.codes), and the
// scalars (alpha, beta, limit) are Activation.params(): SwiGLU (alpha, beta, limit), SwiGLUStep
// (0, 0, limit), SiTU (a, b, inf); the other kinds ignore them.
#pragma once

#include "common.cuh"

namespace moe {

// 1 / (1 + e^-x) from the two special-function approximations: e^-x = 2^(-x log2 e) (ex2.approx, the FP32
// product x log2 e rounded once) and the approximate reciprocal, within a few FP32 ulps of the exact value
// where it matters (|x| < ~16; beyond, far smaller than anything a BF16 or NVFP4 rounding of the activation
// keeps), +-Inf and NaN behaving as in the exact form. Four instructions instead of expf's range reduction
// and an IEEE division with its slow path: the activation epilogues are issue-bound.
// A host build (the CPU tests of this header) uses the exact form.
__device__ __forceinline__ float sigmoid(float x) {
#if defined(__CUDA_ARCH__)
  float e, r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(x * -1.4426950408889634f));
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(1.0f + e));
  return r;
#else
  return 1.0f / (1.0f + expf(-x));
#endif
}

// 0.5 x (1 + erf(x / sqrt(2)))
__device__ __forceinline__ float gelu_erf(float x) { return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f)); }

// 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))
__device__ __forceinline__ float gelu_tanh(float x) {
  return 0.5f * x * (1.0f + tanhf(0.79788456080286536f * (x + 0.044715f * x * x * x)));
}

// The scalar function f of an activation: y = f(x) when not gated, y = f(gate) * up when gated
// (GeGLU, GeGLUTanh; SwiGLU, SwiGLUStep and SiTU have their own forms below).
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

// clamp(x, lo, hi) as torch.clamp: NaN stays NaN.
__device__ __forceinline__ float clamp_nan(float x, float lo, float hi) { return min_nan(max_nan(x, lo), hi); }

// SwiGLU with its default parameters (alpha 1, beta 0, no limit): silu(gate) * (up + 0), bit for bit act_gated's
// SwiGLU with those parameters (its clamps to +-inf and its product with 1 are identities, NaN included; the + 0 is
// its + beta, which turns a -0 up into +0), in five fewer instructions per value.
__device__ __forceinline__ float swiglu_plain(float up, float gate) { return gate * sigmoid(gate) * (up + 0.0f); }

// Whether SwiGLU's scalars are its defaults, so that swiglu_plain gives its bits.
__device__ __forceinline__ bool swiglu_is_plain(float alpha, float beta, float limit) {
  return alpha == 1.0f && beta == 0.0f && limit > 3.40282347e38f;
}

// Gated activations of (up, gate), the common kinds:
//   SwiGLU:     g = min(gate, limit), u = clamp(up, -limit, limit), y = g * sigmoid(alpha * g) * (u + beta)
//   others:     y = act_fn(act, gate) * up   (GeGLU, GeGLUTanh)
// The clamps propagate NaN, as the reference's torch.clamp does.
__device__ __forceinline__ float act_gated(int act, float up, float gate, float alpha, float beta, float limit) {
  if (act != ACT_SWIGLU) return act_fn(act, gate) * up;
  gate = min_nan(gate, limit);
  up = clamp_nan(up, -limit, limit);
  return gate * sigmoid(alpha * gate) * (up + beta);
}

// Every gated activation: act_gated's kinds plus
//   SwiGLUStep: y = min(silu(gate), limit) * clamp(up, -limit, limit)
//   SiTU:       y = (alpha * tanh(gate / alpha) * sigmoid(gate)) * (beta * tanh(up / beta))   (alpha = a, beta = b)
// (both pipelines call this one; with a compile-time kind, e.g. the NVFP4 pipeline's SwiGLU instantiation,
// the two extra tests fold away).
__device__ __forceinline__ float act_gated_all(int act, float up, float gate, float alpha, float beta, float limit) {
  if (act == ACT_SWIGLU_STEP) {
    const float s = min_nan(gate * sigmoid(gate), limit);
    return s * clamp_nan(up, -limit, limit);
  }
  if (act == ACT_SITU) {
    const float soft_gate = alpha * tanhf(gate / alpha) * sigmoid(gate);
    return soft_gate * (beta * tanhf(up / beta));
  }
  return act_gated(act, up, gate, alpha, beta, limit);
}

}  // namespace moe
