// Gather NVFP4 tokens into expert-sorted rows of exact BF16 values in the SM90 token-fragment order
// (cudnn_moe/engines/sm90/layout.py): inside each block of 64 columns, position 16q + 4s + 2b + e
// holds k = 16s + 8b + 2q + e.
#include "common.cuh"

using namespace moe;

// One block per routing slot (grid = num_slots = B * top_k); slot i belongs to token t = i / top_k.
//   xs          uint8 [B, H/2]        packed E2M1 (element 2i in the low nibble)
//   xss         uint8 [B, H/16]       E4M3 scales, linear
//   slot_to_row int32 [num_slots]     destination row, -1 when the slot is masked (nothing written)
//   xp          bf16 [rows, H]        row r = slot_to_row[i] gets E2M1 value x E4M3 scale, exact
//                                     (a NaN scale byte 0x7F / 0xFF gives NaN values)
// Requires H % 64 == 0, xs and xp 16-byte aligned. Thread c of the row writes the 16-byte piece c
// (positions 8c .. 8c + 7): k64 block j = c / 8, q = (c % 8) / 2, h = c % 2; its element 2w + e
// (w = 2s' + b) is k = 32h + 16s' + 8b + 2q + e, i.e. nibble e of byte q of word w of the 16 bytes
// at 32j + 16h of the packed row, scale byte 4j + 2h + s'.
extern "C" __global__ void sm90_permute_decode(const u8* __restrict__ xs, const u8* __restrict__ xss,
                                               const int* __restrict__ slot_to_row, int top_k, int hidden,
                                               u16* __restrict__ xp) {
  const int r = slot_to_row[blockIdx.x];
  if (r < 0) return;
  const i64 t = blockIdx.x / top_k;
  const u8* codes = xs + t * (hidden / 2);
  const u8* scales = xss + t * (hidden / 16);
  u16* dst = xp + static_cast<i64>(r) * hidden;
  for (int c = threadIdx.x; c < hidden / 8; c += blockDim.x) {
    const int j = c >> 3;
    const int q = (c >> 1) & 3;
    const int h = c & 1;
    const uint4 packed = *reinterpret_cast<const uint4*>(codes + 32 * j + 16 * h);
    const float s0 = e4m3_to_float(scales[4 * j + 2 * h]);
    const float s1 = e4m3_to_float(scales[4 * j + 2 * h + 1]);
    const u32 words[4] = {packed.x, packed.y, packed.z, packed.w};
    u32 out[4];
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const u32 byte = (words[w] >> (8 * q)) & 0xFFu;
      const float s = w < 2 ? s0 : s1;
      // Each product is exact in FP32 and in BF16, so the rounding below changes nothing.
      const float lo = e2m1_to_float(static_cast<u8>(byte & 0xFu)) * s;
      const float hi = e2m1_to_float(static_cast<u8>(byte >> 4)) * s;
      out[w] = static_cast<u32>(float_to_bf16(lo)) | (static_cast<u32>(float_to_bf16(hi)) << 16);
    }
    uint4 v;
    v.x = out[0];
    v.y = out[1];
    v.z = out[2];
    v.w = out[3];
    *reinterpret_cast<uint4*>(dst + 8 * c) = v;
  }
}
