// Grouped NVFP4 x BF16 GEMM over ragged expert segments on SM90 (mma.sync, "swap AB": the weights
// are the 16-row A operand, the tokens the 8-wide B operand).
//
// Arguments of both kernels:
//   w_tiles      uint8 [E, N*K/2]   fragment tiles of each expert's W_e [N, K] (layout.py)
//   w_scales     uint8 [E, N*K/16]  E4M3 scale tiles, same tile order
//   alpha        float32 [E]        per-expert global scale
//   x            bf16 [row_capacity, K]  token rows in token-fragment column order
//   offsets      int32 [E + 1]      segment e = rows [offsets[e], offsets[e+1]) (multiples of 8)
//   out          bf16 [row_capacity, N]  row-major, natural column order
// out[r, f] = bf16_rne(float(alpha[e] * 256) * acc), acc = FP32 sum over k of (w s 2^-8) x[r, k] for
// r in segment e. Rows outside the tile's segment are never written, rows >= its end never read.
// Grid: x = feature blocks (N / features per CTA), y >= number of tiles (tile = TILE_ROWS rows of one
// segment, segments concatenated); CTAs past the last tile exit. No atomics: deterministic.
#include "common.cuh"
#include "sm90/fragments.cuh"

using namespace sm90;

// =============================================================================================
// Decode: few tokens per expert. Weights stream global -> registers; split K across warps.
// =============================================================================================

#ifndef SM90_MT
#define SM90_MT 1  // m16 feature tiles per warp
#endif
#ifndef SM90_WM
#define SM90_WM 2  // warps along features
#endif
#ifndef SM90_WK
#define SM90_WK 4  // warps along K (intra-CTA split-K)
#endif
#ifndef SM90_NT
#define SM90_NT 1  // n8 token tiles per warp (tile rows = 8 * NT)
#endif
#ifndef SM90_PREFETCH
#define SM90_PREFETCH 4  // k64 steps in flight per warp (register ring)
#endif

#define DEC_THREADS (SM90_WM * SM90_WK * 32)
#define DEC_FB (SM90_WM * SM90_MT * 16)  // features per CTA
#define DEC_TB (SM90_NT * 8)             // token rows per tile
#define DEC_RED_STRIDE (DEC_FB + 4)      // floats per token row of the split-K buffer (bank spread)
// Accumulator sets per warp: with a single m16 x n8 tile, even and odd k16 steps accumulate apart
// so that consecutive mma do not wait on each other (summed in a fixed order at the end).
#define DEC_ACC_SETS (SM90_MT * SM90_NT == 1 ? 2 : 1)

static_assert(DEC_THREADS >= 32 && DEC_THREADS <= 1024, "decode: 1..32 warps");
static_assert(DEC_FB == 16 || DEC_FB == 32 || DEC_FB == 64 || DEC_FB == 128, "decode: WM*MT*16 must divide 128");
static_assert(SM90_NT >= 1 && SM90_NT <= 8 && SM90_PREFETCH >= 1 && SM90_PREFETCH <= 16, "decode: NT / PREFETCH");
static_assert(SM90_WK * DEC_TB * DEC_RED_STRIDE * 4 <= 48 * 1024, "decode: split-K buffer exceeds 48 KB");

namespace {

template <int I>
__device__ __forceinline__ u32 word_of(const uint4& v) {
  return I == 0 ? v.x : I == 1 ? v.y : I == 2 ? v.z : v.w;
}

struct DecodeRing {
  uint4 w[SM90_PREFETCH][SM90_MT];     // weight words: 4 k16 steps
  uint2 s[SM90_PREFETCH][SM90_MT];     // scale bytes
  uint4 b[SM90_PREFETCH][SM90_NT][2];  // token fragments: steps 0-1, 2-3
};

// One k64 step of a warp: 4 x MT x NT mma.
template <int P>
__device__ __forceinline__ void decode_step(const DecodeRing& ring, float (&acc)[DEC_ACC_SETS][SM90_MT][SM90_NT][4]) {
  u32 sg[SM90_MT][2], sg8[SM90_MT][2];
#pragma unroll
  for (int mt = 0; mt < SM90_MT; ++mt) {
    decode_scale_word(ring.s[P][mt].x, sg[mt][0], sg8[mt][0]);
    decode_scale_word(ring.s[P][mt].y, sg[mt][1], sg8[mt][1]);
  }
#define SM90_DECODE_K16(S)                                                                          \
  _Pragma("unroll") for (int mt = 0; mt < SM90_MT; ++mt) {                                          \
    u32 a[4];                                                                                       \
    scaled_a<S>(word_of<S>(ring.w[P][mt]), sg[mt][S >> 1], sg8[mt][S >> 1], a);                     \
    _Pragma("unroll") for (int nt = 0; nt < SM90_NT; ++nt) {                                        \
      mma_bf16_16816(acc[S % DEC_ACC_SETS][mt][nt], a, word_of<(2 * S) & 3>(ring.b[P][nt][S >> 1]),  \
                     word_of<((2 * S) & 3) + 1>(ring.b[P][nt][S >> 1]));                            \
    }                                                                                               \
  }
  SM90_DECODE_K16(0)
  SM90_DECODE_K16(1)
  SM90_DECODE_K16(2)
  SM90_DECODE_K16(3)
#undef SM90_DECODE_K16
}

}  // namespace

// Warp (wm, wk) owns feature rows [16 (blockIdx.x * WM * MT + wm * MT), +16 MT) and the k64 steps
// j = wk, wk + WK, ...; its partial sums meet in shared memory, summed over wk = 0..WK-1 in order.
extern "C" __global__ void __launch_bounds__(DEC_THREADS)
    sm90_gemm_decode(const u8* __restrict__ w_tiles, const u8* __restrict__ w_scales, const float* __restrict__ alpha,
                     const u16* __restrict__ x, const int* __restrict__ offsets, int num_experts, int n, int k,
                     int row_capacity, u16* __restrict__ out) {
  __shared__ __align__(16) float red[SM90_WK][DEC_TB][DEC_RED_STRIDE];
  Tile tile;
  if (!find_tile<DEC_TB>(offsets, num_experts, row_capacity, static_cast<int>(blockIdx.y), tile)) return;
  if (tile.row0 < 0 || tile.row0 >= tile.row_end) return;  // offsets outside [0, row_capacity]: nothing safe to do

  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int wm = warp % SM90_WM;
  const int wk = warp / SM90_WM;
  const int g = lane >> 2;
  const int q = lane & 3;
  const int kt = k >> 6;  // k64 steps
  const i64 expert_tiles = static_cast<i64>(n >> 4) * kt;
  const i64 first_tile = static_cast<i64>(blockIdx.x * (SM90_WM * SM90_MT) + wm * SM90_MT) * kt + wk;
  const i64 mt_stride_w = static_cast<i64>(kt) * 512;  // bytes between the warp's m16 row blocks
  const i64 mt_stride_s = static_cast<i64>(kt) * 64;
  const u8* wp = w_tiles + (tile.expert * expert_tiles + first_tile) * 512 + lane * 16;
  const u8* sp = w_scales + (tile.expert * expert_tiles + first_tile) * 64 + g * 8;
  // Token rows past the segment are clamped to the tile's first row (always inside it): their
  // columns of the product are garbage but never stored, and nothing past the segment is read.
  const u8* xp[SM90_NT];
#pragma unroll
  for (int nt = 0; nt < SM90_NT; ++nt) {
    const int row = tile.row0 + nt * 8 + g;
    xp[nt] = reinterpret_cast<const u8*>(x) + (static_cast<i64>(row < tile.row_end ? row : tile.row0) * k + wk * 64) * 2 +
             q * 32;
  }
  const int nsteps = wk < kt ? (kt - wk + SM90_WK - 1) / SM90_WK : 0;
  constexpr int W_STEP = SM90_WK * 512, S_STEP = SM90_WK * 64, X_STEP = SM90_WK * 128;  // bytes per step

  float acc[DEC_ACC_SETS][SM90_MT][SM90_NT][4];
#pragma unroll
  for (int set = 0; set < DEC_ACC_SETS; ++set)
#pragma unroll
    for (int mt = 0; mt < SM90_MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < SM90_NT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[set][mt][nt][i] = 0.0f;

  DecodeRing ring;
  // Load ring slot P with step `s` (relative to the current base pointers).
#define SM90_DECODE_LOAD(P, S)                                                                      \
  {                                                                                                 \
    _Pragma("unroll") for (int mt = 0; mt < SM90_MT; ++mt) {                                        \
      ring.w[P][mt] = ldg_stream_v4(wp + (S) * W_STEP + mt * mt_stride_w);                          \
      ring.s[P][mt] = ldg_stream_v2(sp + (S) * S_STEP + mt * mt_stride_s);                          \
    }                                                                                               \
    _Pragma("unroll") for (int nt = 0; nt < SM90_NT; ++nt) {                                        \
      ring.b[P][nt][0] = ldg_v4(xp[nt] + (S) * X_STEP);                                             \
      ring.b[P][nt][1] = ldg_v4(xp[nt] + (S) * X_STEP + 16);                                        \
    }                                                                                               \
  }
#pragma unroll
  for (int p = 0; p < SM90_PREFETCH; ++p)
    if (p < nsteps) SM90_DECODE_LOAD(p, p)

  // Steady state: every slot consumed and refilled, no bounds tests.
  int s0 = 0;
  for (; s0 + 2 * SM90_PREFETCH <= nsteps; s0 += SM90_PREFETCH) {
#define SM90_DECODE_SLOT(P)                                                                         \
  if (P < SM90_PREFETCH) {                                                                          \
    decode_step<(P < SM90_PREFETCH ? P : 0)>(ring, acc);                                            \
    SM90_DECODE_LOAD((P < SM90_PREFETCH ? P : 0), P + SM90_PREFETCH)                                \
  }
    SM90_DECODE_SLOT(0)
    SM90_DECODE_SLOT(1)
    SM90_DECODE_SLOT(2)
    SM90_DECODE_SLOT(3)
    SM90_DECODE_SLOT(4)
    SM90_DECODE_SLOT(5)
    SM90_DECODE_SLOT(6)
    SM90_DECODE_SLOT(7)
    SM90_DECODE_SLOT(8)
    SM90_DECODE_SLOT(9)
    SM90_DECODE_SLOT(10)
    SM90_DECODE_SLOT(11)
    SM90_DECODE_SLOT(12)
    SM90_DECODE_SLOT(13)
    SM90_DECODE_SLOT(14)
    SM90_DECODE_SLOT(15)
#undef SM90_DECODE_SLOT
    wp += SM90_PREFETCH * W_STEP;
    sp += SM90_PREFETCH * S_STEP;
#pragma unroll
    for (int nt = 0; nt < SM90_NT; ++nt) xp[nt] += SM90_PREFETCH * X_STEP;
  }
  // Tail: fewer than 2 * PREFETCH steps left.
  for (; s0 < nsteps; s0 += SM90_PREFETCH) {
#define SM90_DECODE_SLOT(P)                                                                         \
  if (P < SM90_PREFETCH && s0 + P < nsteps) {                                                       \
    decode_step<(P < SM90_PREFETCH ? P : 0)>(ring, acc);                                            \
    if (s0 + P + SM90_PREFETCH < nsteps) SM90_DECODE_LOAD((P < SM90_PREFETCH ? P : 0), P + SM90_PREFETCH) \
  }
    SM90_DECODE_SLOT(0)
    SM90_DECODE_SLOT(1)
    SM90_DECODE_SLOT(2)
    SM90_DECODE_SLOT(3)
    SM90_DECODE_SLOT(4)
    SM90_DECODE_SLOT(5)
    SM90_DECODE_SLOT(6)
    SM90_DECODE_SLOT(7)
    SM90_DECODE_SLOT(8)
    SM90_DECODE_SLOT(9)
    SM90_DECODE_SLOT(10)
    SM90_DECODE_SLOT(11)
    SM90_DECODE_SLOT(12)
    SM90_DECODE_SLOT(13)
    SM90_DECODE_SLOT(14)
    SM90_DECODE_SLOT(15)
#undef SM90_DECODE_SLOT
    wp += SM90_PREFETCH * W_STEP;
    sp += SM90_PREFETCH * S_STEP;
#pragma unroll
    for (int nt = 0; nt < SM90_NT; ++nt) xp[nt] += SM90_PREFETCH * X_STEP;
  }
#undef SM90_DECODE_LOAD

  // Partial sums -> red[wk][token][feature].
#pragma unroll
  for (int set = 1; set < DEC_ACC_SETS; ++set)
#pragma unroll
    for (int mt = 0; mt < SM90_MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < SM90_NT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[0][mt][nt][i] += acc[set][mt][nt][i];
#pragma unroll
  for (int mt = 0; mt < SM90_MT; ++mt) {
    const int f = (wm * SM90_MT + mt) * 16 + g;
#pragma unroll
    for (int nt = 0; nt < SM90_NT; ++nt) {
      const int t = nt * 8 + 2 * q;
      red[wk][t][f] = acc[0][mt][nt][0];
      red[wk][t + 1][f] = acc[0][mt][nt][1];
      red[wk][t][f + 8] = acc[0][mt][nt][2];
      red[wk][t + 1][f + 8] = acc[0][mt][nt][3];
    }
  }
  __syncthreads();

  // Sum over wk in order, scale, round, store 16-byte row pieces of rows inside the segment.
  const float scale = __ldg(alpha + tile.expert) * 256.0f;
  constexpr int CHUNKS_PER_ROW = DEC_FB / 8;
  for (int c = threadIdx.x; c < DEC_TB * CHUNKS_PER_ROW; c += DEC_THREADS) {
    const int t = c / CHUNKS_PER_ROW;
    const int f = (c % CHUNKS_PER_ROW) * 8;
    const int row = tile.row0 + t;
    if (row >= tile.row_end) continue;
    float4 lo = *reinterpret_cast<const float4*>(&red[0][t][f]);
    float4 hi = *reinterpret_cast<const float4*>(&red[0][t][f + 4]);
#pragma unroll
    for (int w = 1; w < SM90_WK; ++w) {
      const float4 l2 = *reinterpret_cast<const float4*>(&red[w][t][f]);
      const float4 h2 = *reinterpret_cast<const float4*>(&red[w][t][f + 4]);
      lo.x += l2.x; lo.y += l2.y; lo.z += l2.z; lo.w += l2.w;
      hi.x += h2.x; hi.y += h2.y; hi.z += h2.z; hi.w += h2.w;
    }
    uint4 v;
    v.x = pack_bf16x2(scale * lo.x, scale * lo.y);
    v.y = pack_bf16x2(scale * lo.z, scale * lo.w);
    v.z = pack_bf16x2(scale * hi.x, scale * hi.y);
    v.w = pack_bf16x2(scale * hi.z, scale * hi.w);
    stg_v4(out + static_cast<i64>(row) * n + blockIdx.x * DEC_FB + f, v);
  }
}

// =============================================================================================
// Prefill: large segments. CTA tile 128 features x 128 tokens x k64 per stage, cp.async pipeline.
// 8 warps: 4 along features (32 each: MT = 2) x 2 along tokens (64 each: NT = 8).
// =============================================================================================

#ifndef SM90_PF_STAGES
#define SM90_PF_STAGES 4
#endif
#ifndef SM90_PF_STMATRIX
#define SM90_PF_STMATRIX 1  // epilogue staging with stmatrix.trans (0: 16-bit shared stores)
#endif
#ifndef SM90_PF_MIN_BLOCKS
#define SM90_PF_MIN_BLOCKS 2  // CTAs per SM the register allocation must allow (2: <= 128 registers)
#endif

#define PF_THREADS 256
#define PF_FB 128                     // features per CTA
#define PF_TB 128                     // token rows per tile
#define PF_W_BYTES 4096               // 8 weight tiles of 512 B
#define PF_S_BYTES 512                // 8 scale tiles of 64 B
#define PF_X_STRIDE 144               // 128 B of a token's k64 block + 16 B pad (conflict-free LDS.128)
#define PF_X_OFFSET (PF_W_BYTES + PF_S_BYTES)
#define PF_STAGE_BYTES (PF_X_OFFSET + PF_TB * PF_X_STRIDE)  // 23040
#define PF_C_STRIDE 272               // 256 B of a token's 128 BF16 outputs + 16 B pad
#define PF_C_BYTES (PF_TB * PF_C_STRIDE)  // 34816
#define PF_SMEM_BYTES (SM90_PF_STAGES * PF_STAGE_BYTES > PF_C_BYTES ? SM90_PF_STAGES * PF_STAGE_BYTES : PF_C_BYTES)

static_assert(SM90_PF_STAGES >= 2 && SM90_PF_STAGES <= 8, "prefill: 2..8 stages");
static_assert(PF_STAGE_BYTES % 128 == 0, "prefill: stage alignment");

// Dynamic shared memory: PF_SMEM_BYTES (the host reads it as SM90_PF_STAGES * 23040, at least 34816).
extern "C" __global__ void __launch_bounds__(PF_THREADS, SM90_PF_MIN_BLOCKS)
    sm90_gemm_prefill(const u8* __restrict__ w_tiles, const u8* __restrict__ w_scales, const float* __restrict__ alpha,
                      const u16* __restrict__ x, const int* __restrict__ offsets, int num_experts, int n, int k,
                      int row_capacity, u16* __restrict__ out) {
  extern __shared__ __align__(128) u8 smem[];
  Tile tile;
  if (!find_tile<PF_TB>(offsets, num_experts, row_capacity, static_cast<int>(blockIdx.y), tile)) return;
  if (tile.row0 < 0 || tile.row0 >= tile.row_end) return;  // offsets outside [0, row_capacity]: nothing safe to do

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int wm = warp & 3;   // features [32 wm, 32 wm + 32) of the CTA
  const int wn = warp >> 2;  // tokens [64 wn, 64 wn + 64) of the tile
  const int g = lane >> 2;
  const int q = lane & 3;
  const int kt = k >> 6;
  const u32 smem_base = smem_addr(smem);

  // Copy assignments; the source pointers advance by one k64 block per loaded stage. Weights:
  // thread -> tile tid / 32, 16 B chunk tid % 32 (shared offset tid * 16).
  const i64 expert_tiles = static_cast<i64>(n >> 4) * kt;
  const i64 block_tile0 = tile.expert * expert_tiles + static_cast<i64>(blockIdx.x * 8) * kt;
  const u8* w_src = w_tiles + (block_tile0 + static_cast<i64>(tid >> 5) * kt) * 512 + lane * 16;
  // Scales: threads 0..31 -> tile tid / 4, 16 B chunk tid % 4 (shared offset PF_W_BYTES + tid * 16).
  const u8* s_src = w_scales + (block_tile0 + static_cast<i64>((tid >> 2) & 7) * kt) * 64 + (tid & 3) * 16;
  // Tokens: thread -> rows tid / 8 + 32 u (u = 0..3), 16 B chunk tid % 8. Rows past the segment read
  // nothing (src size 0: zero fill); their address is clamped to the segment's last row.
  const int x_row = tile.row0 + (tid >> 3);
  const int x_last = tile.row_end - 1;
  const u8* x_src = reinterpret_cast<const u8*>(x) + (tid & 7) * 16;
  const u32 x_dst = PF_X_OFFSET + (tid >> 3) * PF_X_STRIDE + (tid & 7) * 16;

  auto load_stage = [&](int slot) {
    const u32 base = smem_base + slot * PF_STAGE_BYTES;
    cp_async_16(base + tid * 16, w_src, 16u);
    if (tid < 32) cp_async_16(base + PF_W_BYTES + tid * 16, s_src, 16u);
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int row = x_row + 32 * u;
      cp_async_16(base + x_dst + u * 32 * PF_X_STRIDE, x_src + static_cast<i64>(min(row, x_last)) * k * 2,
                  row <= x_last ? 16u : 0u);
    }
    w_src += 512;
    s_src += 64;
    x_src += 128;
  };

  float acc[2][8][4];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[mt][nt][i] = 0.0f;

#pragma unroll
  for (int s = 0; s < SM90_PF_STAGES - 1; ++s) {
    if (s < kt) load_stage(s);
    cp_async_commit();
  }

  int read_slot = 0;
  int write_slot = SM90_PF_STAGES - 1;
  for (int j = 0; j < kt; ++j) {
    cp_async_wait<SM90_PF_STAGES - 2>();
    __syncthreads();  // stage j landed for every thread; stage j - 1 is free to overwrite
    if (j + SM90_PF_STAGES - 1 < kt) load_stage(write_slot);
    cp_async_commit();

    const u8* st = smem + read_slot * PF_STAGE_BYTES;
    uint4 wq[2];
    uint2 sc[2];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
      const int m = wm * 2 + mt;
      wq[mt] = *reinterpret_cast<const uint4*>(st + m * 512 + lane * 16);
      sc[mt] = *reinterpret_cast<const uint2*>(st + PF_W_BYTES + m * 64 + g * 8);
    }
    const u8* xb = st + PF_X_OFFSET + (wn * 64 + g) * PF_X_STRIDE + q * 32;
    // Two k16 steps at a time: decode their A (2 steps x MT = 2) once, then per n8 tile one 16-byte
    // B load (b0, b1 of both steps) and 4 mma.
#define SM90_PREFILL_HALF(H)                                                                        \
  {                                                                                                 \
    u32 a[2][2][4];                                                                                 \
    _Pragma("unroll") for (int mt = 0; mt < 2; ++mt) {                                              \
      u32 sg, sg8;                                                                                  \
      decode_scale_word(H ? sc[mt].y : sc[mt].x, sg, sg8);                                          \
      scaled_a<2 * H>(word_of<2 * H>(wq[mt]), sg, sg8, a[0][mt]);                                   \
      scaled_a<2 * H + 1>(word_of<2 * H + 1>(wq[mt]), sg, sg8, a[1][mt]);                           \
    }                                                                                               \
    _Pragma("unroll") for (int nt = 0; nt < 8; ++nt) {                                              \
      const uint4 bq = *reinterpret_cast<const uint4*>(xb + nt * 8 * PF_X_STRIDE + H * 16);         \
      _Pragma("unroll") for (int mt = 0; mt < 2; ++mt) {                                            \
        mma_bf16_16816(acc[mt][nt], a[0][mt], bq.x, bq.y);                                          \
        mma_bf16_16816(acc[mt][nt], a[1][mt], bq.z, bq.w);                                          \
      }                                                                                             \
    }                                                                                               \
  }
    SM90_PREFILL_HALF(0)
    SM90_PREFILL_HALF(1)
#undef SM90_PREFILL_HALF
    read_slot = read_slot + 1 == SM90_PF_STAGES ? 0 : read_slot + 1;
    write_slot = write_slot + 1 == SM90_PF_STAGES ? 0 : write_slot + 1;
  }
  cp_async_wait<0>();
  __syncthreads();  // every warp is done with the pipeline buffers: reuse them for the C tile

  // C tile -> shared [token][feature] BF16 (row stride PF_C_STRIDE) with transposing stmatrix:
  // matrix i of an x4 = (n8 tile nt + i / 2, features 8 (i % 2) .. + 8 of the m16 tile).
  const float scale = __ldg(alpha + tile.expert) * 256.0f;
#if SM90_PF_STMATRIX
  {
    const int mi = lane >> 3;
    const int r = lane & 7;
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
      for (int nt = 0; nt < 8; nt += 2) {
        const u32 r0 = pack_bf16x2(scale * acc[mt][nt][0], scale * acc[mt][nt][1]);
        const u32 r1 = pack_bf16x2(scale * acc[mt][nt][2], scale * acc[mt][nt][3]);
        const u32 r2 = pack_bf16x2(scale * acc[mt][nt + 1][0], scale * acc[mt][nt + 1][1]);
        const u32 r3 = pack_bf16x2(scale * acc[mt][nt + 1][2], scale * acc[mt][nt + 1][3]);
        const int token = wn * 64 + (nt + (mi >> 1)) * 8 + r;
        const int feature = wm * 32 + mt * 16 + (mi & 1) * 8;
        stmatrix_x4_trans(smem_base + token * PF_C_STRIDE + feature * 2, r0, r1, r2, r3);
      }
    }
  }
#else
  // C fragment (feature g (+8), token 2q (+1)) -> 16-bit stores at [token][feature].
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      const u32 lo = pack_bf16x2(scale * acc[mt][nt][0], scale * acc[mt][nt][1]);
      const u32 hi = pack_bf16x2(scale * acc[mt][nt][2], scale * acc[mt][nt][3]);
      u16* c = reinterpret_cast<u16*>(smem + (wn * 64 + nt * 8 + 2 * q) * PF_C_STRIDE) + wm * 32 + mt * 16 + g;
      c[0] = static_cast<u16>(lo);
      c[PF_C_STRIDE / 2] = static_cast<u16>(lo >> 16);
      c[8] = static_cast<u16>(hi);
      c[PF_C_STRIDE / 2 + 8] = static_cast<u16>(hi >> 16);
    }
  }
#endif
  __syncthreads();
  // 128 rows x 16 chunks of 16 B; rows past the segment are not written.
#pragma unroll
  for (int u = 0; u < (PF_TB * 16) / PF_THREADS; ++u) {
    const int c = tid + u * PF_THREADS;
    const int row = c >> 4;
    const int chunk = c & 15;
    const int grow = tile.row0 + row;
    if (grow < tile.row_end) {
      const uint4 v = *reinterpret_cast<const uint4*>(smem + row * PF_C_STRIDE + chunk * 16);
      stg_v4(out + static_cast<i64>(grow) * n + blockIdx.x * PF_FB + chunk * 8, v);
    }
  }
}
