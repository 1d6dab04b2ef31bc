// Gather NVFP4 tokens into expert-sorted rows of exact BF16 values in the SM90 token-fragment order
// (cudnn_moe/engines/sm90/layout.py): inside each block of 64 columns, position 16q + 4s + 2b + e
// holds k = 16s + 8b + 2q + e. The decode is common.cuh's decode_fragment_unit; the pipeline's permute
// (cudnn_moe.kernels.permute_tokens) uses moe_permute_bf16 of permute.cu, which decodes each token once
// for all its slots.
#include "common.cuh"

using namespace moe;

// One block per routing slot (grid = num_slots = B * top_k); slot i belongs to token t = i / top_k.
//   xs          uint8 [B, H/2]        packed E2M1 (element 2i in the low nibble)
//   xss         uint8 [B, H/16]       E4M3 scales, linear
//   slot_to_row int32 [num_slots]     destination row, -1 when the slot is masked (nothing written)
//   xp          bf16 [rows, H]        row r = slot_to_row[i] gets E2M1 value x E4M3 scale, exact
//                                     (a NaN scale byte 0x7F / 0xFF gives NaN values)
// Requires H % 64 == 0, xs and xp 16-byte aligned. Thread c of the row handles units u = c, c +
// blockDim.x, ... < H / 32: one 16-byte load of codes (32 values, k64 block u / 2, half u % 2), four
// 16-byte stores (decode_fragment_unit / store_fragment_unit).
extern "C" __global__ void sm90_permute_decode(const u8* __restrict__ xs, const u8* __restrict__ xss,
                                               const int* __restrict__ slot_to_row, int top_k, int hidden,
                                               u16* __restrict__ xp) {
  const int r = slot_to_row[blockIdx.x];
  if (r < 0) return;
  const i64 t = blockIdx.x / top_k;
  const u8* codes = xs + t * (hidden / 2);
  const u8* scales = xss + t * (hidden / 16);
  u16* dst = xp + static_cast<i64>(r) * hidden;
  for (int u = threadIdx.x; u < hidden / 32; u += blockDim.x) {
    uint4 piece[4];
    decode_fragment_unit(codes, scales, u, piece);
    store_fragment_unit(dst, u, piece);
  }
}
