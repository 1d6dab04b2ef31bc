// Gather token rows into expert-sorted rows for the first grouped GEMM; for decode buckets, the routing sort
// and the gather in one launch (moe_sort_permute_bf16*).
#include "common.cuh"
#include "l2_warm.cuh"
#include "mxfp8.cuh"
#include "sort.cuh"

using namespace moe;

// One block per slot (grid = num_slots = B * top_k); slot i belongs to token i / top_k.
//   xs          uint8 [B, row_bytes]     packed FP4 rows (row_bytes = H/2)
//   xss         uint8 [B, scale_cols]    E4M3 scales, linear (scale_cols = H/16)
//   slot_to_row int32 [num_slots]        destination row, -1 when the slot is masked
//   xp          uint8 [row_capacity, row_bytes]
//   xps         E4M3 scales of xp: linear [row_capacity, scale_cols], or the 128x4
//               swizzle of a row_capacity x scale_cols matrix when swizzled != 0
// Rows no slot maps to are not written.
extern "C" __global__ void moe_permute(const u8* __restrict__ xs, const u8* __restrict__ xss,
                                       const int* __restrict__ slot_to_row, int top_k, int row_bytes,
                                       int scale_cols, int swizzled, u8* __restrict__ xp,
                                       u8* __restrict__ xps) {
  moe::grid_dependency_begin();
  const int r = slot_to_row[blockIdx.x];
  if (r < 0) return;
  const i64 t = blockIdx.x / top_k;
  block_copy_bytes(xp + static_cast<i64>(r) * row_bytes, xs + t * row_bytes, row_bytes, threadIdx.x, blockDim.x);
  const u8* src = xss + t * scale_cols;
  if (swizzled) {
    for (int c = threadIdx.x; c < scale_cols; c += blockDim.x) xps[swizzle_128x4_offset(r, c, scale_cols)] = src[c];
  } else {
    block_copy_bytes(xps + static_cast<i64>(r) * scale_cols, src, scale_cols, threadIdx.x, blockDim.x);
  }
}

// BF16 token rows for the SM90 engine: each routed slot's token in the token-fragment column order
// (layout TOKENS_BF16_FRAGMENTS, cudnn_moe/engines/sm90/layout.py) or in natural order (TOKENS_BF16_ROWS).
// Token-major: a token's 32-column unit is loaded once (LOAD_UNIT: decoded from NVFP4, or read from BF16)
// and stored to the rows of all its slots. A thread handles units of H / 32 per token; blockDim.x / (H / 32) tokens per block (at least
// one; launch ceil(ceil(num_slots / top_k) / tokens per block) blocks).
//   slot_to_row int32 [num_slots]    destination row of slot i (token i / top_k), -1 when masked
//   layout      TOKENS_BF16_FRAGMENTS or TOKENS_BF16_ROWS (the column order of xp)
//   xp          bf16 [rows, H]       16-byte aligned; rows no slot maps to are not written
// Requires H % 64 == 0.
template <typename LoadUnit>
__device__ __forceinline__ void permute_fragments(const int* __restrict__ slot_to_row, int num_slots, int top_k,
                                                  int hidden, int layout, u16* __restrict__ xp, LoadUnit load_unit) {
  const int units = hidden / 32;
  const int tokens_per_block = max(1, static_cast<int>(blockDim.x) / units);
  const int sub = threadIdx.x / units;  // the block's token of this thread
  if (sub >= tokens_per_block) return;
  const i64 t = static_cast<i64>(blockIdx.x) * tokens_per_block + sub;
  const i64 first_slot = t * top_k;
  if (first_slot >= num_slots) return;
  const int slots = static_cast<int>(min(static_cast<i64>(top_k), num_slots - first_slot));
  const int* rows = slot_to_row + first_slot;
  bool live = false;
  for (int s = 0; s < slots; ++s) live |= rows[s] >= 0;
  if (!live) return;  // every slot masked (tokens past T): nothing to load
  const int stride = tokens_per_block == 1 ? static_cast<int>(blockDim.x) : units;
  for (int u = threadIdx.x - sub * units; u < units; u += stride) {
    uint4 piece[4];
    load_unit(t, u, piece);
    for (int s = 0; s < slots; ++s) {
      const int r = rows[s];
      if (r >= 0) store_token_unit(layout, xp + static_cast<i64>(r) * hidden, u, piece);
    }
  }
}

// NVFP4 tokens, decoded exactly: xs uint8 [B, H/2] packed E2M1 (element 2i in the low nibble), 16-byte
// aligned; xss uint8 [B, H/16] E4M3 scales, linear.
extern "C" __global__ void moe_permute_bf16(const u8* __restrict__ xs, const u8* __restrict__ xss,
                                            const int* __restrict__ slot_to_row, int num_slots, int top_k,
                                            int hidden, int layout, u16* __restrict__ xp) {
  moe::grid_dependency_begin();
  permute_fragments(slot_to_row, num_slots, top_k, hidden, layout, xp, [&](i64 t, int u, uint4 piece[4]) {
    decode_fragment_unit(xs + t * (hidden / 2), xss + t * (hidden / 16), u, piece);
  });
}

// Unit u of BF16 token t of x [B, H] in fragment order (bf16_unit_pieces).
__device__ __forceinline__ void load_bf16_unit(const u16* __restrict__ x, int hidden, i64 t, int u, uint4 piece[4]) {
  bf16_unit_pieces(fetch_bf16_unit(x, hidden, t, u).chunk, piece);
}

// BF16 tokens as they are: x bf16 [B, H], 16-byte aligned.
extern "C" __global__ void moe_permute_bf16_tokens(const u16* __restrict__ x, const int* __restrict__ slot_to_row,
                                                   int num_slots, int top_k, int hidden, int layout,
                                                   u16* __restrict__ xp) {
  moe::grid_dependency_begin();
  permute_fragments(slot_to_row, num_slots, top_k, hidden, layout, xp,
                    [&](i64 t, int u, uint4 piece[4]) { load_bf16_unit(x, hidden, t, u, piece); });
}

// Sort + permute in one launch, for buckets of at most SORT_THREADS slots (decode): every block of
// SORT_THREADS threads runs the whole single-block sort of moe_sort in shared memory (it reads the
// num_slots ids from L2: the blocks never communicate), block 0 alone writes the sort's outputs for the
// later stages (offsets, slot_to_row, row_to_slot, row_expert, counts: moe_sort's documentation), and the
// blocks share the (slot, 32-column unit) pairs of the gather, slot-major, min(SORT_THREADS, ceil(pairs / grid))
// = P per block: thread j of block b takes pairs b P + j, b P + j + grid P, ... A unit is fetched once per slot (fetch(t, u): its raw bytes; the repeats of a
// token's slots hit L1 / L2) and expanded into its four BF16 pieces (expand(raw, piece)). The first pair's
// fetch is issued BEFORE the sort (the tokens need nothing from it), so its latency overlaps the sort's; its row
// comes from the block's sort (shared memory). The ids come from get_ids(), called by every thread once that first
// fetch is issued (the num_slots ids, global or shared memory). The launch's last warm_blocks blocks take no part (the
// staged _warm kernels' blocks that warm L2). Same outputs, bit for bit, as moe_sort followed by
// moe_permute_bf16 / moe_permute_bf16_tokens. Any grid of at least one block (cudnn_moe/kernels/sort.py:
// SORT_PERMUTE_BLOCK_PAIRS pairs per block, at most SORT_PERMUTE_MAX_BLOCKS blocks).
// WarpOnly: for num_slots <= SORT_WARP_SLOTS (returns without writing for more), the one-warp sort alone
// (sort_slots_warp): the kernel then holds 8 KB of static shared memory instead of 45 KB.
template <bool WarpOnly, typename GetIds, typename Fetch, typename Expand>
__device__ __forceinline__ void sort_permute(GetIds get_ids, int num_slots, int top_k, int local_start,
                                             int num_experts, int align, int row_capacity, int hidden, int layout,
                                             int* __restrict__ offsets, int* __restrict__ slot_to_row,
                                             int* __restrict__ row_to_slot, int* __restrict__ row_expert,
                                             int* __restrict__ counts, u16* __restrict__ xp, Fetch fetch,
                                             Expand expand, int warm_blocks = 0) {
  __shared__ int slot_rows[SORT_THREADS];
  if (blockDim.x != SORT_THREADS || num_slots > SORT_THREADS || num_experts < 1 || num_experts > SORT_MAX_EXPERTS ||
      align < 1 || top_k < 1 || hidden % 64)
    return;
  const int units = hidden / 32;
  const int pairs = num_slots * units;  // <= SORT_THREADS * (H / 32): fits an int for any H below 2^26
  const int grid = static_cast<int>(gridDim.x) - warm_blocks;
  const int per_block = min(SORT_THREADS, (pairs + grid - 1) / grid);  // threads of a block with a pair
  const int stride = grid * per_block;
  int p = static_cast<int>(threadIdx.x) < per_block ? static_cast<int>(blockIdx.x) * per_block + threadIdx.x : pairs;
  decltype(fetch(0, 0)) raw{};
  if (p < pairs) raw = fetch(p / units / top_k, p % units);
  const int* ids = get_ids();
  if constexpr (WarpOnly) {  // num_slots <= SORT_WARP_SLOTS: only the warp sort's shared arrays
    __shared__ int counts_smem[SORT_MAX_EXPERTS];
    __shared__ int seg[SORT_MAX_EXPERTS + 1];
    if (num_slots > SORT_WARP_SLOTS) return;
    if (threadIdx.x < 32)
      sort_slots_warp(ids, num_slots, local_start, num_experts, align, row_capacity, blockIdx.x == 0, slot_rows,
                      counts_smem, seg, offsets, slot_to_row, row_to_slot, row_expert, counts);
  } else {
    sort_slots(ids, num_slots, local_start, num_experts, align, row_capacity, max(num_slots, 1), 0, 1,
               blockIdx.x == 0, true, slot_rows, offsets, slot_to_row, row_to_slot, row_expert, counts);
  }
  __syncthreads();
  for (bool first = true; p < pairs; p += stride, first = false) {
    const int s = p / units;
    const int u = p - s * units;
    const int r = slot_rows[s];
    if (r < 0) continue;
    if (!first) raw = fetch(s / top_k, u);
    uint4 piece[4];
    expand(raw, piece);
    store_token_unit(layout, xp + static_cast<i64>(r) * hidden, u, piece);
  }
}

// The 16 code bytes and two scale bytes of an NVFP4 token unit.
struct Nvfp4Unit {
  uint4 codes;
  u8 scale0, scale1;
};

// Unit u of NVFP4 token t (xs, xss as for moe_permute_bf16), as it is.
__device__ __forceinline__ Nvfp4Unit fetch_nvfp4_unit(const u8* __restrict__ xs, const u8* __restrict__ xss, int hidden,
                                                      i64 t, int u) {
  const u8* scales = xss + t * (hidden / 16) + 2 * u;
  return Nvfp4Unit{*reinterpret_cast<const uint4*>(xs + t * (hidden / 2) + 16 * u), scales[0], scales[1]};
}

// A unit's four BF16 fragment-order pieces, decoded exactly.
__device__ __forceinline__ void expand_nvfp4_unit(const Nvfp4Unit& raw, uint4 piece[4]) {
  decode_fragment_words(raw.codes, raw.scale0, raw.scale1, piece);
}

// NVFP4 tokens (xs, xss as for moe_permute_bf16), decoded exactly into BF16 fragments.
extern "C" __global__ void __launch_bounds__(SORT_THREADS)
    moe_sort_permute_bf16(const int* __restrict__ ids, int num_slots, int top_k, int local_start, int num_experts,
                          int align, int row_capacity, int hidden, int layout, const u8* __restrict__ xs,
                          const u8* __restrict__ xss, int* __restrict__ offsets, int* __restrict__ slot_to_row,
                          int* __restrict__ row_to_slot, int* __restrict__ row_expert, int* __restrict__ counts,
                          u16* __restrict__ xp) {
  moe::grid_dependency_begin();
  sort_permute<false>(
      [&] { return ids; }, num_slots, top_k, local_start, num_experts, align, row_capacity, hidden, layout, offsets,
      slot_to_row, row_to_slot, row_expert, counts, xp,
      [&](i64 t, int u) { return fetch_nvfp4_unit(xs, xss, hidden, t, u); }, expand_nvfp4_unit);
}

// A BF16 unit's four fragment-order pieces.
__device__ __forceinline__ void expand_bf16_unit(const Bf16Unit& raw, uint4 piece[4]) {
  bf16_unit_pieces(raw.chunk, piece);
}

// BF16 tokens (x as for moe_permute_bf16_tokens), as they are.
extern "C" __global__ void __launch_bounds__(SORT_THREADS)
    moe_sort_permute_bf16_tokens(const int* __restrict__ ids, int num_slots, int top_k, int local_start,
                                 int num_experts, int align, int row_capacity, int hidden, int layout,
                                 const u16* __restrict__ x,
                                 int* __restrict__ offsets, int* __restrict__ slot_to_row,
                                 int* __restrict__ row_to_slot, int* __restrict__ row_expert,
                                 int* __restrict__ counts, u16* __restrict__ xp) {
  moe::grid_dependency_begin();
  sort_permute<false>(
      [&] { return ids; }, num_slots, top_k, local_start, num_experts, align, row_capacity, hidden, layout, offsets,
      slot_to_row, row_to_slot, row_expert, counts, xp, [&](i64 t, int u) { return fetch_bf16_unit(x, hidden, t, u); },
      expand_bf16_unit);
}

// MXFP8 tokens (codes xs [B, H], 16-byte aligned; E8M0 scales xss [B, H/32]), as their BF16 values.
extern "C" __global__ void __launch_bounds__(SORT_THREADS)
    moe_sort_permute_bf16_mxfp8(const int* __restrict__ ids, int num_slots, int top_k, int local_start,
                                int num_experts, int align, int row_capacity, int hidden, int layout,
                                const u8* __restrict__ xs, const u8* __restrict__ xss, int* __restrict__ offsets,
                                int* __restrict__ slot_to_row, int* __restrict__ row_to_slot,
                                int* __restrict__ row_expert, int* __restrict__ counts, u16* __restrict__ xp) {
  moe::grid_dependency_begin();
  sort_permute<false>(
      [&] { return ids; }, num_slots, top_k, local_start, num_experts, align, row_capacity, hidden, layout, offsets,
      slot_to_row, row_to_slot, row_expert, counts, xp,
      [&](i64 t, int u) { return fetch_mxfp8_unit(xs, xss, hidden, t, u); }, expand_mxfp8_unit);
}

// The parameters every stage + sort + permute kernel takes before its tokens (the caller's routing and the bucket's
// sizes) and after them (the stage's and the sort's outputs, the gathered rows), and the arguments that pass them on.
#define STAGE_ROUTING_PARAMS                                                                                         \
  const void *__restrict__ ids, const void *__restrict__ weights, int routing_format, int ids_int64, int num_tokens, \
      int num_slots, int top_k, int local_start, int num_experts, int align, int row_capacity, int hidden, int layout
#define STAGE_ROUTING_ARGS                                                                                            \
  ids, weights, routing_format, ids_int64, num_tokens, num_slots, top_k, local_start, num_experts, align,             \
      row_capacity, hidden, layout
#define STAGE_OUTPUT_PARAMS                                                                                          \
  int *__restrict__ ids_out, float *__restrict__ w_out, int *__restrict__ offsets, int *__restrict__ slot_to_row,   \
      int *__restrict__ row_to_slot, int *__restrict__ row_expert, int *__restrict__ counts, u16 *__restrict__ xp
#define STAGE_OUTPUT_ARGS ids_out, w_out, offsets, slot_to_row, row_to_slot, row_expert, counts, xp

// The stage (moe_stage_inputs' routing half) folded into sort_permute, for calls whose launches know the caller's
// tensors: the caller's routing (ids, weights, routing_format, ids_int64 as moe_stage_inputs reads them) goes straight
// into the sort and the gather of the bucket's num_slots = B * top_k slots (slots of tokens t >= num_tokens = T
// masked), and the gather reads the caller's T tokens (fetch(t, u), called for t < T only). Every block decodes the
// routing into shared memory (num_slots * 4 bytes of dynamic shared memory); block 0 also writes it to
// ids_out [B, top_k] and w_out [B, top_k] (moe_stage_inputs' outputs, which the finalize reads). The bucket's token
// buffers are not written. Warm (the kernels named _warm, `warm` not null): the launch's last warm->blocks blocks take
// no part in that; they warm L2 with the first weight bytes of the GEMM after the launch (warm_weights) and end.
// Without Warm (`warm` null) the kernels compile to the same SASS as before warming existed (nvcc 13.0, sm_90a): one
// kernel for both, with the warming passed by reference, compiled otherwise and measured 1-1.5 us slower at
// Qwen3-30B-A3B T=2 and 4, where it does not warm.
template <bool WarpOnly, bool Warm, typename Fetch, typename Expand>
__device__ __forceinline__ void stage_sort_permute(STAGE_ROUTING_PARAMS, STAGE_OUTPUT_PARAMS, Fetch fetch,
                                                   Expand expand, const WeightWarm* warm) {
  extern __shared__ __align__(16) int staged_ids[];  // num_slots ints (dynamic: the sort's static arrays fill 44 KB)
  const auto stage_ids = [&]() -> const int* {
    for (int i = threadIdx.x; i < num_slots; i += blockDim.x) {
      int id;
      float w;
      decode_route(ids, weights, routing_format, ids_int64, i, i / top_k < num_tokens, id, w);
      staged_ids[i] = id;
      if (blockIdx.x == 0) {
        ids_out[i] = id;
        w_out[i] = w;
      }
    }
    __syncthreads();
    return staged_ids;
  };
  if constexpr (Warm) {
    const int gather_blocks = static_cast<int>(gridDim.x) - warm->blocks;
    if (static_cast<int>(blockIdx.x) >= gather_blocks) {
      warm_weights(stage_ids(), num_slots, local_start, num_experts, *warm,
                   static_cast<int>(blockIdx.x) - gather_blocks);
      return;
    }
  }
  sort_permute<WarpOnly>(
      stage_ids, num_slots, top_k, local_start, num_experts, align, row_capacity, hidden, layout, offsets, slot_to_row,
      row_to_slot, row_expert, counts, xp,
      [&](i64 t, int u) { return t < num_tokens ? fetch(t, u) : decltype(fetch(t, u)){}; }, expand,
      Warm ? warm->blocks : 0);
}

// stage_sort_permute of tokens given as codes xs (16-byte aligned rows) and 1-byte scales xss, unit u of token t read
// by Fetch and decoded by Expand: NVFP4 (xs [T, H/2], xss [T, H/16]: fetch_nvfp4_unit, expand_nvfp4_unit; the same
// outputs, bit for bit, as moe_stage_inputs followed by moe_sort_permute_bf16) or MXFP8 (xs [T, H], E8M0 xss [T, H/32]:
// fetch_mxfp8_unit, expand_mxfp8_unit; as moe_stage_inputs followed by moe_sort_permute_bf16_mxfp8).
template <bool WarpOnly, bool Warm, typename Unit, Unit (*Fetch)(const u8*, const u8*, int, i64, int),
          void (*Expand)(const Unit&, uint4*)>
__device__ __forceinline__ void stage_sort_permute_scaled(STAGE_ROUTING_PARAMS, const u8* __restrict__ xs,
                                                          const u8* __restrict__ xss, STAGE_OUTPUT_PARAMS,
                                                          const WeightWarm* warm) {
  stage_sort_permute<WarpOnly, Warm>(
      STAGE_ROUTING_ARGS, STAGE_OUTPUT_ARGS, [&](i64 t, int u) { return Fetch(xs, xss, hidden, t, u); }, Expand, warm);
}

// stage_sort_permute of BF16 tokens (x bf16 [T, H], 16-byte aligned), as they are: the same outputs, bit for bit, as
// moe_stage_inputs (the tokens copied as bytes) followed by moe_sort_permute_bf16_tokens.
template <bool WarpOnly, bool Warm>
__device__ __forceinline__ void stage_sort_permute_tokens(STAGE_ROUTING_PARAMS, const u16* __restrict__ x,
                                                          STAGE_OUTPUT_PARAMS, const WeightWarm* warm) {
  stage_sort_permute<WarpOnly, Warm>(
      STAGE_ROUTING_ARGS, STAGE_OUTPUT_ARGS, [&](i64 t, int u) { return fetch_bf16_unit(x, hidden, t, u); },
      expand_bf16_unit, warm);
}

// The kernels: four a token kind. NAME sorts with the general block sort, NAME_warp with the one-warp sort alone
// (num_slots <= SORT_WARP_SLOTS; it writes nothing for more) and only that sort's shared arrays (8 KB against 45 KB:
// sort_permute's WarpOnly); the _warm forms add WARM_PARAMS and their blocks that warm L2. NVFP4 tokens: _bf16; BF16
// tokens: _bf16_tokens; MXFP8 tokens, as their BF16 values: _bf16_mxfp8.
extern "C" __global__ void __launch_bounds__(SORT_THREADS)
    moe_stage_sort_permute_bf16(STAGE_ROUTING_PARAMS, const u8* __restrict__ xs, const u8* __restrict__ xss,
                                STAGE_OUTPUT_PARAMS) {
  moe::grid_dependency_begin();
  stage_sort_permute_scaled<false, false, Nvfp4Unit, fetch_nvfp4_unit, expand_nvfp4_unit>(
      STAGE_ROUTING_ARGS, xs, xss, STAGE_OUTPUT_ARGS, nullptr);
}

extern "C" __global__ void __launch_bounds__(SORT_THREADS)
    moe_stage_sort_permute_bf16_warm(STAGE_ROUTING_PARAMS, const u8* __restrict__ xs, const u8* __restrict__ xss,
                                     STAGE_OUTPUT_PARAMS, WARM_PARAMS) {
  moe::grid_dependency_begin();
  const WeightWarm warm = WARM_ARGS;
  stage_sort_permute_scaled<false, true, Nvfp4Unit, fetch_nvfp4_unit, expand_nvfp4_unit>(
      STAGE_ROUTING_ARGS, xs, xss, STAGE_OUTPUT_ARGS, &warm);
}

extern "C" __global__ void __launch_bounds__(SORT_THREADS)
    moe_stage_sort_permute_bf16_warp(STAGE_ROUTING_PARAMS, const u8* __restrict__ xs, const u8* __restrict__ xss,
                                     STAGE_OUTPUT_PARAMS) {
  moe::grid_dependency_begin();
  stage_sort_permute_scaled<true, false, Nvfp4Unit, fetch_nvfp4_unit, expand_nvfp4_unit>(
      STAGE_ROUTING_ARGS, xs, xss, STAGE_OUTPUT_ARGS, nullptr);
}

extern "C" __global__ void __launch_bounds__(SORT_THREADS)
    moe_stage_sort_permute_bf16_warp_warm(STAGE_ROUTING_PARAMS, const u8* __restrict__ xs, const u8* __restrict__ xss,
                                          STAGE_OUTPUT_PARAMS, WARM_PARAMS) {
  moe::grid_dependency_begin();
  const WeightWarm warm = WARM_ARGS;
  stage_sort_permute_scaled<true, true, Nvfp4Unit, fetch_nvfp4_unit, expand_nvfp4_unit>(
      STAGE_ROUTING_ARGS, xs, xss, STAGE_OUTPUT_ARGS, &warm);
}

extern "C" __global__ void __launch_bounds__(SORT_THREADS)
    moe_stage_sort_permute_bf16_tokens(STAGE_ROUTING_PARAMS, const u16* __restrict__ x, STAGE_OUTPUT_PARAMS) {
  moe::grid_dependency_begin();
  stage_sort_permute_tokens<false, false>(STAGE_ROUTING_ARGS, x, STAGE_OUTPUT_ARGS, nullptr);
}

extern "C" __global__ void __launch_bounds__(SORT_THREADS)
    moe_stage_sort_permute_bf16_tokens_warm(STAGE_ROUTING_PARAMS, const u16* __restrict__ x,
                                            STAGE_OUTPUT_PARAMS, WARM_PARAMS) {
  moe::grid_dependency_begin();
  const WeightWarm warm = WARM_ARGS;
  stage_sort_permute_tokens<false, true>(STAGE_ROUTING_ARGS, x, STAGE_OUTPUT_ARGS, &warm);
}

extern "C" __global__ void __launch_bounds__(SORT_THREADS)
    moe_stage_sort_permute_bf16_tokens_warp(STAGE_ROUTING_PARAMS, const u16* __restrict__ x, STAGE_OUTPUT_PARAMS) {
  moe::grid_dependency_begin();
  stage_sort_permute_tokens<true, false>(STAGE_ROUTING_ARGS, x, STAGE_OUTPUT_ARGS, nullptr);
}

extern "C" __global__ void __launch_bounds__(SORT_THREADS)
    moe_stage_sort_permute_bf16_tokens_warp_warm(STAGE_ROUTING_PARAMS, const u16* __restrict__ x,
                                                 STAGE_OUTPUT_PARAMS, WARM_PARAMS) {
  moe::grid_dependency_begin();
  const WeightWarm warm = WARM_ARGS;
  stage_sort_permute_tokens<true, true>(STAGE_ROUTING_ARGS, x, STAGE_OUTPUT_ARGS, &warm);
}

extern "C" __global__ void __launch_bounds__(SORT_THREADS)
    moe_stage_sort_permute_bf16_mxfp8(STAGE_ROUTING_PARAMS, const u8* __restrict__ xs, const u8* __restrict__ xss,
                                      STAGE_OUTPUT_PARAMS) {
  moe::grid_dependency_begin();
  stage_sort_permute_scaled<false, false, Mxfp8Unit, fetch_mxfp8_unit, expand_mxfp8_unit>(
      STAGE_ROUTING_ARGS, xs, xss, STAGE_OUTPUT_ARGS, nullptr);
}

extern "C" __global__ void __launch_bounds__(SORT_THREADS)
    moe_stage_sort_permute_bf16_mxfp8_warm(STAGE_ROUTING_PARAMS, const u8* __restrict__ xs, const u8* __restrict__ xss,
                                           STAGE_OUTPUT_PARAMS, WARM_PARAMS) {
  moe::grid_dependency_begin();
  const WeightWarm warm = WARM_ARGS;
  stage_sort_permute_scaled<false, true, Mxfp8Unit, fetch_mxfp8_unit, expand_mxfp8_unit>(
      STAGE_ROUTING_ARGS, xs, xss, STAGE_OUTPUT_ARGS, &warm);
}

extern "C" __global__ void __launch_bounds__(SORT_THREADS)
    moe_stage_sort_permute_bf16_mxfp8_warp(STAGE_ROUTING_PARAMS, const u8* __restrict__ xs, const u8* __restrict__ xss,
                                           STAGE_OUTPUT_PARAMS) {
  moe::grid_dependency_begin();
  stage_sort_permute_scaled<true, false, Mxfp8Unit, fetch_mxfp8_unit, expand_mxfp8_unit>(
      STAGE_ROUTING_ARGS, xs, xss, STAGE_OUTPUT_ARGS, nullptr);
}

extern "C" __global__ void __launch_bounds__(SORT_THREADS)
    moe_stage_sort_permute_bf16_mxfp8_warp_warm(STAGE_ROUTING_PARAMS, const u8* __restrict__ xs,
                                                const u8* __restrict__ xss, STAGE_OUTPUT_PARAMS, WARM_PARAMS) {
  moe::grid_dependency_begin();
  const WeightWarm warm = WARM_ARGS;
  stage_sort_permute_scaled<true, true, Mxfp8Unit, fetch_mxfp8_unit, expand_mxfp8_unit>(
      STAGE_ROUTING_ARGS, xs, xss, STAGE_OUTPUT_ARGS, &warm);
}
