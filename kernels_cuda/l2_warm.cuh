// L2 warming: blocks of a launch that runs while DRAM idles (the decode chain's staged sort + permute) read the
// caller's routing and ask L2 for the first bytes of the next GEMM's weight stream, the part its first wave of CTAs
// loads first. Nothing is written: only where the GEMM's loads are served from can change, never a result.
#pragma once
#include "common.cuh"
#include "sort.cuh"

namespace moe {

// What to warm (cudnn_moe/kernels/l2_warm.py L2Warm): weights in row blocks of one expert after another, each row
// block's stream `code_row` bytes of codes (and `scale_row` bytes of scales) long, row_blocks per expert. The first
// `code_bytes` (a multiple of 512) and `scale_bytes` (a multiple of 128) of every row block of the first `experts` used
// local experts, in ascending id order (the order of the GEMM's tiles), by the launch's last `blocks` blocks.
struct WeightWarm {
  const u8* codes;
  const u8* scales;
  i64 code_row, scale_row;
  int row_blocks, code_bytes, scale_bytes, experts, blocks;
};

// The _warm kernels' last parameters (cudnn_moe/kernels/sort.py passes them in this order), and the struct WARM_ARGS
// makes of them.
#define WARM_PARAMS                                                                                                 \
  const u8 *__restrict__ warm_codes, const u8 *__restrict__ warm_scales, i64 warm_code_row, i64 warm_scale_row,    \
      int warm_row_blocks, int warm_code_bytes, int warm_scale_bytes, int warm_experts, int warm_blocks
#define WARM_ARGS                                                                                                   \
  WeightWarm { warm_codes, warm_scales, warm_code_row, warm_scale_row, warm_row_blocks, warm_code_bytes,          \
               warm_scale_bytes, warm_experts, warm_blocks }

__device__ __forceinline__ void prefetch_line_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

// Block `block` of warm.blocks: the used local experts of the num_slots ids (shared or global memory) in ascending
// order, then one L2 prefetch per 128-byte line, k-major (every row block's first 512 bytes, then the next), so that
// what the GEMM's CTAs load first is asked for first. Scales first: they are an eighth of the bytes.
__device__ __forceinline__ void warm_weights(const int* ids, int num_slots, int local_start, int num_experts,
                                             const WeightWarm& warm, int block) {
  constexpr int WORDS = SORT_MAX_EXPERTS / 32;
  __shared__ u32 used[WORDS];
  __shared__ int order[SORT_MAX_EXPERTS];
  if (num_experts < 1 || num_experts > SORT_MAX_EXPERTS || warm.row_blocks < 1) return;  // the host checks: never taken
  const int tid = threadIdx.x;
  for (int w = tid; w < WORDS; w += blockDim.x) used[w] = 0;
  __syncthreads();
  for (int i = tid; i < num_slots; i += blockDim.x) {
    const int e = local_expert(ids[i], local_start, num_experts);
    if (e >= 0) atomicOr(&used[e >> 5], 1u << (e & 31));
  }
  __syncthreads();
  int total = 0;
  for (int w = 0; w < WORDS; ++w) total += __popc(used[w]);
  for (int e = tid; e < num_experts; e += blockDim.x) {
    const u32 word = used[e >> 5];
    if (!(word >> (e & 31) & 1u)) continue;
    int rank = __popc(word & ((1u << (e & 31)) - 1u));
    for (int w = 0; w < (e >> 5); ++w) rank += __popc(used[w]);
    if (rank < warm.experts) order[rank] = e;
  }
  __syncthreads();
  const int experts = min(total, warm.experts);
  const i64 stride = static_cast<i64>(warm.blocks) * blockDim.x;
  const i64 first = static_cast<i64>(block) * blockDim.x + tid;
  const int scale_lines = (warm.scale_bytes + 127) / 128;
  const i64 units = static_cast<i64>(experts) * warm.row_blocks;  // (expert, row block) pairs
  for (i64 item = first; item < units * scale_lines; item += stride) {
    const i64 unit = item % units;
    const int e = order[unit / warm.row_blocks];
    prefetch_line_l2(warm.scales + (static_cast<i64>(e) * warm.row_blocks + unit % warm.row_blocks) * warm.scale_row +
                     item / units * 128);
  }
  const i64 code_items = units * (warm.code_bytes / 128);
  for (i64 item = first; item < code_items; item += stride) {
    const i64 unit = item / 4 % units;  // four lines of one 512-byte tile, then the next unit's
    const int e = order[unit / warm.row_blocks];
    prefetch_line_l2(warm.codes + (static_cast<i64>(e) * warm.row_blocks + unit % warm.row_blocks) * warm.code_row +
                     item / (4 * units) * 512 + item % 4 * 128);
  }
}

}  // namespace moe
