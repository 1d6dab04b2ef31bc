// E4M3 rounding and encoding, E8M0 scales and MXFP8 block quantization (cudnn_moe.formats.quantize_mxfp8), shared by
// the low-latency kernels (their FP8 and MX intermediates, low_latency/decode.cuh) and the SM90 decode chain of the
// MX pair (its MXFP8 tokens and intermediate as BF16 values: activation_unit.cuh, permute.cu).
// Plain FP32 and integer arithmetic, the same on every arch and on the host (the CPU tests build it there); only
// expand_mxfp8_unit has a hardware form (sm_89 on) that gives the same values.
#pragma once

#include "common.cuh"

namespace moe {

// FP32 f rounded to the nearest E4M3 value (float8_e4m3fn: 3 mantissa bits, normals from 2^-6, subnormal step
// 2^-9), ties to even, saturating at +-448 (satfinite: larger magnitudes and +-Inf give +-448), NaN kept; the
// sign of zero is kept. Returns the value itself in FP32 (exact in BF16 and FP16 too), so the caller stores it
// in a 16-bit workspace or encodes it. Plain FP32 arithmetic, the same on every arch and on the host: the
// per-tensor FP8 format quantizes its intermediate with it (ll_moe.cu), as torch's to_e4m3 does on the host.
__device__ __forceinline__ float e4m3_round(float f) {
  const float a = fabsf(f);
  if (!(a == a)) return f;  // NaN
  float r;
  if (a < 0.015625f) {  // below the smallest normal (2^-6): a multiple of 2^-9, rintf rounds ties to even
    r = rintf(a * 512.0f) * 0.001953125f;
  } else {  // keep 3 of FP32's 23 mantissa bits: add half an E4M3 ulp (less one unless the kept LSB is odd)
    u32 b = __float_as_uint(a);
    b += 0x7FFFFu + ((b >> 20) & 1u);
    r = __uint_as_float(b & 0xFFF00000u);
  }
  return copysignf(fminf(r, 448.0f), f);
}

// The float8_e4m3fn byte of r, an E4M3 value (e4m3_round's result: +-0, subnormal multiples of 2^-9 below 2^-6,
// normals with 3 mantissa bits up to 448); NaN gives 0x7F (with r's sign bit). Integer work, any arch and the host.
__device__ __forceinline__ u32 e4m3_code(float r) {
  const u32 b = __float_as_uint(r), sign = (b >> 24) & 0x80u;
  const float a = fabsf(r);
  if (!(a == a)) return sign | 0x7Fu;
  if (a < 0.015625f) return sign | static_cast<u32>(a * 512.0f);  // 0..7, exact
  return sign | ((((b >> 23) & 0xFFu) - 120u) << 3) | ((b >> 20) & 7u);  // E4M3 exponent bias 7 = FP32's 127 - 120
}

// E8M0 scale byte: 2^(b - 127); b = 0 is 2^-127 (an FP32 subnormal), b = 255 is NaN.
__device__ __forceinline__ float e8m0_to_float(u32 b) {
  return b == 255u ? __uint_as_float(0x7FC00000u) : (b == 0u ? __uint_as_float(0x00400000u) : __uint_as_float(b << 23));
}

// MXFP8 quantization (the MX pairs' intermediate; cudnn_moe.formats.quantize_mxfp8 bit for bit on finite values).
// The E8M0 scale byte of a block from amax = max |v| (FP32, non-negative): the scale is 2^clamp(floor(log2 amax) - 8,
// -127, 127) (8: the exponent of E4M3's largest normal, 448 = 1.75 * 2^8), so the byte is amax's biased FP32
// exponent less 8, at least 0: a zero or subnormal amax (floor(log2) below -126) gives 0 (2^-127). A finite amax
// gives at most 246, +Inf (or NaN) 247.
__device__ __forceinline__ u32 mx_e4m3_scale_byte(float amax) {
  const u32 e = (__float_as_uint(amax) >> 23) & 0xFFu;
  return e > 8u ? e - 8u : 0u;
}

// The E4M3 value of v in a block of scale byte b (0..247, mx_e4m3_scale_byte): e4m3(fp32(v / 2^(b - 127))), nearest
// even, saturating at +-448. 2^(127 - b) is a normal FP32 power of two, so the multiply rounds exactly as the
// division by the scale does (the same real quotient, one rounding).
__device__ __forceinline__ float mx_e4m3_value(float v, u32 b) {
  return e4m3_round(v * __uint_as_float((254u - b) << 23));
}

// Its float8_e4m3fn byte.
__device__ __forceinline__ u32 mx_e4m3_code(float v, u32 b) { return e4m3_code(mx_e4m3_value(v, b)); }

// The BF16 bits of the MXFP8 element of E4M3 value r (e4m3_round's result, or a decoded code) in a block of scale byte
// b: r x 2^(b - 127), in FP32, rounded to nearest even. Exact (the element's value) wherever that value is a normal
// BF16 number or zero, which holds for every element of a block with 10 <= b <= 246 (2^-9 x 2^-117 = 2^-126, 448 x
// 2^119 below BF16's largest); quantize_mxfp8 gives b <= 246 for any finite input and b >= 10 for blocks whose amax
// is at least 2^-109. NaN (r NaN, or b = 255) stays NaN.
__device__ __forceinline__ u16 mx_value_bf16(float r, u32 b) { return float_to_bf16(r * e8m0_to_float(b)); }

// ---------------------------------------------------------------------------
// MXFP8 tokens as BF16 token units (32 columns), for the sort + permute (permute.cu)
// ---------------------------------------------------------------------------

// The 32 E4M3 code bytes (column order) and the E8M0 scale byte of an MXFP8 token unit.
struct Mxfp8Unit {
  uint4 codes[2];
  u8 scale;
};

// Unit u of MXFP8 token t: codes xs [., H] (16-byte aligned rows), scales xss [., H/32].
__device__ __forceinline__ Mxfp8Unit fetch_mxfp8_unit(const u8* __restrict__ xs, const u8* __restrict__ xss, int hidden,
                                                      i64 t, int u) {
  const uint4* codes = reinterpret_cast<const uint4*>(xs + t * hidden + 32 * u);
  return Mxfp8Unit{{codes[0], codes[1]}, xss[t * (hidden / 32) + u]};
}

// A unit's four BF16 fragment-order pieces (bf16_unit_pieces' order): element j is mx_value_bf16(e4m3 code j,
// scale), the element's value, exact for scale bytes 10..246. From sm_89 on, the hardware widens each pair of codes
// (cvt.rn.f16x2.e4m3x2: exact, every E4M3 value is an FP16 value) and rounds each pair of scaled FP32 values to
// BF16 (pack_bf16x2: nearest even with subnormals, float_to_bf16's rounding), in an eighth of the arithmetic
// form's instructions (nvcc 13.0, sm_90a: 144 against 1160 for a unit with its loads and stores); the host and older
// archs build the arithmetic form. NaN codes and scale byte 255 give NaN either way.
__device__ __forceinline__ void expand_mxfp8_unit(const Mxfp8Unit& raw, uint4 piece[4]) {
  const u32 words[8] = {raw.codes[0].x, raw.codes[0].y, raw.codes[0].z, raw.codes[0].w,
                        raw.codes[1].x, raw.codes[1].y, raw.codes[1].z, raw.codes[1].w};
  u32 pairs[16];
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  const float scale = e8m0_to_float(raw.scale);
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const unsigned short codes = static_cast<unsigned short>(words[i >> 1] >> (16 * (i & 1)));
    u32 halves;
    float lo, hi;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(halves) : "h"(codes));
    asm("{\n.reg .f16 l, h;\nmov.b32 {l, h}, %2;\ncvt.f32.f16 %0, l;\ncvt.f32.f16 %1, h;\n}"
        : "=f"(lo), "=f"(hi) : "r"(halves));
    const float scaled_hi = hi * scale, scaled_lo = lo * scale;
    pairs[i] = pack_bf16x2(scaled_lo, scaled_hi);
  }
#else
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const u32 word = words[i >> 1] >> (16 * (i & 1));
    const u16 lo = mx_value_bf16(e4m3_to_float(static_cast<u8>(word & 0xFFu)), raw.scale);
    const u16 hi = mx_value_bf16(e4m3_to_float(static_cast<u8>((word >> 8) & 0xFFu)), raw.scale);
    pairs[i] = static_cast<u32>(lo) | (static_cast<u32>(hi) << 16);
  }
#endif
  const uint4 chunk[4] = {make_uint4(pairs[0], pairs[1], pairs[2], pairs[3]),
                          make_uint4(pairs[4], pairs[5], pairs[6], pairs[7]),
                          make_uint4(pairs[8], pairs[9], pairs[10], pairs[11]),
                          make_uint4(pairs[12], pairs[13], pairs[14], pairs[15])};
  bf16_unit_pieces(chunk, piece);
}

}  // namespace moe
