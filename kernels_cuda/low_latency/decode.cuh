// Exact decoders of the low-latency kernels' 4-bit and FP8 weights (and NVFP4 tokens), and (from mxfp8.cuh) the
// E4M3 / MXFP8 encoders of their quantized intermediates, kept apart from ll_moe.cu so
// that a host build (tests/test_low_latency_kernels_cpu.py) can check them against the project's codecs for
// every code: on the device bf16x2_fma is one fma.rn.bf16x2; on the host it is emulated per half (the FP32
// fma rounded to BF16, equal to the instruction wherever the FP32 result is exact, as in every use here).
#pragma once

#include "common.cuh"
#include "mxfp8.cuh"

namespace ll {

using moe::e4m3_code;
using moe::e4m3_round;
using moe::e8m0_to_float;
using moe::mx_e4m3_code;
using moe::mx_e4m3_scale_byte;
using moe::u16;
using moe::u32;

// Two BF16 lanes: d = a * b + c, rounded to nearest even, subnormals kept.
__device__ __forceinline__ u32 bf16x2_fma(u32 a, u32 b, u32 c) {
#if defined(__CUDA_ARCH__)
  u32 d;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
#else
  u32 d = 0;
  for (int h = 0; h < 2; ++h) {
    const float fa = moe::bf16_to_float(static_cast<u16>(a >> (16 * h)));
    const float fb = moe::bf16_to_float(static_cast<u16>(b >> (16 * h)));
    const float fc = moe::bf16_to_float(static_cast<u16>(c >> (16 * h)));
    d |= static_cast<u32>(moe::float_to_bf16(fmaf(fa, fb, fc))) << (16 * h);
  }
  return d;
#endif
}

// The 8 E2M1 codes of word q (code j = nibble j: element 2i is the low nibble of byte i), exact, in FP32.
// Pair j holds codes j (low half) and j + 4 (high half) as BF16 of value x 2^-126 (sign at bit 15, the
// three magnitude bits at 8..6; codes 0 and 1 are BF16 subnormals), then times 2^126 in one bf16x2 FMA.
__device__ __forceinline__ void decode_e2m1_word(u32 q, float v[8]) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const u32 p = q << (12 - 4 * j);
    u32 b = (p & 0x80008000u) | ((p >> 6) & 0x01C001C0u);
    b = bf16x2_fma(b, 0x7E807E80u, 0x80008000u);  // x 2^126 + (-0)
    v[j] = __uint_as_float(b << 16);
    v[j + 4] = __uint_as_float(b & 0xFFFF0000u);
  }
}

// The 8 two's-complement INT4 codes of word q, exact, in FP32: the float with bits 0x4B000000 | (n ^ 8) is
// 2^23 + n + 8 for the signed code n, so one FADD of -(2^23 + 8) leaves n.
__device__ __forceinline__ void decode_int4_word(u32 q, float v[8]) {
#pragma unroll
  for (int j = 0; j < 8; ++j) v[j] = __uint_as_float(0x4B000000u | (((q >> (4 * j)) & 0xFu) ^ 8u)) - 8388616.0f;
}

// Word s of a lane's 16 bytes of an SM90 fragment tile (cudnn_moe.engines.sm90.layout: the lane of group g and
// quad q, k16 step s of the tile) holds the lane's four mma A registers of that step, two codes each (the low half
// the lower k): a0 row g at k = 2q, 2q + 1; a1 row g + 8 at the same k; a2 row g at k = 2q + 8, 2q + 9; a3 row
// g + 8 there (k within the step). The two decoders below give v[2r], v[2r + 1] = register r's two values, exact,
// in FP32: the rows' weights without their block scales.
// E2M1 (NVFP4 tiles): moe::place_tile_e2m1 makes each register a BF16 pair of value x 2^-126 and one bf16x2 FMA by
// 2^126 restores it.
__device__ __forceinline__ void decode_tile_e2m1_word(u32 w, float v[8]) {
  u32 placed[4];
  moe::place_tile_e2m1(w, placed);
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const u32 b = bf16x2_fma(placed[r], 0x7E807E80u, 0x80008000u);  // x 2^126 + (-0)
    v[2 * r] = __uint_as_float(b << 16);
    v[2 * r + 1] = __uint_as_float(b & 0xFFFF0000u);
  }
}

// INT4 (MXINT4 tiles): register r's two's-complement codes at bits 4r .. 4r + 3 of each half, decoded as
// decode_int4_word does.
__device__ __forceinline__ void decode_tile_int4_word(u32 w, float v[8]) {
#pragma unroll
  for (int r = 0; r < 4; ++r)
#pragma unroll
    for (int x = 0; x < 2; ++x)
      v[2 * r + x] = __uint_as_float(0x4B000000u | (((w >> (4 * r + 16 * x)) & 0xFu) ^ 8u)) - 8388616.0f;
}

// The 8 scale codes of an NVFP4 tile's row pair (lo: bytes 0..3, hi: bytes 4..7; layout.py, scale tiles) as their
// E4M3 scales, exact, in FP32: code c is the BF16 s x 2^118 with bits 16 c + NVFP4_TILE_SCALE_BASE, so the FP32 of
// those bits times 2^-118 is s (a zero scale gives -0 or a negative subnormal that the product flushes to -0; the
// NaN code gives NaN).
__device__ __forceinline__ void decode_tile_scale_codes(u32 lo, u32 hi, float v[8]) {
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const u32 code = ((j < 4 ? lo : hi) >> (8 * (j & 3))) & 0xFFu;
    v[j] = __uint_as_float((code * 16u + NVFP4_TILE_SCALE_BASE) << 16) * 0x1p-118f;
  }
}

// The two E2M1 codes of byte b (element 2i: the low nibble), exact, in FP32 (NVFP4 token pairs of the tile kernels).
__device__ __forceinline__ void decode_e2m1_byte(u32 b, float& lo, float& hi) {
  const u32 p = ((b & 0xFu) << 12) | ((b & 0xF0u) << 24);  // code 0 at bits 12..15, code 1 at 28..31
  const u32 placed = bf16x2_fma((p & 0x80008000u) | ((p >> 6) & 0x01C001C0u), 0x7E807E80u, 0x80008000u);
  lo = __uint_as_float(placed << 16);
  hi = __uint_as_float(placed & 0xFFFF0000u);
}

// E4M3 byte b (float8_e4m3fn), exact, in FP32, in a few integer operations: with the sign at bit 31 and the
// 7 other bits at 26..20, the FP32 pattern is the value x 2^-120 (subnormals land on FP32 subnormals), and
// one FMUL by 2^120 restores it; 0x7F / 0xFF are NaN.
__device__ __forceinline__ float e4m3_value(u32 b) {
  const float v = __uint_as_float(((b & 0x80u) << 24) | ((b & 0x7Fu) << 20)) * __uint_as_float(0x7B800000u);
  return (b & 0x7Fu) == 0x7Fu ? __uint_as_float(0x7FC00000u) : v;
}

// The 8 E4M3 bytes of lo (elements 0..3, element j in byte j) and hi (elements 4..7), exact, in FP32. Where the
// GPU converts FP8 itself (SM89 and later: cvt.rn.f16x2.e4m3x2, exact since every E4M3 value is an FP16 value)
// two codes become an FP16 pair in one instruction, then FP32; elsewhere (SM80, the host) e4m3_value per byte.
// 0x7F / 0xFF (NaN) give NaN either way; the prepare methods refuse them in weights.
__device__ __forceinline__ void decode_e4m3_word(u32 lo, u32 hi, float v[8]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  const u32 w[2] = {lo, hi};
#pragma unroll
  for (int i = 0; i < 2; ++i) {
#pragma unroll
    for (int p = 0; p < 2; ++p) {
      const u16 codes = static_cast<u16>(w[i] >> (16 * p));
      u32 pair;
      asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(pair) : "h"(codes));
      const u16 h0 = static_cast<u16>(pair & 0xFFFFu), h1 = static_cast<u16>(pair >> 16);
      asm("cvt.f32.f16 %0, %1;" : "=f"(v[4 * i + 2 * p]) : "h"(h0));
      asm("cvt.f32.f16 %0, %1;" : "=f"(v[4 * i + 2 * p + 1]) : "h"(h1));
    }
  }
#else
#pragma unroll
  for (int j = 0; j < 8; ++j) v[j] = e4m3_value(((j < 4 ? lo : hi) >> (8 * (j & 3))) & 0xFFu);
#endif
}

}  // namespace ll
