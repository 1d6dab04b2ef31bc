// Tensor-core fragments of the low-latency kernels' FP8 formats and MX pairs (ll_moe.cu compiled with -DLL_MMA=1): the
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

#if !defined(__CUDA_ARCH__)  // host stand-ins of the FP16 conversions
inline float f16_bits_value(u32 h) {  // FP16 bits -> value (host)
  const int e = (h >> 10) & 31, m = h & 1023;
  const float v = e == 0 ? std::ldexp(static_cast<float>(m), -24) : std::ldexp(static_cast<float>(1024 + m), e - 25);
  return (h & 0x8000u) ? -v : v;
}
inline u32 f16_bits_exact(float f) {  // an FP16 normal or zero value -> its bits (host)
  const u32 b = __float_as_uint(f), sign = (b >> 16) & 0x8000u, mag = b & 0x7FFFFFFFu;
  return sign | (mag == 0 ? 0u : (((mag >> 23) - 112u) << 10) | ((mag >> 13) & 0x3FFu));
}
#endif

// The E4M3 bytes 0 (low half) and 1 (high half) of q as an FP16 pair, exact.
__device__ __forceinline__ u32 e4m3x2_to_f16x2(u32 q) {
#if defined(__CUDA_ARCH__)
  u32 d;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(d) : "h"(static_cast<unsigned short>(q & 0xFFFFu)));
  return d;
#else
  u32 d = 0;  // every finite E4M3 value is an FP16 normal (or zero)
  for (int h = 0; h < 2; ++h) {
    const float v = e4m3_value((q >> (8 * h)) & 0xFFu);
    d |= (v == v ? f16_bits_exact(v) : (__float_as_uint(v) >> 16 & 0x8000u) | 0x7E00u) << (16 * h);
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

// ------------------------------------------------------------------------------------------ the MX pairs
// MXFP4 (E2M1) or MXFP8 (E4M3) weights with MXFP8 tokens (E4M3), FP16 operands: both decode exactly (every E2M1 and
// E4M3 value is an FP16 normal or zero), the E8M0 block scales stay outside the mma. The k-slots of every mma must
// then come from one 32-value block of K, so that each partial sum can take its block's scale: over a k64 step
// (blocks b = 0, 1: the step's K offsets 32 b .. 32 b + 31), lane (g, t) holds values 8 t .. 8 t + 7 of every block
// of rows g, g + 8 and of token g, and the block's two mma (m = 0, 1) take them as
//   E4M3 weights (FP16 pairs as they lie, tokens alike): k-slots (2t, 2t+1) <- values (4m, 4m+1),
//     (2t+8, 2t+9) <- (4m+2, 4m+3);
//   E2M1 weights (one word of 8 codes, pair j = codes j and j + 4): (2t, 2t+1) <- values (2m, 2m+4),
//     (2t+8, 2t+9) <- (2m+1, 2m+5); the token bytes are permuted to match (one prmt a mma).
// A lane's 8 values of a block are not contiguous in its copies (a lane copies 16 contiguous bytes), so the warp
// copies the step into shared memory in the chunk order of mx_chunk (which it reads back after a __syncwarp):
// E4M3 rows (64 bytes a step: chunks c = 0..3, block b = chunks 2b, 2b + 1) and the tokens (row kind 0) in item q,
// slot bits 4: g / 4, 3: c / 2, 2..1: g % 4, 0: c % 2 (a half-warp's 8-byte reads hit 32 distinct banks);
// E2M1 rows (32 bytes a step: chunk c = block c) in item q / 2, slot bits 4: q % 2, 3: c, 2..0: g (a warp's 4-byte
// reads hit 32 distinct banks). Row kind q: tile q / 2, row g + 8 (q % 2) of the tile.

// The ring position (item * 32 + slot) of chunk c of row kind q, group g.
__device__ __forceinline__ constexpr int mx_chunk(bool e2m1, int q, int g, int c) {
  return e2m1 ? 32 * (q >> 1) + 16 * (q & 1) + 8 * c + g
              : 32 * q + 16 * (g >> 2) + 8 * (c >> 1) + 2 * (g & 3) + (c & 1);
}

// Its inverse: the row kind, group and chunk at ring position n (what the lane of slot n % 32 copies).
__device__ __forceinline__ void mx_chunk_at(bool e2m1, int n, int& q, int& g, int& c) {
  const int s = n & 31;
  if (e2m1) {
    q = 2 * (n >> 5) + (s >> 4), g = s & 7, c = (s >> 3) & 1;
  } else {
    q = n >> 5, g = 4 * ((s >> 4) & 1) + ((s >> 1) & 3), c = 2 * ((s >> 3) & 1) + (s & 1);
  }
}

// The 32-bit word (of the step's ring stage) where lane (g, t)'s values of block b of row kind q start: E2M1, the
// one word of its 8 codes (word t of chunk b); E4M3 (weights, and the tokens as row kind 0 of their own item),
// the first of its two words (bytes 8 (t % 2) .. 8 (t % 2) + 7 of chunk 2b + t / 2).
__device__ __forceinline__ constexpr int mx_word(bool e2m1, int q, int g, int t, int b) {
  return e2m1 ? 4 * mx_chunk(true, q, g, b) + t : 4 * mx_chunk(false, q, g, 2 * b + (t >> 1)) + 2 * (t & 1);
}

// Pair j (0..3) of the E2M1 word q (codes j, low half, and j + 4, high half) as an exact FP16 pair: the sign to bit
// 15 / 31 and the three magnitude bits to 11..9 / 27..25 give the value x 2^-14 (codes 0 and 1 FP16 subnormals),
// then one mul.rn.f16x2 by 2^14.
constexpr u32 F16X2_2P14 = 0x74007400u;
__device__ __forceinline__ u32 e2m1x2_to_f16x2(u32 q, int j) {
  const u32 p = q << (12 - 4 * j);
  const u32 bits = (p & 0x80008000u) | ((p >> 3) & 0x0E000E00u);
#if defined(__CUDA_ARCH__)
  u32 d;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(bits), "r"(F16X2_2P14));
  return d;
#else
  u32 d = 0;
  for (int h = 0; h < 2; ++h) d |= f16_bits_exact(f16_bits_value((bits >> (16 * h)) & 0xFFFFu) * 16384.0f) << (16 * h);
  return d;
#endif
}

// E8M0 byte kb (0..3, a constant once unrolled) of word w as FP32, as e8m0_to_float gives it (2^(b - 127); b = 0:
// 2^-127, b = 255: NaN) in selects, not branches: the byte into the exponent field, at least 2^-127, NaN for 255.
__device__ __forceinline__ float e8m0_word_byte(u32 w, int kb) {
  const int shift = 23 - 8 * kb;
  const u32 bits = (shift >= 0 ? w << shift : w >> -shift) & 0x7F800000u;
  const float v = fmaxf(__uint_as_float(bits), __uint_as_float(0x00400000u));
  return bits == 0x7F800000u ? __uint_as_float(0x7FC00000u) : v;
}

// A fragments of mma m (0, 1) of a block from the lane's values of rows g (lo) and g + 8 (hi): E2M1, the word in .x;
// E4M3, values 0..3 in .x and 4..7 in .y.
template <bool E2M1>
__device__ __forceinline__ void mx_a_fragment(const uint2& lo, const uint2& hi, int m, u32 (&a)[4]) {
  if (E2M1) {
    a[0] = e2m1x2_to_f16x2(lo.x, 2 * m), a[1] = e2m1x2_to_f16x2(hi.x, 2 * m);
    a[2] = e2m1x2_to_f16x2(lo.x, 2 * m + 1), a[3] = e2m1x2_to_f16x2(hi.x, 2 * m + 1);
  } else {
    const u32 wl = m ? lo.y : lo.x, wh = m ? hi.y : hi.x;
    a[0] = e4m3x2_to_f16x2(wl), a[1] = e4m3x2_to_f16x2(wh);
    a[2] = e4m3x2_to_f16x2(wl >> 16), a[3] = e4m3x2_to_f16x2(wh >> 16);
  }
}

// B fragment of mma m from the lane's 8 E4M3 token values of the block (0..3 in .x, 4..7 in .y), in the order of
// the weights' k-slots.
template <bool E2M1>
__device__ __forceinline__ void mx_b_fragment(const uint2& x, int m, u32 (&b)[2]) {
  const u32 w = E2M1 ? byte_perm(x.x, x.y, m ? 0x7362u : 0x5140u) : (m ? x.y : x.x);
  b[0] = e4m3x2_to_f16x2(w), b[1] = e4m3x2_to_f16x2(w >> 16);
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
