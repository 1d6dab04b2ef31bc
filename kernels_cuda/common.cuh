// Device helpers shared by the project's kernels: Programmatic Dependent Launch, number formats (with the E2M1
// placement of the SM90 tile words, which the GEMMs and the CUDA-core kernels both read), the 128x4 scale swizzle and
// a vectorised byte copy.
//
// Self-contained on purpose: NVRTC (through CuPy) may not find the CUDA
// headers, so the FP8/FP4/BF16 conversions are written with plain bit
// manipulation and the built-in vector types (uint2, uint4) only.
#pragma once

// Codes shared with Python arrive as -D options (cudnn_moe.kernels.codes.cuda_defines()).
#if !defined(ACT_SWIGLU) || !defined(ROUTING_PACKED) || !defined(TOKENS_BF16_FRAGMENTS) || \
    !defined(INTER_NVFP4) || !defined(SORT_THREADS)
#error "compile with the -D options of cudnn_moe.kernels.codes.cuda_defines()"
#endif

namespace moe {

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;
typedef unsigned long long u64;

// ---------------------------------------------------------------------------
// Programmatic Dependent Launch (sm_90 and later)
// ---------------------------------------------------------------------------

// Every kernel of the project starts with this. The loader launches kernels on SM90+ with the
// programmatic-stream-serialization attribute (cudnn_moe.kernels.loader), so a kernel may become resident
// while the previous kernel of its stream still runs: griddepcontrol.wait blocks until that kernel has
// completed with its writes visible, and nothing before it reads or writes global memory (two exceptions: the SM90
// decode GEMMs' SM90_EARLY form reads immutable weights and a routing whose writer finished before the previous
// kernel passed this same wait, which the trigger below follows; the decode GEMM2's SM90_AWAIT form does not wait at
// all and orders its reads of GEMM1's rows by a per-tile handoff; sm90/grouped_gemm.cu). The trigger
// right after lets the next kernel of the stream launch (and reach its own wait) while this one works;
// it is a scheduling hint only, never a visibility point. Both are no-ops when the launch had no
// attribute, and compile to nothing before sm_90.
// The trigger alone, also for the one kernel that orders its reads of the previous kernel's writes itself instead of
// waiting for it to complete: the SM90 decode GEMM2 with the tile handoff (SM90_AWAIT, sm90/grouped_gemm.cu).
__device__ __forceinline__ void grid_dependency_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ void grid_dependency_begin() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  grid_dependency_trigger();
}

// ---------------------------------------------------------------------------
// Minimum and maximum that propagate NaN (torch.minimum / torch.clamp semantics; fminf and fmaxf return the other
// operand instead): min.NaN / max.NaN from sm_80 on, a test before.
// ---------------------------------------------------------------------------

__device__ __forceinline__ float min_nan(float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  float r;
  asm("min.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  return (a != a || b != b) ? a + b : fminf(a, b);
#endif
}

__device__ __forceinline__ float max_nan(float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  return (a != a || b != b) ? a + b : fmaxf(a, b);
#endif
}

// ---------------------------------------------------------------------------
// BF16 <-> FP32
// ---------------------------------------------------------------------------

// BF16 is the top half of an FP32 word, so widening is a shift.
__device__ __forceinline__ float bf16_to_float(u16 b) {
  return __uint_as_float(static_cast<u32>(b) << 16);
}

// Round-to-nearest-even narrowing: add 0x7FFF plus the lowest kept bit, then
// truncate. Finite values that round past the BF16 range become +-inf, as in
// IEEE. NaN stays a (quiet) NaN with its sign.
__device__ __forceinline__ u16 float_to_bf16(float f) {
  u32 u = __float_as_uint(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<u16>((u >> 16) | 0x0040u);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<u16>(u >> 16);
}

// (bf16(lo) | bf16(hi) << 16), each rounded to nearest even as float_to_bf16 rounds (subnormals kept, overflow gives
// inf; NaN stays NaN): one cvt.rn.bf16x2.f32 from sm_80 on, float_to_bf16 before.
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  u32 d;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
#else
  return static_cast<u32>(float_to_bf16(lo)) | (static_cast<u32>(float_to_bf16(hi)) << 16);
#endif
}

// ---------------------------------------------------------------------------
// E2M1 codes of an SM90 fragment tile word (cudnn_moe.engines.sm90.layout, CODE_BITS): the four mma A registers of
// one k16 step, two codes each. Every register gets its codes' sign at bit 15 and magnitude at bits 6..8 of each
// half, which makes the half the BF16 value E2M1 x 2^-126 exactly. Eight instructions for the four: a mask, two
// rotations and masks, and for a3 a mask and a multiply by 2^2 + 2^7 + 2^12 whose three shifted copies of the
// eight kept bits never overlap (no carry) before the last mask.
// ---------------------------------------------------------------------------

constexpr u32 kTileCodeMask = 0x81C081C0u;  // sign -> bit 15, magnitude -> bits 6, 7, 8 (each half)

__device__ __forceinline__ void place_tile_e2m1(u32 w, u32 (&a)[4]) {
  a[0] = w & kTileCodeMask;
  a[1] = ((w << 10) | (w >> 22)) & kTileCodeMask;
  a[2] = ((w << 13) | (w >> 19)) & kTileCodeMask;
  a[3] = ((w & 0x001B001Bu) * 0x1084u) & kTileCodeMask;
}

// ---------------------------------------------------------------------------
// E4M3 (float8_e4m3fn): 1 sign, 4 exponent (bias 7), 3 mantissa bits.
// Normal:    (1 + m/8) * 2^(e-7), e in 1..15 (e=15, m=7 is NaN, so max 448).
// Subnormal: (m/8) * 2^-6 = m * 2^-9.
// ---------------------------------------------------------------------------

// Round to nearest even, saturate to +-448. Never returns the NaN codes
// 0x7F/0xFF: a NaN input gives +448 (0x7E).
__device__ __forceinline__ u8 float_to_e4m3(float f) {
  u32 u = __float_as_uint(f);
  const u32 sign = (u >> 24) & 0x80u;
  u &= 0x7FFFFFFFu;
  if (u > 0x7F800000u) return 0x7E;
  const float a = __uint_as_float(u);
  // Everything from 448 up (including the tie at 464 and inf) rounds or
  // saturates to 448.
  if (a >= 448.0f) return static_cast<u8>(sign | 0x7Eu);
  if (a < 0.015625f) {
    // Below 2^-6: subnormal grid of step 2^-9. The scaling by 512 is exact
    // and rintf rounds half to even; m == 8 is the smallest normal, 0x08.
    return static_cast<u8>(sign | static_cast<u32>(rintf(a * 512.0f)));
  }
  // Normal: rebias the exponent (127 -> 7), keep 3 of the 23 mantissa bits
  // and round the other 20 to nearest even; a carry moves into the exponent.
  u32 bits = (((u >> 23) - 120u) << 3) | ((u >> 20) & 7u);
  const u32 rest = u & 0xFFFFFu;
  if (rest > 0x80000u || (rest == 0x80000u && (bits & 1u))) ++bits;
  return static_cast<u8>(sign | bits);
}

// Exact widening; the NaN codes 0x7F/0xFF decode to NaN.
__device__ __forceinline__ float e4m3_to_float(u8 b) {
  const u32 sign = static_cast<u32>(b & 0x80u) << 24;
  const u32 e = (b >> 3) & 0xFu;
  const u32 m = b & 7u;
  if (e == 15u && m == 7u) return __uint_as_float(sign | 0x7FC00000u);
  if (e == 0u) return __uint_as_float(sign | __float_as_uint(static_cast<float>(m) * 0.001953125f));
  return __uint_as_float(sign | ((e + 120u) << 23) | (m << 20));
}

// ---------------------------------------------------------------------------
// E2M1 (FP4): code = sign << 3 | index, index 0..7 into the magnitude grid
// {0, 0.5, 1, 1.5, 2, 3, 4, 6}.
// ---------------------------------------------------------------------------

// Round to nearest even on the grid, saturate to +-6. The index is the number of
// midpoints that |f| has passed; at a midpoint the neighbour with the even index
// wins, so the test is >= where the upper neighbour's index is even, > otherwise:
//   0.25 -> idx 0, 0.75 -> idx 2, 1.25 -> idx 2, 1.75 -> idx 4,
//   2.5  -> idx 4, 3.5  -> idx 6, 5    -> idx 6.
// A value that rounds to zero gets code 0 (never 0x8), as does NaN; this matches
// cudnn_moe.formats.encode_e2m1.
__device__ __forceinline__ u8 float_to_e2m1(float f) {
  const float a = fabsf(f);
  const u32 idx = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) + (a > 5.0f);
  return static_cast<u8>(idx | ((f < 0.0f && idx != 0u) ? 8u : 0u));
}

// Magnitude: index/2 for indices 0..3, then 2, 3, 4, 6 for 4..7.
__device__ __forceinline__ float e2m1_to_float(u8 code) {
  const u32 idx = code & 7u;
  const float v = idx < 4u ? 0.5f * static_cast<float>(idx) : (idx == 7u ? 6.0f : static_cast<float>(idx - 2u));
  return (code & 8u) ? -v : v;
}

// The E2M1 grid value float_to_e2m1(q) stands for, e2m1_to_float(float_to_e2m1(q)), computed without
// the code: round q to the grid step of its magnitude (0.5 below 2, 1 below 4, 2 above) by adding and
// subtracting 1.5 * 2^(22 + k), whose ulp is that step (round to nearest, ties to even: an even multiple
// of the step, which is the grid point of even index), then saturate to +-6. The sum keeps the ulp over
// the whole range it is used for, and (M + q) - M is +0 when q rounds to zero, so the result is never -0,
// as code 0 decodes to +0. NaN gives +0 (code 0). Equal to the helpers' composition for every float q.
__device__ __forceinline__ float round_to_e2m1(float q) {
  const float a = fabsf(q);
  const float magic = a < 2.0f ? 6291456.0f : (a < 4.0f ? 12582912.0f : 25165824.0f);
  const float r = fminf(fmaxf(__fsub_rn(__fadd_rn(q, magic), magic), -6.0f), 6.0f);
  return q == q ? r : 0.0f;
}

// round_to_e2m1(q) for |q| < 7, without its NaN test and its saturation (below 7 the rounding never passes 6), and
// with the rounding step from q's exponent instead of two comparisons: the magic number is 1.5 * 2^22 * 2^e with
// 2^e = max(1, q's power of two), 1.5 * 2^22, 2^23, 2^24 below 2, 4, 8, as there.
__device__ __forceinline__ float round_below_7_to_e2m1(float q) {
  const float power = fmaxf(__uint_as_float(__float_as_uint(q) & 0x7F800000u), 1.0f);
  const float magic = __fmul_rn(power, 6291456.0f);
  return __fsub_rn(__fadd_rn(q, magic), magic);
}

// float_to_e4m3(d) for d in [2^-6, 448] (normal, no saturation), with the code's value (e4m3_to_float) in `value`:
// d rounded to 3 mantissa bits (nearest even; a carry moves into the exponent), without the conversion's special
// cases.
__device__ __forceinline__ u8 e4m3_normal(float d, float& value) {
  const u32 u = __float_as_uint(d);
  const u32 rounded = (u + 0x7FFFFu + ((u >> 20) & 1u)) & 0xFFF00000u;
  value = __uint_as_float(rounded);
  return static_cast<u8>((rounded >> 20) - (120u << 3));
}

// ---------------------------------------------------------------------------
// Block-scale layouts
// ---------------------------------------------------------------------------

// Byte offset of scale (r, c) of an R x C scale matrix in the 128x4 swizzled
// layout (rows padded to 128, columns to 4): tiles of 128 rows x 4 columns are
// 512 contiguous bytes, row-major over tiles; inside a tile, row r sits at
// (r % 32) * 16 + ((r % 128) / 32) * 4 and column c at c % 4.
__device__ __forceinline__ i64 swizzle_128x4_offset(i64 r, i64 c, i64 C) {
  const i64 col_tiles = (C + 3) / 4;
  return ((r / 128) * col_tiles + c / 4) * 512 + (r % 32) * 16 + ((r % 128) / 32) * 4 + c % 4;
}

// Offset of scale (r, c) in either layout: linear row-major (r * C + c) or
// the 128x4 swizzle.
__device__ __forceinline__ i64 scale_offset(i64 r, i64 c, i64 C, bool swizzled) {
  return swizzled ? swizzle_128x4_offset(r, c, C) : r * C + c;
}

// ---------------------------------------------------------------------------
// Vectors of 8 BF16 (16 bytes; element j is the low half of 32-bit word j/2)
// ---------------------------------------------------------------------------

// Load 8 BF16 from a 16-byte aligned address and widen them to FP32.
__device__ __forceinline__ void load_bf16x8(const u16* src, float out[8]) {
  const uint4 v = *reinterpret_cast<const uint4*>(src);
  const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    out[2 * j] = __uint_as_float(w[j] << 16);
    out[2 * j + 1] = __uint_as_float(w[j] & 0xFFFF0000u);
  }
}

// Round 8 FP32 to BF16 (RNE) and store them to a 16-byte aligned address.
__device__ __forceinline__ void store_bf16x8(u16* dst, const float in[8]) {
  u32 w[4];
#pragma unroll
  for (int j = 0; j < 4; ++j)
    w[j] = static_cast<u32>(float_to_bf16(in[2 * j])) | (static_cast<u32>(float_to_bf16(in[2 * j + 1])) << 16);
  uint4 v;
  v.x = w[0];
  v.y = w[1];
  v.z = w[2];
  v.w = w[3];
  *reinterpret_cast<uint4*>(dst) = v;
}

// ---------------------------------------------------------------------------
// NVFP4 -> BF16 token fragments (SM90 token-fragment order, cudnn_moe/engines/sm90/layout.py)
// ---------------------------------------------------------------------------

// BF16 of a product of an E2M1 value and an E4M3 scale: the product is exact in FP32 and in BF16, so
// the top half of its bits is the round-to-nearest-even BF16 (what float_to_bf16 gives); a NaN product
// (NaN scale) is a quiet NaN, whose top half float_to_bf16 also returns unchanged.
__device__ __forceinline__ u32 exact_product_bf16(float p) { return __float_as_uint(p) >> 16; }

// Decode the 32 columns of unit u (k64 block j = u / 2, half h = u % 2) of a packed NVFP4 row into the
// four 16-byte pieces it owns in the token-fragment order: piece q (q = 0..3) is positions 64j + 16q +
// 8h .. + 7 of the BF16 row, i.e. element 2w + e of piece q is k = 64j + 32h + 16(w / 2) + 8(w % 2) +
// 2q + e: nibble e of byte q of word w of the 16 bytes at 16u of the packed row, scale byte
// 2u + w / 2. packed: those 16 bytes; scale0, scale1: the row's E4M3 scale bytes 2u and 2u + 1. Exact values.
__device__ __forceinline__ void decode_fragment_words(uint4 packed, u8 scale0, u8 scale1, uint4 piece[4]) {
  const float s0 = e4m3_to_float(scale0);
  const float s1 = e4m3_to_float(scale1);
  const u32 words[4] = {packed.x, packed.y, packed.z, packed.w};
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    u32 out[4];
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const u32 byte = (words[w] >> (8 * q)) & 0xFFu;
      const float s = w < 2 ? s0 : s1;
      const float lo = e2m1_to_float(static_cast<u8>(byte & 0xFu)) * s;
      const float hi = e2m1_to_float(static_cast<u8>(byte >> 4)) * s;
      out[w] = exact_product_bf16(lo) | (exact_product_bf16(hi) << 16);
    }
    piece[q].x = out[0];
    piece[q].y = out[1];
    piece[q].z = out[2];
    piece[q].w = out[3];
  }
}

// decode_fragment_words on the 16 bytes at 16u of the packed row `codes` (16-byte aligned).
__device__ __forceinline__ void decode_fragment_unit(const u8* codes, const u8* scales, int u, uint4 piece[4]) {
  decode_fragment_words(*reinterpret_cast<const uint4*>(codes + 16 * u), scales[2 * u], scales[2 * u + 1], piece);
}

// The four fragment-order pieces of a BF16 unit given as its four 16-byte chunks in column order: piece q holds the
// value pairs (2q, 2q+1), (8+2q, 9+2q), (16+2q, 17+2q), (24+2q, 25+2q) of its 32 columns (decode_fragment_unit's
// order).
__device__ __forceinline__ void bf16_unit_pieces(const uint4 chunk[4], uint4 piece[4]) {
  const uint4 a = chunk[0], b = chunk[1], c = chunk[2], d = chunk[3];  // pair words 0..3, 4..7, 8..11, 12..15
  const u32 words[16] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w, c.x, c.y, c.z, c.w, d.x, d.y, d.z, d.w};
#pragma unroll
  for (int q = 0; q < 4; ++q) piece[q] = make_uint4(words[q], words[4 + q], words[8 + q], words[12 + q]);
}

// The 32 BF16 values of a token unit, as four 16-byte chunks in column order.
struct Bf16Unit {
  uint4 chunk[4];
};

// Unit u (32 columns) of BF16 token t of x [B, H] (16-byte aligned), as it is.
__device__ __forceinline__ Bf16Unit fetch_bf16_unit(const u16* __restrict__ x, int hidden, i64 t, int u) {
  const uint4* src = reinterpret_cast<const uint4*>(x + t * hidden + 32 * u);
  return Bf16Unit{{src[0], src[1], src[2], src[3]}};
}

// Store the four pieces of unit u into the BF16 row dst (16-byte aligned): piece q at 64j + 16q + 8h.
__device__ __forceinline__ void store_fragment_unit(u16* dst, int u, const uint4 piece[4]) {
  u16* base = dst + 64 * (u >> 1) + 8 * (u & 1);
#pragma unroll
  for (int q = 0; q < 4; ++q) *reinterpret_cast<uint4*>(base + 16 * q) = piece[q];
}

// The same unit in natural column order (TOKENS_BF16_ROWS): word w of piece q holds columns 32u + 8w + 2q,
// + 1, so natural 16-byte chunk w (columns 32u + 8w ..) is word w of the four pieces: a 4 x 4 word transpose.
__device__ __forceinline__ void store_natural_unit(u16* dst, int u, const uint4 piece[4]) {
  uint4* base = reinterpret_cast<uint4*>(dst + 32 * u);
  base[0] = make_uint4(piece[0].x, piece[1].x, piece[2].x, piece[3].x);
  base[1] = make_uint4(piece[0].y, piece[1].y, piece[2].y, piece[3].y);
  base[2] = make_uint4(piece[0].z, piece[1].z, piece[2].z, piece[3].z);
  base[3] = make_uint4(piece[0].w, piece[1].w, piece[2].w, piece[3].w);
}

// The BF16 token layouts: decoded values in R x `cols` storage (TokenLayout in cudnn_moe/kernels/codes.py).
__device__ __forceinline__ bool is_bf16_layout(int layout) {
  return layout == TOKENS_BF16_FRAGMENTS || layout == TOKENS_BF16_ROWS || layout == TOKENS_BF16_TILED;
}

// TOKENS_BF16_TILED (rows R a multiple of 8): the element offset of natural 16-byte chunk j (columns 8j .. 8j + 7)
// of row r. Planes of 64 columns, plane j / 8 holding every row's 128 bytes at (j / 8) R 64 + 64 r, the chunk at
// position (j % 8) ^ (r % 8) in the row (tiled_chunk_position): the 128-byte swizzled image of a wgmma B tile, so
// the rows of one tile and k64 block are one contiguous copy.
__device__ __forceinline__ int tiled_chunk_position(int j, int r) { return (j & 7) ^ (r & 7); }

__device__ __forceinline__ i64 tiled_chunk_offset(i64 r, int j, int rows) {
  return ((j >> 3) * static_cast<i64>(rows) + r) * 64 + (tiled_chunk_position(j, static_cast<int>(r)) << 3);
}

// Unit u in the BF16 layout `layout` (TOKENS_BF16_FRAGMENTS or TOKENS_BF16_ROWS).
__device__ __forceinline__ void store_token_unit(int layout, u16* dst, int u, const uint4 piece[4]) {
  if (layout == TOKENS_BF16_ROWS) {
    store_natural_unit(dst, u, piece);
  } else {
    store_fragment_unit(dst, u, piece);
  }
}

// ---------------------------------------------------------------------------
// Streaming loads (weights read once: not kept in L1; ldg_reused_u16, whose sector the next loads read again, is)
// ---------------------------------------------------------------------------

// 16 bytes of read-only data that is used once. PREFETCH_L2: also ask L2 for the rest of their 256-byte block (a
// row-major stream that reads a row's next bytes soon after, from another instruction).
template <bool PREFETCH_L2 = false>
__device__ __forceinline__ uint4 ldg_stream_v4(const void* p) {
  uint4 v;
  if constexpr (PREFETCH_L2) {
    asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  } else {
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  }
  return v;
}

// 2 bytes of read-only data, zero-extended, whose 32-byte sector the next loads of the stream read again (a
// row-major scale row, 2 bytes a lane a step): kept in L1, and L2 asked for the rest of their 256-byte block. Measured
// on the H200 (row-major decode GEMMs alone, L2 flushed): 10-25% faster than streaming them past L1 (each step's
// sector then came from L2 again), and streaming them with the L2 hint alone was slower still.
__device__ __forceinline__ u32 ldg_reused_u16(const void* p) {
  u32 v;
  asm("ld.global.nc.L2::256B.u16 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}

// 1 byte of read-only data, zero-extended, read as ldg_reused_u16 reads its two (a row-major E8M0 scale row, one byte
// a lane a step).
__device__ __forceinline__ u32 ldg_reused_u8(const void* p) {
  u32 v;
  asm("ld.global.nc.L2::256B.u8 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}

// 4 bytes of read-only data that are used once.
__device__ __forceinline__ u32 ldg_stream_u32(const void* p) {
  u32 v;
  asm("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}

// 8 bytes of read-only data that is used once.
__device__ __forceinline__ uint2 ldg_stream_v2(const void* p) {
  uint2 v;
  asm("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
}

// ---------------------------------------------------------------------------
// Copies
// ---------------------------------------------------------------------------

// Copy n bytes with the threads of one block (thread `tid` of `nthreads`),
// in 16- or 8-byte words when both pointers and n allow it.
__device__ __forceinline__ void block_copy_bytes(u8* dst, const u8* src, i64 n, int tid, int nthreads) {
  const u64 align = reinterpret_cast<u64>(dst) | reinterpret_cast<u64>(src) | static_cast<u64>(n);
  if ((align & 15u) == 0) {
    for (i64 i = tid; i < n / 16; i += nthreads)
      reinterpret_cast<uint4*>(dst)[i] = reinterpret_cast<const uint4*>(src)[i];
  } else if ((align & 7u) == 0) {
    for (i64 i = tid; i < n / 8; i += nthreads)
      reinterpret_cast<uint2*>(dst)[i] = reinterpret_cast<const uint2*>(src)[i];
  } else {
    for (i64 i = tid; i < n; i += nthreads) dst[i] = src[i];
  }
}

// 16 bytes at p, which need only be byte aligned (one 16-byte load when they are 16-byte aligned).
__device__ __forceinline__ uint4 load_16_bytes(const u8* p) {
  if ((reinterpret_cast<u64>(p) & 15u) == 0) return *reinterpret_cast<const uint4*>(p);
  u32 w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
    w[i] = p[4 * i] | (static_cast<u32>(p[4 * i + 1]) << 8) | (static_cast<u32>(p[4 * i + 2]) << 16) |
           (static_cast<u32>(p[4 * i + 3]) << 24);
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// Slot i of the caller's routing in format routing_format (ROUTING_PACKED: int32 (id << 16) | bf16 weight; else ids
// int32, or int64 when ids_int64, with FP32 or BF16 weights): its expert id and route weight. An int64 id outside the
// int32 range becomes -1 (masked). Slots of tokens past the call's (live false) are read nowhere: id -1, weight 0.
__device__ __forceinline__ void decode_route(const void* ids, const void* weights, int routing_format, int ids_int64,
                                             i64 i, bool live, int& id, float& w) {
  id = -1;
  w = 0.0f;
  if (!live) return;
  if (routing_format == ROUTING_PACKED) {
    const int p = static_cast<const int*>(ids)[i];
    id = p >> 16;
    w = bf16_to_float(static_cast<u16>(p & 0xFFFF));
    return;
  }
  if (ids_int64) {
    const i64 v = static_cast<const i64*>(ids)[i];
    id = (v < -2147483647LL - 1 || v > 2147483647LL) ? -1 : static_cast<int>(v);
  } else {
    id = static_cast<const int*>(ids)[i];
  }
  w = routing_format == ROUTING_FP32 ? static_cast<const float*>(weights)[i]
                                     : bf16_to_float(static_cast<const u16*>(weights)[i]);
}

// Stage token t: its row_bytes of packed E2M1 codes (source rows x_row_stride bytes apart, any alignment) and
// scale_bytes of E4M3 scales into row t of the bucket buffers xs / xss, with the threads of one block (thread
// `tid` of `nthreads`). When x_rows is not null, the token is instead decoded exactly into the natural BF16 row t
// of x_rows ([B, 2 * row_bytes], 16-byte aligned; row_bytes % 16 == 0), the rows a gathering GEMM1 reads, and
// xs / xss are not written.
__device__ __forceinline__ void stage_token_row(u8* xs, u8* xss, u16* x_rows, const u8* x, i64 x_row_stride,
                                                const u8* x_scales, i64 t, int row_bytes, int scale_bytes, int tid,
                                                int nthreads) {
  const u8* codes = x + t * x_row_stride;
  const u8* scales = x_scales + t * scale_bytes;
  if (x_rows != nullptr) {
    const int hidden = 2 * row_bytes;
    for (int u = tid; u < hidden / 32; u += nthreads) {
      uint4 piece[4];
      decode_fragment_words(load_16_bytes(codes + 16 * u), scales[2 * u], scales[2 * u + 1], piece);
      store_natural_unit(x_rows + t * hidden, u, piece);
    }
    return;
  }
  block_copy_bytes(xs + t * row_bytes, codes, row_bytes, tid, nthreads);
  block_copy_bytes(xss + t * scale_bytes, scales, scale_bytes, tid, nthreads);
}

}  // namespace moe
