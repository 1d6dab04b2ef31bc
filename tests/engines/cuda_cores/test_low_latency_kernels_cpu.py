"""CPU checks of the low-latency kernels (kernels_cuda/low_latency/ll_moe.cu) and of the call's host side:

- every module builds with nvcc for sm_80, sm_90a, sm_100a and sm_120a (every weight decoder on every arch;
  every (weights, input) module on sm_90a), skipped cleanly without nvcc;
- the sm_90a SASS streams the weights with 128-bit loads that bypass L1 and uses no local memory (no spills);
- the launch wrappers pass exactly the argument types of the kernels' C signatures, with the documented grids;
- the shared activation math (activation_math.cuh), built for the host, matches the float64 activations of
  cudnn_moe.activations for all ten kinds;
- the call checks its arguments (types, devices) before anything runs.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from cudnn_moe.activations import (
    GELU,
    GeGLU,
    GeGLUTanh,
    Identity,
    ReLU,
    ReLU2,
    SiLU,
    SiTU,
    SwiGLU,
    SwiGLUStep,
)
from cudnn_moe.kernels import cuda_defines, kernels_dir
from cudnn_moe.kernels.codes import LL_MAX_SLOTS, LL_THREADS, LowLatencyInputCode, LowLatencyWeightCode
from cudnn_moe.low_latency import LowLatencyMoeConfig, WeightFormat, low_latency_moe
from cudnn_moe.engines.cuda_cores import kernels as ll
from cudnn_moe.routing import Routing
from cudnn_moe.weights.low_latency import TILED_FORMATS

from tests.support import REPO as ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import sass_budget  # noqa: E402
from tests.support.kernel_sources import (  # noqa: E402
    ARG_TYPES, CXX, HOST_PRELUDE, NVCC, NVRTC, host_program, kernel_signatures, nvrtc_build, submit,
)

SOURCE = kernels_dir() / ll.SOURCE
CUOBJDUMP = sass_budget.find_tool("cuobjdump")
ARCHS = ("80", "90a", "100a", "120a")
# One module per weight decoder and token input kind: together they compile every line of ll_moe.cu.
DECODERS = (
    (LowLatencyWeightCode.BF16, LowLatencyInputCode.BF16),
    (LowLatencyWeightCode.FP16, LowLatencyInputCode.FP16),
    (LowLatencyWeightCode.NVFP4, LowLatencyInputCode.NVFP4),
    (LowLatencyWeightCode.MXFP4, LowLatencyInputCode.FP16),
    (LowLatencyWeightCode.MXINT4, LowLatencyInputCode.BF16),
    (LowLatencyWeightCode.FP8, LowLatencyInputCode.FP16),
    (LowLatencyWeightCode.FP8, LowLatencyInputCode.FP8),
    (LowLatencyWeightCode.FP8_BLOCK, LowLatencyInputCode.FP8_BLOCK),
    (LowLatencyWeightCode.MXFP4, LowLatencyInputCode.MXFP8),
    (LowLatencyWeightCode.MXFP8, LowLatencyInputCode.MXFP8),
)


def _variant_id(variant: tuple) -> str:
    """(weights, input) or (weights, input, tiles) -> e.g. "nvfp4-bf16" or "nvfp4-bf16-tiles"."""
    return f"{variant[0].name.lower()}-{variant[1].name.lower()}" + ("-tiles" if variant[2:] == (True,) else "")


def _nvcc_command(arch: str, variant: tuple) -> list[str]:
    return [NVCC, "-std=c++17", f"-gencode=arch=compute_{arch},code=sm_{arch}", "-cubin", "-I", str(kernels_dir()),
            *cuda_defines(), *ll.module_options(*variant), "-Xptxas", "-v", str(SOURCE)]


def _build_all(arch: str, variants) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    """Variant id -> (nvcc result, cubin), built in parallel, once per session (kernel_sources.submit)."""
    futures = {_variant_id(variant): submit(_nvcc_command(arch, variant), ".cubin") for variant in variants}
    return {name: future.result() for name, future in futures.items()}


def nvcc_jobs(item: pytest.Item) -> list[tuple[list[str], str]]:
    """The nvcc builds ``item`` needs, started ahead by the session (kernel_sources.prefetch)."""
    if item.originalname == "test_every_decoder_compiles":
        return [(_nvcc_command(item.callspec.params["arch"], variant), ".cubin") for variant in DECODERS]
    if "sm90_builds" in item.fixturenames:
        return [(_nvcc_command("90a", variant), ".cubin") for variant in ll.MODULE_VARIANTS]
    return []


@pytest.fixture(scope="module")
def sm90_builds() -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    return _build_all("90a", ll.MODULE_VARIANTS)


def test_module_variants_cover_every_call() -> None:
    """The modules a call can ask for are the ones built here."""
    asked = set()
    for fmt in WeightFormat:
        dtypes = {WeightFormat.BF16: (torch.bfloat16,), WeightFormat.FP16: (torch.float16,),
                  WeightFormat.NVFP4_W_NVFP4_A: (None,),
                  WeightFormat.FP8_PER_TENSOR: (torch.float8_e4m3fn,),
                  WeightFormat.DEEPSEEK_FP8: (torch.bfloat16, None), WeightFormat.MXFP4_W_MXFP8_A: (None,),
                  WeightFormat.MXFP8_W_MXFP8_A: (None,)}.get(fmt, (torch.bfloat16, torch.float16))
        asked |= {(ll.weight_code(fmt), ll.input_code(fmt, d)) for d in dtypes}
        if fmt in TILED_FORMATS:  # stored as SM90 tiles on SM90: the tile modules
            asked |= {(ll.weight_code(fmt), ll.input_code(fmt, d), True) for d in dtypes}
    assert asked == set(ll.MODULE_VARIANTS)
    assert {w for w, _ in DECODERS} == set(LowLatencyWeightCode) and {i for _, i in DECODERS} == set(LowLatencyInputCode)


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("arch", [a for a in ARCHS if a != "90a"])
def test_every_decoder_compiles(arch: str) -> None:
    for name, (result, _) in _build_all(arch, DECODERS).items():
        assert result.returncode == 0, f"sm_{arch} {name}:\n{result.stderr}"


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
def test_every_module_compiles_for_sm90a_without_spills(sm90_builds) -> None:
    for name, (result, _) in sm90_builds.items():
        assert result.returncode == 0, f"sm_90a {name}:\n{result.stderr}"
        spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", result.stderr)
        assert spills and all(s == ("0", "0") for s in spills), f"sm_90a {name} spills registers:\n{result.stderr}"


@pytest.mark.skipif(NVCC is None or CUOBJDUMP is None, reason="nvcc or cuobjdump not found")
def test_sm90a_sass_streams_weights_in_128_bit_loads(sm90_builds) -> None:
    """Both GEMM kernels load the weights with LDG.E.NA.128 (16 bytes a lane, not allocated in L1) and touch no
    local memory."""
    for name, (result, cubin) in sm90_builds.items():
        assert result.returncode == 0, result.stderr
        functions = sass_budget.disassemble(cubin)
        for kernel in ("ll_gemm1", "ll_gemm2"):
            code = [text for _, text in functions[kernel]]
            wide = [t for t in code if re.search(r"\bLDG\.E\.NA\.128\b", t)]
            assert wide, f"{name} {kernel}: no 128-bit streaming weight load in the SASS"
            local = [t for t in code if re.search(r"\b(LDL|STL)\b", t)]
            assert not local, f"{name} {kernel}: local memory traffic {local[:3]}"


@pytest.mark.skipif(NVRTC is None, reason="libnvrtc not found (set LL_NVRTC_LIBRARY to run this)")
@pytest.mark.parametrize("variant", DECODERS, ids=_variant_id)
def test_nvrtc_builds_what_the_loader_builds(variant) -> None:
    """The GPU builds these modules with NVRTC (no host headers, the loader's options): the same source text and
    options compile here for sm_90a."""
    status, log = nvrtc_build(ll.SOURCE, ll.module_options(*variant), "sm_90a")
    assert status == 0, log


# ----------------------------------------------------------------------------- wrappers vs C signatures
def _cpu_layer(fmt: WeightFormat, arch: str = "sm90"):
    config = LowLatencyMoeConfig(8, arch=arch)
    e, h, i = 3, 512, 128
    if fmt is WeightFormat.BF16:
        return config.prepare_bf16_weights(torch.zeros(e, 2 * i, h, dtype=torch.bfloat16),
                                           torch.zeros(e, h, i, dtype=torch.bfloat16))
    if fmt is WeightFormat.NVFP4_W_NVFP4_A:
        return config.prepare_nvfp4_weights(torch.zeros(e, 2 * i, h), torch.zeros(e, h, i))
    return config.prepare_mxint4_weight_only_weights(torch.zeros(e, 2 * i, h // 2, dtype=torch.uint8),
                                            torch.zeros(e, 2 * i, h // 32, dtype=torch.bfloat16),
                                            torch.zeros(e, h, i // 2, dtype=torch.uint8),
                                            torch.zeros(e, h, i // 32, dtype=torch.bfloat16))


@pytest.mark.parametrize("arch", ["sm90", "sm100"])
@pytest.mark.parametrize("fmt", [WeightFormat.BF16, WeightFormat.MXINT4_WEIGHT_ONLY, WeightFormat.NVFP4_W_NVFP4_A])
def test_wrappers_match_kernel_signatures(fmt: WeightFormat, arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The argument types and the grids; 4-bit layers prepared for SM90 are tiled: the tile modules, with a feature
    group streaming a row pair (twice a row's chunks) and a GEMM1 group covering two features."""
    launches: list[tuple[str, Any, int, tuple[Any, ...], tuple[str, ...]]] = []
    monkeypatch.setattr(ll, "ptr", lambda tensor, align=1: np.uint64(0))
    monkeypatch.setattr(ll, "launch", lambda file, name, device, grid, block, args, shared_mem=0, extra_options=():
                        launches.append((name, grid, block, args, extra_options)))
    weights = _cpu_layer(fmt, arch)
    tiles = weights.tiled
    assert tiles == (arch == "sm90" and fmt in TILED_FORMATS)
    tokens, top_k, h, ip = 5, 4, weights.hidden_size, weights.padded_intermediate
    if fmt is WeightFormat.NVFP4_W_NVFP4_A:
        x, x_scales, x_dtype = torch.zeros(tokens, h // 2, dtype=torch.uint8), torch.zeros(tokens, h // 16), None
    else:
        x, x_scales, x_dtype = torch.zeros(tokens, h, dtype=torch.bfloat16), None, torch.bfloat16
    ids = torch.zeros(tokens, top_k, dtype=torch.int64)
    inter = torch.zeros(tokens * top_k, ip, dtype=torch.int16)
    rows = torch.zeros(tokens * top_k, h, dtype=torch.int16)
    ll.gemm1(weights, x, x_scales, ids, 1, tokens, top_k, SwiGLU(alpha=2.0, beta=0.5, limit=7.0), inter)
    counters = torch.zeros(ll.max_gemm2_columns(h), dtype=torch.int32)
    out = torch.zeros(tokens, h, dtype=torch.float16)
    ll.gemm2(weights, x_dtype, inter, ids, torch.zeros(tokens, top_k), 1, tokens, top_k, True, rows, out, counters)
    ll.gemm2(weights, x_dtype, inter, ids, None, 0, tokens, top_k, False, rows, None, None)
    signatures = kernel_signatures([SOURCE])
    assert sorted(signatures) == sorted((*ll.KERNELS, ll.QUANT_KERNEL))
    assert [name for name, *_ in launches] == ["ll_gemm1", "ll_gemm2", "ll_gemm2"]
    code_w, code_x = ll.weight_code(fmt), ll.input_code(fmt, x_dtype)
    for name, grid, block, args, options in launches:
        assert [type(a) for a in args] == [ARG_TYPES[k] for k in signatures[name]], name
        assert block == LL_THREADS and options == ll.module_options(code_w, code_x, tiles), name
        assert ("-DLL_TILES=1" in options) == tiles
    per_group = 2 if tiles else 1  # rows (GEMM1: features) of a feature group
    lpr1 = ll.lanes_per_row(per_group * ll.row_bytes(fmt, h) // 16)
    lpr2 = ll.lanes_per_row(per_group * ll.row_bytes(fmt, ip) // 16)
    slots = tokens * top_k
    features1 = per_group * 8 * (32 // lpr1)
    columns1, columns2 = -(-ip // features1), -(-h // (16 * (32 // lpr2)))
    n1 = 2 if weights.gated else 1
    rounds1 = ll.choose_rounds(columns1, slots, 132, features1 * n1 * ll.row_bytes(fmt, h))
    rounds2 = ll.choose_rounds(columns2, slots, 132, 16 * (32 // lpr2) * ll.row_bytes(fmt, ip))
    assert launches[0][1] == (-(-columns1 // rounds1), slots)
    assert launches[1][1] == launches[2][1] == (-(-columns2 // rounds2), slots)
    assert launches[1][1][0] <= counters.numel()
    gemm1_names = ["x", "x_scales", "ids", "routing", "id_bytes", "num_tokens", "top_k", "num_experts", "w", "w_scales",
                   "w_global", "hidden", "inter", "inter_padded", "gated", "lanes", "rounds", "act", "alpha", "beta",
                   "limit", "out", "inter_quant", "inter_scales"]
    gemm1_args = dict(zip(gemm1_names, launches[0][3]))
    assert len(gemm1_names) == len(launches[0][3])
    assert (gemm1_args["lanes"], gemm1_args["rounds"], gemm1_args["gated"]) == (lpr1, rounds1, 1)
    assert gemm1_args["id_bytes"] == 8 and gemm1_args["num_tokens"] == tokens and gemm1_args["top_k"] == top_k
    assert (gemm1_args["act"], gemm1_args["alpha"], gemm1_args["beta"], gemm1_args["limit"]) == (10, 2.0, 0.5, 7.0)
    gemm2_names = ["inter", "ids", "weights", "routing", "id_bytes", "num_tokens", "top_k", "num_experts", "w",
                   "w_scales", "w_global", "hidden", "inter_padded", "lanes", "rounds", "out_fp16", "finalize", "rows",
                   "out", "counters", "scores", "inter_scales"]
    assert len(gemm2_names) == len(launches[1][3])
    gemm2_args = dict(zip(gemm2_names, launches[1][3]))
    assert (gemm2_args["finalize"], gemm2_args["out_fp16"], gemm2_args["lanes"], gemm2_args["rounds"]) == (1, 1, lpr2, rounds2)
    raw_args = dict(zip(gemm2_names, launches[2][3]))
    assert (raw_args["finalize"], raw_args["routing"], raw_args["out_fp16"]) == (0, 0, 0)
    assert slots <= LL_MAX_SLOTS


@pytest.mark.parametrize("prequantized", [False, True])
@pytest.mark.parametrize("finalize", [True, False])
def test_deepseek_fp8_launches_match_kernel_signatures(prequantized: bool, finalize: bool,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSeek FP8 runs ll_quant128 (BF16 tokens only), ll_gemm1 into the FP32 workspace, ll_quant128 on it, then
    ll_gemm2 on the codes and scales: argument types of the C signatures, one warp per 128-value block, the
    module's options, the workspaces each launch reads and writes."""
    from cudnn_moe.engines.base import LowLatencyCall
    from cudnn_moe.engines.cuda_cores import engine as cc_engine

    launches: list[tuple[str, Any, int, tuple[Any, ...], tuple[str, ...]]] = []
    monkeypatch.setattr(ll, "ptr", lambda tensor, align=1: np.uint64(0 if tensor is None else id(tensor)))
    monkeypatch.setattr(ll, "launch", lambda file, name, device, grid, block, args, shared_mem=0, extra_options=():
                        launches.append((name, grid, block, args, extra_options)))
    config = LowLatencyMoeConfig(8, arch="sm90")
    e, h, i, tokens, top_k = 3, 512, 256, 5, 4
    weights = config.prepare_deepseek_fp8_weights(
        torch.zeros(e, 2 * i, h, dtype=torch.float8_e4m3fn), torch.ones(e, 2 * i // 128, h // 128),
        torch.zeros(e, h, i, dtype=torch.float8_e4m3fn), torch.ones(e, h // 128, i // 128))
    call = LowLatencyCall(weights, torch.zeros(tokens, h, dtype=torch.bfloat16), None,
                          Routing.packed(torch.zeros(tokens, top_k, dtype=torch.int32)), SwiGLU(), torch.bfloat16,
                          finalize, torch.zeros(tokens, h) if finalize else torch.zeros(tokens, top_k, h), 8,
                          None if finalize else torch.zeros(tokens, top_k))
    if prequantized:
        call = LowLatencyCall(weights, torch.zeros(tokens, h, dtype=torch.float8_e4m3fn), torch.ones(tokens, h // 128),
                              call.routing, call.activation, call.out_dtype, finalize, call.out, 8, call.scores)
    _, spec = cc_engine.CudaCoresEngine.workspace_spec(call)
    workspace = {name: torch.zeros(shape, dtype=dtype) for name, (shape, dtype) in spec.items()}
    assert spec["inter"] == ((8 * top_k, i), torch.float32) and spec["inter_scales"] == ((8 * top_k, i // 128), torch.float32)
    assert spec["x_codes"] == ((8, h), torch.uint8) and spec["x_scales"] == ((8, h // 128), torch.float32)
    ids, route_weights, code = call.routing.kernel_operands()
    cc_engine._run_deepseek_fp8(call, workspace, ids, route_weights, code, 132, ll.FMA)
    names = [name for name, *_ in launches]
    expected = ["ll_gemm1", "ll_quant128", "ll_gemm2"]
    assert names == (expected if prequantized else ["ll_quant128", *expected])
    signatures = kernel_signatures([SOURCE])
    options = ll.module_options(LowLatencyWeightCode.FP8_BLOCK, LowLatencyInputCode.FP8_BLOCK)
    for name, grid, block, args, opts in launches:
        assert [type(a) for a in args] == [ARG_TYPES[k] for k in signatures[name]], name
        assert block == LL_THREADS and opts == options, name
    quants = [launch for launch in launches if launch[0] == "ll_quant128"]
    warps = LL_THREADS // 32
    address = lambda t: np.uint64(id(t))  # noqa: E731
    inter_q = quants[-1]
    assert inter_q[1] == (-(-tokens * top_k * (i // 128) // warps), 1)
    assert inter_q[3] == (address(workspace["inter"]), 1, tokens * top_k, i, address(workspace["inter_codes"]),
                          address(workspace["inter_scales"]))
    gemm1 = launches[names.index("ll_gemm1")][3]
    gemm2 = launches[names.index("ll_gemm2")][3]
    if not prequantized:
        assert quants[0][1] == (-(-tokens * (h // 128) // warps), 1)
        assert quants[0][3] == (address(call.x), 0, tokens, h, address(workspace["x_codes"]),
                                address(workspace["x_scales"]))
        assert gemm1[:2] == (address(workspace["x_codes"]), address(workspace["x_scales"]))
    else:
        assert gemm1[:2] == (address(call.x), address(call.x_scales))
    assert gemm1[9] == address(weights.w1_scales) and gemm1[10] == 0 and gemm1[21] == address(workspace["inter"])
    assert gemm2[0] == address(workspace["inter_codes"]) and gemm2[-1] == address(workspace["inter_scales"])
    assert gemm2[9] == address(weights.w2_scales) and gemm2[10] == 0
    assert gemm2[16] == int(finalize)


@pytest.mark.parametrize("arch", ["sm90", "sm100"])
@pytest.mark.parametrize("finalize", [True, False])
@pytest.mark.parametrize("hidden", [256, 1024, 2048])
@pytest.mark.parametrize("fp4", [True, False], ids=["mxfp4", "mxfp8"])
def test_mx_pair_launches_match_kernel_signatures(fp4: bool, hidden: int, finalize: bool, arch: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The MX pairs run ll_gemm1 on the MXFP8 tokens (writing the intermediate's MXFP8 codes and E8M0 scales into
    the workspace) and ll_gemm2 on those: two launches, the argument types of the C signatures, the module's
    options, GEMM1's rounds set so that each CTA covers exactly one 32-feature block (grid.x = Ip / 32, for 8, 16
    and 32 lanes a row), and the workspaces each launch reads and writes. An MXFP4 pair prepared for SM90 is stored
    as tiles: the tile module, two features a group (at least 16 lanes a row pair), its shifted form's scale tiles
    and globals."""
    from cudnn_moe.engines.base import LowLatencyCall
    from cudnn_moe.engines.cuda_cores import engine as cc_engine

    launches: list[tuple[str, Any, int, tuple[Any, ...], tuple[str, ...]]] = []
    monkeypatch.setattr(ll, "ptr", lambda tensor, align=1: np.uint64(0 if tensor is None else id(tensor)))
    monkeypatch.setattr(ll, "launch", lambda file, name, device, grid, block, args, shared_mem=0, extra_options=():
                        launches.append((name, grid, block, args, extra_options)))
    monkeypatch.setattr(cc_engine, "_ensure_ready", lambda *args: None)
    monkeypatch.setattr(cc_engine, "_sm_count", lambda index: 132)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    config = LowLatencyMoeConfig(8, arch=arch)
    e, i, tokens, top_k = 3, 96, 5, 4
    code = torch.uint8 if fp4 else torch.float8_e4m3fn
    per_byte = 2 if fp4 else 1
    weights = config.prepare_weights(
        torch.zeros(e, 2 * i, hidden // per_byte, dtype=code), torch.zeros(e, 2 * i, hidden // 32, dtype=torch.uint8),
        torch.zeros(e, hidden, i // per_byte, dtype=code), torch.zeros(e, hidden, i // 32, dtype=torch.uint8))
    ip, tiles = weights.padded_intermediate, weights.tiled
    assert tiles == (fp4 and arch == "sm90")
    acts = config.prepare_mxfp8_activations(torch.ones(tokens, hidden))
    call = LowLatencyCall(weights, acts.codes, acts.scales, Routing.packed(torch.zeros(tokens, top_k, dtype=torch.int32)),
                          SwiGLU(), torch.float16, finalize,
                          torch.zeros(tokens, hidden) if finalize else torch.zeros(tokens, top_k, hidden), 8,
                          None if finalize else torch.zeros(tokens, top_k))
    _, spec = cc_engine.CudaCoresEngine.workspace_spec(call)
    assert "inter" not in spec
    assert spec["inter_codes"] == ((8 * top_k, ip), torch.uint8) and spec["inter_scales"] == ((8 * top_k, ip // 32), torch.uint8)
    workspace = {name: torch.zeros(shape, dtype=dtype) for name, (shape, dtype) in spec.items()}
    cc_engine.CudaCoresEngine.run(call, workspace)
    assert [name for name, *_ in launches] == ["ll_gemm1", "ll_gemm2"]
    signatures = kernel_signatures([SOURCE])
    weight_code = LowLatencyWeightCode.MXFP4 if fp4 else LowLatencyWeightCode.MXFP8
    assert ll.weight_code(weights.format) is weight_code
    for name, grid, block, args, opts in launches:
        assert [type(a) for a in args] == [ARG_TYPES[k] for k in signatures[name]], name
        assert block == LL_THREADS and opts == ll.module_options(weight_code, LowLatencyInputCode.MXFP8, tiles), name
    address = lambda t: np.uint64(id(t))  # noqa: E731
    (_, grid1, _, gemm1, _), (_, _, _, gemm2, _) = launches
    lanes, rounds = gemm1[15], gemm1[16]
    per_group = 2 if tiles else 1  # features (rows of each half) a group computes
    want_lanes = ll.lanes_per_row(per_group * hidden // per_byte // 16)
    assert lanes == (max(want_lanes, 16) if tiles else want_lanes) and rounds * 8 * (32 // lanes) * per_group == 32
    assert grid1 == (ip // 32, tokens * top_k)
    assert gemm1[:2] == (address(call.x), address(call.x_scales))
    w1_scales, w1_global, w2_scales, w2_global = weights.tile_form if tiles else (weights.w1_scales, None,
                                                                                  weights.w2_scales, None)
    assert gemm1[9] == address(w1_scales) and gemm1[10] == (0 if w1_global is None else address(w1_global))
    assert gemm1[21] == address(workspace["inter_codes"]) and gemm1[23] == address(workspace["inter_scales"])
    assert gemm2[0] == address(workspace["inter_codes"]) and gemm2[-1] == address(workspace["inter_scales"])
    assert gemm2[9] == address(w2_scales) and gemm2[10] == (0 if w2_global is None else address(w2_global))
    assert gemm2[15] == 1 and gemm2[16] == int(finalize)  # FP16 output
    assert gemm2[17] == address(workspace["rows"] if finalize else call.out)


def test_choose_rounds() -> None:
    kb = 1 << 10
    # Qwen3-30B-A3B NVFP4 GEMM1 (96 blocks of 8 features x 2 rows x 1 KB): T=1 (8 slots) keeps one round
    # (768 CTAs), T=8 (64 slots) takes four (64 KB a CTA).
    assert ll.choose_rounds(96, 8, 132, 16 * kb) == 1
    assert ll.choose_rounds(96, 64, 132, 16 * kb) == 4
    assert ll.choose_rounds(256, 8, 132, 56 * kb) == 2  # DeepSeek-V3 NVFP4 GEMM1 at T=1: 1024 CTAs of 112 KB
    assert ll.choose_rounds(448, 8, 132, 16 * kb) == 4  # DeepSeek-V3 NVFP4 GEMM2 at T=1
    assert ll.choose_rounds(256, 64, 132, 229 * kb) == 1  # DeepSeek-V3 BF16 GEMM1: big blocks already
    assert ll.choose_rounds(1, 1, 132, kb) == 1


# ----------------------------------------------------------------------------- activation math on the host
_ACT_DRIVER = HOST_PRELUDE + r"""
#include "activation_math.cuh"
using namespace moe;

// stdin: lines "act gated alpha beta limit n" then n pairs "up gate"; stdout: y per pair (%.9g).
int main() {
  int act, gated, n;
  float alpha, beta, limit;
  while (std::scanf("%d %d %f %f %f %d", &act, &gated, &alpha, &beta, &limit, &n) == 6) {
    for (int i = 0; i < n; ++i) {
      float up, gate;
      if (std::scanf("%f %f", &up, &gate) != 2) return 1;
      const float y = gated ? act_gated_all(act, up, gate, alpha, beta, limit) : act_fn(act, up);
      std::printf("%.9g\n", y);
    }
  }
  return 0;
}
"""

HOST_ACTIVATIONS = (Identity(), ReLU(), GELU(), SiLU(), ReLU2(), SwiGLU(), SwiGLU(alpha=1.702, beta=1.0, limit=7.0),
                    GeGLU(), GeGLUTanh(), SwiGLUStep(), SwiGLUStep(limit=2.0), SiTU(), SiTU(a=2.0, b=3.0))


@pytest.mark.skipif(CXX is None, reason="no C++ compiler")
def test_activation_math_matches_the_reference_activations(tmp_path: Path) -> None:
    """Every kind's device formula (the one header both pipelines include), built for the host in FP32, against
    the float64 Activation.apply of cudnn_moe.activations: within FP32 rounding of the formula."""
    program = host_program(tmp_path, "act", _ACT_DRIVER)
    gen = torch.Generator().manual_seed(0)
    up = torch.cat([torch.randn(400, generator=gen) * 4, torch.tensor([0.0, -0.0, 10.0, -10.0, 30.0, -30.0, 1e-3])])
    gate = torch.cat([torch.randn(400, generator=gen) * 4, torch.tensor([0.0, 0.0, -30.0, 30.0, 7.5, 8.0, -1e-3])])
    up, gate = up.float().double(), gate.float().double()
    lines = []
    for act in HOST_ACTIVATIONS:
        alpha, beta, limit = act.params()
        lines.append(f"{int(act.kind)} {int(act.gated)} {alpha!r} {beta!r} {limit if math.isfinite(limit) else 'inf'} {up.numel()}")
        lines += [f"{u!r} {g!r}" for u, g in zip(up.tolist(), gate.tolist())]
    run = subprocess.run([str(program)], input="\n".join(lines) + "\n", capture_output=True, text=True, check=True)
    got = torch.tensor([float(v) for v in run.stdout.split()], dtype=torch.float64).view(len(HOST_ACTIVATIONS), -1)
    for row, act in zip(got, HOST_ACTIVATIONS):
        want = act.apply(up, gate) if act.gated else act.apply(up)
        err = (row - want).abs()
        bound = 1e-5 * want.abs() + 1e-6
        assert bool((err <= bound).all()), (
            f"{act}: host FP32 formula differs from the reference by {float((err - bound).max()):.3g} over the bound "
            f"at up={float(up[int((err - bound).argmax())])}, gate={float(gate[int((err - bound).argmax())])}")


_PLAIN_DRIVER = HOST_PRELUDE + r"""
#include "activation_math.cuh"
using namespace moe;

// stdin: pairs "up gate"; stdout per pair: the bits of SwiGLU(1, 0, inf) by act_gated_all, by swiglu_plain, and of
// SwiGLUStep(limit 2) (hex).
int main() {
  float up, gate;
  while (std::scanf("%f %f", &up, &gate) == 2)
    std::printf("%08x %08x %08x\n", __float_as_uint(act_gated_all(ACT_SWIGLU, up, gate, 1.0f, 0.0f, INFINITY)),
                __float_as_uint(swiglu_plain(up, gate)),
                __float_as_uint(act_gated_all(ACT_SWIGLU_STEP, up, gate, 0.0f, 0.0f, 2.0f)));
  return 0;
}
"""


@pytest.mark.skipif(CXX is None, reason="no C++ compiler")
def test_plain_swiglu_is_the_default_swiglu_and_clamps_keep_nan(tmp_path: Path) -> None:
    """swiglu_plain (the activation unit's path for SwiGLU's default scalars) gives act_gated_all's SwiGLU(1, 0, inf)
    bit for bit, zeros of either sign, infinities and NaN included; and the clamps of SwiGLU and SwiGLUStep keep a NaN
    up or gate NaN, as the reference's torch.clamp does."""
    program = host_program(tmp_path, "plain", _PLAIN_DRIVER)
    gen = torch.Generator().manual_seed(3)
    special = [0.0, -0.0, 1.0, -1.0, 100.0, -100.0, math.inf, -math.inf, math.nan]
    up = torch.cat([torch.randn(300, generator=gen) * 4, torch.tensor(special).repeat_interleave(len(special))])
    gate = torch.cat([torch.randn(300, generator=gen) * 4, torch.tensor(special).repeat(len(special))])
    lines = [f"{u!r} {g!r}" for u, g in zip(up.tolist(), gate.tolist())]
    run = subprocess.run([str(program)], input="\n".join(lines) + "\n", capture_output=True, text=True, check=True)
    bits = torch.tensor([[int(v, 16) for v in line.split()] for line in run.stdout.splitlines()], dtype=torch.int64)
    values = bits.to(torch.int32).view(torch.float32)
    assert torch.equal(bits[:, 0], bits[:, 1])
    nan_in = up.isnan() | gate.isnan()
    assert bool(values[nan_in, 0].isnan().all()) and bool(values[nan_in, 2].isnan().all())
    want = SwiGLU().apply(up.double(), gate.double())
    finite = want.isfinite()
    assert bool(((values[finite, 0].double() - want[finite]).abs() <= 1e-5 * want[finite].abs() + 1e-6).all())


# ----------------------------------------------------------------------------- decoders on the host
_DECODE_DRIVER = HOST_PRELUDE + r"""
#include "low_latency/decode.cuh"

// argv[1]: uint32 words; argv[2]: per word q 8 E2M1 values, 8 INT4 values, then the 8 E4M3 values of the
// bytes of q and ~q (float32); then for b = 0..255 the E8M0 and E4M3 values of b.
int main(int, char** argv) {
  FILE* in = std::fopen(argv[1], "rb");
  FILE* out = std::fopen(argv[2], "wb");
  unsigned int q;
  while (std::fread(&q, 4, 1, in) == 1) {
    float v[24];
    ll::decode_e2m1_word(q, v);
    ll::decode_int4_word(q, v + 8);
    ll::decode_e4m3_word(q, ~q, v + 16);
    std::fwrite(v, 4, 24, out);
  }
  for (unsigned int b = 0; b < 256; ++b) {
    const float s[2] = {ll::e8m0_to_float(b), ll::e4m3_value(b)};
    std::fwrite(s, 4, 2, out);
  }
  return std::fclose(out) != 0 || std::fclose(in) != 0;
}
"""


@pytest.mark.skipif(CXX is None, reason="no C++ compiler")
def test_decoders_match_the_codecs_for_every_code(tmp_path: Path) -> None:
    """decode.cuh (the kernels' E2M1, INT4, E8M0 and E4M3 decoders, the E4M3 word decoder of FP8 weights in
    its SM80 / host form; SM89 on use the GPU's conversion instruction), built for the host with the bf16x2 FMA
    emulated: every code in every nibble position gives the value of cudnn_moe.formats (element 2i = low nibble
    of byte i), bit for bit, and every E8M0 / E4M3 byte the value torch gives (bits; NaN codes NaN)."""
    from cudnn_moe.formats import decode_e2m1

    program = host_program(tmp_path, "decode", _DECODE_DRIVER)
    gen = torch.Generator().manual_seed(0)
    nibbles = torch.arange(16, dtype=torch.int64)
    same = (nibbles[:, None] * torch.tensor([0x11111111], dtype=torch.int64)).flatten()  # every code everywhere
    counting = torch.tensor([0x76543210, 0xFEDCBA98, 0x89ABCDEF, 0x01234567], dtype=torch.int64)
    randoms = torch.randint(0, 2**32, (4096,), generator=gen, dtype=torch.int64)
    words = torch.cat([same, counting, randoms]).to(torch.uint32 if hasattr(torch, "uint32") else torch.int64)
    np.asarray(words.numpy(), dtype=np.uint32).tofile(tmp_path / "in.bin")
    subprocess.run([str(program), str(tmp_path / "in.bin"), str(tmp_path / "out.bin")], check=True)
    raw = np.fromfile(tmp_path / "out.bin", dtype=np.float32)
    n = words.numel()
    got = torch.from_numpy(raw[: 24 * n].reshape(n, 24).copy())
    as_bytes = torch.from_numpy(np.asarray(words.numpy(), dtype=np.uint32).view(np.uint8).reshape(n, 4).copy())
    codes = torch.stack((as_bytes & 0xF, as_bytes >> 4), dim=-1).reshape(n, 8)  # element 2i: low nibble of byte i
    want_fp4 = decode_e2m1(codes)
    assert torch.equal(got[:, :8].view(torch.int32), want_fp4.view(torch.int32)), "E2M1 decode differs (bits)"
    want_int4 = torch.where(codes >= 8, codes.long() - 16, codes.long()).float()
    assert torch.equal(got[:, 8:16], want_int4), "INT4 decode differs"
    fp8_bytes = torch.cat((as_bytes, 255 - as_bytes), dim=1)  # the bytes of q, then of ~q: element j = byte j
    want_fp8 = fp8_bytes.view(torch.float8_e4m3fn).float()
    fin = want_fp8.isfinite()
    assert torch.equal(got[:, 16:][fin].view(torch.int32), want_fp8[fin].view(torch.int32)), "E4M3 word decode differs"
    assert bool(got[:, 16:][~fin].isnan().all())
    scales = torch.from_numpy(raw[24 * n :].copy()).view(256, 2)
    byte = torch.arange(256, dtype=torch.uint8)
    torch.testing.assert_close(scales[:, 0], byte.view(torch.float8_e8m0fnu).float(), rtol=0, atol=0, equal_nan=True)
    assert scales[0, 0] == 2.0**-127 and scales[255, 0].isnan()
    e4m3 = byte.view(torch.float8_e4m3fn).float()
    finite = e4m3.isfinite()
    assert torch.equal(scales[finite, 1].view(torch.int32), e4m3[finite].view(torch.int32)), "E4M3 decode differs (bits)"
    assert bool(scales[~finite, 1].isnan().all()) and int((~finite).sum()) == 2


_TILE_DECODE_DRIVER = HOST_PRELUDE + r"""
#include "low_latency/decode.cuh"

// argv[1]: uint32 words; argv[2]: per word its 8 values as E2M1 tile registers, then as INT4 tile registers
// (float32); then for b = 0..255 the two values of decode_e2m1_byte(b); then for c = 0..255 the scale of tile scale
// code c (decode_tile_scale_codes, eight codes c .. c + 7 at a time).
int main(int, char** argv) {
  FILE* in = std::fopen(argv[1], "rb");
  FILE* out = std::fopen(argv[2], "wb");
  unsigned int w;
  while (std::fread(&w, 4, 1, in) == 1) {
    float v[16];
    ll::decode_tile_e2m1_word(w, v);
    ll::decode_tile_int4_word(w, v + 8);
    std::fwrite(v, 4, 16, out);
  }
  for (unsigned int b = 0; b < 256; ++b) {
    float pair[2];
    ll::decode_e2m1_byte(b, pair[0], pair[1]);
    std::fwrite(pair, 4, 2, out);
  }
  for (unsigned int c = 0; c < 256; c += 8) {
    float v[8];
    ll::decode_tile_scale_codes(c | (c + 1) << 8 | (c + 2) << 16 | (c + 3) << 24,
                                (c + 4) | (c + 5) << 8 | (c + 6) << 16 | (c + 7) << 24, v);
    std::fwrite(v, 4, 8, out);
  }
  return std::fclose(out) != 0 || std::fclose(in) != 0;
}
"""


@pytest.mark.skipif(CXX is None, reason="no C++ compiler")
def test_tile_decoders_give_the_rows_and_k_of_the_sm90_tiles(tmp_path: Path) -> None:
    """The tile mode's decoders (decode.cuh), built for the host, on random tiles packed by
    cudnn_moe.engines.sm90.layout: word s of lane (g, q) gives, bit for bit, rows g (registers a0, a2) and g + 8
    (a1, a3) at k = 16s + 2q + {0, 1} and + 8 (E2M1 and INT4 tiles); decode_e2m1_byte gives a byte's two codes;
    decode_tile_scale_codes gives each unsigned E4M3 scale back from its tile code (layout.py), bit for bit (both
    zeros as zeros), and the NaN code NaN."""
    from cudnn_moe.engines.sm90.layout import pack_int4_weight_tiles, pack_weight_tiles
    from cudnn_moe.formats import decode_e2m1, pack_nibbles

    program = host_program(tmp_path, "tile_decode", _TILE_DECODE_DRIVER)
    gen = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (1, 16, 128), generator=gen, dtype=torch.uint8)  # two k64 tiles of one row block
    packed = pack_nibbles(codes)
    fp4_tiles, _ = pack_weight_tiles(packed, torch.zeros(1, 16, 8, dtype=torch.uint8))
    int4_tiles, _ = pack_int4_weight_tiles(packed, torch.zeros(1, 16, 4, dtype=torch.bfloat16))
    words = torch.cat((fp4_tiles.flatten(), int4_tiles.flatten())).view(torch.int32)  # [2 kinds x 2 tiles x 32 x 4]
    np.asarray(words.numpy(), dtype=np.int32).tofile(tmp_path / "in.bin")
    subprocess.run([str(program), str(tmp_path / "in.bin"), str(tmp_path / "out.bin")], check=True)
    raw = np.fromfile(tmp_path / "out.bin", dtype=np.float32)
    got = torch.from_numpy(raw[: 512 * 16].copy()).view(2, 2, 32, 4, 16)  # kind, tile, lane, word, values
    g, q = torch.arange(32) // 4, torch.arange(32) % 4
    fp4_values = decode_e2m1(codes[0])
    int4_values = torch.where(codes[0] >= 8, codes[0].long() - 16, codes[0].long()).float()
    for kind, (values, offset) in enumerate(((fp4_values, 0), (int4_values, 8))):
        for tile in range(2):
            for s in range(4):
                for r in range(4):
                    row = g + 8 * (r % 2)
                    for x in range(2):
                        k = 64 * tile + 16 * s + 2 * q + 8 * (r // 2) + x
                        want = values[row, k]
                        have = got[kind, tile, :, s, offset + 2 * r + x]
                        assert torch.equal(have.view(torch.int32), want.view(torch.int32)), (kind, tile, s, r, x)
    pairs = torch.from_numpy(raw[512 * 16 : 512 * 16 + 512].copy()).view(256, 2)
    byte = torch.arange(256)
    want_pairs = decode_e2m1(torch.stack((byte & 0xF, byte >> 4), dim=1).to(torch.uint8))
    assert torch.equal(pairs.view(torch.int32), want_pairs.view(torch.int32))
    of_code = torch.from_numpy(raw[512 * 16 + 512 :].copy())

    def scale_of_byte(byte: int) -> torch.Tensor:  # the kernel's scale for the tile code layout.py gives E4M3 byte
        block = torch.full((1, 16, 4), byte, dtype=torch.uint8).view(torch.float8_e4m3fn)
        return of_code[int(pack_weight_tiles(torch.zeros(1, 16, 32, dtype=torch.uint8), block)[1][0, 0])]

    got_scales = torch.stack([scale_of_byte(b) for b in range(1, 127)])
    want_scales = torch.arange(1, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    assert torch.equal(got_scales.view(torch.int32), want_scales.view(torch.int32))
    assert scale_of_byte(0x00) == 0 and scale_of_byte(0x80) == 0 and torch.isnan(scale_of_byte(0x7F))


# ----------------------------------------------------------------------------- call checks on the CPU
def test_call_checks_arguments_before_any_launch() -> None:
    config = LowLatencyMoeConfig(4, arch="sm90")
    weights = _cpu_layer(WeightFormat.BF16)
    x = torch.zeros(2, weights.hidden_size, dtype=torch.bfloat16)
    routing = Routing.unpacked(torch.zeros(2, 2, dtype=torch.int32), torch.ones(2, 2))
    with pytest.raises(TypeError, match="config"):
        low_latency_moe(object(), x, weights, routing)
    with pytest.raises(TypeError, match="weights"):
        low_latency_moe(config, x, object(), routing)
    with pytest.raises(TypeError, match="routing"):
        low_latency_moe(config, x, weights, (routing.ids, routing.weights))
    with pytest.raises(TypeError, match="hidden_states"):
        low_latency_moe(config, x.float(), weights, routing)
    with pytest.raises(ValueError, match="gated"):
        low_latency_moe(config, x, weights, routing, activation="silu")
    with pytest.raises(ValueError, match="out_dtype"):
        low_latency_moe(config, x, weights, routing, out_dtype=torch.float32)
    with pytest.raises(TypeError, match="finalize"):
        low_latency_moe(config, x, weights, routing, finalize="yes")
    with pytest.raises(ValueError, match="max_num_tokens"):
        low_latency_moe(LowLatencyMoeConfig(1, arch="sm90"), x, weights, routing)
    with pytest.raises(TypeError, match="return_scores"):
        low_latency_moe(config, x, weights, routing, finalize=False, return_scores=1)
    with pytest.raises(ValueError, match="return_scores=True needs finalize=False"):
        low_latency_moe(config, x, weights, routing, return_scores=True)
    with pytest.raises(ValueError, match="scores_out is given but return_scores is False"):
        low_latency_moe(config, x, weights, routing, finalize=False, scores_out=torch.zeros(2, 2))
    with pytest.raises(ValueError, match="CUDA device"):
        low_latency_moe(config, x, weights, routing)
    with pytest.raises(ValueError, match="CUDA device"):
        low_latency_moe(config, x, weights, routing, finalize=False, return_scores=True)
