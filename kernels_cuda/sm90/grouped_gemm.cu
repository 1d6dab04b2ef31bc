// Grouped NVFP4 x BF16 GEMM over ragged expert segments on SM90 (mma.sync, "swap AB": the weights
// are the 16-row A operand, the tokens the 8-wide B operand).
//
// Arguments of both kernels (the decode kernel then takes the activation epilogue's, at the kernel):
//   w_tiles      uint8 [E, N*K/2]   fragment tiles of each expert's W_e [N, K] (layout.py; row-major codes with
//                                   the decode kernel's SM90_W_ROWS form)
//   w_scales     uint8 [E, N*K/16]  scale-code tiles, same tile order (layout.py; the caller's E4M3 bytes, row-major
//                                   and linear, with SM90_W_ROWS)
//   alpha        float32 [E], or [2E] with alpha_split < n: per-expert global scale; features
//                f >= alpha_split take alpha[E + e] (e.g. the gate half of GEMM1 with its own scale);
//                alpha_split is a multiple of the CTA's feature block (the host checks)
//   x            bf16 [row_capacity, K]  token rows in token-fragment column order
//   offsets      int32 [E + 1]      segment e = rows [offsets[e], offsets[e+1]) (multiples of 8)
//   out          bf16 [row_capacity, N]  row-major, natural column order
// out[r, f] = bf16_rne(float(a * 256) * acc), a = alpha[e] (alpha[E + e] past alpha_split), acc = FP32 sum
// over k of (w s 2^-8) x[r, k] for r in segment e. Rows outside the tile's segment are never written, rows >= its end never read.
// Grid: x = feature blocks (N / features per CTA), y >= number of tiles (tile = TILE_ROWS rows of one
// segment, segments concatenated); CTAs past the last tile exit. No atomics: deterministic.
#include "common.cuh"
#include "activation_unit.cuh"
#include "finalize.cuh"
#include "sm90/fragments.cuh"
#include "sort.cuh"

using namespace sm90;

// The activation stage folded into the decode kernel's epilogue (the SM90 decode chain): SM90_ACT, an ACT_*
// code, and SM90_ACT_GATED (0 or 1) compiled in, as in wgmma_gemm.cu; without SM90_ACT the kernels write
// their BF16 output. SM90_ACT_MXFP8=1: the epilogue quantizes to MXFP8 (the MX pair's intermediate, inter_code
// INTER_MXFP8, BF16 layouts only), compiled into those forms alone.
#ifndef SM90_ACT_MXFP8
#define SM90_ACT_MXFP8 0
#endif
#ifdef SM90_ACT
#ifndef SM90_ACT_GATED
#error "SM90_ACT needs SM90_ACT_GATED"
#endif
#define DEC_PAIRED (SM90_ACT_GATED != 0)
#else
#define DEC_PAIRED false
#endif
// The finalize folded into the decode kernel (GEMM2 of the SM90 decode chain): SM90_FINALIZE defined, no SM90_ACT.
#if defined(SM90_FINALIZE) && defined(SM90_ACT)
#error "SM90_FINALIZE is for GEMM2, SM90_ACT for GEMM1"
#endif
#ifdef SM90_FINALIZE
#define DEC_FINALIZE true
#else
#define DEC_FINALIZE false
#endif
// The op's stage and the routing sort folded into GEMM1's prologue (a decode chain of one-token buckets:
// SM90_ROUTE 1 for BF16 tokens, 2 for NVFP4 tokens, 3 for MXFP8 tokens (the MXFP4 pair's, on its MXFP4 tiles); with
// SM90_ACT): every CTA decodes the caller's routing, sorts
// its slots in one warp (sort_slots_warp, into shared memory) and stages the token row in fragment order in dynamic
// shared memory (k BF16 values); CTA (0, 0) also writes the sort's outputs and the decoded routing for GEMM2 and the
// finalize. The MMA's token operand then comes from shared memory: every row of a one-token bucket is that token.
#ifdef SM90_ROUTE
#if !defined(SM90_ACT) || defined(SM90_FINALIZE)
#error "SM90_ROUTE is for GEMM1 with the activation epilogue (SM90_ACT)"
#endif
#if SM90_ROUTE == 3 && !SM90_W_MXFP4
#error "SM90_ROUTE 3 (MXFP8 tokens) is for the MXFP4 pair's tiles (SM90_W_MXFP4)"
#endif
#endif
// GEMM1 of a decode chain whose sort + permute runs in the launch before it, or GEMM2 behind a routed GEMM1
// (SM90_EARLY): before its dependency wait each CTA of the first wave reads the call's routing (written before the
// launch before this one passed its own wait, which this launch follows), guesses its tile's expert from it
// (early_tile_expert) and issues its weight ring's first loads, so that the weights stream while the launch before
// runs. After the wait the tile comes from the offsets as in every form; a wrong guess only reloads the ring.
#if defined(SM90_EARLY) && (defined(SM90_ROUTE) || defined(SM90_AWAIT))
#error "SM90_EARLY runs without SM90_ROUTE and SM90_AWAIT"
#endif

// The tile handoff between a decode chain's GEMM1 and GEMM2 (launched right behind it with PDL): SM90_SIGNAL (GEMM1,
// with SM90_ACT) adds one to handoff_done[t] (a release at GPU scope) once its CTA's activation rows of tile t are
// written; SM90_AWAIT (GEMM2: no SM90_ACT, SM90_ROUTE or SM90_EARLY) does not wait for GEMM1 to complete: it triggers
// its dependents, finds its tile, issues its weight ring's first loads, and waits (thread 0, acquire at GPU scope) until
// handoff_done[t] holds GEMM1's CTAs of that tile (handoff_producers: GEMM1's feature blocks; both GEMMs' tiles of the
// same rows), then reads its token rows with weak loads (load_token_piece). So GEMM2's CTAs compute the tiles GEMM1
// has finished while GEMM1's last CTAs still run. GEMM2 then reads before GEMM1 has completed what kernels before
// GEMM1 wrote (the offsets, the finalize's slots and weights): their writers must have completed before GEMM1 passed
// its own dependency wait (the sort launch before GEMM1), which GEMM2's launch follows. The last of a tile's GEMM2
// CTAs (handoff_passed[t] counts them) zeroes both counters for the next launch: int32 [tiles] each, zero before the
// pair and after it. No wait can starve: GEMM2 launches only once every GEMM1 CTA has triggered its dependents (at its
// start), so each producer is resident or done when a consumer waits; without PDL GEMM2 starts after GEMM1 and never
// waits.
#if defined(SM90_SIGNAL) && (!defined(SM90_ACT) || defined(SM90_AWAIT) || defined(SM90_ROUTE))
#error "SM90_SIGNAL is for GEMM1 with the activation epilogue (SM90_ACT), without SM90_ROUTE (it writes the offsets)"
#endif
#if defined(SM90_AWAIT) && (defined(SM90_ACT) || defined(SM90_ROUTE) || defined(SM90_EARLY))
#error "SM90_AWAIT is for GEMM2 (no SM90_ACT, SM90_ROUTE or SM90_EARLY)"
#endif

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
// MXINT4 weights (1; the decode kernel only): two's-complement INT4 tiles decoded exactly to BF16 (fragments.cuh
// decode_a_int4), and BF16 scale tiles: byte g * 8 + 4 h + 2 r of a tile's 64 holds the scale of row g + 8 r and k32
// block h (two bytes, little-endian). Each k32 block's two mma sum into a zeroed fragment, which then enters the
// accumulator as acc = fma(partial, fp32(scale), acc). The C tile the activation epilogue reads then holds the FP32
// preactivation (alpha * 256 times the sum, unrounded: the MXINT4 contract keeps it in FP32).
#ifndef SM90_W_INT4
#define SM90_W_INT4 0
#endif
// MXFP4 weights (1; the decode kernel only) in their exact shifted form: the NVFP4 tiles' codes, and scale tiles of
// one byte per k32 block (layout.py MXFP4 tiles: byte g * 4 + 2h + r of a tile's 32 holds row g + 8r, k32 block h), the
// BF16 multiplier 2^(p + 118) of block scale 2^p (fragments.cuh decode_e8m0_scale_word); alpha the globals 2^a. The
// products are the NVFP4 tiles' (E2M1 x 2^(p - 8)), so are the sums and the output.
#ifndef SM90_W_MXFP4
#define SM90_W_MXFP4 0
#endif
#if SM90_W_MXFP4 && SM90_W_INT4
#error "SM90_W_MXFP4 runs without SM90_W_INT4"
#endif
// BF16 weights (1; the decode kernel only, no route and no early routing): W_e row-major BF16 [N, K] read in place
// (w_tiles its bytes, w_scales unused), no block scales. Lane (g, q) loads, per k64 step, 16 bytes at columns 8q and
// 32 + 8q of rows g and g + 8 of its m16 row block; the token rows are in natural column order (TokenLayout.BF16_ROWS)
// and read at the same columns, so word 2s and 2s + 1 of those 32 bytes are the a / b registers of k16 step s (the
// mma's k order is a fixed permutation of the step's 64 columns, the same for both operands).
#ifndef SM90_W_BF16
#define SM90_W_BF16 0
#endif
#if SM90_W_BF16 && (SM90_W_INT4 || SM90_W_MXFP4 || defined(SM90_ROUTE) || defined(SM90_EARLY))
#error "SM90_W_BF16 runs without SM90_W_INT4, SM90_W_MXFP4, SM90_ROUTE and SM90_EARLY"
#endif
// NVFP4 weights in their canonical row-major layout (1; the decode kernel without a route): w_tiles codes [E, N, K/2]
// and w_scales E4M3 [E, N, K/16], read in place (the aligned op's raw tensors); K a multiple of 128. The ring's steps
// are k128 (PREFETCH / 2 of them in flight, at least one: the same bytes as the tile form's ring): lane (g, q) loads
// the 16 code bytes of columns 32q .. 32q + 31 of rows g and g + 8 (two 16-value blocks, two scale bytes each; a warp
// reads 64 contiguous bytes of each row), and the tokens are natural rows (TokenLayout.BF16_ROWS) read at the same
// columns (64 bytes at 64q of the step's 256): k16 step s (0..7) takes code bytes 2s and 2s + 1
// (fragments.cuh decode_row_byte) and token words 2s and 2s + 1. The sums then run in another k order than the tile
// form's: the same values up to FP32 rounding, not bit for bit.
#ifndef SM90_W_ROWS
#define SM90_W_ROWS 0
#endif
// With SM90_W_MXFP4 the row-major weights are MXFP4 (the MX pair's canonical tensors): w_scales E8M0 [E, N, K/32],
// one byte a lane a row and step (its 16 code bytes are one k32 block), made into the multiplier of the exact shifted
// form with the expert's shift, read off its global 2^a in alpha (fragments.cuh mxfp4_row_multiplier): the products of
// the MXFP4 tiles of that form.
#if SM90_W_ROWS && (SM90_W_INT4 || SM90_W_BF16 || defined(SM90_ROUTE))
#error "SM90_W_ROWS runs without SM90_W_INT4, SM90_W_BF16 and SM90_ROUTE"
#endif
#define DEC_ROWS_MXFP4 (SM90_W_ROWS && SM90_W_MXFP4)
// A persistent GEMM1 (SM90_PERSIST = S, 1..PREFETCH; the activation epilogue, weight tiles, no route): a 1-D grid of
// CTAs, CTA c takes units c, c + gridDim.x, ... (unit u = feature block u % ceil(N / FB) of tile u / ceil(N / FB), the
// decode grid's CTA order) until it runs past the last tile. Right after a unit's main loop, before its epilogue, it
// finds its next unit and issues that unit's first S ring steps of weights (the others after the unit's signal), so the
// CTA's slot keeps loads in flight through the epilogue's stores and the tile signal's fence. Same arithmetic as the
// decode grid: the output bit for bit. Held to 128 registers (DEC_MIN_BLOCKS: the grid is the CTAs the SMs hold).
#ifndef SM90_PERSIST
#define SM90_PERSIST 0
#endif
#define DEC_PERSIST (SM90_PERSIST != 0)
#if DEC_PERSIST && (!defined(SM90_ACT) || defined(SM90_ROUTE) || SM90_W_ROWS || SM90_W_BF16)
#error "SM90_PERSIST is for GEMM1 with the activation epilogue on weight tiles, without SM90_ROUTE"
#endif
// CTAs per SM the register allocation must allow: the NVFP4 forms of one or two m16 x n8 tiles a warp fit 128
// registers a thread (512 threads an SM) on their own; the MXINT4 forms are held to it (unbounded, GEMM1's SwiGLU
// form takes 133 registers and the eight-warp form 225: three CTAs and one an SM). At 128 some forms spill 8 bytes.
// The routed form for BF16 tokens (SM90_ROUTE 1) is held to it too (unbounded, (2, 2, 4) takes 130 registers); the
// NVFP4 one fits 128 on its own (bounded, (2, 4, 1) spills 32 bytes). The BF16 forms the engine runs (one m16 block,
// four steps) fit 128 on their own without spilling; bounded they would spill 8-20 bytes. The NVFP4 tile forms of four
// m16 blocks (one n8 tile) a warp with two steps in flight are held to it (unbounded 130-137 registers, fewer warps an
// SM; bounded no spill), finalizing too (no spill, but the NVFP4 one behind the tile handoff's wait: 4 bytes); the
// engine never runs them with MXINT4 weights (bounded they would spill 56-144 bytes). The persistent forms are held to it
// too (S = 2: no spill with split-K, 4-8 bytes at (2, 4, 1)).
// SM90_MIN_BLOCKS = B (DecodeVariant.min_blocks) asks for B CTAs an SM instead, whatever the form.
#if defined(SM90_MIN_BLOCKS)
#define DEC_MIN_BLOCKS , SM90_MIN_BLOCKS
#elif (SM90_W_INT4 || SM90_W_ROWS || SM90_ROUTE == 1) && SM90_MT * SM90_NT <= 2 || DEC_PERSIST || \
    SM90_MT == 4 && SM90_NT == 1 && SM90_PREFETCH <= 2 && !SM90_W_INT4 && !SM90_W_BF16 && !SM90_W_ROWS
#define DEC_MIN_BLOCKS , 512 / DEC_THREADS  // the launch bounds' second argument
#else
#define DEC_MIN_BLOCKS
#endif

#define DEC_THREADS (SM90_WM * SM90_WK * 32)
#define DEC_FB (SM90_WM * SM90_MT * 16)  // features per CTA
#define DEC_TB (SM90_NT * 8)             // token rows per tile
#if defined(SM90_ACT) && !SM90_W_BF16 && !(SM90_W_INT4 && defined(SM90_EARLY))
#define DEC_LIVE_ROWS 1  // padding rows read the tile's first row (at the token pointers below)
#else
#define DEC_LIVE_ROWS 0
#endif
#define DEC_RED_STRIDE (DEC_FB + 4)      // floats per token row of the split-K buffer (bank spread)
// Accumulator sets per warp: with a single m16 x n8 tile, even and odd k16 steps accumulate apart
// so that consecutive mma do not wait on each other (summed in a fixed order at the end).
#define DEC_ACC_SETS (SM90_MT * SM90_NT == 1 ? 2 : 1)

static_assert(DEC_THREADS >= 32 && DEC_THREADS <= 1024, "decode: 1..32 warps");
static_assert(DEC_FB == 16 || DEC_FB == 32 || DEC_FB == 64 || DEC_FB == 128, "decode: WM*MT*16 must divide 128");
static_assert(SM90_NT >= 1 && SM90_NT <= 8 && SM90_PREFETCH >= 1 && SM90_PREFETCH <= 16, "decode: NT / PREFETCH");
static_assert(SM90_WK * DEC_TB * DEC_RED_STRIDE * 4 <= 48 * 1024, "decode: split-K buffer exceeds 48 KB");
#ifdef SM90_ACT
#define DEC_OUT_FB (DEC_PAIRED ? DEC_FB / 2 : DEC_FB)  // activation outputs per CTA
#if SM90_W_INT4
typedef float DecC;                                    // the staged C tile: FP32 preactivations (MXINT4)
#define DEC_C_STRIDE (DEC_FB + 4)                      // floats per row (16-byte rows)
#else
typedef u16 DecC;                                      // BF16 preactivations
#define DEC_C_STRIDE (DEC_FB + 8)                      // BF16 per row (16-byte rows)
#endif
static_assert(!DEC_PAIRED || SM90_WM % 2 == 0, "decode: a gated activation epilogue pairs warps (WM even)");
static_assert(DEC_OUT_FB % 32 == 0, "decode: the activation epilogue needs units of 32 outputs per CTA");
static_assert(SM90_WK * DEC_TB * DEC_RED_STRIDE * 4 + DEC_TB * DEC_C_STRIDE * sizeof(DecC) <= 48 * 1024,
              "decode: split-K buffer and C tile exceed 48 KB");
#endif

// Where lane (g, q)'s two 16-byte token pieces of a k64 step lie in the row's 128 bytes: 32q and 32q + 16 (token
// fragments), or 16q and 16q + 64 (natural rows, with BF16 weights); with row-major NVFP4 weights its four pieces of a
// k128 step, 64q + 16i of the row's 256 bytes (natural rows).
#define X_LANE (SM90_W_BF16 ? 16 : SM90_W_ROWS ? 64 : 32)
#define X_SECOND (SM90_W_BF16 ? 64 : 16)
// Ring steps: k64 (SM90_ROWS_STEP_K = k128 for row-major NVFP4 weights), DEC_SLOTS of them in flight.
static_assert(SM90_ROWS_STEP_K == 128, "decode: the row-major form's step is k128");
#define DEC_STEP_SHIFT (SM90_W_ROWS ? 7 : 6)  // log2 of the step
#define DEC_SLOTS (SM90_W_ROWS ? (SM90_PREFETCH + 1) / 2 : SM90_PREFETCH)

namespace {

struct DecodeRing {
#if SM90_W_BF16
  uint4 w[SM90_PREFETCH][SM90_MT][4];  // BF16 weights: row g at columns 8q, 32 + 8q; row g + 8 likewise
  uint4 b[SM90_PREFETCH][SM90_NT][2];  // token pieces (X_LANE, X_SECOND): steps 0-1, 2-3
#elif SM90_W_ROWS
  uint4 w[DEC_SLOTS][SM90_MT][2];      // row-major NVFP4: 16 code bytes of row g, of row g + 8
#if DEC_ROWS_MXFP4
  u32 s[DEC_SLOTS][SM90_MT];           // their E8M0 scale byte each (row g at bit 0, row g + 8 at bit 16)
  int w_bias;                          // mxfp4_rows_bias of the expert whose rows the ring streams
#else
  uint2 s[DEC_SLOTS][SM90_MT];         // their two scale bytes each (x row g, y row g + 8)
#endif
  uint4 b[DEC_SLOTS][SM90_NT][4];      // token pieces: 64 bytes at 64q, steps 2i, 2i + 1 in piece i
#else
  uint4 w[SM90_PREFETCH][SM90_MT];     // weight words: 4 k16 steps
#if SM90_W_MXFP4
  u32 s[SM90_PREFETCH][SM90_MT];       // scale bytes: one per row and k32 block
#else
  uint2 s[SM90_PREFETCH][SM90_MT];     // scale bytes
#endif
  uint4 b[SM90_PREFETCH][SM90_NT][2];  // token pieces (X_LANE, X_SECOND): steps 0-1, 2-3
#endif
};

// One k64 step of a warp: 4 x MT x NT mma.
template <int P>
__device__ __forceinline__ void decode_step(const DecodeRing& ring, float (&acc)[DEC_ACC_SETS][SM90_MT][SM90_NT][4]) {
#if SM90_W_INT4
  // MXINT4: k32 block H = k16 steps 2H, 2H + 1 into a zeroed fragment, then scaled into acc[H % SETS] (FP32 fma);
  // the scale word H of the lane's 8 bytes: rows g (low half) and g + 8 (high half).
#define SM90_DECODE_K32(H)                                                                          \
  _Pragma("unroll") for (int mt = 0; mt < SM90_MT; ++mt) {                                          \
    float part[SM90_NT][4];                                                                         \
    u32 a[4];                                                                                       \
    decode_a_int4(word_of<2 * H>(ring.w[P][mt]), a);                                                \
    _Pragma("unroll") for (int nt = 0; nt < SM90_NT; ++nt) {                                        \
      part[nt][0] = part[nt][1] = part[nt][2] = part[nt][3] = 0.0f;                                 \
      mma_bf16_16816(part[nt], a, word_of<0>(ring.b[P][nt][H]), word_of<1>(ring.b[P][nt][H]));      \
    }                                                                                               \
    decode_a_int4(word_of<2 * H + 1>(ring.w[P][mt]), a);                                            \
    const u32 sw = H == 0 ? ring.s[P][mt].x : ring.s[P][mt].y;                                      \
    const float s_g = __uint_as_float(sw << 16), s_g8 = __uint_as_float(sw & 0xFFFF0000u);          \
    _Pragma("unroll") for (int nt = 0; nt < SM90_NT; ++nt) {                                        \
      mma_bf16_16816(part[nt], a, word_of<2>(ring.b[P][nt][H]), word_of<3>(ring.b[P][nt][H]));      \
      float(&c)[4] = acc[H % DEC_ACC_SETS][mt][nt];                                                 \
      c[0] = fmaf(part[nt][0], s_g, c[0]);                                                          \
      c[1] = fmaf(part[nt][1], s_g, c[1]);                                                          \
      c[2] = fmaf(part[nt][2], s_g8, c[2]);                                                         \
      c[3] = fmaf(part[nt][3], s_g8, c[3]);                                                         \
    }                                                                                               \
  }
  SM90_DECODE_K32(0)
  SM90_DECODE_K32(1)
#undef SM90_DECODE_K32
#else
#if SM90_W_BF16
  // Step S: a0 / a2 = words 2S, 2S + 1 of row g's 32 bytes, a1 / a3 those of row g + 8; b0 / b1 likewise.
#define SM90_DECODE_A(S, mt, a)                                                                     \
  a[0] = word_of<(2 * S) & 3>(ring.w[P][mt][S >> 1]);                                               \
  a[1] = word_of<(2 * S) & 3>(ring.w[P][mt][2 + (S >> 1)]);                                         \
  a[2] = word_of<((2 * S) & 3) + 1>(ring.w[P][mt][S >> 1]);                                         \
  a[3] = word_of<((2 * S) & 3) + 1>(ring.w[P][mt][2 + (S >> 1)]);
#elif SM90_W_ROWS
  // Step S (0..7): code bytes 2S, 2S + 1 of the lane's 16 bytes of row g (word S / 2) into a0 / a2, of row g + 8 into
  // a1 / a3; steps 0..3 take the rows' first scale (block 2q), steps 4..7 the second (MXFP4: every step the rows' one
  // multiplier, the low halves).
  u32 sg[SM90_MT], sg8[SM90_MT];
#pragma unroll
  for (int mt = 0; mt < SM90_MT; ++mt) {
#if DEC_ROWS_MXFP4
    sg[mt] = mxfp4_row_multiplier(ring.s[P][mt] & 0xFFu, ring.w_bias);
    sg8[mt] = mxfp4_row_multiplier(ring.s[P][mt] >> 16, ring.w_bias);
#else
    decode_scale_word(__byte_perm(ring.s[P][mt].x, ring.s[P][mt].y, 0x5140), sg[mt], sg8[mt]);
#endif
  }
#define SM90_DECODE_A(S, mt, a)                                                                     \
  {                                                                                                 \
    const u32 wg = word_of<((S) >> 1)>(ring.w[P][mt][0]), wg8 = word_of<((S) >> 1)>(ring.w[P][mt][1]); \
    a[0] = decode_row_byte(wg, row_byte_selector(2 * ((S) & 1)));                                   \
    a[2] = decode_row_byte(wg, row_byte_selector(2 * ((S) & 1) + 1));                               \
    a[1] = decode_row_byte(wg8, row_byte_selector(2 * ((S) & 1)));                                  \
    a[3] = decode_row_byte(wg8, row_byte_selector(2 * ((S) & 1) + 1));                              \
    scale_a<DEC_ROWS_MXFP4 ? 0 : ((S) >> 2)>(sg[mt], sg8[mt], a);                                   \
  }
#elif SM90_W_MXFP4
  // Step S takes the multipliers of k32 block S / 2: the low halves (S < 2) or the high halves.
  u32 sg[SM90_MT], sg8[SM90_MT];
#pragma unroll
  for (int mt = 0; mt < SM90_MT; ++mt) decode_e8m0_scale_word(ring.s[P][mt], sg[mt], sg8[mt]);
#define SM90_DECODE_A(S, mt, a)                                                                     \
  moe::place_tile_e2m1(word_of<S>(ring.w[P][mt]), a);                                               \
  scale_a<((S) >> 1)>(sg[mt], sg8[mt], a);
#else
  u32 sg[SM90_MT][2], sg8[SM90_MT][2];
#pragma unroll
  for (int mt = 0; mt < SM90_MT; ++mt) {
    decode_tile_scale_word(ring.s[P][mt].x, sg[mt][0], sg8[mt][0]);
    decode_tile_scale_word(ring.s[P][mt].y, sg[mt][1], sg8[mt][1]);
  }
#define SM90_DECODE_A(S, mt, a) scaled_a<S>(word_of<S>(ring.w[P][mt]), sg[mt][S >> 1], sg8[mt][S >> 1], a);
#endif
#define SM90_DECODE_K16(S)                                                                          \
  _Pragma("unroll") for (int mt = 0; mt < SM90_MT; ++mt) {                                          \
    u32 a[4];                                                                                       \
    SM90_DECODE_A(S, mt, a)                                                                         \
    _Pragma("unroll") for (int nt = 0; nt < SM90_NT; ++nt) {                                        \
      mma_bf16_16816(acc[S % DEC_ACC_SETS][mt][nt], a, word_of<(2 * S) & 3>(ring.b[P][nt][S >> 1]),  \
                     word_of<((2 * S) & 3) + 1>(ring.b[P][nt][S >> 1]));                            \
    }                                                                                               \
  }
  SM90_DECODE_K16(0)
  SM90_DECODE_K16(1)
  SM90_DECODE_K16(2)
  SM90_DECODE_K16(3)
#if SM90_W_ROWS
  SM90_DECODE_K16(4)
  SM90_DECODE_K16(5)
  SM90_DECODE_K16(6)
  SM90_DECODE_K16(7)
#endif
#undef SM90_DECODE_K16
#undef SM90_DECODE_A
#endif
}

}  // namespace

// 16 bytes of the token operand: from the bucket's rows (global), or with SM90_ROUTE from the token row the CTA
// staged in shared memory. With SM90_AWAIT GEMM1 writes the rows while this launch runs: a weak load (L1-cached), which
// the tile's acquire (await_tile) orders after GEMM1's writes, instead of the read-only path.
__device__ __forceinline__ uint4 load_token_piece(const u8* p) {
#ifdef SM90_ROUTE
  return *reinterpret_cast<const uint4*>(p);
#elif defined(SM90_AWAIT)
  uint4 v;  // volatile: kept after await_tile's barrier (a volatile asm and __syncthreads are never reordered)
  asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
#else
  return ldg_v4(p);
#endif
}

#ifdef SM90_ROUTE
// When the token row is staged: NVFP4 and MXFP8 tokens first of all (fetched and decoded before the routing is read),
// BF16 tokens after the ring's first weight loads are issued (a copy, whose load then overlaps theirs). Measured on the
// H200 at one token (fused_moe, NVFP4 tokens): Qwen3-30B-A3B 23.9-24.2 us staging first, 26.6-26.9 staging after the
// weights; MXFP8 tokens follow NVFP4's (decoded, not copied).
#define ROUTE_STAGE_FIRST (SM90_ROUTE >= 2)

// Units [0, units) of the routed call's token row (NVFP4 codes and scales decoded exactly: decode_token_words; MXFP8
// codes and E8M0 scales expanded to their BF16 values as the sort + permute does: expand_mxfp8_unit; or BF16 values)
// into `row` in fragment order (shared memory). BF16 units one at a time (staged while the weight ring's loads are
// live: unrolled, their 64 bytes each spill it).
__device__ __forceinline__ void stage_token_row(const u8* x, const u8* x_scales, int k, int units, u16* row) {
#if SM90_ROUTE == 1
#pragma unroll 1
#endif
  for (int u = threadIdx.x; u < units; u += DEC_THREADS) {
    uint4 piece[4];
#if SM90_ROUTE == 2
    decode_token_words(*reinterpret_cast<const uint4*>(x + 16 * u), x_scales[2 * u], x_scales[2 * u + 1], piece);
#elif SM90_ROUTE == 3
    moe::expand_mxfp8_unit(moe::fetch_mxfp8_unit(x, x_scales, k, 0, u), piece);
#else
    moe::bf16_unit_pieces(moe::fetch_bf16_unit(reinterpret_cast<const u16*>(x), k, 0, u).chunk, piece);
#endif
    moe::store_fragment_unit(row, u, piece);
  }
}
#endif

#ifdef SM90_FINALIZE
// The finalize of the CTA's feature block: final_out[t, features of the block] for the tokens t < `tokens` from GEMM2's
// rows in out (slot_to_row / route_weights: token t's top_k slots from t * top_k on), moe_finalize's arithmetic
// (finalize_columns) bit for bit.
__device__ __forceinline__ void finalize_block(const u16* out, const int* slot_to_row, const float* route_weights,
                                               int top_k, int n, int tokens, u16* final_out) {
  constexpr int PIECES = DEC_FB / 8;  // 8-feature pieces per token
  for (int item = threadIdx.x; item < tokens * PIECES; item += DEC_THREADS) {
    const int t = item / PIECES;
    moe::finalize_columns(out, slot_to_row + static_cast<i64>(t) * top_k, route_weights + static_cast<i64>(t) * top_k,
                          top_k, n, t, static_cast<int>(blockIdx.x) * DEC_FB + (item % PIECES) * 8, false, final_out);
  }
}
#endif

// The m16 row tile of W that the first of warp wm's MT tiles is, in feature block bx: bx * WM * MT + wm * MT, or paired
// (a gated activation epilogue, W = [up; gate] of n / 2 rows each) the first WM / 2 warps the up tiles
// bx * WM * MT / 2 + wm * MT and the others the gate tiles of the same features, n / 32 tiles on.
// half_swap: W's two halves of n / 2 rows are stored the other way round (half_swapped_tile).
__device__ __forceinline__ int decode_warp_tile(int bx, int wm, int n, int half_swap) {
  constexpr int HALF_WARPS = SM90_WM / 2;
  if (!DEC_PAIRED) return half_swapped_tile(bx * (SM90_WM * SM90_MT) + wm * SM90_MT, n, half_swap);
  const int first = bx * (HALF_WARPS * SM90_MT) + (wm % HALF_WARPS) * SM90_MT;
  return half_swapped_tile(wm < HALF_WARPS ? first : (n >> 5) + first, n, half_swap);
}

// The feature of W behind column f of feature block bx's C tile (decode_warp_tile's order).
__device__ __forceinline__ int decode_feature(int bx, int f, int n) {
  if (!DEC_PAIRED) return bx * DEC_FB + f;
  const int first = bx * (DEC_FB / 2);
  return f < DEC_FB / 2 ? first + f : (n >> 1) + first + f - DEC_FB / 2;
}

// Warp (wm, wk) owns feature rows [16 decode_warp_tile(wm), +16 MT) and the k64 steps j = wk, wk + WK, ...;
// its partial sums meet in shared memory, summed over wk = 0..WK-1 in order.
// With SM90_ACT (the decode chain): the C tile, rounded to BF16 as out would hold it, goes to the
// activation epilogue instead of out: act_out (and act_scales) receive moe_activation's output for the
// tile's rows, bit for bit, in act_layout (inter_code as there; act_alpha / _beta / _limit the activation's
// parameters). Gated: the CTA's first WM / 2 warps compute up and the others the gate rows of DEC_FB / 2
// outputs (grid x = n / DEC_FB blocks). row_to_slot int32 [row_capacity] marks padding rows (< 0). The
// gather arguments must be 0 (the decode kernel reads its rows from x).
// w_half_swap (every form): 1 when W's two halves of n / 2 rows are stored the other way round (half_swapped_tile).
// With SM90_FINALIZE (GEMM2 of the decode chain): after writing out, the CTA of each feature block that finishes last
// also finalizes it: final_out bf16 [tokens, n] (row t: token t's top_k slots, slot_to_row int32 / route_weights
// float32 [tokens * top_k]), as moe_finalize; with no tile at all, the block's first CTA (zeros). tickets int32
// [grid x]: zero before the launch, zero after it.
// With SM90_ROUTE (GEMM1 of a one-token bucket, the arguments past tickets): x, offsets and row_to_slot are not read;
// the caller's routing (route_ids / route_w in route_format, as moe_stage_sort_permute_bf16 reads them; route_tokens
// <= 1 tokens of route_top_k slots, route_slots = route_top_k <= SORT_WARP_SLOTS) and token row route_x (BF16 [k],
// NVFP4 codes [k / 2] with E4M3 scales route_x_scales [k / 16], or MXFP8 codes [k] with E8M0 scales [k / 32]; 16-byte
// aligned) come in instead, and CTA (0, 0)
// writes what that kernel writes besides the token rows: route_ids_out / route_w_out [route_slots] and the sort's
// outputs (sort_*: moe_sort's, for local experts [route_local_start, + num_experts) in segments padded to route_align
// rows). Dynamic shared memory: 2k bytes.
#ifdef SM90_EARLY
// The expert of tile t guessed from the routing alone, for buckets where every used expert holds one tile: the t-th
// local expert (ids in [local_start, + num_experts), ascending) that any of the `slots` ids routes to, or -1.
// Every thread of the CTA calls it. The ids are read through L2 (ld.global.cg): their writer finished before the
// launch before this one passed its wait, but no wait of this kernel orders them.
__device__ __forceinline__ int early_tile_expert(const void* ids, int routing_format, int ids_int64, int slots,
                                                 int local_start, int num_experts, int t) {
  constexpr int WORDS = (SORT_MAX_EXPERTS + 31) / 32;
  __shared__ u32 used[WORDS];
  if (num_experts > SORT_MAX_EXPERTS) return -1;  // the host checks: never taken
  for (int w = threadIdx.x; w < WORDS; w += DEC_THREADS) used[w] = 0u;
  __syncthreads();
  for (int i = threadIdx.x; i < slots; i += DEC_THREADS) {
    int id;
    if (routing_format == ROUTING_PACKED)
      id = __ldcg(static_cast<const int*>(ids) + i) >> 16;
    else if (ids_int64)
      id = static_cast<int>(max(min(__ldcg(static_cast<const long long*>(ids) + i), 2147483647LL), -1LL));
    else
      id = __ldcg(static_cast<const int*>(ids) + i);
    const int e = id - local_start;
    if (e >= 0 && e < num_experts) atomicOr(&used[e >> 5], 1u << (e & 31));
  }
  __syncthreads();
  for (int w = 0; w < (num_experts + 31) >> 5; ++w) {
    u32 m = used[w];
    const int c = __popc(m);
    if (t < c) {
      for (int j = 0; j < t; ++j) m &= m - 1u;  // drop the t lower experts of the word
      return (w << 5) + __ffs(m) - 1;
    }
    t -= c;
  }
  return -1;
}
#define DEC_EARLY_PARAMS                                                                                             \
  , const void* __restrict__ early_ids, int early_format, int early_ids_int64, int early_slots,                      \
      int early_local_start, int early_ctas
#else
#define DEC_EARLY_PARAMS
#endif

#ifdef SM90_SIGNAL
#define DEC_HANDOFF_PARAMS \
  , int* __restrict__ handoff_done
#elif defined(SM90_AWAIT)
#define DEC_HANDOFF_PARAMS \
  , int* __restrict__ handoff_done, int* __restrict__ handoff_passed, int handoff_producers
#else
#define DEC_HANDOFF_PARAMS
#endif

#ifdef SM90_AWAIT
// GEMM2's wait for tile t (SM90_AWAIT above); every thread of the CTA calls it.
__device__ __forceinline__ void await_tile(int* done, int* passed, int producers, int t) {
  if (threadIdx.x == 0) {
    for (;;) {
      int seen;
      asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(seen) : "l"(done + t) : "memory");
      if (seen >= producers) break;
      __nanosleep(32);
    }
    int before;  // acq_rel: the other consumers' reads of done[t] come before the last one's reset
    asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;" : "=r"(before) : "l"(passed + t) : "memory");
    if (before == static_cast<int>(gridDim.x) - 1) {  // the tile's last consumer
      asm volatile("st.relaxed.gpu.global.s32 [%0], 0;" ::"l"(done + t) : "memory");
      asm volatile("st.relaxed.gpu.global.s32 [%0], 0;" ::"l"(passed + t) : "memory");
    }
  }
  __syncthreads();
}
#endif

#ifdef SM90_SIGNAL
// GEMM1's release of tile t once every thread's rows of it are written (SM90_SIGNAL above).
__device__ __forceinline__ void signal_tile(int* done, int t) {
  __syncthreads();
  if (threadIdx.x == 0) asm volatile("red.release.gpu.global.add.s32 [%0], 1;" ::"l"(done + t) : "memory");
}
#endif

#ifdef SM90_ROUTE
#define DEC_ROUTE_PARAMS                                                                                             \
  , const void* __restrict__ route_ids, const void* __restrict__ route_w, int route_format, int route_ids_int64,      \
      int route_tokens, int route_slots, int route_top_k, int route_local_start, int route_align,                    \
      const u8* __restrict__ route_x, const u8* __restrict__ route_x_scales, int* __restrict__ route_ids_out,        \
      float* __restrict__ route_w_out, int* __restrict__ sort_offsets, int* __restrict__ sort_slot_to_row,           \
      int* __restrict__ sort_row_to_slot, int* __restrict__ sort_row_expert, int* __restrict__ sort_counts
#else
#define DEC_ROUTE_PARAMS
#endif
extern "C" __global__ void __launch_bounds__(DEC_THREADS DEC_MIN_BLOCKS)
    sm90_gemm_decode(const u8* __restrict__ w_tiles, const u8* __restrict__ w_scales, const float* __restrict__ alpha,
                     const u16* __restrict__ x, const int* __restrict__ offsets, int num_experts, int n, int k,
                     int row_capacity, int alpha_split, u16* __restrict__ out, const int* __restrict__ row_to_slot,
                     int gather_top_k, int gather_tokens, float act_alpha, float act_beta, float act_limit,
                     int act_layout, int inter_code, u8* __restrict__ act_out, u8* __restrict__ act_scales,
                     int w_half_swap, const int* __restrict__ slot_to_row, const float* __restrict__ route_weights, int top_k,
                     int tokens, u16* __restrict__ final_out, int* __restrict__ tickets DEC_ROUTE_PARAMS
                         DEC_EARLY_PARAMS DEC_HANDOFF_PARAMS) {
  // The warp's place and the weight stream's strides (no memory access: SM90_EARLY loads before the wait).
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int wm = warp % SM90_WM;
  const int wk = warp / SM90_WM;
  const int g = lane >> 2;
  const int q = lane & 3;
  const int kt = k >> DEC_STEP_SHIFT;  // ring steps (k64, or k128)
  // The CTA's unit: feature block bx of tile by (DEC_PERSIST: unit blockIdx.x of the grid's first pass, then every
  // gridDim.x-th on; units in the decode grid's order, feature blocks fastest).
#if DEC_PERSIST
  const int feature_blocks = (n + DEC_FB - 1) / DEC_FB;
  int cta_unit = static_cast<int>(blockIdx.x);
  int bx = cta_unit % feature_blocks, by = cta_unit / feature_blocks;
#else
  const int feature_blocks = static_cast<int>(gridDim.x);
  const int bx = static_cast<int>(blockIdx.x), by = static_cast<int>(blockIdx.y);
#endif
#if SM90_W_BF16
  // Row-major BF16: the lane's row g of its first m16 block, columns 64 wk + 8q on (SM90_W_BF16 above).
  const i64 row_bytes = static_cast<i64>(k) * 2;
  const i64 mt_stride_w = 16 * row_bytes;  // bytes between the warp's m16 row blocks
  const i64 first_row = static_cast<i64>(decode_warp_tile(bx, wm, n, w_half_swap)) * 16 + g;
  const int nsteps = wk < kt ? (kt - wk + SM90_WK - 1) / SM90_WK : 0;
  constexpr int W_STEP = SM90_WK * 128, X_STEP = SM90_WK * 128;  // bytes per step
  DecodeRing ring;
  const u8* wp;
  // Load ring slot P with step `s` (relative to the current base pointer).
#define SM90_DECODE_LOAD_W(P, S)                                                                    \
  _Pragma("unroll") for (int mt = 0; mt < SM90_MT; ++mt) {                                          \
    const u8* const r = wp + (S) * W_STEP + mt * mt_stride_w;                                       \
    ring.w[P][mt][0] = ldg_stream_v4(r);                                                            \
    ring.w[P][mt][1] = ldg_stream_v4(r + 64);                                                       \
    ring.w[P][mt][2] = ldg_stream_v4(r + 8 * row_bytes);                                            \
    ring.w[P][mt][3] = ldg_stream_v4(r + 8 * row_bytes + 64);                                       \
  }
#define SM90_DECODE_POINT_W(EXPERT)                                                                 \
  wp = w_tiles + ((EXPERT) * n + first_row) * row_bytes + wk * 128 + q * 16;
#define SM90_DECODE_ADVANCE_W wp += SM90_PREFETCH * W_STEP;
#elif SM90_W_ROWS
  // Row-major NVFP4: the lane's rows g and g + 8 of its first m16 block, code bytes 64 wk + 16q on and scale bytes
  // 8 wk + 2q on (MXFP4: 4 wk + q; SM90_W_ROWS above); the further blocks 16 rows on. Rows g + 8 at an offset from
  // row g's pointers without split-K, from their own with it: each way the one the register allocation fits in 128
  // without spilling.
  constexpr int SCALE_BYTES = DEC_ROWS_MXFP4 ? 1 : 2;  // a lane's scale bytes of a row and step
  const u32 row_bytes = static_cast<u32>(k >> 1), scale_row_bytes = static_cast<u32>(k >> (DEC_ROWS_MXFP4 ? 5 : 4));
  const i64 first_row = static_cast<i64>(decode_warp_tile(bx, wm, n, w_half_swap)) * 16 + g;
  const int nsteps = wk < kt ? (kt - wk + SM90_WK - 1) / SM90_WK : 0;
  constexpr int W_STEP = SM90_WK * 64, S_STEP = SM90_WK * 4 * SCALE_BYTES, X_STEP = SM90_WK * 256;  // bytes per step
#if DEC_ROWS_MXFP4
// A lane's scale bytes of rows g (at c) and g + 8 (at c8) of a step, in one register.
#define SM90_LOAD_ROW_SCALES(c, c8) (ldg_reused_u8(c) | (ldg_reused_u8(c8) << 16))
  const int w_alpha_feature = decode_warp_tile(bx, wm, n, 0) * 16;
#define SM90_DECODE_POINT_BIAS(EXPERT)                                                              \
  ring.w_bias = mxfp4_rows_bias(                                                                    \
      __ldg(alpha + expert_alpha(static_cast<int>(EXPERT), num_experts, w_alpha_feature, alpha_split)));
#else
#define SM90_LOAD_ROW_SCALES(c, c8) make_uint2(ldg_reused_u16(c), ldg_reused_u16(c8))
#define SM90_DECODE_POINT_BIAS(EXPERT)
#endif
  DecodeRing ring;
#if SM90_WK == 1
  const u8* wp;
  const u8* sp;
  // Load ring slot P with step `s` (relative to the current base pointers).
#define SM90_DECODE_LOAD_W(P, S)                                                                    \
  _Pragma("unroll") for (int mt = 0; mt < SM90_MT; ++mt) {                                          \
    const u8* const r = wp + (S) * W_STEP + mt * 16 * row_bytes;                                    \
    const u8* const c = sp + (S) * S_STEP + mt * 16 * scale_row_bytes;                              \
    ring.w[P][mt][0] = ldg_stream_v4<true>(r);                                                     \
    ring.w[P][mt][1] = ldg_stream_v4<true>(r + 8 * row_bytes);                                     \
    ring.s[P][mt] = SM90_LOAD_ROW_SCALES(c, c + 8 * scale_row_bytes);                                \
  }
#define SM90_DECODE_POINT_W(EXPERT)                                                                 \
  wp = w_tiles + ((EXPERT) * n + first_row) * row_bytes + wk * 64 + q * 16;                         \
  sp = w_scales + ((EXPERT) * n + first_row) * scale_row_bytes + (wk * 4 + q) * SCALE_BYTES;        \
  SM90_DECODE_POINT_BIAS(EXPERT)
#define SM90_DECODE_ADVANCE_W                                                                       \
  wp += DEC_SLOTS * W_STEP;                                                                         \
  sp += DEC_SLOTS * S_STEP;
#else
#if DEC_ROWS_MXFP4
  // Rows g, g + 8; the scales of row g + 8 eight rows on from row g's (not a pointer of their own, as NVFP4's: the
  // multipliers take a register more, and this way every form fits 128 without spilling).
  const u8 *wp, *wp8, *sp;
  // Load ring slot P with step `s` (relative to the current base pointers).
#define SM90_DECODE_LOAD_W(P, S)                                                                    \
  _Pragma("unroll") for (int mt = 0; mt < SM90_MT; ++mt) {                                          \
    _Pragma("unroll") for (int h = 0; h < 2; ++h)                                                   \
      ring.w[P][mt][h] = ldg_stream_v4<true>((h ? wp8 : wp) + (S) * W_STEP + mt * 16 * row_bytes); \
    const u8* const c = sp + (S) * S_STEP + mt * 16 * scale_row_bytes;                              \
    ring.s[P][mt] = SM90_LOAD_ROW_SCALES(c, c + 8 * scale_row_bytes);                                \
  }
#define SM90_DECODE_POINT_W(EXPERT)                                                                 \
  wp = w_tiles + ((EXPERT) * n + first_row) * row_bytes + wk * 64 + q * 16;                         \
  wp8 = wp + 8 * row_bytes;                                                                         \
  sp = w_scales + ((EXPERT) * n + first_row) * scale_row_bytes + wk * 4 + q;                        \
  SM90_DECODE_POINT_BIAS(EXPERT)
#define SM90_DECODE_ADVANCE_W                                                                       \
  wp += DEC_SLOTS * W_STEP;                                                                         \
  wp8 += DEC_SLOTS * W_STEP;                                                                        \
  sp += DEC_SLOTS * S_STEP;
#else
  const u8 *wp, *wp8, *sp, *sp8;  // rows g, g + 8
  // Load ring slot P with step `s` (relative to the current base pointers).
#define SM90_DECODE_LOAD_W(P, S)                                                                    \
  _Pragma("unroll") for (int mt = 0; mt < SM90_MT; ++mt) _Pragma("unroll") for (int h = 0; h < 2; ++h) { \
    ring.w[P][mt][h] = ldg_stream_v4<true>((h ? wp8 : wp) + (S) * W_STEP + mt * 16 * row_bytes);   \
    (h ? ring.s[P][mt].y : ring.s[P][mt].x) = ldg_reused_u16((h ? sp8 : sp) + (S) * S_STEP + mt * 16 * scale_row_bytes); \
  }
#define SM90_DECODE_POINT_W(EXPERT)                                                                 \
  wp = w_tiles + ((EXPERT) * n + first_row) * row_bytes + wk * 64 + q * 16;                         \
  wp8 = wp + 8 * row_bytes;                                                                         \
  sp = w_scales + ((EXPERT) * n + first_row) * scale_row_bytes + wk * 8 + q * 2;                    \
  sp8 = sp + 8 * scale_row_bytes;
#define SM90_DECODE_ADVANCE_W                                                                       \
  wp += DEC_SLOTS * W_STEP;                                                                         \
  wp8 += DEC_SLOTS * W_STEP;                                                                        \
  sp += DEC_SLOTS * S_STEP;                                                                         \
  sp8 += DEC_SLOTS * S_STEP;
#endif
#endif
#else
  const i64 expert_tiles = static_cast<i64>(n >> 4) * kt;
  i64 first_tile = static_cast<i64>(decode_warp_tile(bx, wm, n, w_half_swap)) * kt + wk;  // DEC_PERSIST: per unit
  const i64 mt_stride_w = static_cast<i64>(kt) * 512;  // bytes between the warp's m16 row blocks
  constexpr int TILE_SCALE_BYTES = SM90_W_MXFP4 ? 32 : 64;  // a lane reads TILE_SCALE_BYTES / 8 of them at g
  const i64 mt_stride_s = static_cast<i64>(kt) * TILE_SCALE_BYTES;
  const int nsteps = wk < kt ? (kt - wk + SM90_WK - 1) / SM90_WK : 0;
  constexpr int W_STEP = SM90_WK * 512, S_STEP = SM90_WK * TILE_SCALE_BYTES, X_STEP = SM90_WK * 128;  // bytes per step
  DecodeRing ring;
  const u8* wp;
  const u8* sp;
  // Load ring slot P with step `s` (relative to the current base pointers).
#if SM90_W_MXFP4
#define SM90_LOAD_SCALES ldg_stream_u32
#else
#define SM90_LOAD_SCALES ldg_stream_v2
#endif
#define SM90_DECODE_LOAD_W(P, S)                                                                    \
  _Pragma("unroll") for (int mt = 0; mt < SM90_MT; ++mt) {                                          \
    ring.w[P][mt] = ldg_stream_v4(wp + (S) * W_STEP + mt * mt_stride_w);                            \
    ring.s[P][mt] = SM90_LOAD_SCALES(sp + (S) * S_STEP + mt * mt_stride_s);                         \
  }
#define SM90_DECODE_POINT_W(EXPERT)                                                                 \
  wp = w_tiles + ((EXPERT) * expert_tiles + first_tile) * 512 + lane * 16;                          \
  sp = w_scales + ((EXPERT) * expert_tiles + first_tile) * TILE_SCALE_BYTES + g * (TILE_SCALE_BYTES / 8);
#define SM90_DECODE_ADVANCE_W                                                                       \
  wp += SM90_PREFETCH * W_STEP;                                                                     \
  sp += SM90_PREFETCH * S_STEP;
#endif
#ifdef SM90_EARLY
  // Only the launch's first early_ctas CTAs (one wave: the ones resident while the sort runs) guess; the later ones
  // start after the wait, where the guess would only delay their first loads.
  const bool guesses = static_cast<i64>(by) * feature_blocks + bx < early_ctas;
  const int early_expert =
      guesses ? early_tile_expert(early_ids, early_format, early_ids_int64, early_slots, early_local_start, num_experts, by)
              : -1;
  if (early_expert >= 0) {
    SM90_DECODE_POINT_W(static_cast<i64>(early_expert))
#pragma unroll
    for (int p = 0; p < DEC_SLOTS; ++p)
      if (p < nsteps) SM90_DECODE_LOAD_W(p, p)
  }
#endif
#ifdef SM90_AWAIT
  moe::grid_dependency_trigger();  // no wait: the tile handoff orders GEMM1's rows (SM90_AWAIT above)
#else
  moe::grid_dependency_begin();
#endif
  __shared__ __align__(16) float red[SM90_WK][DEC_TB][DEC_RED_STRIDE];
  Tile tile;
#ifdef SM90_ROUTE
  // The stage and the sort (moe_stage_sort_permute_bf16_warp's, for this CTA): the token row staged (ROUTE_STAGE_FIRST;
  // else after the weight ring's first loads, below), the routing decoded, warp 0 sorts; CTA (0, 0) writes the
  // outputs GEMM2 reads.
  extern __shared__ __align__(128) u8 smem[];  // the token row: k BF16 values in fragment order
  __shared__ int route_slot_ids[SORT_WARP_SLOTS], route_slot_rows[SORT_WARP_SLOTS];
  __shared__ int route_counts[SORT_MAX_EXPERTS], route_seg[SORT_MAX_EXPERTS + 1];
  u16* const token_row = reinterpret_cast<u16*>(smem);
  const bool writer = blockIdx.x == 0 && blockIdx.y == 0;
  if (route_slots > SORT_WARP_SLOTS || route_tokens > 1) return;  // the host checks: never taken
  const int token_units = route_tokens == 1 ? k >> 5 : 0;  // no token: the row stays unwritten, and no slot is live
  if (ROUTE_STAGE_FIRST) stage_token_row(route_x, route_x_scales, k, token_units, token_row);
  for (int i = threadIdx.x; i < route_slots; i += DEC_THREADS) {
    int id;
    float w;
    moe::decode_route(route_ids, route_w, route_format, route_ids_int64, i, i / route_top_k < route_tokens, id, w);
    route_slot_ids[i] = id;
    if (writer) {
      route_ids_out[i] = id;
      route_w_out[i] = w;
    }
  }
  __syncthreads();
  if (threadIdx.x < 32)
    moe::sort_slots_warp(route_slot_ids, route_slots, route_local_start, num_experts, route_align, row_capacity,
                         writer, route_slot_rows, route_counts, route_seg, sort_offsets, sort_slot_to_row,
                         sort_row_to_slot, sort_row_expert, sort_counts);
  __syncthreads();
  if (!find_tile<DEC_TB, true>(route_seg, num_experts, row_capacity, static_cast<int>(blockIdx.y), tile))
    return;
#else
  int tiles = 0;  // with the finalize: the tiles of all segments, the CTAs of this feature block that write rows
  if (!find_tile<DEC_TB>(offsets, num_experts, row_capacity, by, tile,
                         DEC_FINALIZE ? &tiles : nullptr)) {
#ifdef SM90_FINALIZE
    // No segment holds a row (every slot unrouted, e.g. no local expert on this rank): no CTA takes a ticket, and
    // the feature block's first CTA finalizes alone (every slot's row is -1: zeros).
    if (tiles == 0 && blockIdx.y == 0)
      finalize_block(out, slot_to_row, route_weights, top_k, n, tokens, final_out);
#endif
    return;
  }
#endif
  if (tile.row0 < 0 || tile.row0 >= tile.row_end) return;  // offsets outside [0, row_capacity]: nothing safe to do
  // ring_loaded: the ring's weight loads of the unit are in flight (an early guess that hit, or DEC_PERSIST's loads of
  // the unit before).
#ifdef SM90_EARLY
  bool ring_loaded = tile.expert == early_expert;
#elif DEC_PERSIST
  bool ring_loaded = false;
#else
  constexpr bool ring_loaded = false;
#endif
  if (!ring_loaded) {
    SM90_DECODE_POINT_W(tile.expert)
  }
#if DEC_PERSIST
  for (;;) {  // the CTA's units
#endif
  // Token rows past the segment are clamped to the tile's first row (always inside it): their
  // columns of the product are garbage but never stored, and nothing past the segment is read. DEC_LIVE_ROWS (4-bit
  // weights with the activation epilogue): the segment's padding rows (row_to_slot < 0, whose outputs the epilogue
  // writes as zeros) are clamped too, so a tile of one live token reads that token's row once instead of eight rows
  // (decode segments are padded to the tile); the ring then takes its weights first, as its token pointers wait on
  // row_to_slot. (Not for BF16 weights, whose reordered ring takes 132 registers, nor MXINT4's early form: 24 bytes of
  // spill, and MXINT4 never takes early routing.)
#ifdef SM90_ACT
  __shared__ int tile_slot[DEC_TB];  // the slot of each row of the tile inside the segment (the epilogue's)
#endif
  const u8* xp[SM90_NT];
#pragma unroll
  for (int nt = 0; nt < SM90_NT; ++nt) {
#ifdef SM90_ROUTE
    xp[nt] = smem + wk * 128 + q * 32;  // every row of the bucket is the one token
#else
    const int row = tile.row0 + nt * 8 + g;
#if DEC_LIVE_ROWS
    const int slot = row < tile.row_end ? __ldg(row_to_slot + row) : -1;
    const bool live = slot >= 0;
    if (threadIdx.x < 32 && q == 0 && row < tile.row_end) tile_slot[nt * 8 + g] = slot;  // warp 0 keeps them
#else
    const bool live = row < tile.row_end;
#endif
    xp[nt] = reinterpret_cast<const u8*>(x) +
             (static_cast<i64>(live ? row : tile.row0) * k + (wk << DEC_STEP_SHIFT)) * 2 + q * X_LANE;
#endif
  }
  // The epilogue's operands, fetched into shared memory while the main loop runs (no dependent load at the end):
  // the alpha of the CTA's first and second half of features (one alpha each: alpha_split is a multiple of the
  // feature block, and a paired CTA's halves are up and gate features), and (the activation epilogue, unless
  // DEC_LIVE_ROWS already stored them above) the slot of each row of the tile inside the segment.
  __shared__ float tile_alpha[2];
  if (threadIdx.x < 2)
    cp_async_4(smem_addr(&tile_alpha[threadIdx.x]),
               alpha + expert_alpha(tile.expert, num_experts, decode_feature(bx, threadIdx.x * (DEC_FB / 2), n), alpha_split));
#ifdef SM90_ACT
#ifdef SM90_ROUTE
  if (threadIdx.x < DEC_TB && tile.row0 + static_cast<int>(threadIdx.x) < tile.row_end) {
    int slot = -1;  // a padding row unless a slot sorted into it
    for (int i = 0; i < route_slots; ++i)
      if (route_slot_rows[i] == tile.row0 + static_cast<int>(threadIdx.x)) slot = i;
    tile_slot[threadIdx.x] = slot;
  }
#elif !DEC_LIVE_ROWS  // (with DEC_LIVE_ROWS warp 0 stored them with the token pointers above)
  if (threadIdx.x < DEC_TB && tile.row0 + static_cast<int>(threadIdx.x) < tile.row_end)
    cp_async_4(smem_addr(&tile_slot[threadIdx.x]), row_to_slot + tile.row0 + threadIdx.x);
#endif
#endif
  cp_async_commit();

  float acc[DEC_ACC_SETS][SM90_MT][SM90_NT][4];
#pragma unroll
  for (int set = 0; set < DEC_ACC_SETS; ++set)
#pragma unroll
    for (int mt = 0; mt < SM90_MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < SM90_NT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[set][mt][nt][i] = 0.0f;

#if SM90_W_ROWS
#define SM90_DECODE_LOAD_B(P, S)                                                                    \
  _Pragma("unroll") for (int nt = 0; nt < SM90_NT; ++nt) _Pragma("unroll") for (int i = 0; i < 4; ++i) \
    ring.b[P][nt][i] = load_token_piece(xp[nt] + (S) * X_STEP + 16 * i);
#else
#define SM90_DECODE_LOAD_B(P, S)                                                                    \
  _Pragma("unroll") for (int nt = 0; nt < SM90_NT; ++nt) {                                          \
    ring.b[P][nt][0] = load_token_piece(xp[nt] + (S) * X_STEP);                                     \
    ring.b[P][nt][1] = load_token_piece(xp[nt] + (S) * X_STEP + X_SECOND);                          \
  }
#endif
#define SM90_DECODE_LOAD(P, S)                                                                      \
  {                                                                                                 \
    SM90_DECODE_LOAD_W(P, S)                                                                        \
    SM90_DECODE_LOAD_B(P, S)                                                                        \
  }
#ifdef SM90_ROUTE
  if (!ROUTE_STAGE_FIRST) {  // the weights first, then the token row staged while they are in flight
#pragma unroll
    for (int p = 0; p < DEC_SLOTS; ++p)
      if (p < nsteps) SM90_DECODE_LOAD_W(p, p)
    stage_token_row(route_x, route_x_scales, k, token_units, token_row);
    __syncthreads();
#pragma unroll
    for (int p = 0; p < DEC_SLOTS; ++p)
      if (p < nsteps) SM90_DECODE_LOAD_B(p, p)
  } else {
#pragma unroll
    for (int p = 0; p < DEC_SLOTS; ++p)
      if (p < nsteps) SM90_DECODE_LOAD(p, p)
  }
#elif defined(SM90_AWAIT)
#pragma unroll
  for (int p = 0; p < DEC_SLOTS; ++p)
    if (p < nsteps) SM90_DECODE_LOAD_W(p, p)
  await_tile(handoff_done, handoff_passed, handoff_producers, static_cast<int>(blockIdx.y));
#pragma unroll
  for (int p = 0; p < DEC_SLOTS; ++p)
    if (p < nsteps) SM90_DECODE_LOAD_B(p, p)
#elif DEC_LIVE_ROWS  // the weights first: the token pointers wait on row_to_slot
#pragma unroll
  for (int p = 0; p < DEC_SLOTS; ++p)
    if (p < nsteps && !ring_loaded) SM90_DECODE_LOAD_W(p, p)
#pragma unroll
  for (int p = 0; p < DEC_SLOTS; ++p)
    if (p < nsteps) SM90_DECODE_LOAD_B(p, p)
#else
#pragma unroll
  for (int p = 0; p < DEC_SLOTS; ++p)
    if (p < nsteps) {
      if (!ring_loaded) SM90_DECODE_LOAD_W(p, p)
      SM90_DECODE_LOAD_B(p, p)
    }
#endif

  // Both loops below run SM90_DECODE_SLOT(P) for the ring slots P = 0 .. DEC_SLOTS-1 (the slot macro
  // differs: bounds tests only in the tail), then move the pointers on by DEC_SLOTS steps.
#define SM90_DECODE_EACH_SLOT                                                                       \
  SM90_DECODE_SLOT(0) SM90_DECODE_SLOT(1) SM90_DECODE_SLOT(2) SM90_DECODE_SLOT(3)                   \
  SM90_DECODE_SLOT(4) SM90_DECODE_SLOT(5) SM90_DECODE_SLOT(6) SM90_DECODE_SLOT(7)                   \
  SM90_DECODE_SLOT(8) SM90_DECODE_SLOT(9) SM90_DECODE_SLOT(10) SM90_DECODE_SLOT(11)                 \
  SM90_DECODE_SLOT(12) SM90_DECODE_SLOT(13) SM90_DECODE_SLOT(14) SM90_DECODE_SLOT(15)
#define SM90_DECODE_ADVANCE                                                                         \
  SM90_DECODE_ADVANCE_W                                                                             \
  _Pragma("unroll") for (int nt = 0; nt < SM90_NT; ++nt) xp[nt] += DEC_SLOTS * X_STEP;

  // Steady state: every slot consumed and refilled, no bounds tests.
  int s0 = 0;
  for (; s0 + 2 * DEC_SLOTS <= nsteps; s0 += DEC_SLOTS) {
#define SM90_DECODE_SLOT(P)                                                                         \
  if (P < DEC_SLOTS) {                                                                          \
    decode_step<(P < DEC_SLOTS ? P : 0)>(ring, acc);                                            \
    SM90_DECODE_LOAD((P < DEC_SLOTS ? P : 0), P + DEC_SLOTS)                                \
  }
    SM90_DECODE_EACH_SLOT
#undef SM90_DECODE_SLOT
    SM90_DECODE_ADVANCE
  }
  // Tail: fewer than 2 * DEC_SLOTS steps left.
  for (; s0 < nsteps; s0 += DEC_SLOTS) {
#define SM90_DECODE_SLOT(P)                                                                         \
  if (P < DEC_SLOTS && s0 + P < nsteps) {                                                       \
    decode_step<(P < DEC_SLOTS ? P : 0)>(ring, acc);                                            \
    if (s0 + P + DEC_SLOTS < nsteps) SM90_DECODE_LOAD((P < DEC_SLOTS ? P : 0), P + DEC_SLOTS) \
  }
    SM90_DECODE_EACH_SLOT
#undef SM90_DECODE_SLOT
    SM90_DECODE_ADVANCE
  }
#undef SM90_DECODE_LOAD
#undef SM90_DECODE_LOAD_B
#undef SM90_DECODE_EACH_SLOT
#undef SM90_DECODE_ADVANCE

  // Partial sums -> red[wk][token][feature].
#pragma unroll
  for (int set = 1; set < DEC_ACC_SETS; ++set)
#pragma unroll
    for (int mt = 0; mt < SM90_MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < SM90_NT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[0][mt][nt][i] += acc[set][mt][nt][i];
  cp_async_wait<0>();  // tile_alpha, tile_slot (visible to the block after the barrier below)
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
#if DEC_PERSIST
  // The CTA's next unit: its ring's first SM90_PERSIST steps of weights issued before this unit's epilogue, so that
  // they stream while the epilogue runs and while thread 0's signal waits on its fence (the ring's registers are free
  // from here on).
  cta_unit += static_cast<int>(gridDim.x);
  const int next_bx = cta_unit % feature_blocks, next_by = cta_unit / feature_blocks;
  Tile next;
  const bool has_next = find_tile<DEC_TB>(offsets, num_experts, row_capacity, next_by, next) && next.row0 >= 0 &&
                        next.row0 < next.row_end;
  ring = DecodeRing{};  // no value of this unit's ring lives on into the next (the allocation then fits 128)
  if (has_next) {
    first_tile = static_cast<i64>(decode_warp_tile(next_bx, wm, n, w_half_swap)) * kt + wk;
    SM90_DECODE_POINT_W(next.expert)
#pragma unroll
    for (int p = 0; p < SM90_PERSIST; ++p)
      if (p < nsteps) SM90_DECODE_LOAD_W(p, p)
  }
#endif

  // Sum over wk in order, scale, round, store 16-byte row pieces of rows inside the segment (to the C tile
  // for the activation epilogue). Each 8-feature piece takes its half's alpha (tile_alpha).
  constexpr int CHUNKS_PER_ROW = DEC_FB / 8;
#ifdef SM90_ACT
  __shared__ __align__(16) DecC c_tile[DEC_TB][DEC_C_STRIDE];
#endif
  for (int c = threadIdx.x; c < DEC_TB * CHUNKS_PER_ROW; c += DEC_THREADS) {
    const int t = c / CHUNKS_PER_ROW;
    const int f = (c % CHUNKS_PER_ROW) * 8;
    const int row = tile.row0 + t;
    if (row >= tile.row_end) continue;
    const float scale = tile_alpha[f < DEC_FB / 2 ? 0 : 1] * 256.0f;
    float4 lo = *reinterpret_cast<const float4*>(&red[0][t][f]);
    float4 hi = *reinterpret_cast<const float4*>(&red[0][t][f + 4]);
#pragma unroll
    for (int w = 1; w < SM90_WK; ++w) {
      const float4 l2 = *reinterpret_cast<const float4*>(&red[w][t][f]);
      const float4 h2 = *reinterpret_cast<const float4*>(&red[w][t][f + 4]);
      lo.x += l2.x; lo.y += l2.y; lo.z += l2.z; lo.w += l2.w;
      hi.x += h2.x; hi.y += h2.y; hi.z += h2.z; hi.w += h2.w;
    }
#if defined(SM90_ACT) && SM90_W_INT4  // the FP32 preactivation, unrounded
    *reinterpret_cast<float4*>(&c_tile[t][f]) = make_float4(scale * lo.x, scale * lo.y, scale * lo.z, scale * lo.w);
    *reinterpret_cast<float4*>(&c_tile[t][f + 4]) = make_float4(scale * hi.x, scale * hi.y, scale * hi.z, scale * hi.w);
#else
    uint4 v;
    v.x = pack_bf16x2(scale * lo.x, scale * lo.y);
    v.y = pack_bf16x2(scale * lo.z, scale * lo.w);
    v.z = pack_bf16x2(scale * hi.x, scale * hi.y);
    v.w = pack_bf16x2(scale * hi.z, scale * hi.w);
#ifdef SM90_ACT
    *reinterpret_cast<uint4*>(&c_tile[t][f]) = v;
#else
    stg_v4(out + static_cast<i64>(row) * n + blockIdx.x * DEC_FB + f, v);
#endif
#endif
  }
#ifdef SM90_FINALIZE
  // The finalize, by the CTA of this feature block that finishes last (a ticket per block, reset by that CTA for
  // the next launch): with every tile's rows in out, it writes final_out[t, features of the block] for the tokens
  // t < `tokens`, moe_finalize's arithmetic (finalize_columns) bit for bit. No atomics on final_out.
  // The CTA's rows reach thread 0 through the barrier; its ticket releases them to the grid and, for the last CTA,
  // acquires every other CTA's (the tickets' release sequence), which the second barrier hands to the block.
  __shared__ int finalizing;
  __syncthreads();
  if (threadIdx.x == 0) {
    int before;
    asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;" : "=r"(before) : "l"(tickets + blockIdx.x) : "memory");
    finalizing = before == tiles - 1;
  }
  __syncthreads();
  if (!finalizing) return;
  finalize_block(out, slot_to_row, route_weights, top_k, n, tokens, final_out);
  if (threadIdx.x == 0) tickets[blockIdx.x] = 0;
#endif
#ifdef SM90_ACT
  __syncthreads();
  // The activation epilogue: units of 32 outputs (activation_unit.cuh, the bits of moe_activation), a warp per
  // unit for the BF16 layouts (decode tiles hold few live rows: one thread per unit would serialize them),
  // else a thread per unit.
  constexpr int UNITS = DEC_OUT_FB / 32;
  const int inter = DEC_PAIRED ? n / 2 : n;
  const int unit0 = bx * UNITS;
  if (moe::is_bf16_layout(act_layout)) {
    for (int item = warp; item < DEC_TB * UNITS; item += DEC_THREADS / 32) {
      const int t = item / UNITS;
      const int row = tile.row0 + t;
      if (row >= tile.row_end) continue;  // warp-uniform
      moe::activate_store_unit_warp<SM90_ACT, DEC_PAIRED, SM90_ACT_MXFP8 != 0>(
          &c_tile[t][32 * (item % UNITS)], DEC_FB / 2, tile_slot[t] < 0, row, unit0 + item % UNITS,
          inter, row_capacity, SM90_ACT, act_alpha, act_beta, act_limit, act_layout, inter_code,
          reinterpret_cast<u16*>(act_out));
    }
  }
#if !SM90_W_INT4  // MXINT4 runs with BF16 intermediates only (the host checks)
  else {
    for (int item = threadIdx.x; item < DEC_TB * UNITS; item += DEC_THREADS) {
      const int t = item / UNITS;
      const int unit = item % UNITS;
      const int row = tile.row0 + t;
      if (row >= tile.row_end) continue;
      moe::activate_store_unit<SM90_ACT, DEC_PAIRED>(&c_tile[t][32 * unit], DEC_FB / 2, tile_slot[t] < 0,
                                                     row, unit0 + unit, inter, row_capacity, SM90_ACT, act_alpha,
                                                     act_beta, act_limit, act_layout, inter_code, act_out,
                                                     act_scales);
    }
  }
#endif
#ifdef SM90_SIGNAL
  signal_tile(handoff_done, by);
#else
  if (DEC_PERSIST) __syncthreads();  // the epilogue's shared memory, before the next unit's writes
#endif
#endif
#if DEC_PERSIST
  if (!has_next) return;
#pragma unroll
  for (int p = SM90_PERSIST; p < DEC_SLOTS; ++p)
    if (p < nsteps) SM90_DECODE_LOAD_W(p, p)
  tile = next;
  bx = next_bx;
  by = next_by;
  ring_loaded = true;
  }  // the CTA's units
#endif
#undef SM90_DECODE_LOAD_W
#undef SM90_DECODE_POINT_W
#undef SM90_DECODE_ADVANCE_W
#undef SM90_LOAD_SCALES
#undef SM90_LOAD_ROW_SCALES
#undef SM90_DECODE_POINT_BIAS
}

// =============================================================================================
// Prefill: large segments. CTA tile FB features x TB token rows x k64 per stage, STAGES-deep cp.async
// pipeline. Warps of 32 features (MT = 2 m16 tiles) x 64 tokens (NT = 8 n8 tiles): FB / 32 warps
// along features x TB / 64 along tokens (default 128 x 128: 4 x 2 warps, 256 threads).
// ADEC = 1 (TB = 128): each k64 weight tile is decoded once per CTA instead of once per token warp.
// Warp w decodes m16 tile w of the stage (one k64 step ahead of the mma) into a double-buffered
// shared buffer of BF16 A fragments (lane L's a0..a3 of step s at 16 L + 512 s), which the mma warps
// read with one LDS.128 per m16 x k16; the values are those of scaled_a, bit for bit.
// =============================================================================================

#ifndef SM90_PF_STAGES
#define SM90_PF_STAGES 4
#endif
#ifndef SM90_PF_STMATRIX
#define SM90_PF_STMATRIX 1  // epilogue staging with stmatrix.trans (0: 16-bit shared stores)
#endif
#ifndef SM90_PF_MIN_BLOCKS
#define SM90_PF_MIN_BLOCKS 2  // CTAs per SM the register allocation must allow (2 x 256 threads: <= 128 registers)
#endif
#ifndef SM90_PF_FB
#define SM90_PF_FB 128  // features per CTA: 64, 128 or 256 (256: the CTAs past N / 128 features skip them)
#endif
#ifndef SM90_PF_TB
#define SM90_PF_TB 128  // token rows per tile: 64 or 128
#endif
#ifndef SM90_PF_ADEC
#define SM90_PF_ADEC 0  // 1: decode the weight tile once per CTA into shared memory (TB = 128)
#endif

#define PF_FB SM90_PF_FB
#define PF_TB SM90_PF_TB
#define PF_WM (PF_FB / 32)                  // warps along features
#define PF_WN (PF_TB / 64)                  // warps along tokens
#define PF_THREADS (PF_WM * PF_WN * 32)
#define PF_MTILES (PF_FB / 16)              // m16 weight tiles per CTA
#define PF_W_BYTES (PF_MTILES * 512)        // weight tiles of one k64 step
#define PF_S_BYTES (PF_MTILES * 64)         // their scale tiles
#define PF_X_STRIDE 144                     // 128 B of a token's k64 block + 16 B pad (conflict-free LDS.128)
#define PF_X_OFFSET (PF_W_BYTES + PF_S_BYTES)
#define PF_STAGE_BYTES (PF_X_OFFSET + PF_TB * PF_X_STRIDE)  // 23040 at 128 x 128
#define PF_D_BYTES (PF_MTILES * 4 * 512)    // decoded A fragments of one k64 step (ADEC)
#define PF_D_OFFSET (SM90_PF_STAGES * PF_STAGE_BYTES)
#define PF_PIPE_BYTES (PF_D_OFFSET + SM90_PF_ADEC * 2 * PF_D_BYTES)
#define PF_C_STRIDE (PF_FB * 2 + 16)        // a token's FB BF16 outputs + 16 B pad
#define PF_C_BYTES (PF_TB * PF_C_STRIDE)
#define PF_SMEM_BYTES (PF_PIPE_BYTES > PF_C_BYTES ? PF_PIPE_BYTES : PF_C_BYTES)
#define PF_W_PER_THREAD (2 * PF_FB / PF_THREADS)  // 16-byte weight chunks per thread and stage (128 / TB)
#define PF_X_PER_THREAD (8 * PF_TB / PF_THREADS)  // token chunks (512 / FB)
#define PF_S_THREADS (PF_FB / 4)                  // threads copying a scale chunk

static_assert(SM90_PF_STAGES >= 2 && SM90_PF_STAGES <= 8, "prefill: 2..8 stages");
static_assert(PF_FB == 64 || PF_FB == 128 || PF_FB == 256, "prefill: FB must be 64, 128 or 256");
static_assert(PF_TB == 64 || PF_TB == 128, "prefill: TB must be 64 or 128");
static_assert(PF_THREADS <= 512, "prefill: at most 16 warps");
static_assert(PF_W_PER_THREAD * PF_THREADS == 2 * PF_FB && PF_X_PER_THREAD * PF_THREADS == 8 * PF_TB, "prefill: copy split");
static_assert(PF_S_THREADS <= PF_THREADS, "prefill: copy split");
static_assert(PF_STAGE_BYTES % 128 == 0, "prefill: stage alignment");
static_assert(SM90_PF_ADEC == 0 || (PF_WM * PF_WN == PF_MTILES && SM90_PF_STAGES >= 3),
              "prefill: ADEC needs one warp per m16 tile (TB = 128) and >= 3 stages");
static_assert(PF_SMEM_BYTES <= 227 * 1024, "prefill: shared memory");

// Dynamic shared memory: PF_SMEM_BYTES (PrefillVariant.shared_mem computes the same).
extern "C" __global__ void __launch_bounds__(PF_THREADS, SM90_PF_MIN_BLOCKS)
    sm90_gemm_prefill(const u8* __restrict__ w_tiles, const u8* __restrict__ w_scales, const float* __restrict__ alpha,
                      const u16* __restrict__ x, const int* __restrict__ offsets, int num_experts, int n, int k,
                      int row_capacity, int alpha_split, u16* __restrict__ out) {
  moe::grid_dependency_begin();
  extern __shared__ __align__(128) u8 smem[];
  Tile tile;
  if (!find_tile<PF_TB>(offsets, num_experts, row_capacity, static_cast<int>(blockIdx.y), tile)) return;
  if (tile.row0 < 0 || tile.row0 >= tile.row_end) return;  // offsets outside [0, row_capacity]: nothing safe to do

  // With FB > 128 (N is only a multiple of 128) the last CTA may hold m16 tiles past N: their
  // copies read nothing (zero fill, address clamped to the CTA's first tile), their columns are
  // not stored.
  constexpr bool kGuard = PF_FB > 128;
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int wm = warp % PF_WM;  // features [32 wm, 32 wm + 32) of the CTA
  const int wn = warp / PF_WM;  // tokens [64 wn, 64 wn + 64) of the tile
  const int g = lane >> 2;
  const int q = lane & 3;
  const int kt = k >> 6;
  const int mtiles_in = (n >> 4) - static_cast<int>(blockIdx.x) * PF_MTILES;  // m16 tiles of the CTA inside N
  const u32 smem_base = smem_addr(smem);

  // Copy assignments; the source pointers advance by one k64 block per loaded stage. Weights:
  // chunk c = tid + u * THREADS -> tile c / 32, 16 B piece c % 32 (shared offset c * 16).
  const i64 expert_tiles = static_cast<i64>(n >> 4) * kt;
  const i64 block_tile0 = tile.expert * expert_tiles + static_cast<i64>(blockIdx.x * PF_MTILES) * kt;
  const u8* w_src[PF_W_PER_THREAD];
  u32 w_bytes[PF_W_PER_THREAD];
#pragma unroll
  for (int u = 0; u < PF_W_PER_THREAD; ++u) {
    const int m = (tid + u * PF_THREADS) >> 5;
    const bool ok = !kGuard || m < mtiles_in;
    w_src[u] = w_tiles + (block_tile0 + static_cast<i64>(ok ? m : 0) * kt) * 512 + lane * 16;
    w_bytes[u] = ok ? 16u : 0u;
  }
  // Scales: threads tid < FB / 4 -> tile tid / 4, 16 B chunk tid % 4 (shared offset W_BYTES + tid * 16).
  const int s_tile = (tid >> 2) & (PF_MTILES - 1);
  const bool s_ok = !kGuard || s_tile < mtiles_in;
  const u8* s_src = w_scales + (block_tile0 + static_cast<i64>(s_ok ? s_tile : 0) * kt) * 64 + (tid & 3) * 16;
  const u32 s_bytes = s_ok ? 16u : 0u;
  // Tokens: thread -> rows tid / 8 + (THREADS / 8) u, 16 B chunk tid % 8. Rows past the segment read
  // nothing (src size 0: zero fill); their address is clamped to the segment's last row.
  // The row offsets (from the tile's first row, < 2^31 bytes) stay the same for every stage.
  constexpr int X_ROW_STEP = PF_THREADS / 8;
  const int x_first = tile.row0 + (tid >> 3);
  const int x_last = tile.row_end - 1;
  const u8* x_src = reinterpret_cast<const u8*>(x) + static_cast<i64>(tile.row0) * k * 2 + (tid & 7) * 16;
  u32 x_off[PF_X_PER_THREAD];
  u32 x_bytes[PF_X_PER_THREAD];
#pragma unroll
  for (int u = 0; u < PF_X_PER_THREAD; ++u) {
    const int row = x_first + X_ROW_STEP * u;
    x_off[u] = static_cast<u32>(min(row, x_last) - tile.row0) * static_cast<u32>(k) * 2u;
    x_bytes[u] = row <= x_last ? 16u : 0u;
  }
  const u32 x_dst = PF_X_OFFSET + (tid >> 3) * PF_X_STRIDE + (tid & 7) * 16;

  auto load_stage = [&](int slot) {
    const u32 base = smem_base + slot * PF_STAGE_BYTES;
#pragma unroll
    for (int u = 0; u < PF_W_PER_THREAD; ++u) {
      cp_async_16(base + (tid + u * PF_THREADS) * 16, w_src[u], w_bytes[u]);
      w_src[u] += 512;
    }
    if (tid < PF_S_THREADS) cp_async_16(base + PF_W_BYTES + tid * 16, s_src, s_bytes);
#pragma unroll
    for (int u = 0; u < PF_X_PER_THREAD; ++u)
      cp_async_16(base + x_dst + u * X_ROW_STEP * PF_X_STRIDE, x_src + x_off[u], x_bytes[u]);
    s_src += 64;
    x_src += 128;
  };

#if SM90_PF_ADEC
  // Warp w: m16 tile w of the stage in `slot` -> decoded A fragments of its 4 k16 steps in buffer `buf`.
  auto decode_stage = [&](int slot, int buf) {
    const u8* st = smem + slot * PF_STAGE_BYTES;
    const uint4 wq = *reinterpret_cast<const uint4*>(st + warp * 512 + lane * 16);
    const uint2 sc = *reinterpret_cast<const uint2*>(st + PF_W_BYTES + warp * 64 + g * 8);
    u8* d = smem + PF_D_OFFSET + buf * PF_D_BYTES + warp * 2048 + lane * 16;
    u32 sg, sg8, a[4];
    decode_tile_scale_word(sc.x, sg, sg8);
    scaled_a<0>(wq.x, sg, sg8, a);
    *reinterpret_cast<uint4*>(d) = make_uint4(a[0], a[1], a[2], a[3]);
    scaled_a<1>(wq.y, sg, sg8, a);
    *reinterpret_cast<uint4*>(d + 512) = make_uint4(a[0], a[1], a[2], a[3]);
    decode_tile_scale_word(sc.y, sg, sg8);
    scaled_a<2>(wq.z, sg, sg8, a);
    *reinterpret_cast<uint4*>(d + 1024) = make_uint4(a[0], a[1], a[2], a[3]);
    scaled_a<3>(wq.w, sg, sg8, a);
    *reinterpret_cast<uint4*>(d + 1536) = make_uint4(a[0], a[1], a[2], a[3]);
  };
#endif

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
#if SM90_PF_ADEC
  cp_async_wait<SM90_PF_STAGES - 2>();
  __syncthreads();  // stage 0 landed for every thread
  decode_stage(0, 0);
#endif

  int read_slot = 0;
  int write_slot = SM90_PF_STAGES - 1;
  for (int j = 0; j < kt; ++j) {
#if SM90_PF_ADEC
    // Stage j + 1 landed for every thread; decoded step j visible; decoded buffer (j + 1) & 1 and
    // stage slot j - 1 free (both last read by step j - 1's mma).
    cp_async_wait<SM90_PF_STAGES - 3>();
    __syncthreads();
    if (j + SM90_PF_STAGES - 1 < kt) load_stage(write_slot);
    cp_async_commit();
    if (j + 1 < kt) decode_stage(read_slot + 1 == SM90_PF_STAGES ? 0 : read_slot + 1, (j + 1) & 1);
    const u8* da = smem + PF_D_OFFSET + (j & 1) * PF_D_BYTES + wm * 2 * 2048 + lane * 16;
#else
    cp_async_wait<SM90_PF_STAGES - 2>();
    __syncthreads();  // stage j landed for every thread; stage j - 1 is free to overwrite
    if (j + SM90_PF_STAGES - 1 < kt) load_stage(write_slot);
    cp_async_commit();
#endif

    const u8* st = smem + read_slot * PF_STAGE_BYTES;
#if !SM90_PF_ADEC
    uint4 wq[2];
    uint2 sc[2];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
      const int m = wm * 2 + mt;
      wq[mt] = *reinterpret_cast<const uint4*>(st + m * 512 + lane * 16);
      sc[mt] = *reinterpret_cast<const uint2*>(st + PF_W_BYTES + m * 64 + g * 8);
    }
#endif
    const u8* xb = st + PF_X_OFFSET + (wn * 64 + g) * PF_X_STRIDE + q * 32;
    // Two k16 steps at a time: their A (2 steps x MT = 2), then per n8 tile one 16-byte B load (b0, b1
    // of both steps) and 4 mma.
#if SM90_PF_ADEC
#define SM90_PREFILL_A(H)                                                                           \
    _Pragma("unroll") for (int mt = 0; mt < 2; ++mt) {                                              \
      _Pragma("unroll") for (int s2 = 0; s2 < 2; ++s2) {                                            \
        const uint4 v = *reinterpret_cast<const uint4*>(da + mt * 2048 + (2 * H + s2) * 512);       \
        a[s2][mt][0] = v.x;                                                                         \
        a[s2][mt][1] = v.y;                                                                         \
        a[s2][mt][2] = v.z;                                                                         \
        a[s2][mt][3] = v.w;                                                                         \
      }                                                                                             \
    }
#else
#define SM90_PREFILL_A(H)                                                                           \
    _Pragma("unroll") for (int mt = 0; mt < 2; ++mt) {                                              \
      u32 sg, sg8;                                                                                  \
      decode_tile_scale_word(H ? sc[mt].y : sc[mt].x, sg, sg8);                                     \
      scaled_a<2 * H>(word_of<2 * H>(wq[mt]), sg, sg8, a[0][mt]);                                   \
      scaled_a<2 * H + 1>(word_of<2 * H + 1>(wq[mt]), sg, sg8, a[1][mt]);                           \
    }
#endif
#define SM90_PREFILL_HALF(H)                                                                        \
  {                                                                                                 \
    u32 a[2][2][4];                                                                                 \
    SM90_PREFILL_A(H)                                                                               \
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
#undef SM90_PREFILL_A
    read_slot = read_slot + 1 == SM90_PF_STAGES ? 0 : read_slot + 1;
    write_slot = write_slot + 1 == SM90_PF_STAGES ? 0 : write_slot + 1;
  }
  cp_async_wait<0>();
  __syncthreads();  // every warp is done with the pipeline buffers: reuse them for the C tile

  // C tile -> shared [token][feature] BF16 (row stride PF_C_STRIDE) with transposing stmatrix:
  // matrix i of an x4 = (n8 tile nt + i / 2, features 8 (i % 2) .. + 8 of the m16 tile).
  const float scale = __ldg(alpha + expert_alpha(tile.expert, num_experts, static_cast<int>(blockIdx.x) * PF_FB, alpha_split)) * 256.0f;
#if SM90_PF_STMATRIX
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
    for (int nt = 0; nt < 8; nt += 2)
      stage_c_pair(smem_base, PF_C_STRIDE, wn * 64 + nt * 8, wm * 32 + mt * 16, scale, acc[mt][nt], acc[mt][nt + 1]);
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
  // TB rows x FB / 8 chunks of 16 B; rows past the segment (and, FB > 128, columns past N) are not written.
  store_c_tile<PF_TB, PF_FB, PF_THREADS>(smem, PF_C_STRIDE, tile, n, blockIdx.x * PF_FB, 2 * mtiles_in, out);
}
