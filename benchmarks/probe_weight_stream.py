"""Weight-stream probe: how fast do the decode GEMM's CTAs stream row-major NVFP4 codes, against the tile layout?

The decode kernel's row-major form (the aligned op's weights read in place) is slower than its tile form. This probe
times the weight loads alone (no math, no tokens, no scales; every loaded word XORed into a sink) in the decode
kernel's grid, (N / (16 MT WM), E) CTAs of WM x WK warps, each warp streaming MT m16 row blocks over its share of K,
random bytes, one launch after a 256 MiB L2 flush, median. Forms (columns):

- ``tiles:S``: the tile layout, each m16 row block's bytes contiguous; a warp reads 512 contiguous bytes a step, S
  steps in flight (the tile form's register ring);
- ``rows:V:S`` (``rowsh``: with the L2::256B prefetch hint): row-major; lane (g, q) reads V x 16 bytes of rows g and
  g + 8 a step, so a warp reads 64 V contiguous bytes of each of its 16 MT rows; S steps in flight (rows:1:2 is the
  register row-major form's pattern);
- ``bulk:C:S``: row-major; each warp owns S shared-memory stages of [16 MT rows x C bytes], lane r copying row r's C
  bytes with one cp.async.bulk completing on the stage's mbarrier; the lanes read their fragments back (LDS.128);
- ``slab:N``: the tile layout, each CTA's whole share of the weights (16 WM MT rows) copied into shared memory at its
  start by thread 0, in N chunks along K (one cp.async.bulk per row block and chunk, an mbarrier per chunk); the
  warps read their tiles back chunk by chunk (LDS.128);
- ``persist:S`` / ``persistc:S``: the tile layout on a persistent grid of four CTAs an SM. CTA c takes the decode
  grid's CTAs c, c + G, ... (``persist``, G the grid) or a contiguous run of them (``persistc``), and each warp streams
  its places in all of them through one ring of S steps, so the next one's first loads are in flight while this one's
  last are consumed: what fewer, longer CTAs would save over the decode grid's CTA starts and ring drains;
- ``tsc:G:SC:S``: the tile layout with its scale tiles read as the decode kernel reads them (SC 1: 64 scale bytes a
  tile in an array of their own, 8 bytes a lane; SC 2: each tile's scales right after its codes; SC 0: none), with
  the tiles of G consecutive row blocks interleaved step by step (G = 1: the engine's layout): what a layout whose
  CTA steps are longer contiguous runs would gain.

With ``--pairs``, a second table times a layer's two GEMMs (tile form): each alone, as two launches in one CUDA graph
(the second a programmatic dependent, as in the decode chain), and as one launch whose first CTAs stream GEMM1's
weights and the rest GEMM2's: what a chain loses to the second launch's start and the first one's tail; and as one
persistent launch (both forms above, GEMM1's units first).

Every form is held to at most four CTAs an SM (the engine's 128-register kernels; dummy shared memory), fewer where
its stages need more (the cell says so). Cells: us [TB/s]. Usage: python benchmarks/probe_weight_stream.py --help
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Timer, capture, gpu_missing, md_row, nvrtc_module, positive_int  # noqa: E402

from cudnn_moe.kernels import driver  # noqa: E402
from cudnn_moe.kernels.loader import packed_args  # noqa: E402

SOURCE = r"""
typedef unsigned int u32; typedef unsigned char u8; typedef long long i64; typedef unsigned long long u64;
__device__ __forceinline__ uint4 ldg(const void* p) {
  uint4 v; asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x),"=r"(v.y),"=r"(v.z),"=r"(v.w) : "l"(p));
  return v;
}
__device__ __forceinline__ uint4 ldgh(const void* p) {
  uint4 v; asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x),"=r"(v.y),"=r"(v.z),"=r"(v.w) : "l"(p));
  return v;
}
__device__ __forceinline__ uint2 ldg2(const void* p) {
  uint2 v; asm("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];" : "=r"(v.x),"=r"(v.y) : "l"(p));
  return v;
}
#ifndef H
#define H 0
#endif
__device__ __forceinline__ u32 mix(uint4 v) { return v.x ^ v.y ^ v.z ^ v.w; }
#define WARPS (WM * WK)
// A linear grid: CTA c < first2 streams the first weight set w [experts, n, rb] as CTA (c % (n / 16 WM MT),
// c / that) of the decode grid; the CTAs from first2 on stream the second set w2 [., n2, rb2] (two GEMMs in one
// launch). `units`: the decode grid's CTAs in all (the persistent form's work; the others launch that many).
// griddepcontrol.wait first: a no-op unless launched as a programmatic dependent.
extern "C" __global__ void __launch_bounds__(WARPS * 32) probe(const u8* __restrict__ w, int n, int rb,
                                                              const u8* __restrict__ w2, int n2, int rb2, int first2,
                                                              int units, u32* out) {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, wm = warp % WM, wk = warp / WM;
  int cta = blockIdx.x;
  if (P != 4 && cta >= first2) {
    cta -= first2;
    w = w2;
    n = n2;
    rb = rb2;
  }
  const int bx = cta % (n / (16 * WM * MT)), by = cta / (n / (16 * WM * MT));
  const i64 block0 = (static_cast<i64>(bx) * WM + wm) * MT;  // first m16 block of the warp
  const u8* base = w + (static_cast<i64>(by) * n + 16 * block0) * rb;
  u32 acc = 0;
#if P == 0
  const int kt = rb / 32;
  const int nsteps = wk < kt ? (kt - wk + WK - 1) / WK : 0;
  uint4 ring[S][MT];
  const u8* p0 = base + wk * 512 + lane * 16;
#define LOAD(p, i) _Pragma("unroll") for (int mt = 0; mt < MT; ++mt) ring[p][mt] = ldg(p0 + (i64)(i) * WK * 512 + (i64)mt * 16 * rb);
#define USE(p) _Pragma("unroll") for (int mt = 0; mt < MT; ++mt) acc ^= mix(ring[p][mt]);
#elif P == 1
  const int kt = rb / (64 * V);
  const int nsteps = wk < kt ? (kt - wk + WK - 1) / WK : 0;
  uint4 ring[S][MT][2][V];
  const int g = lane >> 2, q = lane & 3;
  const u8* p0 = base + (i64)g * rb + wk * 64 * V + q * 16 * V;
#define LOAD(p, i) _Pragma("unroll") for (int mt = 0; mt < MT; ++mt) _Pragma("unroll") for (int h = 0; h < 2; ++h) \
    _Pragma("unroll") for (int v = 0; v < V; ++v) ring[p][mt][h][v] = (H ? ldgh : ldg)(p0 + (i64)(i) * WK * 64 * V + (i64)(16 * mt + 8 * h) * rb + 16 * v);
#define USE(p) _Pragma("unroll") for (int mt = 0; mt < MT; ++mt) _Pragma("unroll") for (int h = 0; h < 2; ++h) \
    _Pragma("unroll") for (int v = 0; v < V; ++v) acc ^= mix(ring[p][mt][h][v]);
#elif P == 2
  extern __shared__ __align__(128) u8 smem[];
  __shared__ __align__(8) u64 bars[WARPS][S];
  const int kt = rb / C;
  const int nsteps = wk < kt ? (kt - wk + WK - 1) / WK : 0;
  constexpr int RS = C + 16;  // shared row stride
  const u32 stage0 = static_cast<u32>(__cvta_generic_to_shared(smem)) + warp * S * (MT * 16 * RS);
  const u32 bar0 = static_cast<u32>(__cvta_generic_to_shared(&bars[warp][0]));
  if (lane == 0)
    for (int p = 0; p < S; ++p) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar0 + 8 * p) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  __syncwarp();
  const int g = lane >> 2, q = lane & 3;
  const u8* rowp = lane < MT * 16 ? base + (i64)lane * rb + wk * C : nullptr;  // lane r copies row r
#define LOAD(p, i) { \
    if (lane == 0) asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar0 + 8 * (p)), "r"(MT * 16 * C) : "memory"); \
    __syncwarp(); \
    if (lane < MT * 16) asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" \
        ::"r"(stage0 + (p) * (MT * 16 * RS) + lane * RS), "l"(rowp + (i64)(i) * WK * C), "r"(C), "r"(bar0 + 8 * (p)) : "memory"); }
#define USE_AT(p, i) { \
    asm volatile("{\n.reg .pred done;\nW:\nmbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n@!done bra W;\n}" \
        ::"r"(bar0 + 8 * (p)), "r"(((i) / S) & 1) : "memory"); \
    _Pragma("unroll") for (int mt = 0; mt < MT; ++mt) _Pragma("unroll") for (int h = 0; h < 2; ++h) \
      _Pragma("unroll") for (int v = 0; v < C / 64; ++v) { \
        uint4 x; const u32 a = stage0 + (p) * (MT * 16 * RS) + (16 * mt + 8 * h + g) * RS + q * (C / 4) + 16 * v; \
        asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(x.x),"=r"(x.y),"=r"(x.z),"=r"(x.w) : "r"(a)); \
        acc ^= mix(x); } \
    __syncwarp(); asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
#define USE(p) USE_AT(p, i0 + p)
#endif
#if P == 5
  // Tiles with their scale tiles (SC 1: a scale array of 64-byte tiles beside the codes, as the decode kernel reads
  // them; SC 2: each tile's 64 scale bytes right after its 512 code bytes; SC 0: no scales) in groups of G row blocks
  // whose tiles interleave step by step: tile (b, j) of an expert sits at (b / G) G kt U + (j G + b % G) U, U the
  // tile's bytes. G = 1 is the engine's layout (each row block's tiles contiguous).
  const int kt = rb / 32;
  const int nsteps = wk < kt ? (kt - wk + WK - 1) / WK : 0;
  constexpr int UC = SC == 2 ? 576 : 512;
  const i64 expert_blocks = static_cast<i64>(by) * (n / 16);
  auto tile_at = [&](i64 b, int unit) {
    return ((expert_blocks + b) / G * G * kt + wk * G + (expert_blocks + b) % G) * unit;
  };
  const u8* pc[MT];
  const u8* ps[MT];
  const u8* scales = w + static_cast<i64>(gridDim.x / (n / (16 * WM * MT))) * n * rb;  // past the codes
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    pc[mt] = w + tile_at(block0 + mt, UC) + lane * 16;
    ps[mt] = SC == 2 ? pc[mt] - lane * 16 + 512 + (lane >> 2) * 8 : scales + tile_at(block0 + mt, 64) + (lane >> 2) * 8;
  }
  uint4 ring[S][MT];
  uint2 sring[S][MT];
#define LOAD(p, i) _Pragma("unroll") for (int mt = 0; mt < MT; ++mt) { \
    ring[p][mt] = ldg(pc[mt] + (i64)(i) * WK * G * UC); \
    if (SC) sring[p][mt] = ldg2(ps[mt] + (i64)(i) * WK * G * (SC == 2 ? UC : 64)); }
#define USE(p) _Pragma("unroll") for (int mt = 0; mt < MT; ++mt) { acc ^= mix(ring[p][mt]); if (SC) acc ^= sring[p][mt].x ^ sring[p][mt].y; }
#endif
#if P == 4
  // Persistent: grid G CTAs; CTA c takes the decode grid's CTAs ("units") c, c + G, ... (CONTIG 0) or a contiguous run
  // of them (CONTIG 1), and each warp streams its places in them as one sequence through one ring: the first steps of
  // the next unit load while the last ones of this unit are in flight. Units from first2 on are the second set's.
  const int G = gridDim.x;
  const int u_begin = CONTIG ? (int)((i64)blockIdx.x * units / G) : (int)blockIdx.x;
  const int u_end = CONTIG ? (int)((i64)(blockIdx.x + 1) * units / G) : units;
  const int u_step = CONTIG ? 1 : G;
  auto unit_steps = [&](int u) {
    const int kt = (u < first2 ? rb : rb2) / 32;
    return wk < kt ? (kt - wk + WK - 1) / WK : 0;
  };
  // The cursor of the next load: unit cu (its row bytes crow, its warp's first byte cp), step cs of its cn.
  int cu = u_begin, cs = 0, cn = 0;
  i64 crow = 0;
  const u8* cp = w;
  auto enter = [&](int u) {  // the cursor at unit u's first step, or past the CTA's units
    cu = u;
    cs = 0;
    if (u >= u_end) return;
    const u8* ww = w;
    int nn = n;
    crow = rb;
    if (u >= first2) { u -= first2; ww = w2; nn = n2; crow = rb2; }
    const int ux = u % (nn / (16 * WM * MT)), uy = u / (nn / (16 * WM * MT));
    cp = ww + (static_cast<i64>(uy) * nn + 16 * ((static_cast<i64>(ux) * WM + wm) * MT)) * crow + wk * 512 + lane * 16;
    cn = unit_steps(cu);
  };
  auto settle = [&] { while (cu < u_end && cs >= cn) enter(cu + u_step); };  // past units with no step left
  int nsteps = 0;
  for (int u = u_begin; u < u_end; u += u_step) nsteps += unit_steps(u);
  enter(u_begin);
  settle();
  uint4 ring[S][MT];
#define LOAD(p, i) { _Pragma("unroll") for (int mt = 0; mt < MT; ++mt) ring[p][mt] = ldg(cp + (i64)cs * WK * 512 + (i64)mt * 16 * crow); \
    ++cs; settle(); }
#define USE(p) _Pragma("unroll") for (int mt = 0; mt < MT; ++mt) acc ^= mix(ring[p][mt]);
#endif
#if P == 3
  // The CTA's whole slab (its WM MT row blocks, each 16 rb contiguous bytes of 512-byte tiles) copied at its start:
  // chunk c = tiles [c kt / NCH, (c + 1) kt / NCH) of every row block, one cp.async.bulk per block and chunk, issued
  // by thread 0, completing on chunk c's mbarrier; warp (wm, wk) then reads its tiles back (LDS.128) chunk by chunk.
  extern __shared__ __align__(128) u8 smem[];
  __shared__ __align__(8) u64 bars[NCH];
  constexpr int BLOCKS = WM * MT;
  const int kt = rb / 32;  // 512-byte tiles per row block
  const u8* slab_src = w + (static_cast<i64>(by) * n + 16 * static_cast<i64>(bx) * BLOCKS) * rb;
  const u32 slab = static_cast<u32>(__cvta_generic_to_shared(smem));
  const u32 bar0 = static_cast<u32>(__cvta_generic_to_shared(&bars[0]));
  if (threadIdx.x == 0) {
    for (int c = 0; c < NCH; ++c) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar0 + 8 * c) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    for (int c = 0; c < NCH; ++c) {
      const int t0 = c * kt / NCH, bytes = ((c + 1) * kt / NCH - t0) * 512;
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar0 + 8 * c), "r"(BLOCKS * bytes) : "memory");
      for (int b = 0; b < BLOCKS; ++b) {
        const i64 off = (static_cast<i64>(b) * kt + t0) * 512;
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
            ::"r"(slab + static_cast<u32>(off)), "l"(slab_src + off), "r"(bytes), "r"(bar0 + 8 * c) : "memory");
      }
    }
  }
  __syncthreads();
  int chunk = -1, chunk_end = 0;
  for (int j = wk; j < kt; j += WK) {
    while (j >= chunk_end) {
      ++chunk;
      chunk_end = (chunk + 1) * kt / NCH;
      asm volatile("{\n.reg .pred done;\nW:\nmbarrier.try_wait.parity.shared::cta.b64 done, [%0], 0;\n@!done bra W;\n}"
          ::"r"(bar0 + 8 * chunk) : "memory");
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      uint4 x; const u32 a = slab + ((wm * MT + mt) * kt + j) * 512 + lane * 16;
      asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(x.x),"=r"(x.y),"=r"(x.z),"=r"(x.w) : "r"(a));
      acc ^= mix(x);
    }
  }
#else
#pragma unroll
  for (int p = 0; p < S; ++p) if (p < nsteps) LOAD(p, p)
  for (int i0 = 0; i0 < nsteps; i0 += S) {
#pragma unroll
    for (int p = 0; p < S; ++p) if (i0 + p < nsteps) {
      USE(p)
      if (i0 + p + S < nsteps) LOAD(p, i0 + p + S)
    }
  }
#endif
  if (acc == 0x9E3779B9u) out[threadIdx.x] = acc;
}
"""

# (experts a call touches, N, K) of each GEMM: decode calls of top-8 routing, about 60 experts at 8 tokens
SHAPES = {
    "qwen3-t8-gemm1": (60, 1536, 2048), "qwen3-t8-gemm2": (60, 2048, 768),
    "deepseek-t1-gemm1": (8, 4096, 7168), "deepseek-t1-gemm2": (8, 7168, 2048),
    "deepseek-t8-gemm1": (60, 4096, 7168), "deepseek-t8-gemm2": (60, 7168, 2048),
}
PAIRS = sorted({shape.rsplit("-", 1)[0] for shape in SHAPES})  # layers with both GEMMs in SHAPES
FORMS = ["tiles:4", "persist:4", "persistc:4", "rows:1:2", "rowsh:1:2", "rows:2:2", "rows:4:1", "bulk:128:2",
         "bulk:128:4", "bulk:256:2", "bulk:512:1", "slab:4"]
WARP_FORMS = {"2,4,1": (2, 4, 1), "2,2,2": (2, 2, 2), "1,4,1": (1, 4, 1), "2,2,1": (2, 2, 1), "3,4,1": (3, 4, 1),
              "4,4,1": (4, 4, 1), "4,2,2": (4, 2, 2), "3,2,2": (3, 2, 2), "4,2,1": (4, 2, 1)}  # (MT, WM, WK)
CAP_SMEM = 52 * 1024  # at least this much shared memory a CTA: at most four CTAs an SM
MAX_SMEM = 220 * 1024  # dynamic shared memory a CTA may ask (227 KB less the static barriers, with margin)
SMEM_PER_SM = 228 * 1024
PERSIST_CTAS_PER_SM = 4  # the persistent forms' grid: one wave of four CTAs an SM
FORM_PATTERN = re.compile(r"tiles:(\d+)|rowsh?:(1|2|4):(\d+)|bulk:(\d+):(\d+)|slab:(\d+)|persistc?:(\d+)"
                          r"|tsc:(1|2|4|8):(0|1|2):(\d+)")


def form_arg(text: str) -> str:
    """A --forms entry, checked: tiles:S, rows:V:S or rowsh:V:S (V 1, 2 or 4), bulk:C:S (C a multiple of 64 up to
    512), slab:N, persist:S, persistc:S, tsc:G:SC:S (G 1, 2, 4 or 8; SC 0, 1 or 2); S and N 1 to 8."""
    match = FORM_PATTERN.fullmatch(text)
    stages = int(text.rsplit(":", 1)[-1]) if match else 0
    copy = int(match.group(4)) if match and match.group(4) else 64
    if not match or not 1 <= stages <= 8 or copy % 64 or not 64 <= copy <= 512:
        raise argparse.ArgumentTypeError(f"{text!r}: expected tiles:S, rows:V:S, rowsh:V:S (V 1, 2 or 4), bulk:C:S "
                                         "(C 64..512, a multiple of 64), slab:N, persist:S, persistc:S or tsc:G:SC:S, "
                                         "S and N 1..8")
    return text


def defines(form: str, mt: int, wm: int, wk: int) -> dict[str, int]:
    """The kernel's compile-time defines for ``form`` on a grid of (MT, WM, WK) warps."""
    kind, *numbers = form.split(":")
    d = {"MT": mt, "WM": wm, "WK": wk}
    if kind == "tiles":
        return {**d, "P": 0, "S": int(numbers[0])}
    if kind in ("rows", "rowsh"):
        return {**d, "P": 1, "V": int(numbers[0]), "S": int(numbers[1]), "H": int(kind == "rowsh")}
    if kind == "slab":
        return {**d, "P": 3, "NCH": int(numbers[0])}
    if kind == "tsc":
        return {**d, "P": 5, "G": int(numbers[0]), "SC": int(numbers[1]), "S": int(numbers[2])}
    if kind in ("persist", "persistc"):
        return {**d, "P": 4, "S": int(numbers[0]), "CONTIG": int(kind == "persistc")}
    return {**d, "P": 2, "C": int(numbers[0]), "S": int(numbers[1])}


def step_bytes(d: dict[str, int]) -> int:
    """Bytes of each row one warp step covers."""
    return 64 * d["V"] if d["P"] == 1 else d["C"] if d["P"] == 2 else 32


def stage_smem(d: dict[str, int], row_bytes: int) -> int:
    """Dynamic shared memory of the bulk form's stages ([warps][stages][16 MT rows][C + 16 bytes]) or of the slab
    form's slab (16 WM MT rows of row_bytes)."""
    if d["P"] == 2:
        return d["WM"] * d["WK"] * d["S"] * d["MT"] * 16 * (d["C"] + 16)
    return d["WM"] * d["MT"] * 16 * row_bytes if d["P"] == 3 else 0


class Kernels:
    """The probe's kernels, compiled once per form (NVRTC), and launches of them on torch's current stream (the
    capture stream inside a graph capture)."""

    def __init__(self, sink: torch.Tensor) -> None:
        self.sink = sink
        self.sms = torch.cuda.get_device_properties(sink.device).multi_processor_count
        self.functions: dict[tuple, int] = {}

    def function(self, d: dict[str, int], smem: int) -> int:
        key = tuple(sorted(d.items()))
        if key not in self.functions:
            module = nvrtc_module(SOURCE, tuple(f"-D{a}={b}" for a, b in d.items()))
            self.functions[key] = driver.module_get_function(module, "probe")
            driver.set_max_dynamic_shared(self.functions[key], smem)
        return self.functions[key]

    def launch(self, d: dict[str, int], smem: int, first: tuple, second: tuple | None, ctas: int,
               programmatic: bool = False) -> None:
        """One launch over ``ctas`` CTAs of the decode grid: the weight set ``first`` = (weights, N, row bytes) and,
        from its own CTA count on, ``second`` (or nothing); the persistent forms on at most four CTAs an SM."""
        w, n, rb = first
        w2, n2, rb2 = second or first
        first2 = ctas if second is None else grid_ctas(d, n, w.numel() // (n * rb))
        units, ctas = ctas, min(ctas, PERSIST_CTAS_PER_SM * self.sms) if d["P"] == 4 else ctas
        values = (np.uint64(w.data_ptr()), np.int32(n), np.int32(rb), np.uint64(w2.data_ptr()), np.int32(n2),
                  np.int32(rb2), np.int32(first2), np.int32(units), np.uint64(self.sink.data_ptr()))
        launch = driver.launch_kernel_programmatic if programmatic else driver.launch_kernel
        launch(self.function(d, smem), (ctas, 1, 1), 32 * d["WM"] * d["WK"], smem, torch.cuda.current_stream().cuda_stream,
               packed_args(values).pointer)


def grid_ctas(d: dict[str, int], n: int, experts: int) -> int:
    """CTAs of the decode grid over ``experts`` weight sets of N rows."""
    return n // (16 * d["MT"] * d["WM"]) * experts


def form_table(args: argparse.Namespace, kernels: Kernels, timer: Timer) -> None:
    """One row per shape and warp grid, one column per form: each GEMM's weight loads alone."""
    print(md_row(["GEMM", "MB", "(MT, WM, WK)", *args.forms]))
    print(md_row(["---", "---:", "---", *["---:"] * len(args.forms)]))
    for shape in args.shapes:
        experts, n, k = SHAPES[shape]
        row_bytes = k // 2
        # codes, then their scale tiles (read by the tsc forms with scales: 64 bytes per 512-byte tile)
        weights = torch.randint(0, 256, (experts * n * row_bytes * 9 // 8,), dtype=torch.uint8, device="cuda")
        for warps in args.warps:
            mt, wm, wk = WARP_FORMS[warps]
            cells = []
            for form in args.forms:
                d = defines(form, mt, wm, wk)
                smem = max(stage_smem(d, row_bytes), CAP_SMEM)
                group = d.get("G", 1)
                if (n % (16 * mt * wm) or row_bytes % (step_bytes(d) * wk) or smem > MAX_SMEM
                        or row_bytes // 32 < d.get("NCH", 1) or n % (16 * group) or (group > 1 and group % mt)):
                    cells.append("-")
                    continue
                ctas = grid_ctas(d, n, experts)
                us = timer.median_us(lambda d=d, s=smem, c=ctas: kernels.launch(d, s, (weights, n, row_bytes), None, c))
                megabytes = experts * n * row_bytes * (9 / 8 if d.get("SC") else 1) / 1e6
                per_sm = SMEM_PER_SM // (smem + 1024)
                cells.append(f"{us:.1f} [{megabytes / us:.2f}]" + ("" if per_sm >= 4 else f" {per_sm}/SM"))
            print(md_row([shape, f"{experts * n * row_bytes / 1e6:.0f}", f"({mt},{wm},{wk})", *cells]), flush=True)
        del weights


def pair_table(args: argparse.Namespace, kernels: Kernels, timer: Timer) -> None:
    """One row per layer, tile form: GEMM1's and GEMM2's weight loads alone, the two as two launches (the second a
    programmatic dependent, as in the decode chain), and the two in one launch (GEMM1's CTAs first), also persistent
    (persist:4, then persistc:4: "runs"); each captured in a CUDA graph."""
    print(md_row(["layer", "MB", "(MT, WM, WK)", "GEMM1", "GEMM2", "two launches (PDL)", "one launch",
                  "one launch, persistent", "one launch, persistent (runs)"]))
    print(md_row(["---", "---:", "---", "---:", "---:", "---:", "---:", "---:", "---:"]))
    for pair in args.pairs:
        sets = []
        for shape in (f"{pair}-gemm1", f"{pair}-gemm2"):
            experts, n, k = SHAPES[shape]
            sets.append((torch.randint(0, 256, (experts * n * k // 2,), dtype=torch.uint8, device="cuda"), n, k // 2))
        megabytes = sum(w.numel() for w, _, _ in sets) / 1e6
        for warps in args.warps:
            d = defines("tiles:4", *WARP_FORMS[warps])
            if any(n % (16 * d["MT"] * d["WM"]) or rb % (32 * d["WK"]) for _, n, rb in sets):
                continue
            ctas = [grid_ctas(d, n, w.numel() // (n * rb)) for w, n, rb in sets]

            def two(d: dict = d, c: list = ctas) -> None:
                kernels.launch(d, CAP_SMEM, sets[0], None, c[0])
                kernels.launch(d, CAP_SMEM, sets[1], None, c[1], programmatic=True)

            one_launch = [d, *(defines(f"{form}:4", *WARP_FORMS[warps]) for form in ("persist", "persistc"))]
            runs = [lambda d=d, c=ctas: kernels.launch(d, CAP_SMEM, sets[0], None, c[0]),
                    lambda d=d, c=ctas: kernels.launch(d, CAP_SMEM, sets[1], None, c[1]),
                    two,
                    *(lambda f=f, c=ctas: kernels.launch(f, CAP_SMEM, sets[0], sets[1], c[0] + c[1])
                      for f in one_launch)]
            cells = []
            for run in runs:
                graph = capture(run, keep_graph=True)
                cells.append(f"{timer.median_us(graph.replay):.1f}")
            print(md_row([pair, f"{megabytes:.0f}", warps.join("()"), *cells]), flush=True)
        del sets


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--forms", nargs="+", type=form_arg, default=FORMS, help="columns (default: %(default)s)")
    parser.add_argument("--warps", nargs="+", default=list(WARP_FORMS), choices=list(WARP_FORMS),
                        help="(MT, WM, WK) of the grid (default: %(default)s)")
    parser.add_argument("--pairs", nargs="*", default=[], choices=PAIRS,
                        help="also time both GEMMs of these layers in two launches and in one (tile form)")
    parser.add_argument("--iters", type=positive_int, default=15, help="timed launches per median")
    args = parser.parse_args(argv)
    if gpu_missing("probe_weight_stream"):
        return 2
    device = torch.cuda.current_device()
    driver.make_device_current(device)
    kernels = Kernels(torch.zeros(1024, dtype=torch.int32, device="cuda"))
    timer = Timer(args.iters)
    print(f"{torch.cuda.get_device_name(device)}: weight loads alone, us [TB/s], L2 flushed, median of {args.iters}")
    print()
    if args.shapes and args.forms:
        form_table(args, kernels, timer)
        print()
    if args.pairs:
        pair_table(args, kernels, timer)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
