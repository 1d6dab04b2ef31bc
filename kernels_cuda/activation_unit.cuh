// One unit (32 consecutive values of a row) of the activation stage: activation in FP32, NVFP4 requantize
// (or BF16 rounding), and the store in the second GEMM's token layout. Shared by the activation kernel
// (activation.cu) and the wgmma GEMM's activation epilogue (sm90/wgmma_gemm.cu), so both give the same bits.
#pragma once

#include "common.cuh"
#include "activation_math.cuh"
#include "mxfp8.cuh"

namespace moe {

// Activation of the 32 values at column c0 of a GEMM1 row (y, FP32): f(x) when not gated, else
// f(gate) * up with up at c0 and gate at gate_offset + c0. The activation is ACT when ACT >= 0 (compile-time:
// its switch folds away), else the run-time code `act`.
// zero_sign: whether the sign of a zero y matters (BF16 outputs; a requantize maps both zeros to +0, so plain SwiGLU
// may drop its + 0 there).
template <int ACT, bool GATED>
__device__ __forceinline__ void activate_32(const u16* row, int gate_offset, int c0, int act, float alpha, float beta,
                                            float limit, bool zero_sign, float y[32]) {
  const int kind = ACT >= 0 ? ACT : act;
#pragma unroll
  for (int i = 0; i < 4; ++i) load_bf16x8(row + c0 + 8 * i, y + 8 * i);
  if (GATED) {
    float gate[32];
#pragma unroll
    for (int i = 0; i < 4; ++i) load_bf16x8(row + gate_offset + c0 + 8 * i, gate + 8 * i);
    if (kind == ACT_SWIGLU && swiglu_is_plain(alpha, beta, limit)) {
      if (zero_sign) {
#pragma unroll
        for (int j = 0; j < 32; ++j) y[j] = swiglu_plain(y[j], gate[j]);
      } else {
#pragma unroll
        for (int j = 0; j < 32; ++j) y[j] = gate[j] * sigmoid(gate[j]) * y[j];  // swiglu_plain up to a zero's sign
      }
      return;
    }
#pragma unroll
    for (int j = 0; j < 32; ++j) y[j] = act_gated_all(kind, y[j], gate[j], alpha, beta, limit);
  } else {
#pragma unroll
    for (int j = 0; j < 32; ++j) y[j] = act_fn(kind, y[j]);
  }
}

// The reciprocal of d as CUDA's IEEE division refines it: the hardware approximation and one Newton step.
__device__ __forceinline__ float refined_reciprocal(float d) {
  float r0;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r0) : "f"(d));
  return fmaf(r0, fmaf(-d, r0, 1.0f), r0);
}

// y / d rounded to nearest even, given r = refined_reciprocal(d): the fast path of CUDA's IEEE division (the
// quotient y r corrected once with its exact residual), with the reciprocal shared by a whole block instead of
// recomputed per value. It equals y / d wherever CUDA's own division takes that path, which holds for every
// divisor requantize_16 uses (E4M3 scales, 2^-9 .. 448) and every y whose quotient lies in the normal range;
// nearer zero or infinity both round to the same E2M1 grid value. Where y r is infinite or NaN (y infinite
// or NaN, or the quotient overflows) it is the result, as the division's (the correction would make NaN).
// corrected_quotient is the correction alone, for a caller whose quotients are known to be finite.
__device__ __forceinline__ float corrected_quotient(float y, float d, float r, float q0) {
  return fmaf(r, fmaf(-q0, d, y), q0);
}

__device__ __forceinline__ float divide_rn(float y, float d, float r) {
  const float q0 = y * r;
  return fabsf(q0) <= 3.40282347e38f ? corrected_quotient(y, d, r, q0) : q0;
}

// amax / 6, the quotient IEEE (divide_rn's fast path, exact for every amax whose quotient is normal; below that it
// rounds to E4M3 zero either way) without the slow-path branch of the division operator.
__device__ __forceinline__ float sixth(float amax) { return divide_rn(amax, 6.0f, refined_reciprocal(6.0f)); }

// The E4M3 block scale of a 16-value block with largest magnitude amax: e4m3(amax / 6).
__device__ __forceinline__ u8 block_scale_e4m3(float amax) { return float_to_e4m3(sixth(amax)); }

// Requantize one 16-value block in place: s = e4m3(amax(|y|) / 6) (returned; amax NaN-blind), y_j = the E2M1 grid
// value of y_j / float(s) (the IEEE quotient, divide_rn; round_to_e2m1 is e2m1_to_float(float_to_e2m1(.))), all +0
// when float(s) == 0.
// Two paths, one result. While the NaN-propagating maximum of |y| lies in [6 * 2^-6, 6 * 448) (no NaN, no infinity),
// it is the NaN-blind amax, amax / 6 is a normal E4M3 value before rounding (e4m3_normal: s without the conversion's
// special cases), and s is amax / 6 within 1/16, so every quotient is below 6.4 in magnitude: divide_rn's overflow
// test, round_to_e2m1's NaN test and its saturation to +-6 would always pass, and that path leaves them out
// (round_below_7_to_e2m1). Otherwise the loop with all of them.
__device__ __forceinline__ u8 requantize_16(float y[16]) {
  float m[8];  // the NaN-propagating maximum of |y| as a tree, four steps deep instead of a chain of sixteen
#pragma unroll
  for (int j = 0; j < 8; ++j) m[j] = max_nan(fabsf(y[j]), fabsf(y[j + 8]));
#pragma unroll
  for (int w = 4; w > 0; w >>= 1)
#pragma unroll
    for (int j = 0; j < w; ++j) m[j] = max_nan(m[j], m[j + w]);
  const float peak = m[0];
  if (peak >= 0.09375f && peak < 2688.0f) {
    float sf;
    const u8 s = e4m3_normal(sixth(peak), sf);
    const float r = refined_reciprocal(sf);
#pragma unroll
    for (int j = 0; j < 16; ++j) y[j] = round_below_7_to_e2m1(corrected_quotient(y[j], sf, r, y[j] * r));
    return s;
  }
  float amax = 0.0f;
#pragma unroll
  for (int j = 0; j < 16; ++j) amax = fmaxf(amax, fabsf(y[j]));
  const u8 s = block_scale_e4m3(amax);
  const float sf = e4m3_to_float(s);
  if (sf == 0.0f) {
#pragma unroll
    for (int j = 0; j < 16; ++j) y[j] = 0.0f;
    return s;
  }
  const float r = refined_reciprocal(sf);
#pragma unroll
  for (int j = 0; j < 16; ++j) y[j] = round_to_e2m1(divide_rn(y[j], sf, r));
  return s;
}

// Quantize the 32 values of a unit (one block) to MXFP8 in place (the MX pair's intermediate; quantize_mxfp8, as the
// low-latency kernels do): b = mx_e4m3_scale_byte(amax), amax the NaN-blind maximum of |v| (fmaxf), each value
// becomes its E4M3 element times 2^(b - 127) in FP32 (exact: the element's lowest bit is at least 2^-136, above FP32's
// subnormal step), whose BF16 rounding is mx_value_bf16's.
__device__ __forceinline__ void mx_quantize_32(float v[32]) {
  float amax = 0.0f;
#pragma unroll
  for (int j = 0; j < 32; ++j) amax = fmaxf(amax, fabsf(v[j]));
  const u32 b = mx_e4m3_scale_byte(amax);
  const float scale = e8m0_to_float(b);
#pragma unroll
  for (int j = 0; j < 32; ++j) v[j] = mx_e4m3_value(v[j], b) * scale;
}

// BF16 bits of grid value v times scale sf, packed in pairs: the product is exact in FP32 and in BF16
// (2 x 4 significant bits, no NaN), so its top half is the round-to-nearest-even BF16.
__device__ __forceinline__ u32 scaled_bf16x2(float v0, float v1, float sf) {
  return __byte_perm(__float_as_uint(__fmul_rn(v0, sf)), __float_as_uint(__fmul_rn(v1, sf)), 0x7632);
}

// The 32 values of a unit in the BF16 layouts, as four 16-byte chunks in natural column order (chunk c: values
// 8c .. 8c + 7): the grid values v times their block's scale (s0: values 0-15, s1: 16-31; exact).
__device__ __forceinline__ void scaled_unit_chunks(const float v[32], u8 s0, u8 s1, uint4 chunk[4]) {
  const float sf0 = e4m3_to_float(s0), sf1 = e4m3_to_float(s1);
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    const float sf = c < 2 ? sf0 : sf1;
    const float* w = v + 8 * c;
    chunk[c] = make_uint4(scaled_bf16x2(w[0], w[1], sf), scaled_bf16x2(w[2], w[3], sf), scaled_bf16x2(w[4], w[5], sf),
                          scaled_bf16x2(w[6], w[7], sf));
  }
}

// bf16_rne(y[j]) in the low half, bf16_rne(y[j + 1]) in the high half.
__device__ __forceinline__ u32 bf16_pair(const float* y, int j) {
  return static_cast<u32>(float_to_bf16(y[j])) | (static_cast<u32>(float_to_bf16(y[j + 1])) << 16);
}

// The same four chunks of bf16_rne(y) (a unit without requantization).
__device__ __forceinline__ void rounded_unit_chunks(const float y[32], uint4 chunk[4]) {
#pragma unroll
  for (int c = 0; c < 4; ++c)
    chunk[c] =
        make_uint4(bf16_pair(y, 8 * c), bf16_pair(y, 8 * c + 2), bf16_pair(y, 8 * c + 4), bf16_pair(y, 8 * c + 6));
}

// The four chunks of unit u of row r at their places: natural column order (TOKENS_BF16_ROWS, 16-byte stores at
// column 32u) or the tiled planes of `rows` rows (TOKENS_BF16_TILED, tiled_chunk_offset).
__device__ __forceinline__ void store_unit_chunks(int layout, u16* values, i64 r, int u, int inter, int rows,
                                                  const uint4 chunk[4]) {
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    const i64 at = layout == TOKENS_BF16_TILED ? tiled_chunk_offset(r, 4 * u + c, rows) : r * inter + 32 * u + 8 * c;
    *reinterpret_cast<uint4*>(values + at) = chunk[c];
  }
}

// Groups 2u and 2u + 1 (32 values, columns 32u .. 32u + 31) of row r: grid values v (zero for padding
// rows) and their scale bytes, written in the second GEMM's token layout.
// TOKENS_BF16_FRAGMENTS: the 32 decoded values (v * scale, exact) into the BF16 row out + r * inter in
// the SM90 token-fragment column order: group g is k16 step g % 4 of the 64-column block g / 4, and lane
// group q there holds columns 2q, 2q+1, 2q+8, 2q+9 of the group at position 16q + 4(g % 4); the two
// groups are adjacent, so each q is one 16-byte store.
// NVFP4 layouts: 16 bytes of codes at out + r * inter/2 + 16u (8-byte stores when out is not 16-byte
// aligned) and the two scale bytes (linear or 128x4).
// TOKENS_BF16_ROWS and TOKENS_BF16_TILED: the same values as scaled_unit_chunks, placed by store_unit_chunks.
__device__ __forceinline__ void store_unit(int layout, u8* out, u8* out_scales, i64 r, int u, int inter, int rows,
                                           const float v[32], u8 s0, u8 s1) {
  if (layout == TOKENS_BF16_ROWS || layout == TOKENS_BF16_TILED) {
    uint4 chunk[4];
    scaled_unit_chunks(v, s0, s1, chunk);
    store_unit_chunks(layout, reinterpret_cast<u16*>(out), r, u, inter, rows, chunk);
    return;
  }
  if (layout == TOKENS_BF16_FRAGMENTS) {
    const float sf0 = e4m3_to_float(s0), sf1 = e4m3_to_float(s1);
    u16* dst = reinterpret_cast<u16*>(out) + r * inter + 64 * (u >> 1) + 8 * (u & 1);
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      uint4 w;
      w.x = scaled_bf16x2(v[2 * q], v[2 * q + 1], sf0);
      w.y = scaled_bf16x2(v[2 * q + 8], v[2 * q + 9], sf0);
      w.z = scaled_bf16x2(v[16 + 2 * q], v[16 + 2 * q + 1], sf1);
      w.w = scaled_bf16x2(v[16 + 2 * q + 8], v[16 + 2 * q + 9], sf1);
      *reinterpret_cast<uint4*>(dst + 16 * q) = w;
    }
    return;
  }
  u32 packed[4] = {0u, 0u, 0u, 0u};
#pragma unroll
  for (int j = 0; j < 32; ++j) packed[j / 8] |= static_cast<u32>(float_to_e2m1(v[j])) << (4 * (j % 8));
  u8* dst = out + r * (inter / 2) + 16 * u;
  if ((reinterpret_cast<u64>(dst) & 15u) == 0) {
    *reinterpret_cast<uint4*>(dst) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
  } else {
    reinterpret_cast<uint2*>(dst)[0] = make_uint2(packed[0], packed[1]);
    reinterpret_cast<uint2*>(dst)[1] = make_uint2(packed[2], packed[3]);
  }
  const int groups = inter / 16;
  const bool swizzled = layout == TOKENS_NVFP4_SWIZZLED_128X4;
  out_scales[scale_offset(r, 2 * u, groups, swizzled)] = s0;
  out_scales[scale_offset(r, 2 * u + 1, groups, swizzled)] = s1;
}

// Unit u of row r without requantization: bf16_rne(y) at its places in the BF16 layout, as store_unit.
__device__ __forceinline__ void store_unit_bf16(int layout, u8* out, i64 r, int u, int inter, int rows,
                                                const float y[32]) {
  if (layout == TOKENS_BF16_ROWS || layout == TOKENS_BF16_TILED) {
    uint4 chunk[4];
    rounded_unit_chunks(y, chunk);
    store_unit_chunks(layout, reinterpret_cast<u16*>(out), r, u, inter, rows, chunk);
    return;
  }
  u16* dst = reinterpret_cast<u16*>(out) + r * inter + 64 * (u >> 1) + 8 * (u & 1);
#pragma unroll
  for (int q = 0; q < 4; ++q)
    *reinterpret_cast<uint4*>(dst + 16 * q) =
        make_uint4(bf16_pair(y, 2 * q), bf16_pair(y, 2 * q + 8), bf16_pair(y, 16 + 2 * q), bf16_pair(y, 24 + 2 * q));
}

// Unit u of output row r (inter values per row, `rows` rows in the output) from the 32 BF16 values at src (up;
// gate at src + gate_offset when gated): activation in FP32, then by inter_code two requantized 16-value blocks
// stored by store_unit (INTER_NVFP4), or bf16_rne(y) by store_unit_bf16 (INTER_BF16); with MX (INTER_MXFP8, decided
// at compile time so that the forms without it keep their registers) the MXFP8 elements of the unit as BF16 values by
// store_unit_bf16 (mx_quantize_32; BF16 layouts only). A padding row is stored as zeros (codes and scales 0).
template <int ACT, bool GATED, bool MX = false>
__device__ __forceinline__ void activate_store_unit(const u16* src, int gate_offset, bool padding, i64 r, int u,
                                                    int inter, int rows, int act, float alpha, float beta, float limit,
                                                    int layout, int inter_code, u8* out, u8* out_scales) {
  float v[32];
  u8 s0 = 0, s1 = 0;
  if (padding) {
#pragma unroll
    for (int j = 0; j < 32; ++j) v[j] = 0.0f;
  } else {
    activate_32<ACT, GATED>(src, gate_offset, 0, act, alpha, beta, limit, MX || inter_code == INTER_BF16, v);
    if (MX || inter_code == INTER_BF16) {
      if (MX) mx_quantize_32(v);
      store_unit_bf16(layout, out, r, u, inter, rows, v);
      return;
    }
    s0 = requantize_16(v);
    s1 = requantize_16(v + 16);
  }
  store_unit(layout, out, out_scales, r, u, inter, rows, v, s0, s1);
}

// The same unit's values in the BF16 layouts as activate_store_unit stores them, as four 16-byte chunks in natural
// column order (scaled_unit_chunks or rounded_unit_chunks; zeros for a padding row), for a caller that places them.
template <int ACT, bool GATED, bool MX = false>
__device__ __forceinline__ void activate_unit_chunks(const u16* src, int gate_offset, bool padding, int act,
                                                     float alpha, float beta, float limit, int inter_code,
                                                     uint4 chunk[4]) {
  if (padding) {
#pragma unroll
    for (int c = 0; c < 4; ++c) chunk[c] = make_uint4(0u, 0u, 0u, 0u);
    return;
  }
  float v[32];
  activate_32<ACT, GATED>(src, gate_offset, 0, act, alpha, beta, limit, MX || inter_code == INTER_BF16, v);
  if (MX || inter_code == INTER_BF16) {
    if (MX) mx_quantize_32(v);
    rounded_unit_chunks(v, chunk);
    return;
  }
  const u8 s0 = requantize_16(v);
  const u8 s1 = requantize_16(v + 16);
  scaled_unit_chunks(v, s0, s1, chunk);
}

// The same unit by the 32 lanes of a warp, lane j computing value j, for the BF16 layouts (a decode epilogue
// with few rows: a 32x shorter dependency chain per unit). Bit for bit activate_store_unit's stores: the
// activation of value j, its 16-value block's amax by a butterfly of fmaxf (NaN-blind, as the loop's; MX: the
// 32-value block's), the block's scale and quotient, then one 2-byte store at the value's place in the layout
// (store_unit's TOKENS_BF16_FRAGMENTS pieces, natural order, or its tiled place). All 32 lanes call it with one unit.
// The source row holds BF16 preactivations (u16), or FP32 ones (float: MXINT4, whose contract keeps them unrounded).
__device__ __forceinline__ float preactivation(const u16* src, int j) { return bf16_to_float(src[j]); }
__device__ __forceinline__ float preactivation(const float* src, int j) { return src[j]; }

template <int ACT, bool GATED, bool MX, typename Src>
__device__ __forceinline__ void activate_store_unit_warp(const Src* src, int gate_offset, bool padding, i64 r,
                                                         int u, int inter, int rows, int act, float alpha, float beta,
                                                         float limit, int layout, int inter_code, u16* out) {
  const int j = static_cast<int>(threadIdx.x & 31);
  const int kind = ACT >= 0 ? ACT : act;
  const float up = preactivation(src, j);
  const float y = GATED ? act_gated_all(kind, up, preactivation(src, gate_offset + j), alpha, beta, limit)
                        : act_fn(kind, up);
  float amax = fmaxf(0.0f, fabsf(y));
#pragma unroll
  for (int lanes = 1; lanes < (MX ? 32 : 16); lanes <<= 1)
    amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, lanes));
  u16 bits = 0;
  if (!padding && MX) {
    const u32 b = mx_e4m3_scale_byte(amax);
    bits = mx_value_bf16(mx_e4m3_value(y, b), b);
  } else if (!padding && inter_code == INTER_BF16) {
    bits = float_to_bf16(y);
  } else if (!padding) {
    const float sf = e4m3_to_float(block_scale_e4m3(amax));
    const float v = sf != 0.0f ? round_to_e2m1(divide_rn(y, sf, refined_reciprocal(sf))) : 0.0f;
    bits = static_cast<u16>(__float_as_uint(__fmul_rn(v, sf)) >> 16);  // exact product: its top half (scaled_bf16x2)
  }
  if (layout == TOKENS_BF16_TILED) {
    out[tiled_chunk_offset(r, 4 * u + (j >> 3), rows) + (j & 7)] = bits;
    return;
  }
  const int column = layout == TOKENS_BF16_ROWS
                         ? 32 * u + j
                         : 64 * (u >> 1) + 8 * (u & 1) + 16 * ((j & 7) >> 1) + 2 * (j >> 3) + (j & 1);
  out[r * inter + column] = bits;
}

}  // namespace moe
