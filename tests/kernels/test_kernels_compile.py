"""CPU checks of the CUDA glue kernels: every .cu compiles with nvcc, every Python wrapper passes arguments whose
count and types match its kernel's C signature, the sort's grid has the documented shape, and the number-format
helpers of common.cuh, built for the host with a few stand-ins for CUDA built-ins, match torch bit for bit."""

from __future__ import annotations

import importlib
import math
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from cudnn_moe import kernels
from cudnn_moe.activations import SwiGLU
from cudnn_moe.formats import decode_e2m1, encode_e2m1
from cudnn_moe.kernels import SORT_THREADS
from cudnn_moe.kernels.l2_warm import L2Warm
from cudnn_moe.kernels.sort import sort_grid
from tests.support.kernel_sources import ARG_TYPES, CXX, HOST_PRELUDE, NVCC, compiled, host_program, kernel_signatures
from tests.support.number_formats import check_format_helpers, format_inputs

KERNELS_DIR = kernels.kernels_dir()
SOURCES = sorted(path.name for path in KERNELS_DIR.glob("*.cu"))


def _nvcc_command(source: str, arch: str) -> list[str]:
    return [NVCC, "-std=c++17", f"-arch={arch}", "-I", str(KERNELS_DIR), *kernels.cuda_defines(), "-c",
            str(KERNELS_DIR / source)]


def nvcc_jobs(item: pytest.Item) -> list[tuple[list[str], str]]:
    """The nvcc builds ``item`` needs, started ahead by the session (kernel_sources.prefetch)."""
    if item.originalname == "test_kernel_compiles":
        return [(_nvcc_command(item.callspec.params["source"], item.callspec.params["arch"]), ".o")]
    return []


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("arch", ["sm_90", "sm_100a"])
@pytest.mark.parametrize("source", SOURCES)
def test_kernel_compiles(source: str, arch: str) -> None:
    result, _ = compiled(_nvcc_command(source, arch))
    assert result.returncode == 0, result.stderr


def test_sources_present() -> None:
    assert SOURCES == ["activation.cu", "aligned_stage.cu", "expert_scale.cu", "finalize.cu", "permute.cu", "sort.cu",
                       "stage.cu"]


def test_sort_grid_shape() -> None:
    """One block (moe_sort) up to SORT_THREADS slots, then a grid of at most SORT_MAX_BLOCKS blocks of whole chunks."""
    assert sort_grid(0) == (1, 0) and sort_grid(SORT_THREADS) == (1, SORT_THREADS)
    assert sort_grid(SORT_THREADS + 1) == (2, SORT_THREADS)
    assert sort_grid(32768) == (32, SORT_THREADS)
    blocks, per_block = sort_grid(1 << 20)
    assert blocks <= 128 and per_block % SORT_THREADS == 0 and blocks * per_block >= 1 << 20


@pytest.mark.parametrize("tokens, hidden", [(1, 2048), (8, 7168), (128, 64), (512, 2048), (1024, 8192)])
def test_decode_glue_grids(monkeypatch: pytest.MonkeyPatch, tokens: int, hidden: int) -> None:
    """The sort + permute launch takes a block per SORT_PERMUTE_BLOCK_PAIRS (slot, 32-column unit) pairs, at most
    SORT_PERMUTE_MAX_BLOCKS blocks (pairs then strided over them); the finalize a block per (token, 8 x ROW_THREADS columns)."""
    from cudnn_moe.kernels.codes import ROW_THREADS

    sort_module = importlib.import_module("cudnn_moe.kernels.sort")
    finalize_module = importlib.import_module("cudnn_moe.kernels.finalize")

    grids: dict[str, Any] = {}
    for module in (sort_module, finalize_module):
        monkeypatch.setattr(module, "ptr", lambda tensor, align=1: np.uint64(0))
        monkeypatch.setattr(module, "launch", lambda file, name, device, grid, block, args: grids.update({name: grid}))
    k = 2 if tokens * 2 <= kernels.SORT_PERMUTE_MAX_SLOTS else 1
    slots, experts, rows = tokens * k, 4, tokens * k + 7 * 4
    i32 = torch.int32
    sorted_ = kernels.SortBuffers(torch.zeros(experts + 1, dtype=i32), torch.zeros(slots, dtype=i32),
                                  torch.zeros(rows, dtype=i32), torch.zeros(rows, dtype=i32),
                                  torch.zeros(experts, dtype=i32))
    kernels.sort_permute_bf16(torch.zeros(slots, dtype=i32), k, 0, experts, 8, sorted_,
                              torch.zeros(tokens, hidden, dtype=torch.bfloat16), None,
                              torch.zeros(rows, hidden, dtype=torch.bfloat16))
    kernels.finalize(torch.zeros(rows, hidden, dtype=torch.bfloat16), torch.zeros(slots, dtype=i32),
                     torch.zeros(slots, dtype=torch.float32), k, torch.zeros(tokens, hidden, dtype=torch.bfloat16))
    pairs = slots * hidden // 32
    assert grids["moe_sort_permute_bf16_tokens"] == min(-(-pairs // sort_module.SORT_PERMUTE_BLOCK_PAIRS),
                                                         sort_module.SORT_PERMUTE_MAX_BLOCKS)
    assert grids["moe_finalize"] == (tokens, -(-hidden // (8 * ROW_THREADS)))


def _wrapper_calls() -> list[tuple[str, Callable[..., None], tuple[Any, ...]]]:
    """(kernel name, its wrapper, arguments) with CPU tensors of consistent small shapes."""
    u8, i32, f32, bf16 = torch.uint8, torch.int32, torch.float32, torch.bfloat16
    T, B, k, H, inter, E, R = 3, 4, 2, 64, 64, 2, 16

    def z(*shape: int, dtype: torch.dtype = u8) -> torch.Tensor:
        return torch.zeros(*shape, dtype=dtype)

    staged = (
        z(T, H // 2), z(T, H // 16), z(T, k, dtype=i32), None, kernels.ROUTING_PACKED,
        z(B, H // 2), z(B, H // 16), z(B, k, dtype=i32), z(B, k, dtype=f32),
    )
    def sort_buffers(slots: int, rows: int) -> kernels.SortBuffers:
        return kernels.SortBuffers(z(E + 1, dtype=i32), z(slots, dtype=i32), z(rows, dtype=i32), z(rows, dtype=i32),
                                   z(E, dtype=i32))

    sorting = (z(B * k, dtype=i32), k, 0, E, 8, sort_buffers(B * k, R))
    big = 3 * kernels.SORT_THREADS + 5  # more slots than one block sorts: moe_sort_blocks
    sorting_blocks = (z(big, dtype=i32), 1, 0, E, 8, sort_buffers(big, 2 * big))
    linear = kernels.TokenLayout.NVFP4_LINEAR
    permute = (z(B, H // 2), z(B, H // 16), z(B * k, dtype=i32), B * k, k, linear, z(R, H // 2), z(R * H // 16))
    permute_bf16 = (
        z(B, H // 2), z(B, H // 16), z(B * k, dtype=i32), B * k, k, kernels.TokenLayout.BF16_FRAGMENTS,
        z(R, H, dtype=bf16), None,
    )
    activation = (
        z(R, 2 * inter, dtype=bf16), z(R, dtype=i32), z(E + 1, dtype=i32), SwiGLU(), linear, z(R, inter // 2),
        z(R * inter // 16),
    )
    finalize = (z(R, H, dtype=bf16), z(B * k, dtype=i32), z(B, k, dtype=f32), k, z(T, H, dtype=bf16))
    aligned = (
        z(T, H // 2), z(T, H // 16), z(T, k, dtype=f32), 2.0, (z(E, dtype=f32), z(E, dtype=f32), z(E, dtype=f32)),
        z(B, H // 2), z(B, H // 16), z(B, k, dtype=i32), z(B, k, dtype=f32), z(2 * E, dtype=f32), z(E, dtype=f32),
    )
    plan = (z(R, dtype=i32), z(R // 8, dtype=i32), z(1, dtype=i32), 8, T * k, E, z(B * k, dtype=i32))
    unfinalized = (z(R, H, dtype=bf16), z(R, dtype=i32), z(R - 2, H, dtype=bf16))
    nvfp4_tokens, bf16_tokens = (z(T, H // 2), z(T, H // 16)), (z(T, H, dtype=bf16), None)
    mxfp8_tokens = (z(T, H).view(torch.float8_e4m3fn), z(T, H // 32).view(torch.float8_e8m0fnu))
    many = kernels.SORT_WARP_SLOTS // k + 1  # a bucket of more slots than the one-warp sort takes
    warm = L2Warm(z(E * 2 * 1024), z(E * 2 * 128), row_blocks=2, code_row=1024, scale_row=128, code_bytes=512,
                  scale_bytes=128, experts=E, blocks=2)

    def staged_sort(bucket: int) -> tuple[Any, ...]:
        return (z(T, k, dtype=torch.int64), z(T, k, dtype=f32), kernels.ROUTING_FP32, z(bucket, k, dtype=i32),
                z(bucket, k, dtype=f32), 0, E, 8, sort_buffers(bucket * k, 8 * bucket * k), z(8 * bucket * k, H, dtype=bf16))

    return [
        ("moe_stage_inputs", kernels.stage_inputs, staged),
        ("moe_stage_aligned", kernels.stage_aligned, aligned),
        ("moe_plan_routes", kernels.plan_routes, plan),
        ("moe_sort", kernels.sort_routing, sorting),
        ("moe_sort_blocks", kernels.sort_routing, sorting_blocks),
        ("moe_permute", kernels.permute_tokens, permute),
        ("moe_permute_bf16", kernels.permute_tokens, permute_bf16),
        ("moe_permute_bf16_tokens", kernels.permute_bf16_tokens,
         (z(B, H, dtype=bf16), z(B * k, dtype=i32), B * k, k, z(R, H, dtype=bf16))),
        ("moe_sort_permute_bf16", kernels.sort_permute_bf16,
         (*sorting, z(B, H // 2), z(B, H // 16), z(R, H, dtype=bf16))),
        ("moe_sort_permute_bf16_tokens", kernels.sort_permute_bf16,
         (*sorting, z(B, H, dtype=bf16), None, z(R, H, dtype=bf16))),
        ("moe_sort_permute_bf16_mxfp8", kernels.sort_permute_bf16,
         (*sorting, z(B, H).view(torch.float8_e4m3fn), z(B, H // 32), z(R, H, dtype=bf16))),
        ("moe_stage_sort_permute_bf16_mxfp8_warp", kernels.stage_sort_permute_bf16, (*mxfp8_tokens, *staged_sort(B))),
        ("moe_stage_sort_permute_bf16_mxfp8", kernels.stage_sort_permute_bf16, (*mxfp8_tokens, *staged_sort(many))),
        ("moe_stage_sort_permute_bf16_warp", kernels.stage_sort_permute_bf16, (*nvfp4_tokens, *staged_sort(B))),
        ("moe_stage_sort_permute_bf16_tokens_warp", kernels.stage_sort_permute_bf16, (*bf16_tokens, *staged_sort(B))),
        ("moe_stage_sort_permute_bf16", kernels.stage_sort_permute_bf16, (*nvfp4_tokens, *staged_sort(many))),
        ("moe_stage_sort_permute_bf16_tokens", kernels.stage_sort_permute_bf16, (*bf16_tokens, *staged_sort(many))),
        *((f"moe_stage_sort_permute_bf16{kind}{form}_warm", kernels.stage_sort_permute_bf16,
           (*tokens, *staged_sort(bucket), kernels.TokenLayout.BF16_FRAGMENTS, warm))
          for kind, tokens in (("", nvfp4_tokens), ("_tokens", bf16_tokens), ("_mxfp8", mxfp8_tokens))
          for form, bucket in (("", many), ("_warp", B))),
        ("moe_activation", kernels.activate_quantize, activation),
        ("moe_finalize", kernels.finalize, finalize),
        ("moe_unfinalized_rows", kernels.unfinalized_rows, unfinalized),
    ]


def test_wrapper_arguments_match_kernel_signatures(monkeypatch: pytest.MonkeyPatch) -> None:
    launches: list[tuple[str, tuple[Any, ...]]] = []
    for stage_name in ("stage", "aligned_stage", "sort", "permute", "activate", "finalize"):
        module = importlib.import_module(f"cudnn_moe.kernels.{stage_name}")
        monkeypatch.setattr(module, "ptr", lambda tensor, align=1, row_strided=False: np.uint64(0))
        monkeypatch.setattr(module, "launch",
                            lambda file, name, device, grid, block, args, **_: launches.append((name, args)))
    signatures = kernel_signatures((KERNELS_DIR / name for name in SOURCES), [KERNELS_DIR / "l2_warm.cuh"])
    signatures.pop("moe_expert_scale")  # launched by the cuDNN engine, checked on the GPU
    calls = _wrapper_calls()
    assert sorted(signatures) == sorted(name for name, _, _ in calls)
    for name, wrapper, args in calls:
        launches.clear()
        wrapper(*args)
        assert [launched for launched, _ in launches] == [name]
        expected = [ARG_TYPES[kind] for kind in signatures[name]]
        assert [type(arg) for arg in launches[0][1]] == expected, name


# ---------------------------------------------------------------------------------------------------------------
# Number-format helpers (inputs and checks shared with the device test: tests/support/number_formats.py)
# ---------------------------------------------------------------------------------------------------------------

# Host build of common.cuh: stand-ins for the CUDA qualifiers, vector types and bit-cast intrinsics it uses.
_HOST_DRIVER = HOST_PRELUDE + r"""
#include "common.cuh"
using namespace moe;

// argv[1]: float32 inputs. argv[2]: per input e4m3, e2m1 (1 byte each) and bf16 (2 bytes), then for every
// 16-bit pattern i the decoded bf16, e4m3 (i & 0xFF) and e2m1 (i & 0xF) as three float32.
int main(int, char** argv) {
  FILE* in = std::fopen(argv[1], "rb");
  FILE* out = std::fopen(argv[2], "wb");
  float f;
  while (std::fread(&f, 4, 1, in) == 1) {
    const u8 codes[2] = {float_to_e4m3(f), float_to_e2m1(f)};
    const u16 bf16 = float_to_bf16(f);
    std::fwrite(codes, 1, 2, out);
    std::fwrite(&bf16, 2, 1, out);
  }
  for (int i = 0; i < 65536; ++i) {
    const float d[3] = {bf16_to_float(static_cast<u16>(i)), e4m3_to_float(static_cast<u8>(i & 0xFF)),
                        e2m1_to_float(static_cast<u8>(i & 0xF))};
    std::fwrite(d, 4, 3, out);
  }
  return std::fclose(out) != 0 || std::fclose(in) != 0;
}
"""


@pytest.mark.skipif(CXX is None, reason="no C++ compiler")
def test_format_helpers_on_host(tmp_path: Path) -> None:
    program = host_program(tmp_path, "driver", _HOST_DRIVER, opt="-O2")
    x = format_inputs()
    x.numpy().tofile(tmp_path / "in.bin")
    subprocess.run([str(program), str(tmp_path / "in.bin"), str(tmp_path / "out.bin")], check=True)
    raw = np.fromfile(tmp_path / "out.bin", dtype=np.uint8)
    n = x.numel()
    encoded = torch.from_numpy(raw[: 4 * n].reshape(n, 4).copy())
    bf16 = encoded[:, 2:].contiguous().view(torch.int16).reshape(n)
    decoded = torch.from_numpy(raw[4 * n :].copy().view(np.float32).reshape(65536, 3))
    check_format_helpers(x, encoded[:, 0].contiguous(), encoded[:, 1].contiguous(), bf16, decoded)


_ROUND_DRIVER = HOST_PRELUDE + r"""
#include "common.cuh"
using namespace moe;

// argv[1]: float32 inputs; argv[2]: per input round_to_e2m1(x), e2m1_to_float(float_to_e2m1(x)), for |x| < 7
// round_below_7_to_e2m1(x) (else the composition again), and 1 where x is outside [2^-6, 448] or e4m3_normal(x) gives
// float_to_e4m3(x) and its value (else 0), as float32.
int main(int, char** argv) {
  FILE* in = std::fopen(argv[1], "rb");
  FILE* out = std::fopen(argv[2], "wb");
  float f;
  while (std::fread(&f, 4, 1, in) == 1) {
    const float composed = e2m1_to_float(float_to_e2m1(f));
    float value = 0.0f;
    const bool normal = f >= 0x1p-6f && f <= 448.0f;
    const u8 code = normal ? e4m3_normal(f, value) : 0;
    const bool same = !normal || (code == float_to_e4m3(f) && value == e4m3_to_float(code));
    const float d[4] = {round_to_e2m1(f), composed, std::fabs(f) < 7.0f ? round_below_7_to_e2m1(f) : composed,
                        same ? 1.0f : 0.0f};
    std::fwrite(d, 4, 4, out);
  }
  return std::fclose(out) != 0 || std::fclose(in) != 0;
}
"""


@pytest.mark.skipif(CXX is None, reason="no C++ compiler")
def test_round_to_e2m1_is_the_encode_decode_composition(tmp_path: Path) -> None:
    """round_to_e2m1 (the activation kernel's requantize), and round_below_7_to_e2m1 below 7, equal
    e2m1_to_float(float_to_e2m1(x)) bit for bit, and e4m3_normal is float_to_e4m3 on [2^-6, 448]: every tie and its
    neighbours on both grids, wide-range randoms, specials, NaN, and every float around the seven E2M1 midpoints,
    saturation, 7 and the E4M3 normal range's ends at many binades of offset. (Every float of those ranges was
    checked once, offline.)"""
    program = host_program(tmp_path, "round", _ROUND_DRIVER, opt="-O2")
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.0, 2.5, 3.5, 4.0, 5.0, 6.0, 7.0, 8.0, 2.0**21, 2.0**22, 2.0**23,
                         2.0**24, 2.0**25, 2.0**-6, 448.0, 464.0, 3.0e38])
    bits = mids.view(torch.int32).unsqueeze(1) + torch.arange(-64, 65, dtype=torch.int32)
    around = bits.reshape(-1).view(torch.float32)
    gen = torch.Generator().manual_seed(1)
    uniform = torch.rand(200000, generator=gen) * 16 - 8
    x = torch.cat([format_inputs(), around, -around, uniform, torch.tensor([-0.0, math.inf, -math.inf, -math.nan])])
    x.numpy().tofile(tmp_path / "in.bin")
    subprocess.run([str(program), str(tmp_path / "in.bin"), str(tmp_path / "out.bin")], check=True)
    got = torch.from_numpy(np.fromfile(tmp_path / "out.bin", dtype=np.float32).reshape(-1, 4).copy())
    assert torch.equal(got[:, 0].view(torch.int32), got[:, 1].view(torch.int32))
    assert torch.equal(got[:, 2].view(torch.int32), got[:, 1].view(torch.int32))
    assert bool((got[:, 3] == 1).all())
    want = decode_e2m1(encode_e2m1(x.nan_to_num(nan=0.0)))  # the project's codec (NaN: code 0)
    assert torch.equal(got[:, 0].view(torch.int32), want.view(torch.int32))


_ROUTE_DRIVER = HOST_PRELUDE + r"""
#include <cstdlib>
#include <vector>
#include "common.cuh"
using namespace moe;

// argv: routing format, ids_int64 (0/1), live slots L (slots i >= L are past the call's tokens), the ids file, the
// weights file (read when the format is not ROUTING_PACKED), the output file: per slot decode_route's id (int32) and
// weight (float32).
static std::vector<unsigned char> slurp(const char* path) {
  std::vector<unsigned char> bytes;
  FILE* f = std::fopen(path, "rb");
  for (int c; f != nullptr && (c = std::fgetc(f)) != EOF;) bytes.push_back(static_cast<unsigned char>(c));
  if (f != nullptr) std::fclose(f);
  return bytes;
}

int main(int, char** argv) {
  const int format = std::atoi(argv[1]), ids_int64 = std::atoi(argv[2]);
  const long live = std::atol(argv[3]);
  const std::vector<unsigned char> ids = slurp(argv[4]), weights = slurp(argv[5]);
  const long n = static_cast<long>(ids.size()) / (ids_int64 ? 8 : 4);
  FILE* out = std::fopen(argv[6], "wb");
  for (long i = 0; i < n; ++i) {
    int id;
    float w;
    decode_route(ids.data(), weights.data(), format, ids_int64, i, i < live, id, w);
    std::fwrite(&id, 4, 1, out);
    std::fwrite(&w, 4, 1, out);
  }
  return std::fclose(out) != 0;
}
"""


@pytest.mark.skipif(CXX is None, reason="no C++ compiler")
@pytest.mark.parametrize("routing", ["packed", "fp32", "bf16", "int64"])
def test_decode_route_reads_every_routing_format(tmp_path: Path, routing: str) -> None:
    """decode_route (common.cuh: the stage kernel's and the folded stage + sort + permute's routing decoder), on the
    host: packed words give (word >> 16, the BF16 low half), plain ids their FP32 or BF16 weight, int64 ids outside the
    int32 range -1 (their weight kept), and slots past the call's tokens -1 with weight 0."""
    from cudnn_moe.routing import pack_routing

    program = host_program(tmp_path, "route", _ROUTE_DRIVER, opt="-O1")
    gen = torch.Generator().manual_seed(len(routing))
    slots, live = 96, 80
    ids = torch.randint(-40, 300, (slots, 1), dtype=torch.int32, generator=gen)
    weights = torch.randn(slots, 1, generator=gen) * 3
    want_ids, want_w = ids.flatten().clone(), weights.flatten().clone()
    if routing == "packed":
        ids_in, w_in, fmt = pack_routing(ids, weights), None, kernels.ROUTING_PACKED
        want_w = weights.to(torch.bfloat16).float().flatten()
    elif routing == "bf16":
        ids_in, w_in, fmt = ids, weights.to(torch.bfloat16), kernels.ROUTING_BF16
        want_w = w_in.float().flatten()
    else:
        ids_in, w_in, fmt = ids, weights, kernels.ROUTING_FP32
        if routing == "int64":
            ids_in = ids.to(torch.int64)
            ids_in[3, 0], ids_in[7, 0], ids_in[9, 0] = 2**31, -(2**31) - 1, -(2**31)  # two outside int32, one at its edge
            want_ids[3], want_ids[7], want_ids[9] = -1, -1, -(2**31)
    want_ids[live:], want_w[live:] = -1, 0.0
    ids_in.numpy().tofile(tmp_path / "ids.bin")
    (w_in.view(torch.int16) if w_in is not None and w_in.dtype == torch.bfloat16 else
     (w_in if w_in is not None else torch.zeros(0))).numpy().tofile(tmp_path / "w.bin")
    subprocess.run([str(program), str(fmt), str(int(routing == "int64")), str(live), str(tmp_path / "ids.bin"),
                    str(tmp_path / "w.bin"), str(tmp_path / "out.bin")], check=True)
    got = np.fromfile(tmp_path / "out.bin", dtype=np.int32).reshape(slots, 2)
    assert torch.equal(torch.from_numpy(got[:, 0].copy()), want_ids)
    assert torch.equal(torch.from_numpy(got[:, 1].copy()).view(torch.float32), want_w)


def test_l2_warm_geometry_is_checked() -> None:
    """L2Warm refuses prefixes that are not whole 512-byte tiles (codes) or 128-byte lines (scales), prefixes past a
    row block, and tensors that are not whole experts of uint8."""
    codes, scales = torch.zeros(2 * 3 * 1024, dtype=torch.uint8), torch.zeros(2 * 3 * 128, dtype=torch.uint8)
    good = dict(codes=codes, scales=scales, row_blocks=3, code_row=1024, scale_row=128, code_bytes=512,
                scale_bytes=128, experts=2, blocks=4)
    L2Warm(**good)
    for bad in (dict(code_bytes=256), dict(code_bytes=1536), dict(scale_bytes=64), dict(scale_bytes=256),
                dict(experts=0), dict(blocks=0), dict(codes=codes[:-1]), dict(scales=scales.view(torch.int8))):
        with pytest.raises(ValueError, match="L2Warm"):
            L2Warm(**{**good, **bad})
