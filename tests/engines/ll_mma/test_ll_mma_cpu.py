"""CPU checks of the ll_mma engine (tensor-core dot products of the low-latency FP8 formats and MX pairs):

- the fragments of kernels_cuda/low_latency/mma.cuh, built for the host, fed into an emulation of
  mma.sync.m16n8k16's fragment layout (PTX ISA: which lane and register holds which A, B, C element) compute
  sum_k w[row][k] x[token][k] for every row and token of a k64 step, for each operand kind (BF16, FP16 and E4M3
  tokens): the K permutation the lanes load in is the same for A and B;
- the MX pairs (MXFP4 / MXFP8 weights, MXFP8 tokens): a whole tile pair's dot products over 1-3 units as
  mma_pair_dot_mx runs them, emulated on the host with the kernel's own helpers (the warp's copies to the
  mx_chunk_at positions, the lanes' reads at mx_word, mx_a_fragment / mx_b_fragment, the mma per the PTX layout,
  each 32-K block's partial times its weight x token E8M0 scales) equal the float64 sum over blocks of the block's
  exact dot product times its two scales, for random codes and per-block scales; the ring positions are a
  bijection with conflict-free shared-memory reads; the E2M1 -> FP16 decode gives every code exactly;
- the E4M3 -> BF16 decode (bit placement + one bf16x2 FMA by 2^120, emulated on the host) and the host stand-in
  of the E4M3 -> FP16 conversion give every one of the 256 codes (NaN codes aside) bit for bit as torch does;
- the tensor-core modules (-DLL_MMA=1) compile for sm_90a, sm_100a, sm_103a and sm_120a without spills, and the
  sm_90a main loops hold HMMA and cp.async (LDGSTS) and touch no local memory;
- what the engine declares (formats, architectures, K), the registry's choices, the launch geometry and the
  launch arguments against the kernels' C signatures (launches recorded, nothing run).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from cudnn_moe.activations import SwiGLU
from cudnn_moe.arch import SM80, SM90, SM100, SM103, SM107, SM120
from cudnn_moe.engines.base import OP_LOW_LATENCY, GemmShape, LowLatencyCall, Request, WeightFormat
from cudnn_moe.engines.cuda_cores import engine as cc_engine
from cudnn_moe.engines.cuda_cores import kernels as cc
from cudnn_moe.engines.ll_mma import kernels as mk
from cudnn_moe.engines.ll_mma.engine import LlMmaEngine
from cudnn_moe.engines.registry import choose, engine_names
from cudnn_moe.kernels import cuda_defines, kernels_dir
from cudnn_moe.kernels.codes import LL_THREADS, LowLatencyInputCode, LowLatencyWeightCode
from cudnn_moe.low_latency import LowLatencyMoeConfig
from cudnn_moe.routing import Routing
from tests.support import REPO
from tests.support.kernel_sources import (
    ARG_TYPES, HOST_PRELUDE, NVCC, NVRTC, host_program, kernel_signatures, nvrtc_build, submit,
)

sys.path.insert(0, str(REPO / "scripts"))
import sass_budget  # noqa: E402

CUOBJDUMP = sass_budget.find_tool("cuobjdump")
SOURCE = kernels_dir() / cc.SOURCE
FP8_FORMATS = (WeightFormat.FP8_WEIGHT_ONLY, WeightFormat.FP8_PER_TENSOR, WeightFormat.DEEPSEEK_FP8)
MX_FORMATS = (WeightFormat.MXFP4_W_MXFP8_A, WeightFormat.MXFP8_W_MXFP8_A)
MMA_FORMATS = FP8_FORMATS + MX_FORMATS
# Every tensor-core module a call can build: FP8 weight-only with BF16 / FP16 tokens, per-tensor FP8, DeepSeek FP8,
# the two MX pairs.
MMA_VARIANTS = (
    (LowLatencyWeightCode.FP8, LowLatencyInputCode.BF16),
    (LowLatencyWeightCode.FP8, LowLatencyInputCode.FP16),
    (LowLatencyWeightCode.FP8, LowLatencyInputCode.FP8),
    (LowLatencyWeightCode.FP8_BLOCK, LowLatencyInputCode.FP8_BLOCK),
    (LowLatencyWeightCode.MXFP4, LowLatencyInputCode.MXFP8),
    (LowLatencyWeightCode.MXFP8, LowLatencyInputCode.MXFP8),
)
ARCHS = ("90a", "100a", "103a", "120a")


def _variant_id(variant) -> str:
    return f"{variant[0].name.lower()}-{variant[1].name.lower()}"


def _nvcc_command(arch: str, variant) -> list[str]:
    return [NVCC, "-std=c++17", f"-gencode=arch=compute_{arch},code=sm_{arch}", "-cubin", "-I", str(kernels_dir()),
            *cuda_defines(), *cc.module_options(*variant), mk.OPTION, "-Xptxas", "-v", str(SOURCE)]


def nvcc_jobs(item: pytest.Item) -> list[tuple[list[str], str]]:
    """The nvcc builds ``item`` needs, started ahead by the session (kernel_sources.prefetch)."""
    if item.originalname == "test_mma_modules_compile_without_spills":
        return [(_nvcc_command(item.callspec.params["arch"], v), ".cubin") for v in MMA_VARIANTS]
    if item.originalname == "test_sm90a_main_loops_run_on_tensor_cores":
        return [(_nvcc_command("90a", v), ".cubin") for v in MMA_VARIANTS]
    return []


# ----------------------------------------------------------------------------- fragments on the host
_FRAGMENT_DRIVER = HOST_PRELUDE + r"""
#include <cstdint>
#include "low_latency/mma.cuh"
using namespace ll;

static double half_value(unsigned h) {  // FP16 bits -> value (normals, subnormals, zeros)
  const int e = (h >> 10) & 31, m = h & 1023;
  const double v = e == 0 ? std::ldexp(m, -24) : std::ldexp(1024 + m, e - 25);
  return (h & 0x8000u) ? -v : v;
}
static double bf16_value(unsigned b) { return __uint_as_float(b << 16); }
static double half_of(u32 reg, int half, bool bf16) {
  const unsigned bits = (reg >> (16 * half)) & 0xFFFFu;
  return bf16 ? bf16_value(bits) : half_value(bits);
}
static uint4 chunk(const unsigned char* p) { uint4 v; std::memcpy(&v, p, 16); return v; }

// One k64 step of one m16 tile: mode 0 BF16 tokens, 1 FP16 tokens, 2 E4M3 tokens. W: 16 rows x 64 E4M3 bytes;
// X: 8 tokens x 64 values (16-bit bits, or E4M3 bytes in the low byte). Every lane builds its fragments as the
// kernel does (lane 4g + t: 16 bytes of rows g and g + 8 at K offset 16t, token g's 16 values at 16t); then the
// 4 mma are evaluated from the fragments per the PTX layout, in double, into the accumulator fragments, and
// C[row][token] is read from those through c_slot.
template <int XK>
static void step(const unsigned char* W, const unsigned short* X, double C[16][8]) {
  constexpr bool BF = XK == LL_INPUT_BF16;
  u32 A[32][4][4], B[32][4][2];
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane / 4, t = lane % 4;
    const uint4 lo = chunk(W + g * 64 + 16 * t), hi = chunk(W + (g + 8) * 64 + 16 * t);
    unsigned char xb[32];
    for (int i = 0; i < 16; ++i) {
      const unsigned short v = X[g * 64 + 16 * t + i];
      if (XK == LL_INPUT_FP8) xb[i] = static_cast<unsigned char>(v);
      else std::memcpy(xb + 2 * i, &v, 2);
    }
    const uint4 q0 = chunk(xb), q1 = chunk(xb + 16);
    for (int j = 0; j < 4; ++j) {
      a_fragment<BF>(lo, hi, j, A[lane][j]);
      b_fragment<XK>(q0, q1, j, B[lane][j]);
    }
  }
  double frag[32][4];  // the accumulator fragments: lane 4g + t, register c holds (row g + 8 (c / 2), col 2t + c % 2)
  for (int lane = 0; lane < 32; ++lane)
    for (int c = 0; c < 4; ++c) {
      const int r = lane / 4 + 8 * (c / 2), n = 2 * (lane % 4) + c % 2;
      double sum = 0.0;
      for (int j = 0; j < 4; ++j)
        for (int kk = 0; kk < 16; ++kk) {
          const int a_lane = (r % 8) * 4 + (kk % 8) / 2, a_reg = (r >= 8 ? 1 : 0) + (kk >= 8 ? 2 : 0);
          const int b_lane = n * 4 + (kk % 8) / 2, b_reg = kk >= 8 ? 1 : 0;
          sum += half_of(A[a_lane][j][a_reg], kk % 2, BF) * half_of(B[b_lane][j][b_reg], kk % 2, BF);
        }
      frag[lane][c] = sum;
    }
  for (int r = 0; r < 16; ++r)  // read back as the kernels' reduction does (c_slot)
    for (int n = 0; n < 8; ++n) {
      int lane, c;
      c_slot(r, n, lane, c);
      C[r][n] = frag[lane][c];
    }
}

// argv[1]: cases (int32 mode, 16 x 64 uint8 W, 8 x 64 uint16 X); argv[2]: per case C 16 x 8 float64, then for
// every E4M3 word 0x03020100 + 0x04040404 i (i < 64: each code once) its 4 BF16 and 4 FP16 decodes (uint16).
int main(int, char** argv) {
  FILE* in = std::fopen(argv[1], "rb");
  FILE* out = std::fopen(argv[2], "wb");
  int mode;
  unsigned char W[16 * 64];
  unsigned short X[8 * 64];
  while (std::fread(&mode, 4, 1, in) == 1 && std::fread(W, 1, sizeof W, in) == sizeof W &&
         std::fread(X, 2, 8 * 64, in) == 8 * 64) {
    double C[16][8];
    if (mode == 0) step<LL_INPUT_BF16>(W, X, C);
    else if (mode == 1) step<LL_INPUT_FP16>(W, X, C);
    else step<LL_INPUT_FP8>(W, X, C);
    std::fwrite(C, 8, 16 * 8, out);
  }
  for (u32 i = 0; i < 64; ++i) {
    const u32 w = 0x03020100u + 0x04040404u * i, even = e4m3_bf16x2_even_pair(w), odd = e4m3_bf16x2_odd_pair(w);
    const u32 f01 = e4m3x2_to_f16x2(w), f23 = e4m3x2_to_f16x2(w >> 16);
    const unsigned short v[8] = {
        static_cast<unsigned short>(even), static_cast<unsigned short>(odd), static_cast<unsigned short>(even >> 16),
        static_cast<unsigned short>(odd >> 16), static_cast<unsigned short>(f01), static_cast<unsigned short>(f01 >> 16),
        static_cast<unsigned short>(f23), static_cast<unsigned short>(f23 >> 16)};
    std::fwrite(v, 2, 8, out);
  }
  return std::fclose(out) != 0 || std::fclose(in) != 0;
}
"""


def _e4m3_bytes(gen: torch.Generator, n: int) -> torch.Tensor:
    codes = torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8)
    return torch.where((codes & 0x7F) == 0x7F, codes - 1, codes)  # no NaN codes


@pytest.fixture(scope="module")
def fragment_program(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return host_program(tmp_path_factory.mktemp("mma"), "mma", _FRAGMENT_DRIVER)


def _run_cases(program: Path, folder: Path, cases: list[tuple[int, torch.Tensor, torch.Tensor]]):
    """-> (C float64 [cases, 16, 8], decodes uint16 [64, 8])."""
    with open(folder / "in.bin", "wb") as f:
        for mode, w, x in cases:
            f.write(np.int32(mode).tobytes() + w.numpy().astype(np.uint8).tobytes() + x.numpy().astype(np.uint16).tobytes())
    subprocess.run([str(program), str(folder / "in.bin"), str(folder / "out.bin")], check=True)
    raw = (folder / "out.bin").read_bytes()
    c_bytes = len(cases) * 16 * 8 * 8
    c = torch.from_numpy(np.frombuffer(raw[:c_bytes], dtype=np.float64).reshape(len(cases), 16, 8).copy())
    decodes = torch.from_numpy(np.frombuffer(raw[c_bytes:], dtype=np.uint16).reshape(64, 8).astype(np.int32))
    return c, decodes


def _token_values(mode: int, x: torch.Tensor) -> torch.Tensor:
    """x [8, 64] (uint16 bits / E4M3 bytes, as int32) -> float64 values."""
    if mode == 2:
        return x.to(torch.uint8).view(torch.float8_e4m3fn).double()
    bits = x.to(torch.int32).to(torch.int16)  # wrap to the signed 16-bit view
    return bits.view(torch.bfloat16 if mode == 0 else torch.float16).double()


@pytest.mark.parametrize("mode", [0, 1, 2], ids=["bf16-tokens", "fp16-tokens", "e4m3-tokens"])
def test_fragments_compute_the_dot_products(fragment_program: Path, tmp_path: Path, mode: int) -> None:
    """Random E4M3 weights (one case holding all 254 finite codes) and tokens; the emulated mma of the lanes'
    fragments equals sum_k w[row][k] x[token][k] for all 16 rows x 8 tokens of the step (float64, up to its
    rounding: every product is exact), read back through c_slot (the kernels' reduction). A wrong lane, register,
    half or K permutation on either side breaks it."""
    gen = torch.Generator().manual_seed(mode)
    cases = []
    for index in range(6):
        w = _e4m3_bytes(gen, 16 * 64)
        if index == 0:  # every finite code once, the rest random
            codes = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
            w[: codes.numel()] = codes[torch.randperm(codes.numel(), generator=gen)]
        if mode == 2:
            x = _e4m3_bytes(gen, 8 * 64).to(torch.int32)
        else:
            dtype = torch.bfloat16 if mode == 0 else torch.float16
            x = (torch.randn(8 * 64, generator=gen) * 3).to(dtype).view(torch.int16).to(torch.int32) & 0xFFFF
        cases.append((mode, w.reshape(16, 64), x.reshape(8, 64)))
    got, _ = _run_cases(fragment_program, tmp_path, cases)
    for index, (_, w, x) in enumerate(cases):
        wv = w.contiguous().view(torch.float8_e4m3fn).double()
        xv = _token_values(mode, x)
        want = wv @ xv.T
        scale = wv.abs() @ xv.abs().T
        err = (got[index] - want).abs()
        assert bool((err <= 1e-12 * scale + 1e-300).all()), (
            f"case {index}: max error {float(err.max()):.3g} at {divmod(int(err.argmax()), 8)}")


def test_e4m3_decodes_every_code_exactly(fragment_program: Path, tmp_path: Path) -> None:
    """The BF16 pairs (bytes 0 and 2, then 1 and 3 of a word: bit placement, x 2^120 in one emulated bf16x2 FMA)
    and the FP16 pairs (bytes 0 and 1, 2 and 3: the host stand-in of cvt.rn.f16x2.e4m3x2) of every E4M3 code are
    torch's BF16 / FP16 of the code's value, bit for bit (signed zeros, subnormals and +-448 included)."""
    _, decodes = _run_cases(fragment_program, tmp_path, [])
    codes = torch.arange(256, dtype=torch.uint8)
    value = codes.view(torch.float8_e4m3fn).float()
    finite = value.isfinite()
    bf16 = value.bfloat16().view(torch.int16).to(torch.int32) & 0xFFFF
    fp16 = value.half().view(torch.int16).to(torch.int32) & 0xFFFF
    got_bf16 = decodes[:, :4].reshape(256)  # bytes 0, 1, 2, 3 of word i are codes 4i .. 4i + 3
    got_fp16 = decodes[:, 4:].reshape(256)
    assert torch.equal(got_bf16[finite], bf16[finite]), "E4M3 -> BF16 decode differs"
    assert torch.equal(got_fp16[finite], fp16[finite]), "E4M3 -> FP16 (host stand-in) differs"
    assert int((~finite).sum()) == 2


_MX_DRIVER = HOST_PRELUDE + r"""
#include <cstdint>
#include <vector>
static inline uint2 make_uint2(unsigned int x, unsigned int y) { return {x, y}; }
#include "low_latency/mma.cuh"
using namespace ll;

// One tile pair (32 weight rows: tile q / 2, row g + 8 (q % 2) is row 16 (q / 2) + g + 8 (q % 2)) x 8 tokens over
// K = 128 * units, as mma_pair_dot_mx runs it (one warp, kpart 0, ksplit 1): every k64 step the 32 lanes' copies
// land at the ring positions mx_chunk_at gives (weight chunks, token chunks, with a unit's first step the E8M0
// words), every lane reads its values back at mx_word, builds its fragments (mx_a_fragment / mx_b_fragment), the
// two mma of each block are evaluated from the fragments per the PTX layout in double into zeroed partials, and
// acc += partial * (weight scale * token scale) per C element; C[row][token] is read back through c_slot.
// W: 32 rows of K E4M3 bytes (e2m1: K / 2 bytes of codes, element 2i the low nibble), WS: 32 x K / 32 E8M0 bytes,
// X: 8 x K E4M3 bytes, XS: 8 x K / 32.
static double f16v(u32 reg, int half) { return f16_bits_value((reg >> (16 * half)) & 0xFFFFu); }
template <bool E2M1>
static void pair(int units, const unsigned char* W, const unsigned char* WS, const unsigned char* X,
                 const unsigned char* XS, double C[32][8]) {
  const int k = 128 * units, wrow = E2M1 ? k / 2 : k, WI = E2M1 ? 2 : 4, srow = k / 32;
  std::vector<u32> stage(128 * (WI + 2));
  double acc[32][2][4] = {};
  u32 wsw[32][4] = {}, xsw[32][2] = {};
  for (int step = 0; step < 2 * units; ++step) {
    const int u = step / 2, k0 = 64 * step;
    for (int lane = 0; lane < 32; ++lane) {  // the copies
      for (int i = 0; i < WI; ++i) {
        int q, g, c;
        mx_chunk_at(E2M1, 32 * i + lane, q, g, c);
        const int row = 16 * (q >> 1) + g + 8 * (q & 1);
        std::memcpy(&stage[4 * (32 * i + lane)], W + row * wrow + (E2M1 ? k0 / 2 : k0) + 16 * c, 16);
      }
      int q, g, c;
      mx_chunk_at(false, lane, q, g, c);
      std::memcpy(&stage[4 * (32 * WI + lane)], X + g * k + k0 + 16 * c, 16);
      if (step % 2 == 0) {
        const int row = 16 * (lane >> 4) + (lane & 7) + 8 * ((lane >> 3) & 1);
        std::memcpy(&stage[128 * (WI + 1) + lane], WS + row * srow + 4 * u, 4);
        if (lane < 8) std::memcpy(&stage[128 * (WI + 1) + 32 + lane], XS + lane * srow + 4 * u, 4);
      }
    }
    for (int b = 0; b < 2; ++b) {
      u32 A[32][2][2][4], B[32][2][2];  // [lane][m][tile][reg], [lane][m][reg]
      for (int lane = 0; lane < 32; ++lane) {
        const int g = lane / 4, t = lane % 4;
        if (step % 2 == 0) {
          for (int q = 0; q < 4; ++q) wsw[lane][q] = stage[128 * (WI + 1) + 8 * q + g];
          xsw[lane][0] = stage[128 * (WI + 1) + 32 + 2 * t], xsw[lane][1] = stage[128 * (WI + 1) + 32 + 2 * t + 1];
        }
        uint2 wv[4];
        for (int q = 0; q < 4; ++q) {
          const int at = mx_word(E2M1, q, g, t, b);
          wv[q] = make_uint2(stage[at], E2M1 ? 0u : stage[at + 1]);
        }
        const int xat = 128 * WI + mx_word(false, 0, g, t, b);
        const uint2 xv = make_uint2(stage[xat], stage[xat + 1]);
        for (int m = 0; m < 2; ++m) {
          mx_b_fragment<E2M1>(xv, m, B[lane][m]);
          for (int tile = 0; tile < 2; ++tile) mx_a_fragment<E2M1>(wv[2 * tile], wv[2 * tile + 1], m, A[lane][m][tile]);
        }
      }
      const int kb = 2 * (step % 2) + b;
      for (int lane = 0; lane < 32; ++lane)
        for (int tile = 0; tile < 2; ++tile)
          for (int c = 0; c < 4; ++c) {
            const int r = lane / 4 + 8 * (c / 2), n = 2 * (lane % 4) + c % 2;
            double part = 0.0;
            for (int m = 0; m < 2; ++m)
              for (int kk = 0; kk < 16; ++kk) {
                const int a_lane = (r % 8) * 4 + (kk % 8) / 2, a_reg = (r >= 8 ? 1 : 0) + (kk >= 8 ? 2 : 0);
                const int b_lane = n * 4 + (kk % 8) / 2, b_reg = kk >= 8 ? 1 : 0;
                part += f16v(A[a_lane][m][tile][a_reg], kk % 2) * f16v(B[b_lane][m][b_reg], kk % 2);
              }
            const double ws = e8m0_word_byte(wsw[lane][2 * tile + c / 2], kb);
            const double xs = e8m0_word_byte(xsw[lane][c % 2], kb);
            acc[lane][tile][c] += part * (ws * xs);
          }
    }
  }
  for (int tile = 0; tile < 2; ++tile)
    for (int r = 0; r < 16; ++r)
      for (int n = 0; n < 8; ++n) {
        int lane, c;
        c_slot(r, n, lane, c);
        C[16 * tile + r][n] = acc[lane][tile][c];
      }
}

// argv[1]: cases (int32 e2m1, int32 units, W, WS, X, XS as above); argv[2]: per case C 32 x 8 float64, then the
// E2M1 decodes of every word 0x76543210 + 0x88888888 i (i = 0, 1: every code once) as 8 FP16 (pair j: codes j,
// j + 4), then mx_chunk(e2m1, q, g, c) for e2m1 = 0 (q < 4, g < 8, c < 4) and 1 (c < 2), then mx_chunk_at's (q, g, c)
// of every n < 128 (e2m1 0) and < 64 (e2m1 1), then mx_word(e2m1, q, g, t, b) for q < 4, g < 8, t < 4, b < 2 (int32),
// then the FP32 bits of e8m0_word_byte for byte kb < 4, value v < 256, the word's other bytes 0x5A, then 0xA5.
int main(int, char** argv) {
  FILE* in = std::fopen(argv[1], "rb");
  FILE* out = std::fopen(argv[2], "wb");
  int head[2];
  while (std::fread(head, 4, 2, in) == 2) {
    const int e2m1 = head[0], units = head[1], k = 128 * units;
    std::vector<unsigned char> W(32 * (e2m1 ? k / 2 : k)), WS(32 * k / 32), X(8 * k), XS(8 * k / 32);
    if (std::fread(W.data(), 1, W.size(), in) != W.size() || std::fread(WS.data(), 1, WS.size(), in) != WS.size() ||
        std::fread(X.data(), 1, X.size(), in) != X.size() || std::fread(XS.data(), 1, XS.size(), in) != XS.size())
      return 2;
    double C[32][8];
    if (e2m1) pair<true>(units, W.data(), WS.data(), X.data(), XS.data(), C);
    else pair<false>(units, W.data(), WS.data(), X.data(), XS.data(), C);
    std::fwrite(C, 8, 32 * 8, out);
  }
  for (u32 i = 0; i < 2; ++i)
    for (int j = 0; j < 4; ++j) {
      const u32 d = e2m1x2_to_f16x2(0x76543210u + 0x88888888u * i, j);
      const unsigned short v[2] = {static_cast<unsigned short>(d), static_cast<unsigned short>(d >> 16)};
      std::fwrite(v, 2, 2, out);
    }
  std::vector<int> ints;
  for (int e = 0; e < 2; ++e)
    for (int q = 0; q < 4; ++q)
      for (int g = 0; g < 8; ++g)
        for (int c = 0; c < (e ? 2 : 4); ++c) ints.push_back(mx_chunk(e, q, g, c));
  for (int e = 0; e < 2; ++e)
    for (int n = 0; n < (e ? 64 : 128); ++n) {
      int q, g, c;
      mx_chunk_at(e, n, q, g, c);
      ints.insert(ints.end(), {q, g, c});
    }
  for (int e = 0; e < 2; ++e)
    for (int q = 0; q < 4; ++q)
      for (int g = 0; g < 8; ++g)
        for (int t = 0; t < 4; ++t)
          for (int b = 0; b < 2; ++b) ints.push_back(mx_word(e, q, g, t, b));
  for (u32 kb = 0; kb < 4; ++kb)  // e8m0_word_byte of byte v at byte kb of a word whose other bytes are 0x5A / 0xA5
    for (u32 v = 0; v < 256; ++v)
      for (u32 other : {0x5A5A5A5Au, 0xA5A5A5A5u})
        ints.push_back(static_cast<int>(__float_as_uint(e8m0_word_byte((other & ~(0xFFu << (8 * kb))) | (v << (8 * kb)), kb))));
  std::fwrite(ints.data(), 4, ints.size(), out);
  return std::fclose(out) != 0 || std::fclose(in) != 0;
}
"""


@pytest.fixture(scope="module")
def mx_program(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return host_program(tmp_path_factory.mktemp("mma_mx"), "mma_mx", _MX_DRIVER)


E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def _e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """Packed E2M1 bytes [..., K/2] (element 2i the low nibble) -> float64 [..., K]."""
    nibbles = torch.stack((codes & 0xF, codes >> 4), dim=-1).flatten(-2).long()
    return torch.where(nibbles >= 8, -1.0, 1.0).double() * E2M1_VALUES[nibbles & 7]


def _run_mx(program: Path, folder: Path, cases: list) -> tuple[torch.Tensor, bytes]:
    """cases: (e2m1, units, W, WS, X, XS) uint8 tensors -> (C float64 [cases, 32, 8], the trailing tables)."""
    with open(folder / "in.bin", "wb") as f:
        for e2m1, units, *arrays in cases:
            f.write(np.array([e2m1, units], dtype=np.int32).tobytes() + b"".join(a.numpy().tobytes() for a in arrays))
    subprocess.run([str(program), str(folder / "in.bin"), str(folder / "out.bin")], check=True)
    raw = (folder / "out.bin").read_bytes()
    n = len(cases) * 32 * 8 * 8
    return torch.from_numpy(np.frombuffer(raw[:n], dtype=np.float64).reshape(len(cases), 32, 8).copy()), raw[n:]


@pytest.mark.parametrize("e2m1", [True, False], ids=["mxfp4-weights", "mxfp8-weights"])
def test_mx_fragments_compute_the_block_scaled_dot_products(mx_program: Path, tmp_path: Path, e2m1: bool) -> None:
    """Random codes (MXFP4: random bytes; MXFP8 weights and the tokens: every finite E4M3 code) and random E8M0 scales
    per row / token and 32-K block (2^-20 .. 2^20, so a scale applied to the wrong block, row or token shows), over 1,
    2 and 3 units: the emulated tile pair equals sum_b (W_b . X_b) * 2^(s_w - 127) * 2^(s_x - 127) in float64 (every
    product and block sum is exact there; only the float64 sum over blocks rounds)."""
    gen = torch.Generator().manual_seed(7 + e2m1)
    cases = []
    for units in (1, 2, 3):
        k = 128 * units
        w = (torch.randint(0, 256, (32, k // 2), generator=gen, dtype=torch.uint8) if e2m1
             else _e4m3_bytes(gen, 32 * k).reshape(32, k))
        ws = torch.randint(107, 148, (32, k // 32), generator=gen, dtype=torch.uint8)
        x = _e4m3_bytes(gen, 8 * k).reshape(8, k)
        xs = torch.randint(107, 148, (8, k // 32), generator=gen, dtype=torch.uint8)
        cases.append((int(e2m1), units, w, ws, x, xs))
    got, _ = _run_mx(mx_program, tmp_path, cases)
    for index, (_, units, w, ws, x, xs) in enumerate(cases):
        wv = _e2m1_values(w) if e2m1 else w.view(torch.float8_e4m3fn).double()
        xv = x.view(torch.float8_e4m3fn).double()
        blocks = 4 * units
        wb, xb = wv.reshape(32, blocks, 32), xv.reshape(8, blocks, 32)
        scale = torch.pow(2.0, ws.double()[:, None, :] - 127) * torch.pow(2.0, xs.double()[None, :, :] - 127)
        terms = torch.einsum("rbk,nbk->rnb", wb, xb) * scale
        want = terms.sum(-1)
        bound = 1e-12 * (torch.einsum("rbk,nbk->rnb", wb.abs(), xb.abs()) * scale).sum(-1)
        err = (got[index] - want).abs()
        assert bool((want != 0).any()) and bool((err <= bound).all()), (
            f"{units} units: max error {float(err.max()):.3g} at {divmod(int(err.argmax()), 8)}")


def test_mx_ring_positions_and_e2m1_decode(mx_program: Path, tmp_path: Path) -> None:
    """mx_chunk is a bijection onto the step's ring positions (E4M3 rows: 4 items of 32 chunks, E2M1 rows: 2) and
    mx_chunk_at its inverse; mx_word points into the right chunk; each read instruction (fixed row kind and block)
    of the 32 lanes hits 32 distinct banks (E2M1: 4-byte reads) or, per half-warp, 32 distinct banks (E4M3:
    8-byte reads); the E2M1 -> FP16 pairs (bit placement, x 2^14 in one emulated mul.rn.f16x2) of every code are
    torch's FP16 of the code's value, bit for bit (-0 included)."""
    _, raw = _run_mx(mx_program, tmp_path, [])
    decodes = torch.from_numpy(np.frombuffer(raw[:32], dtype=np.uint16).astype(np.int32)).reshape(2, 4, 2)
    ints = np.frombuffer(raw[32:], dtype=np.int32)
    for i in range(2):  # word 0x76543210 + 0x88888888 i: code j is j + 8 i
        for j in range(4):
            for half, code in enumerate((j + 8 * i, j + 4 + 8 * i)):
                value = float(_e2m1_values(torch.tensor([code], dtype=torch.uint8))[0])
                want = torch.tensor([value]).half().view(torch.int16).to(torch.int32) & 0xFFFF
                assert int(decodes[i, j, half]) == int(want), f"E2M1 code {code:#x}"
    chunks = {False: ints[:128], True: ints[128:192]}
    at = {False: ints[192:576].reshape(128, 3), True: ints[576:768].reshape(64, 3)}
    words = {False: ints[768:1024].reshape(4, 8, 4, 2), True: ints[1024:1280].reshape(4, 8, 4, 2)}
    for e2m1, per_row in ((False, 4), (True, 2)):
        table = chunks[e2m1].reshape(4, 8, per_row)
        assert sorted(table.flatten().tolist()) == list(range(32 * per_row)), e2m1
        for n, (q, g, c) in enumerate(at[e2m1]):
            assert table[q, g, c] == n, (e2m1, n)
        for q in range(4):
            for b in range(2):
                w = words[e2m1][q, :, :, b]  # [g, t]
                for g in range(8):
                    for t in range(4):
                        c = b if e2m1 else 2 * b + t // 2
                        assert w[g, t] // 4 == table[q, g, c], (e2m1, q, g, t, b)
                if e2m1:
                    assert len({int(v) % 32 for v in w.flatten()}) == 32, (q, b)
                else:
                    for half in (w[:4], w[4:]):
                        banks = {int(v + d) % 32 for v in half.flatten() for d in (0, 1)}
                        assert len(banks) == 32, (q, b)


def test_e8m0_word_byte_is_the_scale_of_every_byte(mx_program: Path, tmp_path: Path) -> None:
    """e8m0_word_byte (the MX loops' scale conversion, selects instead of branches) of byte v at each of a word's four
    byte positions, whatever the other bytes, is the FP32 value of the E8M0 scale 2^(v - 127), bit for bit: 2^-127 (an
    FP32 subnormal) for v = 0, NaN for v = 255."""
    _, raw = _run_mx(mx_program, tmp_path, [])
    got = torch.from_numpy(np.frombuffer(raw[32 + 1280 * 4:], dtype=np.int32).copy()).reshape(4, 256, 2)
    want = torch.arange(256, dtype=torch.uint8).view(torch.float8_e8m0fnu).float().view(torch.int32)
    for kb in range(4):
        for other in range(2):
            bits = got[kb, :, other]
            assert torch.equal(bits[:255], want[:255]), (kb, other)
            assert bool(torch.isnan(bits[255:].view(torch.float32)).all()), (kb, other)


# ----------------------------------------------------------------------------- builds and SASS
@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("arch", ARCHS)
def test_mma_modules_compile_without_spills(arch: str) -> None:
    for variant in MMA_VARIANTS:
        result, _ = submit(_nvcc_command(arch, variant), ".cubin").result()
        assert result.returncode == 0, f"sm_{arch} {_variant_id(variant)}:\n{result.stderr}"
        spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", result.stderr)
        assert spills and all(s == ("0", "0") for s in spills), f"sm_{arch} {_variant_id(variant)} spills:\n{result.stderr}"
        registers = [int(r) for r in re.findall(r"Used (\d+) registers", result.stderr)]
        assert registers and max(registers) <= 65536 // (2 * LL_THREADS), f"two CTAs per SM need <= 128 registers: {registers}"


@pytest.mark.skipif(NVRTC is None, reason="libnvrtc not found (set LL_NVRTC_LIBRARY to run this)")
@pytest.mark.parametrize("variant", MMA_VARIANTS, ids=_variant_id)
def test_nvrtc_builds_the_mma_modules(variant) -> None:
    """The GPU builds these modules with NVRTC (no host headers, the loader's options, the tactic's -D option) for
    the device's generic target (sm_90, as CuPy asks): the same source text and options compile here."""
    status, log = nvrtc_build(cc.SOURCE, mk.MMA.module_options(*_formats_of(variant)), "sm_90")
    assert status == 0, log


def _formats_of(variant) -> tuple[WeightFormat, torch.dtype | None]:
    """A (weight format, token dtype) whose module is ``variant``."""
    weights, tokens = variant
    if tokens is LowLatencyInputCode.MXFP8:
        return (WeightFormat.MXFP4_W_MXFP8_A if weights is LowLatencyWeightCode.MXFP4 else WeightFormat.MXFP8_W_MXFP8_A), None
    if weights is LowLatencyWeightCode.FP8_BLOCK:
        return WeightFormat.DEEPSEEK_FP8, None
    if tokens is LowLatencyInputCode.FP8:
        return WeightFormat.FP8_PER_TENSOR, torch.float8_e4m3fn
    return WeightFormat.FP8_WEIGHT_ONLY, torch.bfloat16 if tokens is LowLatencyInputCode.BF16 else torch.float16


def test_mma_variants_cover_every_call() -> None:
    """The modules an ll_mma call can ask for are the ones built here."""
    asked = {(cc.weight_code(f), cc.input_code(f, d)) for f in MMA_FORMATS
             for d in ((torch.bfloat16, torch.float16) if f is WeightFormat.FP8_WEIGHT_ONLY else (None,))}
    assert asked == set(MMA_VARIANTS) and {_formats_of(v)[0] for v in MMA_VARIANTS} == set(MMA_FORMATS)


def _innermost_hmma_loop(code: list[tuple[int, str]]) -> list[str]:
    """The smallest loop (a backward branch) of a kernel that holds an HMMA."""
    best: list[str] | None = None
    for index, (address, instruction) in enumerate(code):
        match = sass_budget._BRANCH.search(instruction)
        if not match or int(match.group(1), 16) >= address:
            continue
        body = [ins for addr, ins in code[: index + 1] if addr >= int(match.group(1), 16)]
        if any("HMMA" in ins for ins in body) and (best is None or len(body) < len(best)):
            best = body
    return best or []


@pytest.mark.skipif(NVCC is None or CUOBJDUMP is None, reason="nvcc or cuobjdump not found")
@pytest.mark.parametrize("variant", MMA_VARIANTS, ids=_variant_id)
def test_sm90a_main_loops_run_on_tensor_cores(variant) -> None:
    """Both GEMMs' main loop: 8 HMMA (4 k16 steps x 2 tiles) a k64 step of the operand kind the tokens ask for (the
    MX pairs' loop runs a unit, two k64 steps, per iteration), each step's cp.async copies (4 weight chunks, 2 of E2M1
    rows, L1-bypassing: LDGSTS.E.BYPASS.128), no local memory anywhere, and an issue budget per k64 step
    (hopper-kernels.md: the E4M3 weights of a step, 2 KB a warp, arrive at 4.3 TB/s in about 110 cycles of an SM, 440
    warp-instruction slots of its four schedulers: those loops stay within 300). E2M1 weights bring half the bytes (about
    264 slots a step) but cost 5 instructions an A register to decode (160 a step), so the MXFP4 pair's loop, at 330-348
    a step on nvcc 13.0, stays issue-bound at about 0.8x its byte rate: held within 360 so that it does not grow."""
    result, cubin = submit(_nvcc_command("90a", variant), ".cubin").result()
    assert result.returncode == 0, result.stderr
    functions = sass_budget.disassemble(cubin)
    mx = variant[1] is LowLatencyInputCode.MXFP8
    steps = 2 if mx else 1  # k64 steps per iteration of the loop
    for kernel in ("ll_gemm1", "ll_gemm2"):
        name = f"{_variant_id(variant)} {kernel}"
        assert not [t for _, t in functions[kernel] if re.search(r"\b(LDL|STL)\b", t)], f"{name}: local memory"
        loop = _innermost_hmma_loop(functions[kernel])
        hmma = [t for t in loop if "HMMA" in t]
        assert len(hmma) == 8 * steps, f"{name}: {len(hmma)} HMMA in the loop"
        bf16 = variant[1] is LowLatencyInputCode.BF16 or (kernel == "ll_gemm2" and variant[1] is LowLatencyInputCode.FP8)
        assert all((".BF16" in t) == bf16 for t in hmma), f"{name}: {hmma[0]}"
        e2m1 = variant[0] is LowLatencyWeightCode.MXFP4
        copies = sum(bool(re.search(r"\bLDGSTS\.E\.BYPASS\.128\b", t)) for t in loop)
        assert copies >= (2 if e2m1 else 4) * steps, f"{name}: {copies} weight copies"
        per_step = len(loop) / steps
        assert per_step <= (360 if e2m1 else 300), f"{name}: {per_step} instructions per k64 step"


# ----------------------------------------------------------------------------- what the engine declares
def _request(fmt: WeightFormat, arch=SM90, k1: int = 7168, k2: int = 2048) -> Request:
    return Request(OP_LOW_LATENCY, arch, fmt.value, (GemmShape(k1, 2 * k2, 256), GemmShape(k2, k1, 256)), 256,
                   torch.bfloat16, torch.bfloat16, True, 8)


def test_engine_serves_the_fp8_formats_and_mx_pairs_where_the_ptx_is_valid() -> None:
    for fmt in MMA_FORMATS:
        for arch in (SM90, SM100, SM103, SM107, SM120):
            assert LlMmaEngine.supports(_request(fmt, arch)), (fmt, arch)
        assert not LlMmaEngine.supports(_request(fmt, SM80))
    for fmt in set(WeightFormat) - set(MMA_FORMATS):
        answer = LlMmaEngine.supports(_request(fmt))
        assert not answer and "does not run" in answer.reason, fmt
    nine = Request(OP_LOW_LATENCY, SM90, WeightFormat.FP8_WEIGHT_ONLY.value, tokens=9)
    assert not LlMmaEngine.supports(nine) and "at most 8" in LlMmaEngine.supports(nine).reason
    odd = LlMmaEngine.supports(_request(WeightFormat.DEEPSEEK_FP8, k1=7168 + 64))
    assert not odd and "multiple of 128" in odd.reason and "7232" in odd.reason


def test_registry_keeps_cuda_cores_as_the_default_and_names_ll_mma() -> None:
    """"auto" picks the CUDA cores over ll_mma (the MXFP4 pair on SM90: the SM90 decode chain, first of all)."""
    assert "ll_mma" in engine_names(OP_LOW_LATENCY)
    for fmt in MMA_FORMATS:
        assert choose(_request(fmt)).name == ("sm90" if fmt is WeightFormat.MXFP4_W_MXFP8_A else "cuda_cores")
        assert choose(_request(fmt, SM100)).name == "cuda_cores"
        assert choose(_request(fmt), "ll_mma") is LlMmaEngine
    with pytest.raises(ValueError, match="ll_mma"):
        choose(_request(WeightFormat.BF16), "ll_mma")
    assert LowLatencyMoeConfig(8, arch="sm90", engine="ll_mma").engine == "ll_mma"


def test_choose_split() -> None:
    assert [mk.choose_split(u) for u in (1, 2, 3, 4, 6, 8, 15, 16, 56)] == [1, 1, 1, 2, 2, 4, 4, 8, 8]


def _weights(fmt: WeightFormat, hidden: int, padded: int, gated: bool = True) -> Any:
    return SimpleNamespace(format=fmt, hidden_size=hidden, padded_intermediate=padded, gated=gated)


def test_geometry_at_deepseek_v3_shapes() -> None:
    """H = 7168, I = 2048: GEMM1 8 warps split K (one pair, 16 features, a CTA), 128 columns; GEMM2 likewise, 32 rows
    a CTA, 224 columns; rounds as choose_rounds gives them; shared memory per the token kind."""
    bf16, fp8, block = LowLatencyInputCode.BF16, LowLatencyInputCode.FP8, LowLatencyInputCode.FP8_BLOCK
    w = _weights(WeightFormat.FP8_WEIGHT_ONLY, 7168, 2048)
    one = mk.MMA.gemm1_geometry(w, bf16, 8, 132)
    assert (one.split, one.grid, one.rounds, one.shared_mem) == (8, (128, 8), 1, 8 * 4 * 6 * 512)
    two = mk.MMA.gemm2_geometry(w, bf16, 64, 132)
    assert (two.split, two.grid, two.rounds) == (8, (224, 64), 1)
    assert mk.MMA.gemm1_geometry(w, fp8, 8, 132).shared_mem == 8 * 4 * 5 * 512
    assert mk.MMA.gemm1_geometry(w, block, 8, 132).shared_mem == 8 * 4 * 6 * 512
    assert mk.MMA.max_gemm2_columns(7168) == 224 >= two.grid[0]
    small = mk.MMA.gemm2_geometry(_weights(WeightFormat.FP8_WEIGHT_ONLY, 2048, 768), bf16, 8, 132)
    assert small.split == 2 and small.grid[0] * small.rounds * (8 // 2) * 32 >= 2048
    non_gated = mk.MMA.gemm1_geometry(_weights(WeightFormat.FP8_WEIGHT_ONLY, 256, 128, gated=False), bf16, 4, 132)
    assert (non_gated.split, non_gated.grid) == (1, (1, 4))  # 8 pairs of 32 features cover Ip = 128


def _launches(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Any, int, tuple[Any, ...], int, tuple[str, ...]]]:
    launches: list = []
    monkeypatch.setattr(cc, "ptr", lambda tensor, align=1: np.uint64(0 if tensor is None else id(tensor)))
    monkeypatch.setattr(cc, "launch", lambda file, name, device, grid, block, args, shared_mem=0, extra_options=():
                        launches.append((name, grid, block, args, shared_mem, extra_options)))
    return launches


def _call(weights, x, x_scales, finalize: bool, tokens: int = 5, top_k: int = 4) -> LowLatencyCall:
    h = weights.hidden_size
    out = torch.zeros(tokens, h) if finalize else torch.zeros(tokens, top_k, h)
    return LowLatencyCall(weights, x, x_scales, Routing.packed(torch.zeros(tokens, top_k, dtype=torch.int32)), SwiGLU(),
                          torch.bfloat16, finalize, out, 8, None if finalize else torch.zeros(tokens, top_k))


def _fp8_layers():
    config = LowLatencyMoeConfig(8, arch="sm90")
    e, h, i = 3, 512, 256
    z = lambda *s: torch.zeros(*s, dtype=torch.float8_e4m3fn)  # noqa: E731
    weight_only = config.prepare_fp8_weight_only_weights(z(e, 2 * i, h), torch.ones(e), z(e, h, i), torch.ones(e))
    deepseek = config.prepare_deepseek_fp8_weights(z(e, 2 * i, h), torch.ones(e, 2 * i // 128, h // 128), z(e, h, i),
                                                   torch.ones(e, h // 128, i // 128))
    return weight_only, deepseek


@pytest.mark.parametrize("finalize", [True, False])
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16])
def test_fp8_weight_only_launches(x_dtype: torch.dtype, finalize: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """LlMmaEngine.run: ll_gemm1 then ll_gemm2 of the -DLL_MMA=1 module, the C signatures' argument types, the
    geometry of the tactic (split in the lanes_per_row slot, rounds, grid, dynamic shared memory), the engine's own
    workspaces (counters: one per GEMM2 column of the finest cut)."""
    launches = _launches(monkeypatch)
    ready = []
    monkeypatch.setattr(cc_engine, "_ensure_ready", lambda *args: ready.append(args))
    monkeypatch.setattr(cc_engine, "_sm_count", lambda index: 132)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # CPU tensors stand for device 0's
    weights, _ = _fp8_layers()
    call = _call(weights, torch.zeros(5, weights.hidden_size, dtype=x_dtype), None, finalize)
    key, spec = LlMmaEngine.workspace_spec(call)
    assert spec["counters"] == ((mk.MMA.max_gemm2_columns(weights.hidden_size),), torch.int32)
    workspace = {name: torch.zeros(shape, dtype=dtype) for name, (shape, dtype) in spec.items()}
    LlMmaEngine.run(call, workspace)
    assert ready == [("ll_mma", mk.MMA, weights.format, x_dtype, False, 0)]
    assert [name for name, *_ in launches] == ["ll_gemm1", "ll_gemm2"]
    signatures = kernel_signatures([SOURCE])
    kind = cc.input_code(weights.format, x_dtype)
    options = (*cc.module_options(LowLatencyWeightCode.FP8, kind), mk.OPTION)
    geometries = (mk.MMA.gemm1_geometry(weights, kind, 20, 132),
                  mk.MMA.gemm2_geometry(weights, cc.inter_kind(weights.format, x_dtype), 20, 132))
    for (name, grid, block, args, shared, opts), cut in zip(launches, geometries):
        assert [type(a) for a in args] == [ARG_TYPES[k] for k in signatures[name]], name
        assert block == LL_THREADS and opts == options and grid == cut.grid and shared == cut.shared_mem, name
    assert launches[0][3][15:17] == (np.int32(geometries[0].split), np.int32(geometries[0].rounds))
    assert launches[1][3][13:15] == (np.int32(geometries[1].split), np.int32(geometries[1].rounds))
    assert launches[1][3][16] == int(finalize)


@pytest.mark.parametrize("prequantized", [False, True])
def test_deepseek_fp8_launches(prequantized: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSeek FP8 through the tensor-core module: ll_quant128 (BF16 tokens), ll_gemm1, ll_quant128, ll_gemm2, every
    launch from the -DLL_MMA=1 module, the GEMMs with the rings of E4M3 tokens with scales (6 items a lane)."""
    launches = _launches(monkeypatch)
    _, weights = _fp8_layers()
    h = weights.hidden_size
    x, scales = ((torch.zeros(5, h, dtype=torch.float8_e4m3fn), torch.ones(5, h // 128)) if prequantized
                 else (torch.zeros(5, h, dtype=torch.bfloat16), None))
    call = _call(weights, x, scales, True)
    _, spec = LlMmaEngine.workspace_spec(call)
    workspace = {name: torch.zeros(shape, dtype=dtype) for name, (shape, dtype) in spec.items()}
    ids, route_weights, code = call.routing.kernel_operands()
    cc_engine._run_deepseek_fp8(call, workspace, ids, route_weights, code, 132, mk.MMA)
    names = [name for name, *_ in launches]
    assert names == ([] if prequantized else ["ll_quant128"]) + ["ll_gemm1", "ll_quant128", "ll_gemm2"]
    options = (*cc.module_options(LowLatencyWeightCode.FP8_BLOCK, LowLatencyInputCode.FP8_BLOCK), mk.OPTION)
    assert all(launch[5] == options for launch in launches)
    for launch in launches:
        want = mk.shared_bytes(LowLatencyInputCode.FP8_BLOCK, weights.format) if launch[0] != "ll_quant128" else 0
        assert launch[4] == want, launch[0]


@pytest.mark.parametrize("fmt", MX_FORMATS, ids=lambda f: f.value)
def test_mx_gemm1_cut_covers_one_block_of_32_features(fmt: WeightFormat) -> None:
    """GEMM1 of the MX pairs quantizes its intermediate per CTA, so every cut (gated or not, any H, any slot count)
    gives a CTA exactly 32 features (rounds x pairs x pair features), one feature block per grid column; GEMM2 keeps
    the FP8 formats' cut; the rings: E4M3 weights 4 items + token + scales, E2M1 weights 2 + token + scales."""
    items = 4 if fmt is WeightFormat.MXFP4_W_MXFP8_A else 6
    assert mk.ring_items(LowLatencyInputCode.MXFP8, fmt) == items
    for hidden, padded in ((256, 128), (512, 128), (1024, 256), (2048, 768), (7168, 2048)):
        for gated in (True, False):
            w = _weights(fmt, hidden, padded, gated)
            for slots in (1, 64):
                cut = mk.MMA.gemm1_geometry(w, LowLatencyInputCode.MXFP8, slots, 132)
                features = cut.rounds * (mk.WARPS // cut.split) * mk.gemm1_features(gated)
                assert features == 32 and cut.grid == (padded // 32, slots), (hidden, padded, gated, cut)
                assert cut.shared_mem == mk.WARPS * 4 * items * 512
    deepseek = mk.MMA.gemm1_geometry(_weights(fmt, 7168, 2048), LowLatencyInputCode.MXFP8, 64, 132)
    assert (deepseek.split, deepseek.rounds) == (8, 2)
    assert (mk.mx_gemm1_cut(1, 16), mk.mx_gemm1_cut(2, 32)) == ((4, 1), (8, 1))
    two = mk.MMA.gemm2_geometry(_weights(fmt, 7168, 2048), LowLatencyInputCode.MXFP8, 64, 132)
    assert (two.split, two.grid, two.rounds) == (8, (224, 64), 1)


def _mx_layer(fmt: WeightFormat):
    """A small MX layer kept row-major (prepared for SM100: an MXFP4 pair prepared for SM90 is stored as tiles, which
    ll_mma does not read)."""
    config = LowLatencyMoeConfig(8, arch="sm100")
    e, h, i = 3, 256, 128
    gen = torch.Generator().manual_seed(3)
    if fmt is WeightFormat.MXFP4_W_MXFP8_A:
        w1 = torch.randint(0, 256, (e, 2 * i, h // 2), generator=gen, dtype=torch.uint8)
        w2 = torch.randint(0, 256, (e, h, i // 2), generator=gen, dtype=torch.uint8)
    else:
        w1 = _e4m3_bytes(gen, e * 2 * i * h).reshape(e, 2 * i, h).view(torch.float8_e4m3fn)
        w2 = _e4m3_bytes(gen, e * h * i).reshape(e, h, i).view(torch.float8_e4m3fn)
    s1 = torch.full((e, 2 * i, h // 32), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    s2 = torch.full((e, h, i // 32), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    return config, config.prepare_weights(w1, s1, w2, s2)


@pytest.mark.parametrize("finalize", [True, False])
@pytest.mark.parametrize("fmt", MX_FORMATS, ids=lambda f: f.value)
def test_mx_launches(fmt: WeightFormat, finalize: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """LlMmaEngine.run on MX weights: ll_gemm1 then ll_gemm2 of the -DLL_MMA=1 MX module with the C signatures'
    argument types, the tactic's cuts (GEMM1 a 32-feature block per CTA), the MXFP8 intermediate's codes and scales
    (the engine's own workspace) passed to both launches."""
    launches = _launches(monkeypatch)
    monkeypatch.setattr(cc_engine, "_ensure_ready", lambda *args: None)
    monkeypatch.setattr(cc_engine, "_sm_count", lambda index: 132)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    config, weights = _mx_layer(fmt)
    acts = config.prepare_mxfp8_activations(torch.randn(5, weights.hidden_size, generator=torch.Generator().manual_seed(1)))
    call = _call(weights, acts.codes, acts.scales, finalize)
    _, spec = LlMmaEngine.workspace_spec(call)
    workspace = {name: torch.zeros(shape, dtype=dtype) for name, (shape, dtype) in spec.items()}
    LlMmaEngine.run(call, workspace)
    assert [name for name, *_ in launches] == ["ll_gemm1", "ll_gemm2"]
    signatures = kernel_signatures([SOURCE])
    options = (*cc.module_options(cc.weight_code(fmt), LowLatencyInputCode.MXFP8), mk.OPTION)
    cuts = (mk.MMA.gemm1_geometry(weights, LowLatencyInputCode.MXFP8, 20, 132),
            mk.MMA.gemm2_geometry(weights, LowLatencyInputCode.MXFP8, 20, 132))
    for (name, grid, block, args, shared, opts), cut in zip(launches, cuts):
        assert [type(a) for a in args] == [ARG_TYPES[k] for k in signatures[name]], name
        assert block == LL_THREADS and opts == options and grid == cut.grid and shared == cut.shared_mem, name
    scales_ptr = np.uint64(id(workspace["inter_scales"]))
    assert launches[0][3][-1] == scales_ptr and launches[1][3][-1] == scales_ptr
    assert launches[0][3][-3] == launches[1][3][0] == np.uint64(id(workspace["inter_codes"]))
