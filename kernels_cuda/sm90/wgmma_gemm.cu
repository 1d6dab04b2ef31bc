// Grouped NVFP4 x BF16 GEMM over ragged expert segments on SM90 tensor cores through wgmma (sm_90a): the
// prefill engine for long segments. The leading arguments, contract and weight layout of sm90_gemm_prefill
// (grouped_gemm.cu), except that the token rows are in NATURAL column order (TokenLayout.BF16_ROWS); then the
// fused forms' arguments (the gather and the activation epilogue, at the kernel).
//
//   w_tiles   uint8 [E, N*K/2]   fragment tiles of each expert's W_e [N, K] (layout.py), read in place (row-major
//                                codes with SM90_WG_W_ROWS)
//   w_scales  uint8 [E, N*K/16]  scale-code tiles, same tile order (layout.py; the caller's E4M3 bytes, row-major
//                                and linear, with SM90_WG_W_ROWS)
//   alpha     float32 [E], or [2E] with alpha_split < n (features f >= alpha_split take alpha[E + e])
//   x         bf16 [row_capacity, K]  token rows, natural column order, 16-byte aligned; with SM90_WG_TILED_X,
//                                    the TOKENS_BF16_TILED planes instead (row_capacity a multiple of 8)
//   offsets   int32 [E + 1]      segment e = rows [offsets[e], offsets[e+1]) (starts multiples of 8)
//   out       bf16 [row_capacity, N]
// out[r, f] = bf16_rne(float(a * 256) * acc), acc = the FP32 sum over k of (w s 2^-8) x[r, k].
//
// CTA: WG_GROUPS warpgroups (2 or 4: 256 or 512 threads), 64 WG_GROUPS features x WG_TB token rows of one
// segment; warpgroup h owns features 64 h .. 64 h + 63 (warp w: the m16 tile w of the CTA). Per k64 stage,
// all threads copy with cp.async into a WG_STAGES-deep ring: the TB x 64 token tile (128-byte swizzled, the
// wgmma B operand), the CTA's m16 weight tiles (512 B each) and their scales (64 B each); with SM90_WG_TILED_X the
// token tile is one bulk copy from the TOKENS_BF16_TILED planes (the tile's rows of the stage's 64-column plane,
// already in their swizzled image), issued by one thread, that completes on the stage's mbarrier: no per-thread
// token copies or address arithmetic in the main loop. Each warp decodes
// its weight tile exactly into
// BF16 A registers (scaled_a: the values of the mma.sync kernels bit for bit) and its warpgroup issues
// four m64nTBk16 wgmma. The C tile goes through shared memory (stmatrix.trans) to 16-byte row stores (or to
// the activation epilogue, see the kernel).
// A tile with at most 32 (64) rows left in its segment runs the same code with N = 32 (64): the last tile
// of a segment costs about what its rows need.
// Grid: x = ceil(N / FB) feature blocks, y >= the number of TB-row tiles (find_tile); CTAs past the last exit.
#include "common.cuh"
#include "activation_unit.cuh"
#include "sm90/fragments.cuh"
#include "sm90/wgmma.cuh"

using namespace sm90;

#ifndef SM90_WG_TB
#define SM90_WG_TB 128  // token rows per tile: the wgmma N (64 or 128)
#endif
#ifndef SM90_WG_GROUPS
#define SM90_WG_GROUPS 4  // warpgroups per CTA, 64 features each (2 or 4)
#endif
#ifndef SM90_WG_STAGES
#define SM90_WG_STAGES 5  // k64 stages in the cp.async ring (loads run STAGES - 2 ahead)
#endif
#ifndef SM90_WG_MIN_BLOCKS
#define SM90_WG_MIN_BLOCKS 1  // CTAs per SM the register allocation must allow
#endif
#ifndef SM90_WG_TILED_X
#define SM90_WG_TILED_X 0  // 1: tokens in the TOKENS_BF16_TILED planes, bulk-copied (no gather)
#endif
// 1: NVFP4 weights in their canonical row-major layout, read in place (w_tiles codes [E, N, K/2], w_scales E4M3
// [E, N, K/16]; the aligned op's raw tensors). A stage's m16 x k64 block is 16 rows of 32 code bytes and 4 scale bytes,
// copied as they lie (natural row order in shared memory); lane (g, q) takes, for k16 step s, code byte q of words 2s
// and 2s + 1 of rows g and g + 8 (k = 16s + 2q, + 1 and 16s + 8 + 2q, + 1: the mma's natural k order, so the tokens
// are unchanged) and the rows' scale byte s. The same values as the tile form, bit for bit.
#ifndef SM90_WG_W_ROWS
#define SM90_WG_W_ROWS 0
#endif

// The activation stage folded into the epilogue (the SM90 prefill chain): SM90_ACT, an ACT_* code, and
// SM90_ACT_GATED (0 or 1) compiled in; without SM90_ACT the kernel writes GEMM1/GEMM2's BF16 output.
#ifdef SM90_ACT
#ifndef SM90_ACT_GATED
#error "SM90_ACT needs SM90_ACT_GATED"
#endif
#define WG_PAIRED (SM90_ACT_GATED != 0)
#else
#define WG_PAIRED false
#endif

#define WG_TB SM90_WG_TB
#define WG_THREADS (SM90_WG_GROUPS * 128)
#define WG_MTILES (SM90_WG_GROUPS * 4)              // m16 weight tiles per CTA (one per warp)
#define WG_FB (WG_MTILES * 16)                      // features per CTA
#define WG_X_BYTES (WG_TB * 128)                    // token tile of one stage
#define WG_W_OFFSET WG_X_BYTES
#define WG_S_OFFSET (WG_W_OFFSET + WG_MTILES * 512)
#define WG_STAGE_BYTES (((WG_S_OFFSET + WG_MTILES * 64) + 1023) / 1024 * 1024)
#define WG_PIPE_BYTES (SM90_WG_STAGES * WG_STAGE_BYTES)
#define WG_C_STRIDE (WG_FB * 2 + 16)                // a token's FB BF16 outputs + 16 B pad
#define WG_C_BYTES (WG_TB * WG_C_STRIDE)
// The activation epilogue's image of the tile's rows of its tiled output planes, after the C tile: at most FB / 64
// planes (not gated) of TB rows of 128 bytes.
#define WG_IMAGE_OFFSET ((WG_C_BYTES + 1023) / 1024 * 1024)
#define WG_EPILOGUE_BYTES (WG_IMAGE_OFFSET + WG_TB * 128 * (WG_FB / 64))
// Dynamic shared memory: the larger of the ring and the epilogue's, plus 1 KB to align the ring to 1024 bytes
// (WgmmaVariant.shared_mem).
#define WG_SMEM_BYTES ((WG_PIPE_BYTES > WG_EPILOGUE_BYTES ? WG_PIPE_BYTES : WG_EPILOGUE_BYTES) + 1024)

static_assert(WG_TB == 64 || WG_TB == 128, "wgmma gemm: TB must be 64 or 128");
static_assert(SM90_WG_GROUPS == 2 || SM90_WG_GROUPS == 4, "wgmma gemm: 2 or 4 warpgroups");
static_assert(SM90_WG_STAGES >= 3 && SM90_WG_STAGES <= 8, "wgmma gemm: 3..8 stages");
static_assert(WG_SMEM_BYTES <= 227 * 1024, "wgmma gemm: shared memory");
#if SM90_WG_TILED_X && defined(SM90_ACT)
#error "wgmma gemm: the tiled token load is GEMM2's (GEMM1 with the activation gathers natural rows)"
#endif

// The token tiles' mbarriers (SM90_WG_TILED_X), one per ring stage: the shared address of the first (8 bytes each).
__device__ __forceinline__ u32 token_barriers() {
  __shared__ alignas(8) u64 barriers[SM90_WG_STAGES];
  return smem_addr(barriers);
}

// The 1024-byte aligned start of the dynamic shared memory (the ring, later the C tile).
__device__ __forceinline__ u8* wgmma_smem(u32& ring) {
  extern __shared__ __align__(128) u8 smem_raw[];
  const u32 raw_base = smem_addr(smem_raw);
  ring = (raw_base + 1023u) & ~1023u;
  return smem_raw + (ring - raw_base);
}

// The m16 row tile of W (features 16 t ..) that the CTA's tile m computes, or -1 past N. Plain: tile
// blockIdx.x * MTILES + m. Paired (the activation epilogue of a gated activation, W = [up; gate] of n / 2
// rows each): the CTA's first MTILES / 2 tiles are up tiles blockIdx.x * MTILES / 2 + m, the others the
// gate tiles of the same features, n / 32 tiles further. (The logical tile: half_swapped_tile gives the stored one.)
__device__ __forceinline__ int cta_weight_tile(int m, int n) {
  constexpr int HALF = WG_MTILES / 2;
  if (!WG_PAIRED) {
    const int t = static_cast<int>(blockIdx.x) * WG_MTILES + m;
    return t < (n >> 4) ? t : -1;
  }
  const int j = static_cast<int>(blockIdx.x) * HALF + m % HALF;
  if (j >= (n >> 5)) return -1;
  return m < HALF ? j : (n >> 5) + j;
}

// Token rows to read: row r of the segment is x[r] (gather_top_k == 0), or with a gather the token
// row_to_slot[r] / gather_top_k of x's gather_tokens rows, zeros where row_to_slot[r] < 0 (a padding row)
// or the token is out of range.
struct RowSource {
  const int* row_to_slot;
  int gather_top_k;
  int gather_tokens;
};

// One TB-row tile (TB <= WG_TB: rows past the segment's end are zero-filled and not stored).
template <int TB>
__device__ __forceinline__ void wgmma_tile(const Tile& tile, const u8* __restrict__ w_tiles,
                                           const u8* __restrict__ w_scales, const float* __restrict__ alpha,
                                           const u16* __restrict__ x, RowSource rows, int num_experts, int n, int k,
                                           int row_capacity, int alpha_split, int w_half_swap) {
  constexpr int ACC = TB / 2;
#if !SM90_WG_TILED_X
  constexpr int X_ROW_STEP = WG_THREADS / 8;  // token rows one copy pass covers
  constexpr int X_PASSES = TB > X_ROW_STEP ? TB / X_ROW_STEP : 1;
  static_assert(TB <= WG_TB && (TB % X_ROW_STEP == 0 || TB < X_ROW_STEP), "wgmma gemm: token copy split");
#endif
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;  // m16 tile of the CTA; warpgroup warp / 4
  const int g = lane >> 2;
  const int kt = k >> 6;
  u32 ring;
  u8* const smem = wgmma_smem(ring);

  // Copies; the sources advance by one k64 block per loaded stage. Weights: thread -> tile tid / 32 (the
  // warp's own), its 16-byte piece tid % 32 (each thread copies WG_MTILES * 32 / WG_THREADS = 1 chunk).
  // Scales: threads < 4 * MTILES -> tile tid / 4, chunk tid % 4. A tile past N (a last CTA of 256 features
  // over N a multiple of 128 only) reads nothing (zero fill, address clamped to the expert's first tile);
  // its outputs are not stored.
  const int w_tile = cta_weight_tile(warp, n);
  const u32 w_bytes = w_tile >= 0 ? 16u : 0u;
#if SM90_WG_W_ROWS
  // Row-major: thread -> row lane / 2 of the warp's tile, its 16 bytes (lane % 2) of the row's 32 (natural order in
  // shared memory: the tile's row r at 32 r); scales: threads < 16 * MTILES -> tile tid / 16, row tid % 16, its 4 bytes
  // (at 4 r of the tile's 64).
  const i64 expert_row0 = tile.expert * static_cast<i64>(n);
  const int w_row = 16 * max(half_swapped_tile(w_tile, n, w_half_swap), 0) + (lane >> 1);
  const u8* w_src = w_tiles + (expert_row0 + w_row) * (k >> 1) + (lane & 1) * 16;
  const int s_tile = cta_weight_tile((tid >> 4) & (WG_MTILES - 1), n);
  const int s_row = 16 * max(half_swapped_tile(s_tile, n, w_half_swap), 0) + (tid & 15);
  const u8* s_src = w_scales + (expert_row0 + s_row) * (k >> 4);
  const u32 s_bytes = s_tile >= 0 ? 4u : 0u;
  constexpr int W_SRC_STEP = 32, S_SRC_STEP = 4, S_COPIERS = 16 * WG_MTILES;
#else
  const i64 expert_tile0 = tile.expert * static_cast<i64>(n >> 4) * kt;
  const u8* w_src = w_tiles + (expert_tile0 + static_cast<i64>(max(half_swapped_tile(w_tile, n, w_half_swap), 0)) * kt) * 512 + lane * 16;
  const int s_tile = cta_weight_tile((tid >> 2) & (WG_MTILES - 1), n);
  const u8* s_src = w_scales + (expert_tile0 + static_cast<i64>(max(half_swapped_tile(s_tile, n, w_half_swap), 0)) * kt) * 64 + (tid & 3) * 16;
  const u32 s_bytes = s_tile >= 0 ? 16u : 0u;
  constexpr int W_SRC_STEP = 512, S_SRC_STEP = 64, S_COPIERS = 4 * WG_MTILES;
#endif
  // Tokens: thread -> chunk tid % 8 of rows tid / 8 + (THREADS / 8) u; rows past the segment (and, with a
  // gather, padding rows) read nothing (zero fill, address clamped to a row that exists). Swizzled
  // destination: chunk c of row r at chunk position c ^ (r % 8) (THREADS / 8 is a multiple of 8, so r % 8 is
  // the same for every u).
#if SM90_WG_TILED_X
  // Tiled tokens: stage j is the tile's rows of plane j, (j row_capacity + row0) 128 bytes into x, copied whole (in
  // 8-row groups: rows of the last group past the segment, and the rest of the TB rows, hold other data that only
  // reaches C columns that are never stored). Thread 0 sets up the ring's barriers and issues every copy.
  const u32 x_bars = token_barriers();
  const u32 x_tile_bytes = static_cast<u32>(min((tile.row_end - tile.row0 + 7) >> 3, TB / 8)) * 1024u;
  const u8* x_src = reinterpret_cast<const u8*>(x) + static_cast<i64>(tile.row0) * 128;
  const i64 x_plane_bytes = static_cast<i64>(row_capacity) * 128;
  if (tid == 0) {
    for (int s = 0; s < SM90_WG_STAGES; ++s) mbarrier_init(x_bars + 8 * s, 1);
    fence_mbarrier_init();
  }
  __syncthreads();
#else
  const int chunk = tid & 7;
  const int x_last = tile.row_end - 1;
  const bool gather = rows.gather_top_k > 0;
  const u8* x_src = reinterpret_cast<const u8*>(x) + (gather ? 0 : static_cast<i64>(tile.row0) * k * 2) + chunk * 16;
  const bool x_copies = (tid >> 3) < TB;  // TB < X_ROW_STEP: the threads of rows past the tile copy nothing
  u32 x_off[X_PASSES];
  u32 x_bytes[X_PASSES];
  const u32 x_dst = (tid >> 3) * 128 + ((chunk ^ ((tid >> 3) & 7)) << 4);
#endif

  auto load_weights = [&](int slot) {
    const u32 base = ring + slot * WG_STAGE_BYTES;
#if SM90_WG_W_ROWS
    cp_async_16<true>(base + WG_W_OFFSET + tid * 16, w_src, w_bytes);
    if (tid < S_COPIERS) cp_async_4_zfill(base + WG_S_OFFSET + tid * 4, s_src, s_bytes);
#else
    cp_async_16(base + WG_W_OFFSET + tid * 16, w_src, w_bytes);
    if (tid < S_COPIERS) cp_async_16(base + WG_S_OFFSET + tid * 16, s_src, s_bytes);
#endif
    w_src += W_SRC_STEP;
    s_src += S_SRC_STEP;
  };
  auto load_tokens = [&](int slot) {
    const u32 base = ring + slot * WG_STAGE_BYTES;
#if SM90_WG_TILED_X
    if (tid == 0) {
      mbarrier_arrive_expect_tx(x_bars + 8 * slot, x_tile_bytes);
      bulk_copy_to_shared(base, x_src, x_tile_bytes, x_bars + 8 * slot);
    }
    x_src += x_plane_bytes;
#else
    if (x_copies) {
#pragma unroll
      for (int u = 0; u < X_PASSES; ++u)
        cp_async_16(base + x_dst + u * X_ROW_STEP * 128, x_src + x_off[u], x_bytes[u]);
    }
    x_src += 128;
#endif
  };

  float acc[ACC];
#pragma unroll
  for (int i = 0; i < ACC; ++i) acc[i] = 0.0f;

  // Prologue: the weights of the first AHEAD stages go first (they need no row index), so the row lookups of
  // a gather overlap with their copies; then each stage's tokens, one commit group per stage (group 0 also
  // holds every prologue weight copy, so stage j has landed once groups 0..j have).
  constexpr int AHEAD = SM90_WG_STAGES - 2;  // stages loaded ahead of the one being multiplied
#pragma unroll
  for (int s = 0; s < AHEAD; ++s)
    if (s < kt) load_weights(s);
#if !SM90_WG_TILED_X
#pragma unroll
  for (int u = 0; u < X_PASSES; ++u) {
    const int row = tile.row0 + (tid >> 3) + X_ROW_STEP * u;
    if (gather) {
      const int slot = x_copies && row <= x_last ? __ldg(rows.row_to_slot + row) : -1;
      const int token = slot >= 0 ? slot / rows.gather_top_k : -1;
      const bool live = token >= 0 && token < rows.gather_tokens;
      x_off[u] = static_cast<u32>(live ? token : 0) * static_cast<u32>(k) * 2u;
      x_bytes[u] = live ? 16u : 0u;
    } else {
      x_off[u] = static_cast<u32>(min(row, x_last) - tile.row0) * static_cast<u32>(k) * 2u;
      x_bytes[u] = row <= x_last ? 16u : 0u;
    }
  }
#endif
#pragma unroll
  for (int s = 0; s < AHEAD; ++s) {
    if (s < kt) load_tokens(s);
    cp_async_commit();
  }

  u32 a[4][4];
  int read_slot = 0;
  int write_slot = AHEAD;
  u32 read_phase = 0;  // parity of the token barrier phase of the stage read (SM90_WG_TILED_X)
  for (int j = 0; j < kt; ++j) {
    // Stage j landed for this thread (AHEAD - 1 younger groups may be pending) and is made visible to
    // wgmma; after the barrier it has landed for every thread, and every warpgroup's wgmma of stage
    // j - 2 (the slot refilled now) are complete. Bulk-copied tokens: their barrier, before the first wgmma.
    cp_async_wait<AHEAD - 1>();
#if !SM90_WG_TILED_X
    fence_proxy_async_shared();
#endif
    __syncthreads();
    if (j + AHEAD < kt) {
      load_tokens(write_slot);
      load_weights(write_slot);
    }
    cp_async_commit();
#if SM90_WG_TILED_X
    mbarrier_wait(x_bars + 8 * read_slot, read_phase);
#endif

    const u8* st = smem + read_slot * WG_STAGE_BYTES;
    const u32 xb = ring + read_slot * WG_STAGE_BYTES;
    u32 sg, sg8;
#if SM90_WG_W_ROWS
    // Rows g and g + 8 of the warp's tile (32 bytes each) and their 4 scale bytes, as tile-form scale words: bytes
    // (step 2p row g, step 2p row g + 8, step 2p + 1 row g, step 2p + 1 row g + 8) for p = 0 (x) and 1 (y).
    const u8* const wrow = st + WG_W_OFFSET + warp * 512 + g * 32;
    const uint4 wg0 = *reinterpret_cast<const uint4*>(wrow), wg1 = *reinterpret_cast<const uint4*>(wrow + 16);
    const uint4 wh0 = *reinterpret_cast<const uint4*>(wrow + 256), wh1 = *reinterpret_cast<const uint4*>(wrow + 272);
    const u32 s_g = *reinterpret_cast<const u32*>(st + WG_S_OFFSET + warp * 64 + g * 4);
    const u32 s_g8 = *reinterpret_cast<const u32*>(st + WG_S_OFFSET + warp * 64 + g * 4 + 32);
    const uint2 sc = make_uint2(__byte_perm(s_g, s_g8, 0x5140), __byte_perm(s_g, s_g8, 0x7362));
    const u32 lo_sel = row_byte_selector(lane & 3);  // code byte q of a word
    // Step S: words 2S, 2S + 1 of rows g (a0, a2) and g + 8 (a1, a3), their byte q.
#define SM90_WG_DECODE(S)                                                                           \
  {                                                                                                 \
    const uint4& rg = (S) < 2 ? wg0 : wg1;                                                          \
    const uint4& rh = (S) < 2 ? wh0 : wh1;                                                          \
    a[S][0] = decode_row_byte((S) % 2 ? rg.z : rg.x, lo_sel);                                       \
    a[S][2] = decode_row_byte((S) % 2 ? rg.w : rg.y, lo_sel);                                       \
    a[S][1] = decode_row_byte((S) % 2 ? rh.z : rh.x, lo_sel);                                       \
    a[S][3] = decode_row_byte((S) % 2 ? rh.w : rh.y, lo_sel);                                       \
    scale_a<S>(sg, sg8, a[S]);                                                                      \
  }
#else
    const uint4 wq = *reinterpret_cast<const uint4*>(st + WG_W_OFFSET + warp * 512 + lane * 16);
    const uint2 sc = *reinterpret_cast<const uint2*>(st + WG_S_OFFSET + warp * 64 + g * 8);
#define SM90_WG_DECODE(S) scaled_a<S>(word_of<S>(wq), sg, sg8, a[S]);
#endif
#if SM90_WG_W_ROWS
#define SM90_WG_SCALES decode_scale_word  // the caller's E4M3 bytes
#else
#define SM90_WG_SCALES decode_tile_scale_word
#endif
#define SM90_WG_STEP(S)                                                                             \
  wgmma_wait<3>();                                                                                  \
  if ((S) % 2 == 0) SM90_WG_SCALES((S) ? sc.y : sc.x, sg, sg8);                                     \
  SM90_WG_DECODE(S)                                                                                 \
  wgmma_fence();                                                                                    \
  wgmma_rs<TB>(acc, a[S], wgmma_desc_sw128(xb + 32 * (S)));                                      \
  wgmma_commit();
    SM90_WG_STEP(0)
    SM90_WG_STEP(1)
    SM90_WG_STEP(2)
    SM90_WG_STEP(3)
#undef SM90_WG_STEP
#undef SM90_WG_DECODE
#undef SM90_WG_SCALES
    read_phase ^= read_slot + 1 == SM90_WG_STAGES ? 1u : 0u;
    read_slot = read_slot + 1 == SM90_WG_STAGES ? 0 : read_slot + 1;
    write_slot = write_slot + 1 == SM90_WG_STAGES ? 0 : write_slot + 1;
  }
  wgmma_wait<0>();
  cp_async_wait<0>();
  __syncthreads();  // every warp is done with the ring: reuse it for the C tile

  // C tile -> shared [token][CTA tile column] BF16 with transposing stmatrix: matrix i of an x4 = (n8 block
  // nt + i / 2, columns 8 (i % 2) .. + 8 of the warp's m16 tile). Each warp scales by its own features'
  // alpha (alpha_split is a multiple of 16).
  const float scale = __ldg(alpha + expert_alpha(tile.expert, num_experts, 16 * max(w_tile, 0), alpha_split)) * 256.0f;
#pragma unroll
  for (int nt = 0; nt < TB / 8; nt += 2)
    stage_c_pair(ring, WG_C_STRIDE, nt * 8, warp * 16, scale, acc + 4 * nt, acc + 4 * nt + 4);
  __syncthreads();
}

// The activation epilogue: the staged C tile (the tile's rows of FB BF16 GEMM1 outputs, WG_C_STRIDE bytes
// apart at smem, shared address `ring`) -> the activation stage's output rows, a unit of 32 outputs per item
// (activation_unit.cuh: the bits of moe_activation), in GEMM2's token layout. Gated (paired tiles): outputs
// blockIdx.x * FB / 2 .. + FB / 2 of the inter = n / 2 per row, up from tile columns [0, FB / 2), gate from
// [FB / 2, FB); else outputs blockIdx.x * FB .. + FB of inter = n. Rows past the segment and outputs past inter are
// not written; padding rows (row_to_slot < 0) are written as zeros (`rows`: the output's rows, where the tiled
// planes start).
// TOKENS_BF16_TILED: the units go into a shared-memory image of the tile's rows of the CTA's planes (at
// WG_IMAGE_OFFSET, each row's chunks already in their swizzled places: tile.row0 is a multiple of 8), then one thread
// writes each plane's rows with one bulk copy (contiguous in the plane) and waits until they have been read.
template <int ACT, bool GATED>
__device__ __forceinline__ void activation_epilogue(u8* smem, u32 ring, const Tile& tile,
                                                    const int* __restrict__ row_to_slot, int inter, int rows, float alpha, float beta, float limit,
                                                    int layout, int inter_code, u8* __restrict__ out,
                                                    u8* __restrict__ out_scales) {
  constexpr int COLS = GATED ? WG_FB / 2 : WG_FB;
  constexpr int UNITS = COLS / 32;
  const int unit0 = static_cast<int>(blockIdx.x) * UNITS;
  const int units_in = min(UNITS, inter / 32 - unit0);
  const int tile_rows = min(tile.row_end - tile.row0, WG_TB);
  if (layout != TOKENS_BF16_TILED) {
    for (int item = threadIdx.x; item < WG_TB * UNITS; item += WG_THREADS) {
      const int row = item / UNITS;
      const int unit = item % UNITS;
      if (row >= tile_rows || unit >= units_in) continue;
      const int r = tile.row0 + row;
      const u16* src = reinterpret_cast<const u16*>(smem + row * WG_C_STRIDE) + 32 * unit;
      moe::activate_store_unit<ACT, GATED>(src, COLS, __ldg(row_to_slot + r) < 0, r, unit0 + unit, inter, rows, ACT,
                                           alpha, beta, limit, layout, inter_code, out, out_scales);
    }
    return;
  }
  static_assert(UNITS % 2 == 0 && (COLS / 64) * WG_TB * 128 <= WG_EPILOGUE_BYTES - WG_IMAGE_OFFSET,
                "wgmma gemm: the tiled image");
  const int planes_in = units_in >> 1;  // inter % 64 == 0 in the tiled layout
  u8* const image = smem + WG_IMAGE_OFFSET;
  for (int item = threadIdx.x; item < WG_TB * UNITS; item += WG_THREADS) {
    const int row = item / UNITS;
    const int unit = item % UNITS;
    if (row >= tile_rows || unit >= 2 * planes_in) continue;
    const u16* src = reinterpret_cast<const u16*>(smem + row * WG_C_STRIDE) + 32 * unit;
    uint4 chunk[4];
    moe::activate_unit_chunks<ACT, GATED>(src, COLS, __ldg(row_to_slot + tile.row0 + row) < 0, ACT, alpha, beta, limit,
                                          inter_code, chunk);
    u8* const line = image + ((unit >> 1) * WG_TB + row) * 128;
#pragma unroll
    for (int c = 0; c < 4; ++c)
      *reinterpret_cast<uint4*>(line + (moe::tiled_chunk_position(4 * (unit & 1) + c, row) << 4)) = chunk[c];
  }
  fence_proxy_async_shared();  // the image's generic-proxy writes, before the bulk copies read them
  __syncthreads();
  if (threadIdx.x == 0 && tile_rows > 0) {
    for (int p = 0; p < planes_in; ++p) {
      u8* dst = out + ((static_cast<i64>(unit0 / 2 + p) * rows) + tile.row0) * 128;
      bulk_copy_to_global(dst, ring + WG_IMAGE_OFFSET + p * WG_TB * 128, static_cast<u32>(tile_rows) * 128u);
    }
    bulk_commit_wait_read();  // the CTA's shared memory stays until the copies have read it
  }
}

// Per k64 stage j and k16 step s, warp w (its warpgroup's A rows 16 (w % 4) ..): wait until at most 3
// wgmma groups are pending (so the group of step s of stage j - 1, which read a[s], is done), decode a[s]
// from stage j's weight tile, fence, issue one wgmma on it, commit it as its own group. Up to four
// wgmma run behind the decode; a stage slot is refilled two stages after its last read, when every
// warpgroup's groups of it are complete (the barrier at the top of each stage sees to that).
//
// Fused forms (the prefill chain of the SM90 engine):
//   gather_top_k > 0  the permute folded into the token load: x is bf16 [gather_tokens, K] (natural rows,
//                     token order) and row r of a segment reads token row_to_slot[r] / gather_top_k, zeros
//                     where row_to_slot[r] < 0 (padding rows) or the token is past gather_tokens
//   SM90_ACT       the activation stage folded into the epilogue (act_alpha / _beta / _limit as
//                     moe_activation takes them): instead of out, act_out (and act_scales for the NVFP4
//                     layouts) receive moe_activation's output for the tile's rows, bit for bit, in act_layout
//                     (inter_code as there). Gated: W is [up; gate] (n / 2 rows each), the grid's x covers
//                     ceil(n / FB) blocks of FB / 2 outputs, each CTA's first half of warps computing up and
//                     its second half the gate rows of those outputs.
//   row_to_slot       int32 [row_capacity]: read by either (unused by the plain kernel without a gather)
extern "C" __global__ void __launch_bounds__(WG_THREADS, SM90_WG_MIN_BLOCKS)
    sm90_gemm_wgmma(const u8* __restrict__ w_tiles, const u8* __restrict__ w_scales, const float* __restrict__ alpha,
                    const u16* __restrict__ x, const int* __restrict__ offsets, int num_experts, int n, int k,
                    int row_capacity, int alpha_split, u16* __restrict__ out, const int* __restrict__ row_to_slot,
                    int gather_top_k, int gather_tokens, float act_alpha, float act_beta, float act_limit,
                    int act_layout, int inter_code, u8* __restrict__ act_out, u8* __restrict__ act_scales,
                    int w_half_swap) {
  moe::grid_dependency_begin();
  Tile tile;
  if (!find_tile<WG_TB>(offsets, num_experts, row_capacity, static_cast<int>(blockIdx.y), tile)) return;
  if (tile.row0 < 0 || tile.row0 >= tile.row_end) return;  // offsets outside [0, row_capacity]: nothing safe to do
  const RowSource rows{row_to_slot, gather_top_k, gather_tokens};
  // A segment's last tile often holds few rows: it runs with the smallest wgmma N that covers them.
  const int tile_rows = tile.row_end - tile.row0;
  if (WG_TB > 32 && tile_rows <= 32) {
    wgmma_tile<32>(tile, w_tiles, w_scales, alpha, x, rows, num_experts, n, k, row_capacity, alpha_split,
                   w_half_swap);
  } else if (WG_TB > 64 && tile_rows <= 64) {
    wgmma_tile<64>(tile, w_tiles, w_scales, alpha, x, rows, num_experts, n, k, row_capacity, alpha_split,
                   w_half_swap);
  } else {
    wgmma_tile<WG_TB>(tile, w_tiles, w_scales, alpha, x, rows, num_experts, n, k, row_capacity, alpha_split,
                   w_half_swap);
  }
  u32 ring;
  u8* smem = wgmma_smem(ring);
#ifdef SM90_ACT
  activation_epilogue<SM90_ACT, WG_PAIRED>(smem, ring, tile, row_to_slot, WG_PAIRED ? n / 2 : n, row_capacity,
                                              act_alpha, act_beta, act_limit, act_layout, inter_code, act_out,
                                              act_scales);
#else
  // The tile's rows x FB / 8 chunks of 16 B; rows past the segment and features past N are not written.
  const int mtiles_in = (n >> 4) - static_cast<int>(blockIdx.x) * WG_MTILES;
  store_c_tile<WG_TB, WG_FB, WG_THREADS>(smem, WG_C_STRIDE, tile, n, blockIdx.x * WG_FB, 2 * mtiles_in, out);
#endif
}
