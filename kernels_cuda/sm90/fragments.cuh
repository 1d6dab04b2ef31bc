// Device helpers of the SM90 (mma.sync) kernels: NVFP4 weight-fragment decode, E4M3 scale decode,
// the BF16 tensor-core mma, global / shared-memory access in PTX, the ragged tile finder and the
// epilogue. The layouts are those of cudnn_moe/engines/sm90/layout.py:
//
//   lane L of a warp: g = L / 4, q = L % 4
//   A (weights, 16 features x 16 k):  a0 = W[g, 2q:2q+2]  a1 = W[g+8, 2q:2q+2]
//                                     a2 = W[g, 2q+8:+2]  a3 = W[g+8, 2q+8:+2]
//   B (tokens, 16 k x 8 tokens):      b0 = X[g, 2q:2q+2]  b1 = X[g, 2q+8:+2]   (X[token, k])
//   C (16 features x 8 tokens):       c0 = (g, 2q)  c1 = (g, 2q+1)  c2 = (g+8, 2q)  c3 = (g+8, 2q+1)
//
// Weight tile (m16 x k64, 512 bytes): lane L owns bytes [16L, 16L+16) = four words, word s for the
// k16 step s. Scale tile (64 bytes): byte g*8 + s*2 + h = scale code of row g + 8h, k16 step s.
// Token fragments: lane (g, q) finds b0, b1 of step s at words 2s, 2s+1 of the 32 bytes at 32q of the
// token's 128-byte k64 block.
//
// Numerics: a weight word decodes to BF16 E2M1 x 2^-126 exactly (moe::place_tile_e2m1); a tile's scale
// code c is the BF16 s x 2^118 with bits 16 c + NVFP4_TILE_SCALE_BASE (a zero scale: -0), and the product
// with the weight is w s 2^-8, exact and normal in BF16 (|w s| >= 2^-10). The row-major forms read the
// caller's E4M3 bytes b instead: BF16 bits (b & 0x7F) << 4 = s x 2^-120 (E4M3 subnormals land on BF16
// subnormals), then two exact multiplies by 2^119. The epilogue multiplies the FP32 accumulator by the
// exact FP32 product alpha * 256 and rounds once to BF16 (RNE). BF16 arithmetic in PTX keeps
// subnormal inputs (there is no .ftz for bf16 / bf16x2).
#pragma once

#include "common.cuh"

namespace sm90 {

using moe::i64;
using moe::ldg_reused_u16;  // row-major scales: kept in L1, the next steps read their sector again (common.cuh)
using moe::ldg_reused_u8;
using moe::ldg_stream_u32;  // weights and scales: streamed, not kept in L1 (common.cuh)
using moe::ldg_stream_v2;
using moe::ldg_stream_v4;
using moe::u16;
using moe::u32;
using moe::u64;
using moe::u8;

// ---------------------------------------------------------------------------------------------
// NVFP4 weight fragments
// ---------------------------------------------------------------------------------------------

constexpr u32 kBf16x2Pow119 = 0x7B007B00u;  // bf16x2 (2^119, 2^119)

// bf16x2 products, round to nearest even (exact for every use here).
__device__ __forceinline__ u32 bf16x2_mul(u32 a, u32 b) {
  u32 d;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// a * (low half of s, low half of s)
__device__ __forceinline__ u32 bf16x2_mul_lo(u32 a, u32 s) {
  u32 d;
  asm("{\n\t.reg .b16 l, h;\n\t.reg .b32 t;\n\tmov.b32 {l, h}, %2;\n\tmov.b32 t, {l, l};\n\t"
      "mul.rn.bf16x2 %0, %1, t;\n\t}"
      : "=r"(d)
      : "r"(a), "r"(s));
  return d;
}

// a * (high half of s, high half of s)
__device__ __forceinline__ u32 bf16x2_mul_hi(u32 a, u32 s) {
  u32 d;
  asm("{\n\t.reg .b16 l, h;\n\t.reg .b32 t;\n\tmov.b32 {l, h}, %2;\n\tmov.b32 t, {h, h};\n\t"
      "mul.rn.bf16x2 %0, %1, t;\n\t}"
      : "=r"(d)
      : "r"(a), "r"(s));
  return d;
}

// One 32-bit word of a lane's 8 scale codes of an NVFP4 tile (layout.py): codes (step 2p row g, step 2p row g + 8,
// step 2p + 1 row g, step 2p + 1 row g + 8). Returns the bf16x2 pairs s x 2^118 of (step 2p, step 2p + 1) for row g
// and row g + 8: a PRMT puts two codes in the low bytes of the halves and a LEA makes each 16 c + base.
static_assert(255 * 16 + NVFP4_TILE_SCALE_BASE < 0x10000, "NVFP4 tile scale codes: no carry between the halves");
__device__ __forceinline__ void decode_tile_scale_word(u32 w, u32& row_g, u32& row_g8) {
  constexpr u32 base = NVFP4_TILE_SCALE_BASE * 0x10001u;
  row_g = __byte_perm(w, 0u, 0x4240) * 16u + base;   // codes 0 and 2
  row_g8 = __byte_perm(w, 0u, 0x4341) * 16u + base;  // codes 1 and 3
}

// The same for the caller's E4M3 bytes (the row-major forms, read in place; non-negative, as prepare checks: the sign
// bit is not read).
__device__ __forceinline__ void decode_scale_word(u32 w, u32& row_g, u32& row_g8) {
  const u32 lo = (w << 4) & 0x07F007F0u;  // bytes 0 and 2, (b & 0x7F) << 4 in each half: s x 2^-120
  const u32 hi = (w >> 4) & 0x07F007F0u;  // bytes 1 and 3
  row_g = bf16x2_mul(bf16x2_mul(lo, kBf16x2Pow119), kBf16x2Pow119);
  row_g8 = bf16x2_mul(bf16x2_mul(hi, kBf16x2Pow119), kBf16x2Pow119);
}

// MXFP4 tiles (layout.py): a lane's scale word holds bytes (row g block 0, row g + 8 block 0, row g block 1, row g + 8
// block 1) of its tile's two k32 blocks, each the BF16 exponent field of the block's multiplier 2^(p + 118)
// (MXFP4_TILE_SCALE_POW2), 0 for an all-zero block. Returns the bf16x2 multipliers (block 0, block 1) of row g and of
// row g + 8: a shift and a mask each. Times a placed code (E2M1 x 2^-126) that is E2M1 x 2^(p - 8), the product of
// the NVFP4 tiles' scale s = 2^p (decode_scale_word).
static_assert(MXFP4_TILE_SCALE_POW2 == 118, "MXFP4 tiles: the multiplier's 2^118 meets the placed codes' 2^-126");
__device__ __forceinline__ void decode_e8m0_scale_word(u32 w, u32& row_g, u32& row_g8) {
  row_g = (w << 7) & 0x7F807F80u;   // bytes 0 and 2 into the exponent fields of the halves
  row_g8 = (w >> 1) & 0x7F807F80u;  // bytes 1 and 3
}

// MXFP4 weights in their canonical row-major layout (the MX pair's, read in place): the multiplier of the exact
// shifted form for a row's E8M0 scale byte of one k32 block, in the low bf16 half (scale_a<0>): the tiles' byte of that
// block (decode_e8m0_scale_word), the exponent field byte - a + MXFP4_TILE_SCALE_POW2 for the expert's shift a
// (bias = MXFP4_TILE_SCALE_POW2 - a, mxfp4_rows_bias), clamped to 1 .. 254. Every nonzero block of the form lies
// inside that range (cudnn_moe.formats.mxfp4_as_nvfp4); an all-zero block, whose byte the form ignores, gets some
// finite multiplier of its zero codes.
__device__ __forceinline__ u32 mxfp4_row_multiplier(u32 byte, int bias) {
  return static_cast<u32>(min(max(static_cast<int>(byte) + bias, 1), 254)) << 7;
}

// The bias of mxfp4_row_multiplier for an expert whose global (alpha) is 2^a: MXFP4_TILE_SCALE_POW2 - a, a read off
// alpha's FP32 exponent field.
__device__ __forceinline__ int mxfp4_rows_bias(float alpha) {
  return MXFP4_TILE_SCALE_POW2 + 127 - static_cast<int>((__float_as_uint(alpha) >> 23) & 0xFFu);
}

// ---------------------------------------------------------------------------------------------
// NVFP4 weights in their canonical row-major layout (codes [N, K/2], element 2i in the low nibble of byte i; E4M3
// scales [N, K/16]), read in place: an A register holds the two values of one code byte, so its k pair is adjacent
// (k = 2i, 2i + 1), as in natural token rows.
// ---------------------------------------------------------------------------------------------

// The register of code byte `b` (0..3) of word w: BF16 E2M1 x 2^-126 of its low nibble (low half) and high nibble
// (high half), exactly. One PRMT puts the low nibble at bits 12..15 (byte b of w << 4 into byte 1) and the high nibble
// at bits 28..31 (byte b of w into byte 3); then sign stays and magnitude moves to bits 6..8 of each half.
// sel: row_byte_selector(b).
__device__ __forceinline__ u32 row_byte_selector(u32 b) { return (b << 12) | ((b + 4) << 4); }

__device__ __forceinline__ u32 decode_row_byte(u32 w, u32 sel) {
  u32 r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(w), "r"(w << 4), "r"(sel));
  return (r & 0x80008000u) | ((r >> 6) & 0x01C001C0u);
}

// The stored m16 row tile behind logical tile t of an n-row W whose two halves of n / 2 rows are stored the other
// way round when half_swap is set (the aligned op's raw w1, [gate; up], read as [up; gate]); t < 0 stays.
__device__ __forceinline__ int half_swapped_tile(int t, int n, int half_swap) {
  const int half = n >> 5;
  return half_swap == 0 || t < 0 ? t : t < half ? t + half : t - half;
}

// Multiply decoded A registers by their scales: sg / sg8 bf16x2 scale pairs of rows g / g + 8, the low half (S even)
// or the high half (S odd) applying (the pairs decode_scale_word returns).
template <int S>
__device__ __forceinline__ void scale_a(u32 sg, u32 sg8, u32 (&a)[4]) {
  if (S & 1) {
    a[0] = bf16x2_mul_hi(a[0], sg);
    a[2] = bf16x2_mul_hi(a[2], sg);
    a[1] = bf16x2_mul_hi(a[1], sg8);
    a[3] = bf16x2_mul_hi(a[3], sg8);
  } else {
    a[0] = bf16x2_mul_lo(a[0], sg);
    a[2] = bf16x2_mul_lo(a[2], sg);
    a[1] = bf16x2_mul_lo(a[1], sg8);
    a[3] = bf16x2_mul_lo(a[3], sg8);
  }
}

// ---------------------------------------------------------------------------------------------
// NVFP4 token units (the routed GEMM1's token row): moe::decode_fragment_words by bit placement
// ---------------------------------------------------------------------------------------------

constexpr u32 kBf16x2Pow8 = 0x43804380u;  // bf16x2 (2^8, 2^8)

// The BF16 pair (E2M1 x 2^-126 of the low nibble, of the high nibble) of the byte in bits 0..7 of x: each nibble's
// sign to bit 15 of its half and its magnitude bits to bits 6..8 (higher bits of x are masked off).
__device__ __forceinline__ u32 e2m1_byte_pair(u32 x) {
  return ((x << 6) & 0x000001C0u) | ((x << 12) & 0x00008000u) | ((x << 18) & 0x01C00000u) | ((x << 24) & 0x80000000u);
}

// moe::decode_fragment_words (piece q, word w = the byte q of packed word w times the scale of block w / 2) with
// two exact bf16x2 multiplies per pair instead of a float decode per value: E2M1 x 2^-126 times s x 2^118 (the
// scale converted exactly, NaN kept) is e s 2^-8, normal (|e s| >= 2^-10), times 2^8 is e s. The same values (a NaN
// scale's products are NaN either way, not necessarily with the same bits).
__device__ __forceinline__ void decode_token_words(uint4 packed, u8 scale0, u8 scale1, uint4 piece[4]) {
  const u32 b0 = __float_as_uint(moe::e4m3_to_float(scale0) * 0x1p118f) >> 16;  // exact: 4 significant bits
  const u32 b1 = __float_as_uint(moe::e4m3_to_float(scale1) * 0x1p118f) >> 16;
  const u32 s[2] = {b0 | (b0 << 16), b1 | (b1 << 16)};
  const u32 words[4] = {packed.x, packed.y, packed.z, packed.w};
  u32 out[4][4];
#pragma unroll
  for (int w = 0; w < 4; ++w)
#pragma unroll
    for (int q = 0; q < 4; ++q)
      out[q][w] = bf16x2_mul(bf16x2_mul(e2m1_byte_pair(words[w] >> (8 * q)), s[w >> 1]), kBf16x2Pow8);
#pragma unroll
  for (int q = 0; q < 4; ++q) piece[q] = make_uint4(out[q][0], out[q][1], out[q][2], out[q][3]);
}

// ---------------------------------------------------------------------------------------------
// MXINT4 weight fragments (layout.py INT4_CODE_BITS): register r of a k16 step holds its two two's-complement
// codes at bits 4r .. 4r + 3 of each 16-bit half of the word. (code ^ 8) = v + 8 placed in the low mantissa bits
// of BF16 128 gives 136 + v, and one exact fma takes 136 off: BF16 v (-8 .. 7), exactly.
// ---------------------------------------------------------------------------------------------

constexpr u32 kInt4Magic = 0x43084308u;     // bf16x2 (136, 136) with the code's top bit to flip
constexpr u32 kBf16x2One = 0x3F803F80u;     // bf16x2 (1, 1)
constexpr u32 kBf16x2Minus136 = 0xC308C308u;  // bf16x2 (-136, -136)

__device__ __forceinline__ u32 int4_pair(u32 w) {
  u32 biased;  // (w & 0x000F000F) ^ magic in one LOP3: the magic in a register, the mask immediate
  asm("lop3.b32 %0, %1, 0x000F000F, %2, 0x6A;" : "=r"(biased) : "r"(w), "r"(kInt4Magic));
  u32 d;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(biased), "r"(kBf16x2One), "r"(kBf16x2Minus136));
  return d;
}

// The four A registers of one k16 step of MXINT4 weights: BF16 values v exactly (no scale: the block scale
// multiplies the FP32 partial sum of its 32 values, grouped_gemm.cu).
__device__ __forceinline__ void decode_a_int4(u32 w, u32 (&a)[4]) {
  a[0] = int4_pair(w);
  a[1] = int4_pair(w >> 4);
  a[2] = int4_pair(w >> 8);
  a[3] = int4_pair(w >> 12);
}

// Word I (0..3) of a lane's 16 bytes: the weight word of k16 step I, or a token-fragment pair.
template <int I>
__device__ __forceinline__ u32 word_of(const uint4& v) {
  return I == 0 ? v.x : I == 1 ? v.y : I == 2 ? v.z : v.w;
}

// Scaled A registers of k16 step s (0..3) of a tile: words `w` (4 words of a lane), scale pairs
// sg[2] / sg8[2] from decode_tile_scale_word of the two scale words.
template <int S>
__device__ __forceinline__ void scaled_a(u32 w, u32 sg, u32 sg8, u32 (&a)[4]) {
  moe::place_tile_e2m1(w, a);
  scale_a<S>(sg, sg8, a);
}

// ---------------------------------------------------------------------------------------------
// Tensor core
// ---------------------------------------------------------------------------------------------

// c += A (16x16, row) * B (16x8, col), BF16 inputs, FP32 accumulation.
__device__ __forceinline__ void mma_bf16_16816(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ---------------------------------------------------------------------------------------------
// Global loads
// ---------------------------------------------------------------------------------------------

// 16 bytes of read-only data shared by several warps (token fragments), L1-cached.
__device__ __forceinline__ uint4 ldg_v4(const void* p) {
  uint4 v;
  asm("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// ---------------------------------------------------------------------------------------------
// Shared memory
// ---------------------------------------------------------------------------------------------

__device__ __forceinline__ u32 smem_addr(const void* p) {
  return static_cast<u32>(__cvta_generic_to_shared(p));
}

// 16-byte asynchronous copy global -> shared; only `src_bytes` (0 or 16) are read, the rest of the
// 16 bytes is zero-filled. With src_bytes == 0 nothing is read. PREFETCH_L2: also ask L2 for the rest of the
// 128-byte line (a row-major stream whose next stages read it).
template <bool PREFETCH_L2 = false>
__device__ __forceinline__ void cp_async_16(u32 dst, const void* src, u32 src_bytes) {
  if constexpr (PREFETCH_L2) {
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes)
                 : "memory");
  } else {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
  }
}

// 4-byte asynchronous copy global -> shared (L1-cached): a value the epilogue needs, fetched while the main loop runs.
__device__ __forceinline__ void cp_async_4(u32 dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src) : "memory");
}

// 4-byte asynchronous copy global -> shared; only `src_bytes` (0 or 4) are read, the rest zero-filled.
__device__ __forceinline__ void cp_async_4_zfill(u32 dst, const void* src, u32 src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Shared-memory loads and stores are plain C++ accesses (the compiler then orders them against
// __syncthreads); stmatrix and cp.async are volatile asm with a memory clobber.

// Four 8x8 b16 matrices stored transposed: lane l holds, in register i, the elements (row l/4,
// columns 2(l%4), 2(l%4)+1) of matrix i; they land at shared rows 2(l%4) and 2(l%4)+1, column l/4,
// where lanes 8i..8i+7 give the addresses of the 8 (16-byte) rows of matrix i.
__device__ __forceinline__ void stmatrix_x4_trans(u32 addr, u32 r0, u32 r1, u32 r2, u32 r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(r0),
               "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}

// ---------------------------------------------------------------------------------------------
// Epilogue
// ---------------------------------------------------------------------------------------------

using moe::pack_bf16x2;  // (common.cuh)

// 16-byte global store.
__device__ __forceinline__ void stg_v4(void* p, uint4 v) {
  asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

// C fragments of two adjacent n8 token blocks of one m16 feature tile (c0, c1: the blocks' four
// accumulators each), times `scale`, rounded to BF16 and stored transposed with stmatrix at shared
// [token][feature] (row stride `stride` bytes from shared address `base`): matrix i of the x4 = (block
// i / 2, features 8 (i % 2) .. + 8), tokens token0 .. token0 + 15, features feature0 .. feature0 + 15.
__device__ __forceinline__ void stage_c_pair(u32 base, int stride, int token0, int feature0, float scale,
                                             const float* c0, const float* c1) {
  const int lane = threadIdx.x & 31;
  const int mi = lane >> 3;
  const u32 r0 = pack_bf16x2(scale * c0[0], scale * c0[1]);
  const u32 r1 = pack_bf16x2(scale * c0[2], scale * c0[3]);
  const u32 r2 = pack_bf16x2(scale * c1[0], scale * c1[1]);
  const u32 r3 = pack_bf16x2(scale * c1[2], scale * c1[3]);
  const int token = token0 + (mi >> 1) * 8 + (lane & 7);
  const int feature = feature0 + (mi & 1) * 8;
  stmatrix_x4_trans(base + token * stride + feature * 2, r0, r1, r2, r3);
}

// ---------------------------------------------------------------------------------------------
// Ragged tile scheduling
// ---------------------------------------------------------------------------------------------

struct Tile {
  int expert;   // local expert of the tile
  int row0;     // first row of the tile
  int row_end;  // end of the expert's segment (clamped to the row capacity): rows >= row_end are
                // neither read nor written
};

// The staged C tile (ROWS token rows of FB BF16 features, row stride `stride` bytes at `smem`) -> out rows
// tile.row0 + .. with 16-byte stores by THREADS threads, columns col0 ..; rows at or past tile.row_end and
// 16-byte chunks at or past `chunks_in` (features past N) are not written.
template <int ROWS, int FB, int THREADS>
__device__ __forceinline__ void store_c_tile(const u8* smem, int stride, const Tile& tile, int n, int col0,
                                             int chunks_in, u16* __restrict__ out) {
  constexpr int CHUNKS = FB / 8;
  static_assert(ROWS * CHUNKS % THREADS == 0, "store_c_tile: chunk split");
#pragma unroll
  for (int u = 0; u < ROWS * CHUNKS / THREADS; ++u) {
    const int c = static_cast<int>(threadIdx.x) + u * THREADS;
    const int row = c / CHUNKS;
    const int chunk = c % CHUNKS;
    const int grow = tile.row0 + row;
    if (grow < tile.row_end && chunk < chunks_in) {
      const uint4 v = *reinterpret_cast<const uint4*>(smem + row * stride + chunk * 16);
      stg_v4(out + static_cast<i64>(grow) * n + col0 + chunk * 8, v);
    }
  }
}

// Index into alpha of expert e for a CTA whose features start at feature0: alpha[E + e] past alpha_split.
__device__ __forceinline__ int expert_alpha(int e, int num_experts, int feature0, int alpha_split) {
  return feature0 >= alpha_split ? num_experts + e : e;
}

// *p, from shared memory (SHARED) or through the read-only path.
template <bool SHARED>
__device__ __forceinline__ int load_offset(const int* p) {
  if constexpr (SHARED) {
    return *p;
  } else {
    return __ldg(p);
  }
}

// Warp-collective (all 32 lanes, same arguments): tile `t` of the concatenation over experts of
// ceil(len_e / TILE_ROWS) tiles, expert e's segment being rows [offsets[e], offsets[e+1]).
// Returns false (in every lane) when t is past the last tile. Each lane sums a contiguous range of
// ceil(E / 32) experts, a warp scan finds the lane holding tile t, which walks its range again. With `tiles`, the
// number of tiles in all goes there. SHARED: offsets lie in shared memory (a sort of the kernel's own), else global.
template <int TILE_ROWS, bool SHARED = false>
__device__ __forceinline__ bool find_tile(const int* __restrict__ offsets, int num_experts, int row_capacity,
                                          int t, Tile& tile, int* tiles = nullptr) {
  const int lane = threadIdx.x & 31;
  const int per = (num_experts + 31) >> 5;
  const int e0 = min(lane * per, num_experts);
  const int e1 = min(e0 + per, num_experts);
  int count = 0;
  {
    int prev = load_offset<SHARED>(offsets + e0);
    for (int e = e0; e < e1; ++e) {
      const int next = load_offset<SHARED>(offsets + e + 1);
      count += (max(next - prev, 0) + TILE_ROWS - 1) / TILE_ROWS;
      prev = next;
    }
  }
  int inclusive = count;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int v = __shfl_up_sync(0xFFFFFFFFu, inclusive, d);
    if (lane >= d) inclusive += v;
  }
  if (tiles != nullptr) *tiles = __shfl_sync(0xFFFFFFFFu, inclusive, 31);
  const u32 holders = __ballot_sync(0xFFFFFFFFu, inclusive > t);
  if (holders == 0u) return false;
  const int src = __ffs(holders) - 1;
  int expert = 0, row0 = 0, row_end = 0;
  if (lane == src) {
    int before = inclusive - count;
    int prev = load_offset<SHARED>(offsets + e0);
    for (int e = e0; e < e1; ++e) {
      const int next = load_offset<SHARED>(offsets + e + 1);
      const int n = (max(next - prev, 0) + TILE_ROWS - 1) / TILE_ROWS;
      if (t - before < n) {
        expert = e;
        row0 = prev + (t - before) * TILE_ROWS;
        row_end = min(next, row_capacity);
        break;
      }
      before += n;
      prev = next;
    }
  }
  tile.expert = __shfl_sync(0xFFFFFFFFu, expert, src);
  tile.row0 = __shfl_sync(0xFFFFFFFFu, row0, src);
  tile.row_end = __shfl_sync(0xFFFFFFFFu, row_end, src);
  return true;
}

}  // namespace sm90
