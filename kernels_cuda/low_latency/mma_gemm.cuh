// The tensor-core GEMM bodies of ll_moe.cu, compiled in with -DLL_MMA=1 (FP8 weight-only, per-tensor FP8, DeepSeek
// FP8, and the MX pairs: MXFP4 or MXFP8 weights with MXFP8 tokens). Included by ll_moe.cu after its plan, argument structs and epilogues
// (gemm1_store, gemm2_store), which this file shares: only the dot products differ from the CUDA-core modules.
//
// Work split. A warp owns a tile pair: two m16 tiles of weight rows (GEMM1 gated: the up rows f0 .. f0 + 15 and
// the gate rows Ip + f0 .. Ip + f0 + 15 of features f0 .. f0 + 15; non-gated GEMM1 and GEMM2: 32 consecutive
// rows), and a share of K: K is cut in units of 128 values (a DeepSeek scale block), and the ksplit warps of a
// pair (ksplit = the kernels' lanes_per_row argument: 1, 2, 4 or 8) take units kpart, kpart + ksplit, ... So a
// CTA holds WARPS / ksplit tile pairs; its ksplit partial sums per pair are added in shared memory, in kpart
// order (deterministic), before the shared epilogues. All tokens of the expert (the plan's <= 8) are the
// B operand's 8 columns, so the weights are streamed once whatever the token count.
//
// Streaming. Each warp keeps a ring of MMA_STAGES k64 steps in shared memory (dynamic; its own, so the loop
// needs no barrier): cp.async.cg copies (16 bytes, L1 bypassed) of the lane's four weight chunks (rows g, g + 8
// of both tiles), its token's chunk(s) and, for DeepSeek FP8, the unit's four FP32 scales; the copies of step
// i + MMA_STAGES - 1 are issued before step i is computed, so up to MMA_STAGES - 1 steps (a few hundred bytes
// per lane) are in flight. Fragments: mma.cuh (the K permutation there; exact E4M3 -> FP16 / BF16 decodes).
//
// Sums. FP8 weight-only and per-tensor: every mma accumulates into the FP32 C fragment; the finished sum goes to
// the shared epilogue (the per-expert scale or factor multiplies it there, as in the CUDA-core path). DeepSeek
// FP8: each 128-K unit's 8 mma accumulate into a zeroed fragment, then acc = fma(partial, fp32(weight block scale
// * token block scale), acc), as the CUDA-core path does per chunk. The MX pairs (mma_pair_dot_mx): each 32-K
// block's two mma accumulate into a zeroed fragment (FP16 operands: the exact codes; the block's k-slots of both
// operands, mma.cuh), then acc = fma(partial, fp32(weight E8M0 scale * token E8M0 scale), acc), the CUDA-core
// path's rounding per block (reference_mx_pair step 1 / 3). Tensor-core FP32 accumulation differs from the
// CUDA-core FMA chains only in the order (and inner rounding) of the FP32 sums.
//
// MX streaming (k64 steps as well): the warp copies a step in 16-byte chunks (E4M3 rows: 4 chunks of each of the
// pair's 32 rows; E2M1 rows: 2; the 8 tokens: 4 each) to the positions of mx_chunk (mma.cuh), and with a unit's
// first step the E8M0 scale words of the unit (4 bytes = its 4 blocks) of the 32 rows and the tokens; after
// cp.async.wait_group a __syncwarp makes every lane's copies visible to the warp (a lane reads other lanes'
// chunks), and also orders the previous step's reads before the copies that overwrite its stage.
#pragma once

namespace ll {

static_assert(FP8W || FP8B || MXI, "the tensor-core path (LL_MMA) serves the FP8 formats and the MX pairs");

constexpr int MMA_STAGES = LL_MMA_STAGES;
constexpr int MMA_ROWS = LL_MMA_WARP_ROWS;  // weight rows of a tile pair
constexpr int MMA_UNIT = 128;               // K values per unit (two k64 steps)
static_assert(MMA_ROWS == 32, "a tile pair is two m16 tiles");
static_assert(GROUPS == 1 && (VALUES == 16 || (MXI && VALUES == 32)), "E4M3 chunks of 16 values, E2M1 of 32 (MX pairs)");
constexpr bool MMA_E2M1 = MXI && !MXFP8W;           // MXFP4 weights
constexpr int MMA_WEIGHT_ITEMS = MMA_E2M1 ? 2 : 4;  // weight chunks per lane and k64 step (32 rows of 64 or 32 bytes)

// 16-byte items per lane and ring stage: the weight chunks (MMA_WEIGHT_ITEMS), the token chunks (16 K values: 16
// or 32 bytes), and a scale item: DeepSeek FP8's 4 scales (the two tiles' weight block scales, the lane's two C
// columns' token scales), the MX pairs' E8M0 words (one per row of the pair, one per token).
template <int XK>
__host__ __device__ constexpr int mma_items() {
  return MMA_WEIGHT_ITEMS + x_bytes_num(XK) + (XK == LL_INPUT_FP8_BLOCK || XK == LL_INPUT_MXFP8 ? 1 : 0);
}
// Dynamic shared memory of a CTA: the rings of its warps (the partial sums reuse them once the loop is done).
template <int XK>
__host__ __device__ constexpr int mma_smem_bytes() { return WARPS * MMA_STAGES * mma_items<XK>() * 32 * 16; }
static_assert(WARPS * 2 * 4 * 32 * 4 <= mma_smem_bytes<LL_INPUT_FP8>(), "the partial sums fit in the rings");

__device__ __forceinline__ u32 shared_address(const void* p) {
  u32 a;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
  return a;
}
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(shared_address(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async4(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(shared_address(dst)), "l"(src) : "memory");
}
// The same copies to a shared-memory address, reading src_bytes (16 / 4, or 0: nothing read, zeros written).
__device__ __forceinline__ void cp_async16_at(u32 dst, const void* src, u32 src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async4_at(u32 dst, const void* src, u32 src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

// A launch with less dynamic shared memory than the rings need is a bug of the host side: stop there.
template <int XK>
__device__ __forceinline__ void require_mma_smem() {
  u32 bytes;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(bytes));
  if (bytes < static_cast<u32>(mma_smem_bytes<XK>())) __trap();
}

// What a warp streams for one tile pair. w0, w1: the tiles' first weight rows (rows of row_bytes(k));
// x: the row of this lane's token (B column g = lane / 4; null when g >= the expert's token count), XK values;
// ws0, ws1: the tiles' weight scale rows (scale_row). DeepSeek FP8: xs0, xs1 the token scale rows of the lane's C
// columns 2t, 2t + 1 (null past the token count), FP32, one value per unit. MX pairs: xc the token chunk this lane
// copies (mx_chunk_at of its lane, at K = 0; null past the token count), xs0 the E8M0 scale row of token `lane`
// (lanes 0..7; null past the token count).
struct MmaPair {
  const u8* w0;
  const u8* w1;
  const u8* x;
  const u8* xc;
  const u8* ws0;
  const u8* ws1;
  const u8* xs0;
  const u8* xs1;
};

// The FP8 formats' mma_pair_dot (the file header; K order and decodes: mma.cuh).
template <int XK>
__device__ __forceinline__ void mma_pair_dot_fp8(uint4* ring, const MmaPair& p, int k, int kpart, int ksplit,
                                                 float (&acc)[2][4]) {
  constexpr bool BF16 = XK == LL_INPUT_BF16;  // BF16 tokens: BF16 operands; FP16 and E4M3 tokens: FP16 operands
  constexpr int XC = x_bytes_num(XK), ITEMS = mma_items<XK>();
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const i64 k64 = k;
  const u8* w[4] = {p.w0 + g * k64 + 16 * t, p.w0 + (g + 8) * k64 + 16 * t, p.w1 + g * k64 + 16 * t,
                    p.w1 + (g + 8) * k64 + 16 * t};
  const u8* x = p.x != nullptr ? p.x + 16 * XC * t : nullptr;
  const int units = k / MMA_UNIT;
  const int steps = units > kpart ? 2 * ((units - kpart + ksplit - 1) / ksplit) : 0;
  uint4* const mine = ring + lane;
  auto issue = [&](int i) {  // step i into stage i % MMA_STAGES
    const int u = kpart + ksplit * (i >> 1), k0 = MMA_UNIT * u + 64 * (i & 1);
    uint4* slot = mine + (i % MMA_STAGES) * ITEMS * 32;
#pragma unroll
    for (int q = 0; q < 4; ++q) cp_async16(slot + 32 * q, w[q] + k0);
    if (x != nullptr) {
#pragma unroll
      for (int c = 0; c < XC; ++c) cp_async16(slot + 32 * (4 + c), x + XC * k0 + 16 * c);
    }
    if (FP8B && (i & 1)) {  // the unit's scales, read with its second step
      float* s = reinterpret_cast<float*>(slot + 32 * (4 + XC));
      cp_async4(s, p.ws0 + 4 * u);
      cp_async4(s + 1, p.ws1 + 4 * u);
      if (p.xs0 != nullptr) cp_async4(s + 2, p.xs0 + 4 * u);
      if (p.xs1 != nullptr) cp_async4(s + 3, p.xs1 + 4 * u);
    }
  };
#pragma unroll
  for (int i = 0; i < MMA_STAGES - 1; ++i) {
    if (i < steps) issue(i);
    cp_async_commit();
  }
  float part[2][4] = {};
  for (int i = 0; i < steps; ++i) {
    cp_async_wait<MMA_STAGES - 2>();  // step i has landed (this lane's own copies: no barrier needed)
    if (i + MMA_STAGES - 1 < steps) issue(i + MMA_STAGES - 1);  // into the stage step i - 1 used
    cp_async_commit();
    const uint4* slot = mine + (i % MMA_STAGES) * ITEMS * 32;
    uint4 wq[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) wq[q] = slot[32 * q];
    const uint4 x0 = slot[32 * 4], x1 = XC == 2 ? slot[32 * 5] : x0;  // garbage past the token count: B is zeroed
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      u32 b[2];
      b_fragment<XK>(x0, x1, j, b);
      if (x == nullptr) b[0] = b[1] = 0u;
#pragma unroll
      for (int tile = 0; tile < 2; ++tile) {
        u32 a[4];
        a_fragment<BF16>(wq[2 * tile], wq[2 * tile + 1], j, a);
        mma_16816<BF16>(FP8B ? part[tile] : acc[tile], a, b);
      }
    }
    if (FP8B && (i & 1)) {
      const float* s = reinterpret_cast<const float*>(slot + 32 * (4 + XC));
      const float xs[2] = {p.xs0 != nullptr ? s[2] : 0.0f, p.xs1 != nullptr ? s[3] : 0.0f};
#pragma unroll
      for (int tile = 0; tile < 2; ++tile)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          acc[tile][c] = fmaf(part[tile][c], __fmul_rn(s[tile], xs[c & 1]), acc[tile][c]);
          part[tile][c] = 0.0f;
        }
    }
  }
  cp_async_wait<0>();
}

// The MX pairs' mma_pair_dot (XK = LL_INPUT_MXFP8): the warp's copies and the fragments in the block-pure K order
// of mma.cuh (MX section), each block's partial scaled into acc (the file header). The loop runs a unit (two k64
// steps, the first bringing the unit's scale words) per iteration, so each step's stage and half are known; the
// copies go to shared addresses computed once, and a lane with no token to copy zero-fills its token chunk and
// scale word instead of branching (src-size 0 reads nothing): absent tokens' B columns are then exact zeros.
__device__ __forceinline__ void mma_pair_dot_mx(uint4* ring, const MmaPair& p, int k, int kpart, int ksplit,
                                                float (&acc)[2][4]) {
  constexpr bool E2M1 = MMA_E2M1;
  constexpr int WI = MMA_WEIGHT_ITEMS, ITEMS = mma_items<LL_INPUT_MXFP8>();
  constexpr u32 ITEM_BYTES = 32 * 16, STAGE_BYTES = ITEMS * ITEM_BYTES;
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const i64 wrow = row_bytes(k), srow = k / MX_BLOCK;
  const u8* wsrc[WI];  // the weight chunks this lane copies (at K = 0)
#pragma unroll
  for (int i = 0; i < WI; ++i) {
    int q, gc, c;
    mx_chunk_at(E2M1, 32 * i + lane, q, gc, c);
    wsrc[i] = (q >> 1 ? p.w1 : p.w0) + (gc + 8 * (q & 1)) * wrow + 16 * c;
  }
  // The scale word this lane copies: row kind lane / 8, group lane % 8 (index lane of the scale item).
  const u8* ssrc = ((lane >> 4) ? p.ws1 : p.ws0) + ((lane & 7) + 8 * ((lane >> 3) & 1)) * srow;
  // The lane's token chunk and token scale word; where there is none, src-size 0 at an address that stays valid
  // (the chunk at the weight row's start, the scale word at the lane's weight scale word).
  const u8* xsrc = p.xc != nullptr ? p.xc : wsrc[0];
  const u8* xssrc = p.xs0 != nullptr ? p.xs0 : ssrc;
  const u32 x_size = p.xc != nullptr ? 16u : 0u, xs_size = p.xs0 != nullptr ? 4u : 0u;
  const int x_step = p.xc != nullptr ? ~0 : 0;  // masks the chunk's K offset
  const u32 mine = shared_address(ring) + 16 * lane;  // this lane's slot of item 0, stage 0
  const int units = k / MMA_UNIT;
  const int steps = units > kpart ? 2 * ((units - kpart + ksplit - 1) / ksplit) : 0;
  auto issue = [&](int i) {  // step i into stage i % MMA_STAGES
    const int u = kpart + ksplit * (i >> 1), k0 = MMA_UNIT * u + 64 * (i & 1);
    const u32 stage = mine + (i % MMA_STAGES) * STAGE_BYTES;
#pragma unroll
    for (int w = 0; w < WI; ++w) cp_async16_at(stage + w * ITEM_BYTES, wsrc[w] + (E2M1 ? k0 / 2 : k0), 16u);
    cp_async16_at(stage + WI * ITEM_BYTES, xsrc + (k0 & x_step), x_size);
    if (!(i & 1)) {  // the unit's scale words, read with its first step
      const u32 s = mine - 12 * lane + (i % MMA_STAGES) * STAGE_BYTES + (WI + 1) * ITEM_BYTES;  // u32 slot `lane`
      cp_async4_at(s, ssrc + 4 * u, 4u);
      cp_async4_at(s + 128, xssrc + 4 * u, xs_size);
    }
  };
#pragma unroll
  for (int i = 0; i < MMA_STAGES - 1; ++i) {
    if (i < steps) issue(i);
    cp_async_commit();
  }
  u32 wsw[4] = {}, xsw[2] = {};  // this unit's E8M0 words (byte b: block b of the unit), rows g, g + 8 of both tiles
  for (int i = 0; i < steps; i += 2) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // the unit's two k64 steps: step i + h in stage (i + h) % MMA_STAGES
      cp_async_wait<MMA_STAGES - 2>();  // this lane's copies of step i + h have landed
      __syncwarp();                     // ... and every lane's; every lane is done with step i + h - 1's stage
      if (i + h + MMA_STAGES - 1 < steps) issue(i + h + MMA_STAGES - 1);
      cp_async_commit();
      const uint4* stage = ring + ((i + h) % MMA_STAGES) * ITEMS * 32;
      if (h == 0) {
        const u32* s = reinterpret_cast<const u32*>(stage + 32 * (WI + 1));
#pragma unroll
        for (int q = 0; q < 4; ++q) wsw[q] = s[8 * q + g];
        xsw[0] = s[32 + 2 * t], xsw[1] = s[32 + 2 * t + 1];
      }
#pragma unroll
      for (int b = 0; b < 2; ++b) {
        const int kb = 2 * h + b;  // the block of the unit
        const u32* words = reinterpret_cast<const u32*>(stage);
        uint2 wv[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const int at = mx_word(E2M1, q, g, t, b);
          wv[q] = E2M1 ? make_uint2(words[at], 0u) : *reinterpret_cast<const uint2*>(words + at);
        }
        const uint2 xv = *reinterpret_cast<const uint2*>(words + 128 * WI + mx_word(false, 0, g, t, b));
        float part[2][4] = {};
#pragma unroll
        for (int m = 0; m < 2; ++m) {
          u32 bf[2];
          mx_b_fragment<E2M1>(xv, m, bf);  // zero-filled past the token count: B columns of zeros
#pragma unroll
          for (int tile = 0; tile < 2; ++tile) {
            u32 af[4];
            mx_a_fragment<E2M1>(wv[2 * tile], wv[2 * tile + 1], m, af);
            mma_16816<false>(part[tile], af, bf);
          }
        }
        float ws[2][2], xs[2];
#pragma unroll
        for (int r = 0; r < 4; ++r) ws[r >> 1][r & 1] = e8m0_word_byte(wsw[r], kb);
        xs[0] = e8m0_word_byte(xsw[0], kb), xs[1] = e8m0_word_byte(xsw[1], kb);
#pragma unroll
        for (int tile = 0; tile < 2; ++tile)
#pragma unroll
          for (int c = 0; c < 4; ++c)
            acc[tile][c] = fmaf(part[tile][c], __fmul_rn(ws[tile][c >> 1], xs[c & 1]), acc[tile][c]);
      }
    }
  }
  cp_async_wait<0>();
}

// acc[tile][c] (C fragments, FP32) = this warp's share (units kpart, kpart + ksplit, ...) of the pair's sums.
template <int XK>
__device__ __forceinline__ void mma_pair_dot(uint4* ring, const MmaPair& p, int k, int kpart, int ksplit,
                                             float (&acc)[2][4]) {
  if constexpr (XK == LL_INPUT_MXFP8) mma_pair_dot_mx(ring, p, k, kpart, ksplit, acc);
  else mma_pair_dot_fp8<XK>(ring, p, k, kpart, ksplit, acc);
}

// ------------------------------------------------------------------------------------------ geometry
// Warp w of a CTA serves tile pair w / ksplit of the CTA's block (WARPS / ksplit pairs) with K share w % ksplit;
// round r of CTA b serves block b * rounds + r. Its first row (of the pair's features or output rows):
__device__ __forceinline__ int mma_pair_first(int round, int rounds, int ksplit, int per_pair) {
  const int pairs = WARPS / ksplit, pair = (static_cast<int>(threadIdx.x) >> 5) / ksplit;
  return ((static_cast<int>(blockIdx.x) * rounds + round) * pairs + pair) * per_pair;
}

// GEMM1 features per tile pair: gated, 16 (tile 0 the up rows, tile 1 the gate rows); non-gated, 32.
__host__ __device__ constexpr int mma_gemm1_features(bool gated) { return gated ? MMA_ROWS / 2 : MMA_ROWS; }

// The weight rows (of w1 [E, N1p, H]) of the pair starting at feature f0 of expert e: tile 0 and tile 1.
__device__ __forceinline__ void mma_gemm1_rows(int e, int f0, bool gated, int inter_padded, i64 (&row)[2]) {
  const i64 base = static_cast<i64>(e) * (gated ? 2 : 1) * inter_padded + f0;
  row[0] = base;
  row[1] = gated ? base + inter_padded : base + MMA_ROWS / 2;
}

// L2 prefetch of the first two units this warp streams of a tile pair: one 128-byte line per row and unit, each
// lane one row (the pair's 32).
__device__ __forceinline__ void mma_prefetch_pair(const u8* w0, const u8* w1, int k, int kpart, int ksplit) {
  const int lane = threadIdx.x & 31;
  const u8* row = (lane < 16 ? w0 : w1) + (lane & 15) * row_bytes(k);
  for (int u = kpart, n = 0; u < k / MMA_UNIT && n < 2; u += ksplit, ++n) prefetch_l2(row + row_bytes(MMA_UNIT) * u);
}

__device__ __forceinline__ void mma_prefetch_gemm1(int e, int round, const u8* w, int hidden, int inter,
                                                   int inter_padded, bool gated, int ksplit, int rounds) {
  const int f0 = mma_pair_first(round, rounds, ksplit, mma_gemm1_features(gated));
  if (e < 0 || f0 >= inter) return;
  i64 row[2];
  mma_gemm1_rows(e, f0, gated, inter_padded, row);
  mma_prefetch_pair(w + row[0] * row_bytes(hidden), w + row[1] * row_bytes(hidden), hidden, (threadIdx.x >> 5) % ksplit,
                    ksplit);
}

__device__ __forceinline__ void mma_prefetch_gemm2(int e, int round, const u8* w, int hidden, int inter_padded,
                                                   int ksplit, int rounds) {
  const int h0 = mma_pair_first(round, rounds, ksplit, MMA_ROWS);
  if (e < 0 || h0 >= hidden) return;
  const u8* w0 = w + (static_cast<i64>(e) * hidden + h0) * row_bytes(inter_padded);
  mma_prefetch_pair(w0, w0 + (MMA_ROWS / 2) * row_bytes(inter_padded), inter_padded,
                    (threadIdx.x >> 5) % ksplit, ksplit);
}

// ------------------------------------------------------------------------------------------ the pair sums
// The ksplit warps' sums of pair p, tile `tile`, row r (0..15), token column n, in kpart order: the partial sums
// sit at red[((warp * 2 + tile) * 4 + c) * 32 + lane] for the C element (row, column) of (lane, c).
__device__ __forceinline__ float mma_pair_sum(const float* red, int p, int ksplit, int tile, int r, int n) {
  int lane, c;
  c_slot(r, n, lane, c);
  float sum = 0.0f;
  for (int kp = 0; kp < ksplit; ++kp) sum += red[(((p * ksplit + kp) * 2 + tile) * 4 + c) * 32 + lane];
  return sum;
}

// Every warp's C fragments into the reduction area (the rings, all warps done with them).
__device__ __forceinline__ void mma_store_partials(float* red, const float (&acc)[2][4]) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  __syncthreads();  // every warp has left its ring
#pragma unroll
  for (int tile = 0; tile < 2; ++tile)
#pragma unroll
    for (int c = 0; c < 4; ++c) red[((warp * 2 + tile) * 4 + c) * 32 + lane] = acc[tile][c];
  __syncthreads();
}

// The lane's token row (B column g) and its scale rows (MmaPair): token row `row_of(index)` of the plan's distinct
// tokens, `bytes` per row of values; DeepSeek FP8 k / 128 FP32 scales per row, the MX pairs k / 32 E8M0 bytes.
template <typename RowOf>
__device__ __forceinline__ void mma_token_rows(const Plan& plan, const u8* x, const u8* x_scales, i64 bytes, int k,
                                               RowOf row_of, MmaPair& p) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, n = plan.count;
  p.x = g < n ? x + row_of(g) * bytes : nullptr;
  if (FP8B) {
    const i64 scale_bytes = 4 * (k / MMA_UNIT);
    p.xs0 = 2 * t < n ? x_scales + row_of(2 * t) * scale_bytes : nullptr;
    p.xs1 = 2 * t + 1 < n ? x_scales + row_of(2 * t + 1) * scale_bytes : nullptr;
  }
  if (MXI) {
    int q, gc, c;
    mx_chunk_at(false, lane, q, gc, c);
    p.xc = gc < n ? x + row_of(gc) * bytes + 16 * c : nullptr;
    p.xs0 = lane < n ? x_scales + row_of(lane) * (k / MX_BLOCK) : nullptr;
  }
}

// ------------------------------------------------------------------------------------------ GEMM1 + activation
// GEMM1 of expert e on tensor cores, every round of this CTA, then the shared epilogue (gemm1_store) per
// (feature, token): R = 2 gated, 1 not.
template <int R>
__device__ __forceinline__ void mma_gemm1(const Plan& plan, const Gemm1Args& a, int e) {
  extern __shared__ uint4 mma_smem[];
  require_mma_smem<LL_INPUT>();
  constexpr bool GATED = R == 2;
  constexpr int F = mma_gemm1_features(GATED);
  const int ksplit = a.lanes_per_row, pairs = WARPS / ksplit, warp = threadIdx.x >> 5, kpart = warp % ksplit;
  uint4* ring = mma_smem + warp * MMA_STAGES * mma_items<LL_INPUT>() * 32;
  float* red = reinterpret_cast<float*>(mma_smem);
  MmaPair p{};
  mma_token_rows(plan, a.x, a.x_scales, static_cast<i64>(x_bytes_num(LL_INPUT)) * a.hidden, a.hidden,
                 [&](int index) { return static_cast<i64>(plan.list[index] / a.top_k); }, p);
  for (int round = 0; round < a.rounds; ++round) {
    if (round + 1 < a.rounds)  // the next round's rows start streaming into L2 now
      mma_prefetch_gemm1(e, round + 1, a.w, a.hidden, a.inter, a.inter_padded, GATED, ksplit, a.rounds);
    const int f0 = mma_pair_first(round, a.rounds, ksplit, F);
    float acc[2][4] = {};
    if (f0 < a.inter) {  // pairs of padding features (I <= f < Ip: all-zero weights) are not read
      i64 row[2];
      mma_gemm1_rows(e, f0, GATED, a.inter_padded, row);
      p.w0 = a.w + row[0] * row_bytes(a.hidden), p.w1 = a.w + row[1] * row_bytes(a.hidden);
      p.ws0 = scale_row(a.w_scales, row[0], a.hidden), p.ws1 = scale_row(a.w_scales, row[1], a.hidden);
      mma_pair_dot<LL_INPUT>(ring, p, a.hidden, kpart, ksplit, acc);
    }
    mma_store_partials(red, acc);
    // Items (token n, feature first + i), features fastest (coalesced stores); i = pair * F + r.
    const int first = (blockIdx.x * a.rounds + round) * pairs * F;
    for (int item = threadIdx.x; item < plan.count * pairs * F; item += LL_THREADS) {
      const int n = item / (pairs * F), i = item % (pairs * F), pair = i / F, r = i % F, f = first + i;
      if (f >= a.inter_padded) continue;
      float h[R];
      if (GATED) {
        h[0] = mma_pair_sum(red, pair, ksplit, 0, r, n);
        h[R - 1] = mma_pair_sum(red, pair, ksplit, 1, r, n);
      } else {
        h[0] = mma_pair_sum(red, pair, ksplit, r >> 4, r & 15, n);
      }
      gemm1_store<R>(plan, a, e, f, n, h, 0, 1);
    }
    __syncthreads();  // the sums are read before the next round's rings overwrite them
  }
}

// ------------------------------------------------------------------------------------------ GEMM2
// GEMM2 of expert e on tensor cores (32 output rows per pair), every round, then gemm2_store per (feature pair,
// token).
__device__ __forceinline__ void mma_gemm2(const Plan& plan, const Gemm2Args& a, int e) {
  extern __shared__ uint4 mma_smem[];
  require_mma_smem<INTER_INPUT>();
  const int ksplit = a.lanes_per_row, pairs = WARPS / ksplit, warp = threadIdx.x >> 5, kpart = warp % ksplit;
  uint4* ring = mma_smem + warp * MMA_STAGES * mma_items<INTER_INPUT>() * 32;
  float* red = reinterpret_cast<float*>(mma_smem);
  const int k = a.inter_padded;
  MmaPair p{};
  mma_token_rows(plan, reinterpret_cast<const u8*>(a.inter), a.inter_scales,
                 static_cast<i64>(x_bytes_num(INTER_INPUT)) * k, k,
                 [&](int index) { return static_cast<i64>(plan.list[index]); }, p);
  for (int round = 0; round < a.rounds; ++round) {
    if (round + 1 < a.rounds)
      mma_prefetch_gemm2(e, round + 1, a.w, a.hidden, k, ksplit, a.rounds);
    const int h0 = mma_pair_first(round, a.rounds, ksplit, MMA_ROWS);
    float acc[2][4] = {};
    if (h0 < a.hidden) {
      const i64 row = static_cast<i64>(e) * a.hidden + h0;
      p.w0 = a.w + row * row_bytes(k), p.w1 = a.w + (row + MMA_ROWS / 2) * row_bytes(k);
      p.ws0 = scale_row(a.w_scales, row, k), p.ws1 = scale_row(a.w_scales, row + MMA_ROWS / 2, k);
      mma_pair_dot<INTER_INPUT>(ring, p, k, kpart, ksplit, acc);
    }
    mma_store_partials(red, acc);
    // Items (token n, features h, h + 1), features fastest; h = first + 2 i, row r = 2 i % 32 of pair 2 i / 32.
    const int first = (blockIdx.x * a.rounds + round) * pairs * MMA_ROWS;
    constexpr int ROW_PAIRS = MMA_ROWS / 2;
    for (int item = threadIdx.x; item < plan.count * pairs * ROW_PAIRS; item += LL_THREADS) {
      const int n = item / (pairs * ROW_PAIRS), i = item % (pairs * ROW_PAIRS), pair = i / ROW_PAIRS;
      const int r = 2 * (i % ROW_PAIRS), h = first + 2 * i;
      if (h >= a.hidden) continue;
      const float v[2] = {mma_pair_sum(red, pair, ksplit, r >> 4, r & 15, n),
                          mma_pair_sum(red, pair, ksplit, r >> 4, (r & 15) + 1, n)};
      gemm2_store<1>(plan, a, e, h, n, v, 0, 1);
    }
    __syncthreads();
  }
}

// Output features one CTA of ll_gemm2 covers (its column of the finalize).
__device__ __forceinline__ int gemm2_cta_features(int ksplit, int rounds) { return MMA_ROWS * (WARPS / ksplit) * rounds; }

}  // namespace ll
