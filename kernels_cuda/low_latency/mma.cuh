// Tensor-core fragments of the low-latency kernels' FP8 formats (ll_moe.cu compiled with -DLL_MMA=1): the
// weights are the A operand of mma.sync.m16n8k16 (16 weight rows), the expert's distinct tokens the B operand
// (n8, one column per token), FP32 accumulators. Host-compilable (tests/engines/ll_mma: the decoders and the
// fragment ownership are checked on the CPU with an emulation of the instruction's fragment layout); the mma
// itself is device-only.
//
// Fragment layout of m16n8k16 (PTX ISA, .f16 / .bf16 A and B, .f32 C), lane = 4 g + t (g = lane / 4, t = lane % 4):
//   A (16 x 16, row-major) a0: (row g, k 2t, 2t+1)  a1: (row g+8, k 2t, 2t+1)  a2: (row g, k 2t+8, 2t+9)
//                          a3: (row g+8, k 2t+8, 2t+9)        (the lower k in the lower half of each register)
//   B (16 x 8)             b0: (k 2t, 2t+1; column g)       b1: (k 2t+8, 2t+9; column g)
//   C (16 x 8)             c0, c1: (row g; columns 2t, 2t+1)  c2, c3: (row g+8; columns 2t, 2t+1)
//
// K permutation. K is a reduction index, so any order shared by A and B gives the same sum. Over a k64 step
// (64 consecutive K values) lane (g, t) loads 16 contiguous weight bytes (E4M3) of row g and 16 of row g + 8 at
// K offsets 16 t .. 16 t + 15, and the same 16 K values of token g (the B column it owns); it uses them as its
// k-slots over the step's 4 mma instructions: mma j (0..3) takes the lane's values 4 j .. 4 j + 3 (word j of
// each 16-byte chunk):
//   FP16 operands (cvt.rn.f16x2.e4m3x2, two adjacent codes to an FP16 pair): k-slots (2t, 2t+1) <- values
//     (4j, 4j+1), k-slots (2t+8, 2t+9) <- values (4j+2, 4j+3): 16-bit tokens are read as they lie.
//   BF16 operands (E4M3 weights with BF16 tokens): k-slots (2t, 2t+1) <- values (4j, 4j+2), (2t+8, 2t+9) <-
//     (4j+1, 4j+3): the even and odd bytes of a word decode with the same shifts (e4m3_bf16x2_odd), and the
//     tokens' two words are permuted to match (one prmt each).
// So every (row, token) product w[row][k] x[token][k] of the step lands in exactly one mma, in the C element
// (row, token) of the lane that owns it.
//
// Exact decoding: every E4M3 value is an FP16 and a BF16 value. FP16: cvt.rn.f16x2.e4m3x2 (one instruction a
// pair). BF16: the E4M3 byte b gives the BF16 bits (b & 0x80) << 8 | (b & 0x7F) << 4, of value e4m3(b) x 2^-120
// (E4M3 subnormals become BF16 subnormals), and one fma.rn.bf16x2 by 2^120 (+ -0) restores the value exactly
// (bf16x2_fma of decode.cuh; on the host an emulation). Codes 0x7F / 0xFF (NaN) are refused in weights.
#pragma once

#include "common.cuh"
#include "low_latency/decode.cuh"

namespace ll {

using moe::u32;

// The bytes of (hi:lo) picked by the four selector nibbles of s (prmt / __byte_perm without sign replication).
__device__ __forceinline__ u32 byte_perm(u32 lo, u32 hi, u32 s) {
#if defined(__CUDA_ARCH__)
  return __byte_perm(lo, hi, s);
#else
  const unsigned long long both = (static_cast<unsigned long long>(hi) << 32) | lo;
  u32 d = 0;
  for (int i = 0; i < 4; ++i) d |= static_cast<u32>((both >> (8 * ((s >> (4 * i)) & 7u))) & 0xFFu) << (8 * i);
  return d;
#endif
}

// The E4M3 bytes 0 (low half) and 1 (high half) of q as an FP16 pair, exact.
__device__ __forceinline__ u32 e4m3x2_to_f16x2(u32 q) {
#if defined(__CUDA_ARCH__)
  u32 d;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(d) : "h"(static_cast<unsigned short>(q & 0xFFFFu)));
  return d;
#else
  u32 d = 0;  // every finite E4M3 value is an FP16 normal (or zero): re-bias the FP32 exponent, keep 10 mantissa bits
  for (int h = 0; h < 2; ++h) {
    const u32 b = (q >> (8 * h)) & 0xFFu, f = __float_as_uint(e4m3_value(b));
    const u32 sign = (f >> 16) & 0x8000u, mag = f & 0x7FFFFFFFu;
    const u32 bits = mag == 0 ? 0u : mag > 0x7F800000u ? 0x7E00u : (((mag >> 23) - 112u) << 10) | ((mag >> 13) & 0x3FFu);
    d |= (sign | bits) << (16 * h);
  }
  return d;
#endif
}

// The E4M3 bytes 1 (low half) and 3 (high half) of w as BF16 bits of value x 2^-120: sign to bit 15 / 31 (it is
// there already), the 7 exponent-mantissa bits shifted right by 4.
__device__ __forceinline__ u32 e4m3_bf16x2_odd(u32 w) { return (w & 0x80008000u) | ((w & 0x7F007F00u) >> 4); }

constexpr u32 BF16X2_2P120 = 0x7B807B80u;  // 2^120 in both halves
constexpr u32 BF16X2_NEG0 = 0x80008000u;   // -0 in both halves (the FMA keeps -0 codes -0)

// Bytes (0, 2) and (1, 3) of an E4M3 word as exact BF16 pairs.
__device__ __forceinline__ u32 e4m3_bf16x2_even_pair(u32 w) {
  return bf16x2_fma(e4m3_bf16x2_odd(w << 8), BF16X2_2P120, BF16X2_NEG0);
}
__device__ __forceinline__ u32 e4m3_bf16x2_odd_pair(u32 w) {
  return bf16x2_fma(e4m3_bf16x2_odd(w), BF16X2_2P120, BF16X2_NEG0);
}

__device__ __forceinline__ u32 word_at(const uint4& v, int i) { return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w; }

// A fragments of mma j (0..3) of a k64 step from the lane's 16 E4M3 bytes of row g (lo) and of row g + 8 (hi).
// BF16: the BF16 layout of the header (values (4j, 4j+2) then (4j+1, 4j+3)); else FP16 (adjacent pairs).
template <bool BF16>
__device__ __forceinline__ void a_fragment(const uint4& lo, const uint4& hi, int j, u32 (&a)[4]) {
  const u32 wl = word_at(lo, j), wh = word_at(hi, j);
  if (BF16) {
    a[0] = e4m3_bf16x2_even_pair(wl), a[1] = e4m3_bf16x2_even_pair(wh);
    a[2] = e4m3_bf16x2_odd_pair(wl), a[3] = e4m3_bf16x2_odd_pair(wh);
  } else {
    a[0] = e4m3x2_to_f16x2(wl), a[1] = e4m3x2_to_f16x2(wh);
    a[2] = e4m3x2_to_f16x2(wl >> 16), a[3] = e4m3x2_to_f16x2(wh >> 16);
  }
}

// B fragment of mma j from the lane's 16 K values of its token: 16-bit tokens in two 16-byte chunks (q0: values
// 0..7, q1: 8..15; BF16 permuted as the header says, FP16 as they lie), E4M3 tokens in q0 (q1 unused).
template <int XK>
__device__ __forceinline__ void b_fragment(const uint4& q0, const uint4& q1, int j, u32 (&b)[2]) {
  if (XK == LL_INPUT_FP8 || XK == LL_INPUT_FP8_BLOCK) {
    const u32 w = word_at(q0, j);
    b[0] = e4m3x2_to_f16x2(w), b[1] = e4m3x2_to_f16x2(w >> 16);
  } else {
    const uint4& q = j < 2 ? q0 : q1;
    const u32 w0 = word_at(q, 2 * (j & 1)), w1 = word_at(q, 2 * (j & 1) + 1);
    if (XK == LL_INPUT_BF16) {
      b[0] = byte_perm(w0, w1, 0x5410u), b[1] = byte_perm(w0, w1, 0x7632u);
    } else {
      b[0] = w0, b[1] = w1;
    }
  }
}

// The lane and register (c0..c3) of the C element (row, col) of an m16n8 FP32 accumulator (the layout above).
__device__ __forceinline__ void c_slot(int row, int col, int& lane, int& reg) {
  lane = (row & 7) * 4 + (col >> 1);
  reg = ((row >> 3) << 1) | (col & 1);
}

#if defined(__CUDA_ARCH__)
// c += A B for one m16n8k16 step, FP32 accumulators; BF16 or FP16 operands.
template <bool BF16>
__device__ __forceinline__ void mma_16816(float (&c)[4], const u32 (&a)[4], const u32 (&b)[2]) {
  if (BF16)
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  else
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
#endif

}  // namespace ll
