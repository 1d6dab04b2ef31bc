"""CPU checks of the SM90 kernels (kernels_cuda/sm90/): every source compiles with nvcc for sm_90a and
sm_100a; the decode bit operations of fragments.cuh, emulated in Python, give the exact NVFP4 values
for every E2M1 code and E4M3 scale byte, and read the layouts of layout.py right (weight tiles, scale
tiles, token fragments, the C fragment and the transposing stmatrix of the prefill epilogue); the
tile finder finds every tile; the wrappers check their arguments before launching and pass what
the kernels' C signatures take; the decode kernel's main loop keeps to its issue budget in SASS."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from cudnn_moe.activations import GELU, GeGLUTanh, SiTU, SwiGLU
from cudnn_moe.engines.base import (
    ActivationEpilogue,
    BlockCode,
    EarlyRouting,
    FinalizeEpilogue,
    RoutePrologue,
    RowGather,
    TileHandoff,
    TokenOperand,
)
from cudnn_moe.engines.sm90 import kernels as sm90
from cudnn_moe.engines.sm90.layout import pack_weight_tiles, to_token_fragments, unpack_weight_tiles
from cudnn_moe.formats import decode_e2m1, dequantize_nvfp4, quantize_nvfp4
from cudnn_moe.kernels import IntermediateCode, RoutingFormat, SortBuffers, TokenLayout, cuda_defines, kernels_dir, loader
from cudnn_moe.kernels.codes import NVFP4_TILE_SCALE_BASE
from cudnn_moe.kernels import sort as kernel_sort
from cudnn_moe.kernels import stage as kernel_stage

from tests.support import REPO as ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import sass_budget  # noqa: E402

SM90_DIR = kernels_dir() / "sm90"
SOURCES = sorted(path.name for path in SM90_DIR.glob("*.cu"))
CUOBJDUMP = sass_budget.find_tool("cuobjdump")

from tests.support.kernel_sources import NVCC, compiled, ptxas_report, register_usage  # noqa: E402
from tests.support.sm90_variants import (  # noqa: E402
    DECODE_VARIANTS, OTHER_PREFILL_VARIANTS, PREFILL_VARIANTS, SIX_CTAS_AN_SM, WGMMA_VARIANTS,
)


def _nvcc_command(source: Path, arch: str, options: tuple[str, ...] = ()) -> list[str]:
    return [NVCC, "-std=c++17", f"-gencode=arch=compute_{arch},code=sm_{arch}", "-I", str(kernels_dir()),
            *cuda_defines(), *options, "-Xptxas", "-v", "-c", str(source)]


def _nvcc(source: Path, arch: str, options: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """nvcc -c of ``source`` (ptxas -v report in stderr), compiled once per session (kernel_sources)."""
    return compiled(_nvcc_command(source, arch, options))[0]


def _sass_defines(variant: sm90.DecodeVariant) -> list[str]:
    return [option[2:] for option in variant.options()]


def nvcc_jobs(item: pytest.Item) -> list[tuple[list[str], str]]:
    """The nvcc builds ``item`` needs, started ahead by the session (kernel_sources.prefetch)."""
    params = getattr(item, "callspec", None)
    params = params.params if params is not None else {}
    gemm = SM90_DIR / "grouped_gemm.cu"
    if item.originalname == "test_kernel_compiles":
        return [(_nvcc_command(SM90_DIR / params["source"], params["arch"]), ".o")]
    if item.originalname == "test_wgmma_variant_compiles":
        return [(_nvcc_command(SM90_DIR / "wgmma_gemm.cu", "90a", params["variant"].options()), ".o")]
    if item.originalname == "test_epilogue_compiles":
        variant = params["variant"]
        options = (*variant.options(), *sm90.epilogue_options(params["activation"]))
        return [(_nvcc_command(kernels_dir() / variant.source, "90a", options), ".o")]
    if item.originalname == "test_variant_compiles":
        return [(_nvcc_command(gemm, "90a", params["variant"].options()), ".o")]
    if item.originalname == "test_finalize_compiles":
        return [(_nvcc_command(gemm, params["arch"], (*params["variant"].options(), "-DSM90_FINALIZE=1")), ".o")]
    if item.originalname == "test_coded_decode_compiles":
        options = coded_options(params["variant"], params["form"], params["code"])
        return [(_nvcc_command(gemm, params["arch"], options), ".o")]
    if item.originalname == "test_bf16_decode_compiles":
        return [(_nvcc_command(gemm, params["arch"], bf16_options(params["form"])), ".o")]
    if item.originalname == "test_route_compiles":
        return [(_nvcc_command(gemm, params["arch"], route_options(params["variant"], params["tokens"])), ".o")]
    if item.originalname == "test_prefill_variant_compiles_for_sm100":
        return [(_nvcc_command(gemm, "100a", params["variant"].options()), ".o")]
    if item.originalname == "test_decode_sass_budget":
        return [(sass_budget.cubin_command("90a", _sass_defines(params["variant"])), ".cubin")]
    return []


# ---------------------------------------------------------------------------------------------------------------
# Compilation
# ---------------------------------------------------------------------------------------------------------------


def test_sources_present() -> None:
    assert SOURCES == ["grouped_gemm.cu", "wgmma_gemm.cu"]


# wgmma exists on sm_90a only: the wgmma kernel is built for that target alone (its variant carries
# loader.ARCH_SPECIFIC); the engine picks it on SM90 only.
ARCH_SOURCES = [(source, arch) for source in SOURCES for arch in ("90a", "100a")
                if not (source == "wgmma_gemm.cu" and arch != "90a")]


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("source,arch", ARCH_SOURCES)
def test_kernel_compiles(source: str, arch: str) -> None:
    result = _nvcc(SM90_DIR / source, arch)
    assert result.returncode == 0, result.stderr


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("variant", WGMMA_VARIANTS, ids=str)
def test_wgmma_variant_compiles(variant: Any) -> None:
    """Every wgmma variant builds for sm_90a without spills or static shared memory (but the tiled token load's
    mbarriers, 8 bytes a stage), with HGMMA in its loop (the SASS check runs where cuobjdump is found)."""
    result = _nvcc(SM90_DIR / "wgmma_gemm.cu", "90a", variant.options())
    report = ptxas_report(result, variant.kernel)
    static = re.search(r"\b(\d+) bytes smem", report)
    assert " 0 bytes spill stores" in report, report
    assert (int(static.group(1)) if static else 0) <= (128 if variant.tiled_tokens else 0), report
    assert "instructions are serialized" not in result.stderr  # ptxas's warning when wgmma must wait on itself


EPILOGUE_DECODE_VARIANTS = [v for v in DECODE_VARIANTS if v.epilogue_problem(SwiGLU()) is None]


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("variant,activation", [(v, SwiGLU()) for v in WGMMA_VARIANTS + EPILOGUE_DECODE_VARIANTS] +
                         [(v, act) for v in (WGMMA_VARIANTS[0], EPILOGUE_DECODE_VARIANTS[0])
                          for act in (GELU(), SiTU(1.5, 2.0), GeGLUTanh())], ids=str)
def test_epilogue_compiles(variant: Any, activation: Any) -> None:
    """The wgmma (reading natural rows, as GEMM1 does) and decode kernels with an activation epilogue compiled in
    build for sm_90a; the SwiGLU epilogue (the models' activation) keeps every variant free of spills."""
    variant = variant.gathering() if isinstance(variant, sm90.WgmmaVariant) else variant
    result = _nvcc(kernels_dir() / variant.source, "90a", (*variant.options(), *sm90.epilogue_options(activation)))
    report = ptxas_report(result, variant.kernel)
    if isinstance(activation, SwiGLU):
        assert " 0 bytes spill stores" in report, report
    assert "instructions are serialized" not in result.stderr


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("variant", [*DECODE_VARIANTS, *PREFILL_VARIANTS[1:]], ids=str)
def test_variant_compiles(variant: Any) -> None:
    result = _nvcc(SM90_DIR / "grouped_gemm.cu", "90a", variant.options())
    report = ptxas_report(result, variant.kernel)
    print(variant, report)
    if variant.kernel == "sm90_gemm_decode":  # the decode register ring must never go to local memory
        assert " 0 bytes spill stores" in report, report
    else:  # the dynamic shared memory only: PrefillVariant.shared_mem is all the kernel needs
        assert not re.search(r"\b[1-9]\d* bytes smem", report), report


def test_decode_min_blocks_sets_the_wave_and_the_launch_bounds() -> None:
    """min_blocks: CTAs an SM in the launch bounds (-DSM90_MIN_BLOCKS) and in the wave the engine counts; 0 keeps 512
    threads an SM; it must ask for more than that and fit 2048 threads."""
    six = SIX_CTAS_AN_SM
    assert "-DSM90_MIN_BLOCKS=6" in six.options() and sm90.decode_wave(six, 132) == 792
    plain = replace(six, min_blocks=0)
    assert not any("MIN_BLOCKS" in o for o in plain.options()) and sm90.decode_wave(plain, 132) == 528
    for bad in (-1, 4, 17):  # 512 threads: the kernel's own rule; 2176 threads
        with pytest.raises(ValueError, match="min_blocks"):
            replace(six, min_blocks=bad)


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
def test_six_ctas_an_sm_fit_the_register_file_behind_the_handoff() -> None:
    """The form held to six CTAs of 128 threads an SM, as GEMM1 runs it (SwiGLU epilogue, tile signal): at most 80
    registers a thread (65536 / 768, in steps of 8), spilling no more than 8 bytes."""
    six = SIX_CTAS_AN_SM
    options = (*six.options(), *sm90.epilogue_options(SwiGLU()), "-DSM90_SIGNAL=1")
    result = _nvcc(SM90_DIR / "grouped_gemm.cu", "90a", options)
    registers, spilled = register_usage(ptxas_report(result, six.kernel))
    assert registers <= 80 and spilled <= 8, (registers, spilled)


# The decode module's option of each tile code but NVFP4's.
CODE_OPTIONS = {"mxint4": ("-DSM90_W_INT4=1",), "mxfp4": ("-DSM90_W_MXFP4=1",)}


def coded_options(variant: Any, form: str, code: str) -> tuple[str, ...]:
    """The decode module's options for MXINT4 or MXFP4 weights (``code``): plain (GEMM2), with the finalize, waiting for
    GEMM1's tiles (a handoff), or with the SwiGLU epilogue (GEMM1; MXINT4: FP32 preactivations) and its handoff
    signal; MXFP4 also as the MXFP4 pair's GEMM1 (the epilogue quantizing to MXFP8, with the signal, and with early
    routing too)."""
    swiglu = sm90.epilogue_options(SwiGLU())
    mxfp8 = (*swiglu, "-DSM90_ACT_MXFP8=1")
    extra = {"plain": (), "finalize": ("-DSM90_FINALIZE=1",), "await": ("-DSM90_AWAIT=1", "-DSM90_FINALIZE=1"),
             "swiglu": swiglu, "signal": (*swiglu, "-DSM90_SIGNAL=1"), "swiglu-mxfp8": mxfp8,
             "signal-mxfp8": (*mxfp8, "-DSM90_SIGNAL=1"),
             "early-signal-mxfp8": (*mxfp8, "-DSM90_SIGNAL=1", "-DSM90_EARLY=1")}[form]
    return (*variant.options(), *CODE_OPTIONS[code], *extra)


# The variants the engine picks for buckets of at most 8 tokens (engine.py: _WIDE, _SPLIT, _SPLIT_DEEP), the only
# ones MXINT4 and MXFP4 layers (low-latency calls) run but for _WIDE_MT4 (GEMM2 of NVFP4 and MXFP4 tiles past one
# wave of _WIDE) and its split-K form behind a tile handoff.
LOW_LATENCY_DECODE_VARIANTS = [sm90.DecodeVariant(mt=2, wm=4, wk=1, nt=1, prefetch=4),
                               sm90.DecodeVariant(mt=2, wm=2, wk=2, nt=1, prefetch=4),
                               sm90.DecodeVariant(mt=2, wm=2, wk=4, nt=1, prefetch=4)]
WIDE_MT4 = sm90.DecodeVariant(mt=4, wm=2, wk=1, nt=1, prefetch=2)
WIDE_MT4_SPLIT = sm90.DecodeVariant(mt=4, wm=2, wk=2, nt=1, prefetch=2)
_CODED_FORMS = ("plain", "finalize", "await", "swiglu", "signal")
_PAIR_FORMS = ("swiglu-mxfp8", "signal-mxfp8", "early-signal-mxfp8")  # GEMM1 of the MXFP4 pair stored in its tiles


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("variant,form,code,arch", [(v, f, c, "90a") for v in LOW_LATENCY_DECODE_VARIANTS
                                                    for f in _CODED_FORMS for c in CODE_OPTIONS]
                         + [(WIDE_MT4, f, "mxfp4", "90a") for f in ("plain", "finalize", "await")]
                         + [(WIDE_MT4_SPLIT, "await", "mxfp4", "90a")]
                         + [(v, f, "mxfp4", "90a") for v in LOW_LATENCY_DECODE_VARIANTS for f in _PAIR_FORMS]
                         + [(LOW_LATENCY_DECODE_VARIANTS[1], "signal-mxfp8", "mxfp4", "100a")]
                         + [(LOW_LATENCY_DECODE_VARIANTS[0], "swiglu", c, "100a") for c in CODE_OPTIONS], ids=str)
def test_coded_decode_compiles(variant: Any, form: str, code: str, arch: str) -> None:
    """The decode kernel with MXINT4 or MXFP4 weights builds in every form the low-latency chain uses, within 128
    registers a thread (512 threads an SM, as the NVFP4 forms); MXINT4 spills at most 8 bytes, MXFP4 (whose ring holds
    fewer scale bytes than NVFP4's) none."""
    result = _nvcc(SM90_DIR / "grouped_gemm.cu", arch, coded_options(variant, form, code))
    report = ptxas_report(result, variant.kernel)
    registers, spilled = register_usage(report)
    assert registers * variant.threads * (512 // variant.threads) <= 65536, report
    assert spilled <= (8 if code == "mxint4" else 0), report


# The one variant BF16 weights run (engine.py: _BF16).
BF16_VARIANT = sm90.DecodeVariant(mt=1, wm=4, wk=1, nt=1, prefetch=4, bf16_weights=True)


def bf16_options(form: str) -> tuple[str, ...]:
    """The decode module's options for BF16 weights: plain (GEMM2), with the finalize, or with the SwiGLU epilogue."""
    extra = {"plain": (), "finalize": ("-DSM90_FINALIZE=1",), "swiglu": sm90.epilogue_options(SwiGLU())}[form]
    return (*BF16_VARIANT.options(), *extra)


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("form,arch", [(f, "90a") for f in ("plain", "finalize", "swiglu")] + [("swiglu", "100a")],
                         ids=str)
def test_bf16_decode_compiles(form: str, arch: str) -> None:
    """The decode kernel's BF16-weight form builds in every form the low-latency chain uses without spills, for sm_90a
    (the engine's GPU) within 128 registers a thread (four CTAs of 128 threads an SM)."""
    result = _nvcc(SM90_DIR / "grouped_gemm.cu", arch, bf16_options(form))
    report = ptxas_report(result, BF16_VARIANT.kernel)
    registers, _ = register_usage(report)
    assert (arch != "90a" or registers <= 128) and " 0 bytes spill stores" in report, report


def route_options(variant: Any, tokens: str) -> tuple[str, ...]:
    """The decode module's options for GEMM1 with the stage and the sort in its prologue (SwiGLU epilogue) for BF16 or
    NVFP4 tokens, or ("mxint4", "mxfp4") MXINT4 or MXFP4 weights and BF16 tokens, or ("mxfp8") the MXFP4 pair's: MXFP4
    tiles, MXFP8 tokens and the epilogue quantizing to MXFP8."""
    if tokens == "mxfp8":
        return (*variant.options(), *CODE_OPTIONS["mxfp4"], *sm90.epilogue_options(SwiGLU()), "-DSM90_ACT_MXFP8=1",
                "-DSM90_ROUTE=3")
    return (*variant.options(), *CODE_OPTIONS.get(tokens, ()), *sm90.epilogue_options(SwiGLU()),
            f"-DSM90_ROUTE={2 if tokens == 'nvfp4' else 1}")


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("variant,tokens,arch", [(v, t, "90a") for v in LOW_LATENCY_DECODE_VARIANTS
                                                 for t in ("bf16", "nvfp4", "mxint4", "mxfp4", "mxfp8")]
                         + [(LOW_LATENCY_DECODE_VARIANTS[2], t, "100a") for t in ("nvfp4", "mxfp8")], ids=str)
def test_route_compiles(variant: Any, tokens: str, arch: str) -> None:
    """GEMM1 of a one-token bucket with the stage and the sort in its prologue builds for the variants the engine
    picks there within 128 registers a thread (512 threads an SM, as the plain forms), without spills (MXINT4: at most
    8 bytes, as its plain form; MXFP4 tiles none, as NVFP4's, with MXFP8 tokens too): the token row lives in dynamic
    shared memory, the sort's arrays in static."""
    result = _nvcc(SM90_DIR / "grouped_gemm.cu", arch, route_options(variant, tokens))
    report = ptxas_report(result, variant.kernel)
    registers, spilled = register_usage(report)
    assert registers <= 128 and spilled <= (8 if tokens == "mxint4" else 0), report


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("variant,arch", [(v, "90a") for v in DECODE_VARIANTS] + [(DECODE_VARIANTS[0], "100a")],
                         ids=str)
def test_finalize_compiles(variant: Any, arch: str) -> None:
    """The decode kernel with GEMM2's finalize compiled in builds without spills."""
    result = _nvcc(SM90_DIR / "grouped_gemm.cu", arch, (*variant.options(), "-DSM90_FINALIZE=1"))
    report = ptxas_report(result, variant.kernel)
    assert " 0 bytes spill stores" in report, report


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("variant", OTHER_PREFILL_VARIANTS, ids=str)
def test_prefill_variant_compiles_for_sm100(variant: Any) -> None:
    result = _nvcc(SM90_DIR / "grouped_gemm.cu", "100a", variant.options())
    assert result.returncode == 0, result.stderr


# ---------------------------------------------------------------------------------------------------------------
# Bit-exact emulation of the decode of fragments.cuh
# ---------------------------------------------------------------------------------------------------------------

M32 = 0xFFFFFFFF
CODE_MASK = 0x81C081C0


def _u32(x: np.ndarray) -> np.ndarray:
    return (x.astype(np.uint64) & M32).astype(np.uint64)


def _rotl(w: np.ndarray, n: int) -> np.ndarray:
    return ((w << np.uint64(n)) & M32) | (w >> np.uint64(32 - n))


def place_tile_e2m1(w: np.ndarray) -> list[np.ndarray]:
    """common.cuh place_tile_e2m1: word -> a0..a3 (bf16x2 bits); a3's 32-bit multiply wraps."""
    w = w.astype(np.uint64)
    return [
        w & CODE_MASK,
        _rotl(w, 10) & CODE_MASK,
        _rotl(w, 13) & CODE_MASK,
        (((w & 0x001B001B) * 0x1084) & M32) & CODE_MASK,
    ]


def bf16_value(bits: np.ndarray) -> np.ndarray:
    """16-bit patterns -> float64 values (subnormals included)."""
    t = torch.from_numpy((bits.astype(np.int64) & 0xFFFF).astype(np.uint16).view(np.int16).copy())
    return t.view(torch.bfloat16).double().numpy()


def bf16_bits(values: np.ndarray) -> np.ndarray:
    """float64 values that must be exact BF16 -> their 16-bit patterns (asserts exactness)."""
    t = torch.from_numpy(np.asarray(values, dtype=np.float64))
    rounded = t.to(torch.float32).to(torch.bfloat16)
    assert torch.equal(rounded.double(), t), "a product is not exact in BF16"
    return rounded.view(torch.int16).numpy().astype(np.int64) & 0xFFFF


def halves(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return x & 0xFFFF, (x >> 16) & 0xFFFF


def bf16x2_mul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """mul.rn.bf16x2 for exact products (asserted)."""
    (alo, ahi), (blo, bhi) = halves(a), halves(b)
    lo = bf16_bits(bf16_value(alo) * bf16_value(blo))
    hi = bf16_bits(bf16_value(ahi) * bf16_value(bhi))
    return (lo | (hi << 16)).astype(np.uint64)


def decode_tile_scale_word(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """fragments.cuh decode_tile_scale_word -> (row g pair, row g+8 pair) of s x 2^118: codes 0, 2 (row g) and 1, 3
    (row g + 8) of the word, each 16 c + NVFP4_TILE_SCALE_BASE in its half."""
    w = w.astype(np.uint64)
    base = np.uint64(NVFP4_TILE_SCALE_BASE * 0x10001)
    row_g = ((w & 0xFF) | (((w >> 16) & 0xFF) << 16)) * 16 + base
    row_g8 = (((w >> 8) & 0xFF) | (((w >> 24) & 0xFF) << 16)) * 16 + base
    return row_g, row_g8


def broadcast(s: np.ndarray, high: bool) -> np.ndarray:
    h = (s >> 16) & 0xFFFF if high else s & 0xFFFF
    return h | (h << 16)


def scaled_a(w: np.ndarray, sg: np.ndarray, sg8: np.ndarray, step: int) -> list[np.ndarray]:
    """fragments.cuh scaled_a<step>: sg / sg8 = the pairs of the scale word of steps (step & ~1, | 1)."""
    a = place_tile_e2m1(w)
    high = bool(step & 1)
    return [bf16x2_mul(a[0], broadcast(sg, high)), bf16x2_mul(a[1], broadcast(sg8, high)),
            bf16x2_mul(a[2], broadcast(sg, high)), bf16x2_mul(a[3], broadcast(sg8, high))]


def e2m1_byte_pair(x: np.ndarray) -> np.ndarray:
    """fragments.cuh e2m1_byte_pair: the byte in bits 0..7 of x -> bf16x2 bits (low nibble, high nibble) x 2^-126."""
    x = x.astype(np.uint64)
    return (((x << 6) & M32) & 0x000001C0) | (((x << 12) & M32) & 0x00008000) | (
        ((x << 18) & M32) & 0x01C00000) | (((x << 24) & M32) & 0x80000000)


def test_token_decode_every_byte_every_scale() -> None:
    """fragments.cuh decode_token_words, per pair: (the byte's bf16x2 E2M1 x 2^-126) x (scale x 2^118) x 2^8 equals
    decode_fragment_words' pair, e2m1(low) * s and e2m1(high) * s, bit for bit, for all 256 bytes (the byte's
    neighbours in the word masked off) and every finite E4M3 scale of either sign."""
    table = decode_e2m1(torch.arange(16, dtype=torch.uint8)).double().numpy()
    scale_bytes = np.array([b for b in range(256) if b & 0x7F != 0x7F], dtype=np.uint64)
    scales = torch.from_numpy(scale_bytes.astype(np.uint8)).view(torch.float8_e4m3fn).double().numpy()
    pow8 = np.uint64(0x43804380)
    for byte in range(256):
        for q in range(4):
            word = np.uint64(0xA5A5A5A5) & ~np.uint64(0xFF << (8 * q)) | np.uint64(byte << (8 * q))
            pair = e2m1_byte_pair(np.full(scale_bytes.shape, word >> np.uint64(8 * q), dtype=np.uint64))
            s118 = bf16_bits(scales * 2.0**118).astype(np.uint64)
            got = bf16x2_mul(bf16x2_mul(pair, s118 | (s118 << 16)), np.full_like(pair, pow8))
            lo, hi = halves(got)
            want_lo = bf16_bits(table[byte & 0xF] * scales)
            want_hi = bf16_bits(table[byte >> 4] * scales)
            np.testing.assert_array_equal(lo, want_lo)
            np.testing.assert_array_equal(hi, want_hi)


def test_weight_decode_every_code_every_scale() -> None:
    """All 16 codes in every register slot and half, x all 127 finite scale bytes, in every scale
    byte position: (bits -> bf16) x (scale byte -> bf16 x 2^118) == e2m1 x e4m3 x 2^-8 exactly."""
    codes = np.arange(16)
    expected_w = decode_e2m1(torch.arange(16, dtype=torch.uint8)).double().numpy()
    # A word holding code c in every slot: place bits per layout.CODE_BITS
    from cudnn_moe.engines.sm90.layout import CODE_BITS

    for r, register_bits in enumerate(CODE_BITS):
        for half, (sign, *mag) in enumerate(register_bits):
            word = np.zeros(16, dtype=np.uint64)
            for bit, pos in enumerate(mag):
                word |= (((codes >> bit) & 1).astype(np.uint64) << np.uint64(pos))
            word |= (((codes >> 3) & 1).astype(np.uint64) << np.uint64(sign))
            value = bf16_value((place_tile_e2m1(word)[r] >> (16 * half)) & 0xFFFF)
            np.testing.assert_array_equal(value, expected_w * 2.0**-126)
            other = bf16_value((place_tile_e2m1(word)[r] >> (16 * (1 - half))) & 0xFFFF)
            assert not other.any(), "a code leaks into the other half"
            for r2 in range(4):
                if r2 != r:
                    assert not place_tile_e2m1(word)[r2].any(), f"register {r} leaks into register {r2}"

    # every unsigned E4M3 scale, as the tiles store it (its code), in every byte position of the scale word
    scale_bytes = torch.tensor([*range(127), 0x80], dtype=torch.uint8)
    codes = tile_scale_codes(scale_bytes).astype(np.uint64)
    expected_s = scale_bytes.view(torch.float8_e4m3fn).double().numpy()
    w_bits = bf16_bits(expected_w * 2.0**-126)
    for pos in range(4):  # byte position in the scale word: (step parity, row half)
        others = np.uint64(0xA5A5A5A5) & ~np.uint64(0xFF << (8 * pos))  # neighbours must not leak
        word = (codes << np.uint64(8 * pos)) | others
        row_g, row_g8 = decode_tile_scale_word(word)
        pair = row_g if pos % 2 == 0 else row_g8
        chosen = bf16_value(broadcast(pair, high=pos >= 2) & 0xFFFF)
        np.testing.assert_array_equal(chosen[:-1], expected_s[:-1] * 2.0**118)
        assert chosen[0] == 0 and chosen[-1] <= 0 and abs(chosen[-1]) < 2.0**-120  # +0 and -0: -0, a tiny negative
        # products with every code, rounded to BF16 as mul.rn.bf16x2 does: w * s * 2^-8 exactly, normal or zero
        product = bf16_value(w_bits)[:, None] * chosen[None, :]
        rounded = torch.from_numpy(product.ravel()).to(torch.bfloat16).double().numpy().reshape(product.shape)
        np.testing.assert_array_equal(rounded, expected_w[:, None] * expected_s[None, :] * 2.0**-8)
        nonzero = np.abs(rounded[rounded != 0])
        assert nonzero.min() >= 2.0**-126 * 2**8  # far from BF16 subnormals (min |w s| 2^-8 = 2^-18)


def tile_scale_codes(scale_bytes: torch.Tensor) -> np.ndarray:
    """The NVFP4 tiles' codes of E4M3 scale bytes (pack_weight_tiles on a 16 x 64 block of them)."""
    block = torch.zeros(1, 16, 4, dtype=torch.uint8)
    codes = []
    for byte in scale_bytes.tolist():
        block[:] = byte
        codes.append(int(pack_weight_tiles(torch.zeros(1, 16, 32, dtype=torch.uint8), block)[1][0, 0]))
    return np.array(codes)


def test_tile_scale_codes_round_trip_and_decode_as_the_bf16_of_s_times_2_pow_118() -> None:
    """layout.py's scale codes: each unsigned E4M3 byte (0x00-0x7E, 0x80) its own code, unpacked back bit for bit;
    the positive ones 0 .. 142 in steps of the BF16 bits of s x 2^118 (16 c + base), +0 160, -0 161; NaN and negative
    bytes the NaN code 153 (a BF16 NaN)."""
    unsigned = torch.tensor([*range(127), 0x80], dtype=torch.uint8)
    codes = tile_scale_codes(unsigned)
    assert len(set(codes.tolist())) == len(codes) and codes[0] == 160 and codes[-1] == 161
    assert codes[1:-1].max() == 142
    scales = unsigned.view(torch.float8_e4m3fn).double().numpy()
    np.testing.assert_array_equal(bf16_value(16 * codes[1:-1] + NVFP4_TILE_SCALE_BASE), scales[1:-1] * 2.0**118)
    refused = torch.tensor([0x7F, 0xFF, 0x81, 0xB8, 0xFE], dtype=torch.uint8)
    assert (tile_scale_codes(refused) == 153).all() and np.isnan(bf16_value(np.array([16 * 153 + NVFP4_TILE_SCALE_BASE])))
    block = unsigned.repeat(16 * 4)[: 16 * 4 * 32].reshape(1, 16 * 4, 32)  # 64 rows x 32 blocks (K = 512)
    tiles, tile_scales = pack_weight_tiles(torch.zeros(1, 64, 256, dtype=torch.uint8), block.view(torch.float8_e4m3fn))
    _, back = unpack_weight_tiles(tiles, tile_scales, 64, 512)
    assert torch.equal(back.view(torch.uint8), block)


def _dequantized(packed: torch.Tensor, scales: torch.Tensor) -> np.ndarray:
    return dequantize_nvfp4(packed, scales, 1.0, torch.float64).numpy()


def _random_weights(e: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, generator=gen)
    scales = torch.randint(0, 127, (e, n, k // 16), dtype=torch.uint8, generator=gen).view(torch.float8_e4m3fn)
    return packed, scales


def _le_words(raw: np.ndarray) -> np.ndarray:
    """Bytes [.., 4n] -> their little-endian 32-bit words [.., n] (uint64)."""
    raw = raw.astype(np.uint64)
    return raw[..., 0::4] | (raw[..., 1::4] << 8) | (raw[..., 2::4] << 16) | (raw[..., 3::4] << 24)


def lane_words(tiles: np.ndarray, tile_scales: np.ndarray, tile: int, scale_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """What lane L of a warp loads of weight tile ``tile``: its 16 code bytes at tile * 512 + 16L as four words
    [32, 4], and the ``scale_bytes`` bytes at g * scale_bytes of the tile's 8 * scale_bytes scale bytes as words
    [32, scale_bytes / 4] (8 bytes for NVFP4 and MXINT4 tiles, 4 for MXFP4 ones)."""
    lanes = np.arange(32)
    g = lanes // 4
    codes = tiles[tile * 512 + 16 * lanes[:, None] + np.arange(16)]
    scales = tile_scales[tile * 8 * scale_bytes + scale_bytes * g[:, None] + np.arange(scale_bytes)]
    return _le_words(codes), _le_words(scales)


def each_tile(tiles: torch.Tensor, tile_scales: torch.Tensor, n: int, k: int, scale_bytes: int) -> Any:
    """(expert, i, j, code words, scale words) of every tile (i, j) of every expert, as lane_words loads them."""
    kt = k // 64
    for expert in range(tiles.shape[0]):
        t, ts = tiles[expert].numpy(), tile_scales[expert].numpy()
        for i in range(n // 16):
            for j in range(kt):
                yield expert, i, j, *lane_words(t, ts, i * kt + j, scale_bytes)


def emulate_a_tile(tiles: np.ndarray, tile_scales: np.ndarray, tile: int) -> np.ndarray:
    """One m16 x k64 weight tile as the kernels read it: lane L's 16 bytes at tile*512 + 16L, its scale
    bytes at tile*64 + 8g; A registers per step -> W[16, 64] (values x 2^8)."""
    lanes = np.arange(32)
    g, q = lanes // 4, lanes % 4
    words, swords = lane_words(tiles, tile_scales, tile, 8)
    out = np.full((16, 64), np.nan)
    for s in range(4):
        sg, sg8 = decode_tile_scale_word(swords[:, s >> 1])
        a = scaled_a(words[:, s], sg, sg8, s)
        for r, (row_off, col_off) in enumerate(((0, 0), (8, 0), (0, 8), (8, 8))):
            for half in range(2):
                out[g + row_off, 16 * s + 2 * q + col_off + half] = bf16_value((a[r] >> (16 * half)) & 0xFFFF)
    assert not np.isnan(out).any()
    return out * 2.0**8


def test_weight_tiles_decode_to_the_canonical_matrix() -> None:
    e, n, k = 2, 32, 128
    packed, scales = _random_weights(e, n, k, seed=1)
    tiles, tile_scales = pack_weight_tiles(packed, scales)
    want = _dequantized(packed, scales)
    kt = k // 64
    for expert in range(e):
        t, ts = tiles[expert].numpy(), tile_scales[expert].numpy()
        for i in range(n // 16):
            for j in range(kt):
                got = emulate_a_tile(t, ts, i * kt + j)
                np.testing.assert_array_equal(got, want[expert, 16 * i : 16 * i + 16, 64 * j : 64 * j + 64])


INT4_MAGIC, BF16_136 = 0x43084308, 136.0


def decode_a_int4(w: np.ndarray) -> list[np.ndarray]:
    """fragments.cuh decode_a_int4: word -> a0..a3 as float64 pairs (low half, high half): ((w >> 4r) & 0x000F000F)
    ^ 0x43084308 read as bf16x2, minus 136 (exact, asserted)."""
    out = []
    for r in range(4):
        biased = (((w.astype(np.uint64) >> np.uint64(4 * r)) & 0x000F000F) ^ INT4_MAGIC).astype(np.uint64)
        lo, hi = bf16_value(biased & 0xFFFF) - BF16_136, bf16_value((biased >> 16) & 0xFFFF) - BF16_136
        bf16_bits(lo), bf16_bits(hi)  # the fma's result is exact in BF16
        out.append((lo, hi))
    return out


def test_tile_words_place_every_code_at_once() -> None:
    """Random full words (every slot holding a code at once, so any carry of a3's multiply would show): each register
    half is exactly its code of layout.CODE_BITS, sign at bit 15 and magnitude at bits 6..8, and nothing else."""
    from cudnn_moe.engines.sm90.layout import CODE_BITS

    words = np.random.default_rng(5).integers(0, 2**32, size=100_000, dtype=np.uint64)
    words[:2] = (0, M32)
    placed = place_tile_e2m1(words)
    for r, register_bits in enumerate(CODE_BITS):
        for half, (sign, *mag) in enumerate(register_bits):
            want = ((words >> np.uint64(sign)) & 1) << np.uint64(15)
            for bit, pos in enumerate(mag):
                want |= ((words >> np.uint64(pos)) & 1) << np.uint64(6 + bit)
            np.testing.assert_array_equal((placed[r] >> np.uint64(16 * half)) & 0xFFFF, want)


def test_int4_decode_every_code_in_every_slot() -> None:
    """Each of the 16 two's-complement codes, in every register slot and half of the MXINT4 word layout
    (layout.INT4_CODE_BITS), decodes to its value -8 .. 7, and to that slot only."""
    from cudnn_moe.engines.sm90.layout import INT4_CODE_BITS

    codes = np.arange(16)
    values = np.where(codes >= 8, codes - 16, codes).astype(np.float64)
    for r, register_bits in enumerate(INT4_CODE_BITS):
        for half, (sign, *mag) in enumerate(register_bits):
            word = np.zeros(16, dtype=np.uint64)
            for bit, pos in enumerate(mag):
                word |= ((codes >> bit) & 1).astype(np.uint64) << np.uint64(pos)
            word |= ((codes >> 3) & 1).astype(np.uint64) << np.uint64(sign)
            decoded = decode_a_int4(word)
            for r2 in range(4):
                for h2 in range(2):
                    want = values if (r2, h2) == (r, half) else np.zeros(16)
                    np.testing.assert_array_equal(decoded[r2][h2], want, err_msg=f"slot {r}.{half} -> {r2}.{h2}")


def test_int4_weight_tiles_decode_to_the_canonical_matrix() -> None:
    """MXINT4 tiles as the decode kernel reads them: lane (g, q)'s words give INT4 values at the A positions, and
    the scale word h of its 8 bytes holds the BF16 scales of rows g (low half) and g + 8 (high half) for k32 block h;
    codes x scales give dequantize_mxint4's matrix."""
    from cudnn_moe.engines.sm90.layout import pack_int4_weight_tiles, unpack_int4_weight_tiles
    from cudnn_moe.formats import dequantize_mxint4

    e, n, k = 2, 32, 128
    gen = torch.Generator().manual_seed(3)
    packed = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, generator=gen)
    scales = (torch.rand(e, n, k // 32, generator=gen) * 0.1 + 0.01).to(torch.bfloat16)
    tiles, tile_scales = pack_int4_weight_tiles(packed, scales)
    back_codes, back_scales = unpack_int4_weight_tiles(tiles, tile_scales, n, k)
    assert torch.equal(back_codes, packed) and torch.equal(back_scales.view(torch.int16), scales.view(torch.int16))
    want = dequantize_mxint4(packed, scales).double().numpy()
    lanes = np.arange(32)
    g, q = lanes // 4, lanes % 4
    for expert, i, j, words, swords in each_tile(tiles, tile_scales, n, k, 8):
        got = np.full((16, 64), np.nan)
        for step in range(4):
            scale_g = bf16_value(swords[:, step >> 1] & 0xFFFF)
            scale_g8 = bf16_value(swords[:, step >> 1] >> 16)
            a = decode_a_int4(words[:, step])
            for r, (row_off, col_off) in enumerate(((0, 0), (8, 0), (0, 8), (8, 8))):
                scale = scale_g8 if row_off else scale_g
                for half in range(2):
                    got[g + row_off, 16 * step + 2 * q + col_off + half] = a[r][half] * scale
        np.testing.assert_array_equal(got, want[expert, 16 * i : 16 * i + 16, 64 * j : 64 * j + 64])


def decode_e8m0_scale_word(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """fragments.cuh decode_e8m0_scale_word -> (row g pair, row g+8 pair): bf16x2 multipliers of k32 blocks (0, 1)."""
    w = w.astype(np.uint64)
    return ((w << 7) & M32) & 0x7F807F80, (w >> 1) & 0x7F807F80


def _mxfp4_form(e: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random E2M1 codes uint8 [E, N, K/2] and recoded E8M0 scales [E, N, K/32] as the exact shifted form holds them:
    every power 2^-9 .. 2^8, and byte 0 on the all-zero blocks (+-0 codes) of every fifth scale block."""
    gen = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, generator=gen)
    scales = torch.randint(127 - 9, 127 + 9, (e, n, k // 32), dtype=torch.uint8, generator=gen)
    zero = torch.arange(e * n * k // 32).reshape(e, n, k // 32) % 5 == 0
    packed.view(e, n, k // 32, 16)[zero] &= 0x88
    scales[zero] = 0
    return packed, scales.view(torch.float8_e8m0fnu)


def test_mxfp4_weight_tiles_decode_to_the_form_matrix() -> None:
    """MXFP4 tiles as the decode kernel reads them: lane (g, q)'s scale word (4 bytes at 4g) gives the multipliers of
    rows g and g + 8 for both k32 blocks, step s takes block s / 2 (scale_a<s / 2>), and every product is exact in
    BF16 and equal to the form's value x 2^-8 (the NVFP4 tiles' products); the tiles unpack to the form."""
    from cudnn_moe.engines.sm90.layout import pack_mxfp4_weight_tiles, unpack_mxfp4_weight_tiles
    from cudnn_moe.formats import dequantize_mxfp4

    e, n, k = 2, 32, 192
    packed, scales = _mxfp4_form(e, n, k, seed=4)
    tiles, tile_scales = pack_mxfp4_weight_tiles(packed, scales)
    assert tile_scales.dtype == torch.uint8 and tile_scales.shape == (e, n * k // 32)
    back_codes, back_scales = unpack_mxfp4_weight_tiles(tiles, tile_scales, n, k)
    assert torch.equal(back_codes, packed) and torch.equal(back_scales.view(torch.uint8), scales.view(torch.uint8))
    want = dequantize_mxfp4(packed, scales, dtype=torch.float64).numpy()
    lanes = np.arange(32)
    g, q = lanes // 4, lanes % 4
    for expert, i, j, words, swords in each_tile(tiles, tile_scales, n, k, 4):
        sg, sg8 = decode_e8m0_scale_word(swords[:, 0])
        got = np.full((16, 64), np.nan)
        for step in range(4):
            a = scaled_a(words[:, step], sg, sg8, step >> 1)  # products asserted exact in BF16
            for r, (row_off, col_off) in enumerate(((0, 0), (8, 0), (0, 8), (8, 8))):
                for half in range(2):
                    got[g + row_off, 16 * step + 2 * q + col_off + half] = bf16_value((a[r] >> (16 * half)) & 0xFFFF)
        np.testing.assert_array_equal(got * 2.0**8, want[expert, 16 * i : 16 * i + 16, 64 * j : 64 * j + 64])


def test_mxfp4_tiles_refuse_scales_outside_the_form() -> None:
    from cudnn_moe.engines.sm90.layout import pack_mxfp4_weight_tiles

    packed, scales = _mxfp4_form(1, 16, 64, seed=5)
    for bad in (127 - 10, 127 + 9, 255):
        wide = scales.view(torch.uint8).clone()
        wide[0, 3, 1] = bad
        with pytest.raises(ValueError, match="exact shifted form"):
            pack_mxfp4_weight_tiles(packed, wide.view(torch.float8_e8m0fnu))
    with pytest.raises(ValueError, match="float8_e8m0fnu"):
        pack_mxfp4_weight_tiles(packed, scales.view(torch.uint8))


def emulate_b(x_frag_bytes: np.ndarray, row_bytes: int, rows: np.ndarray, j: int) -> np.ndarray:
    """B registers of a k64 block j for token rows[g] (lane g, q): 32 bytes at row*row_bytes + 128j + 32q;
    b0 / b1 of step s = words 2s / 2s+1 -> X[8, 64] (token g, k)."""
    lanes = np.arange(32)
    g, q = lanes // 4, lanes % 4
    base = rows[g] * row_bytes + 128 * j + 32 * q
    raw = x_frag_bytes[base[:, None] + np.arange(32)].astype(np.uint64)
    words = raw[:, 0::4] | (raw[:, 1::4] << 8) | (raw[:, 2::4] << 16) | (raw[:, 3::4] << 24)  # [32, 8]
    out = np.full((8, 64), np.nan)
    for s in range(4):
        for b in range(2):
            for half in range(2):
                out[g, 16 * s + 8 * b + 2 * q + half] = bf16_value((words[:, 2 * s + b] >> (16 * half)) & 0xFFFF)
    return out


def test_token_fragments_give_the_b_registers() -> None:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(8, 192, generator=gen).to(torch.bfloat16)
    frag = to_token_fragments(x).contiguous().view(torch.uint8).numpy().ravel()
    for j in range(3):
        got = emulate_b(frag, 192 * 2, np.arange(8), j)
        np.testing.assert_array_equal(got, x[:, 64 * j : 64 * j + 64].double().numpy())


def test_stmatrix_trans_puts_c_fragments_at_token_feature() -> None:
    """The prefill epilogue's stmatrix.x4.trans addressing, per the PTX fragment layout: register i of
    lane l holds (row l/4, cols 2(l%4), +1) of matrix i and lands at row 2(l%4)(+1), col l/4 of it."""
    stride, staged = 272 // 2, {}
    for wm in range(4):
        for wn in range(2):
            for mt in range(2):
                for nt in range(0, 8, 2):
                    # rows addressed by lanes 8i..8i+7 (kernel: token / feature of lane l)
                    addr = {}
                    for lane in range(32):
                        mi, r = lane >> 3, lane & 7
                        token = wn * 64 + (nt + (mi >> 1)) * 8 + r
                        feature = wm * 32 + mt * 16 + (mi & 1) * 8
                        addr[(mi, r)] = token * stride + feature
                    for lane in range(32):
                        g, q = lane // 4, lane % 4
                        # registers: r0 = (c0, c1) of nt, r1 = (c2, c3) of nt, r2 / r3 the same of nt + 1
                        for i, (ntt, row_off) in enumerate(((nt, 0), (nt, 8), (nt + 1, 0), (nt + 1, 8))):
                            for half in range(2):
                                feature = wm * 32 + mt * 16 + g + row_off
                                token = wn * 64 + ntt * 8 + 2 * q + half
                                where = addr[(i, 2 * q + half)] + g  # .trans: row 2(l%4)+half, column l/4
                                assert where not in staged
                                staged[where] = (token, feature)
    assert len(staged) == 128 * 128
    for where, (token, feature) in staged.items():
        assert where == token * stride + feature


# ---------------------------------------------------------------------------------------------------------------
# Tile finder (fragments.cuh find_tile), emulated lane by lane
# ---------------------------------------------------------------------------------------------------------------


def find_tile(offsets: list[int], tile_rows: int, capacity: int, t: int) -> tuple[int, int, int] | None:
    e_count = len(offsets) - 1
    per = (e_count + 31) >> 5
    counts, ranges = [], []
    for lane in range(32):
        e0 = min(lane * per, e_count)
        e1 = min(e0 + per, e_count)
        ranges.append((e0, e1))
        counts.append(sum((max(offsets[e + 1] - offsets[e], 0) + tile_rows - 1) // tile_rows for e in range(e0, e1)))
    inclusive = list(np.cumsum(counts))
    holders = [lane for lane in range(32) if inclusive[lane] > t]
    if not holders:
        return None
    src = holders[0]
    before = inclusive[src] - counts[src]
    e0, e1 = ranges[src]
    for e in range(e0, e1):
        n = (max(offsets[e + 1] - offsets[e], 0) + tile_rows - 1) // tile_rows
        if t - before < n:
            return e, offsets[e] + (t - before) * tile_rows, min(offsets[e + 1], capacity)
        before += n
    raise AssertionError("unreachable")


@pytest.mark.parametrize("experts", [1, 3, 31, 32, 33, 64, 100, 512])
@pytest.mark.parametrize("tile_rows", [8, 16, 32, 128])
def test_tile_finder_covers_every_row_once(experts: int, tile_rows: int) -> None:
    gen = torch.Generator().manual_seed(experts * 1000 + tile_rows)
    lengths = torch.randint(0, 40, (experts,), generator=gen) * 8
    lengths[torch.rand(experts, generator=gen) < 0.3] = 0
    offsets = [0, *torch.cumsum(lengths, 0).tolist()]
    capacity = offsets[-1] + 16
    grid_y = min(experts, capacity // 8) + -(-capacity // tile_rows)
    covered = np.zeros(capacity, dtype=int)
    for t in range(grid_y):
        found = find_tile(offsets, tile_rows, capacity, t)
        if found is None:
            assert t >= sum(-(-n // tile_rows) for n in lengths.tolist())
            continue
        e, row0, row_end = found
        assert offsets[e] <= row0 < row_end == offsets[e + 1]
        covered[row0 : min(row0 + tile_rows, row_end)] += 1
    assert (covered[: offsets[-1]] == 1).all() and not covered[offsets[-1] :].any()


# ---------------------------------------------------------------------------------------------------------------
# Wrappers: argument checks and kernel signatures
# ---------------------------------------------------------------------------------------------------------------

_ENTRY = re.compile(r'extern "C" __global__ void(?:\s+__launch_bounds__\([^)]*\))?\s+(\w+)\(([^)]*)\)', re.S)
_ARG_TYPES = {"int": np.int32, "float": np.float32, "pointer": np.uint64}


def _signatures() -> dict[str, list[str]]:
    out = {}
    for name in SOURCES:
        for kernel, params in _ENTRY.findall((SM90_DIR / name).read_text()):
            out[kernel] = ["pointer" if "*" in p else p.split()[0] for p in (x.strip() for x in params.split(","))]
    return out


def _gemm_args(e: int = 3, n: int = 128, k: int = 128, rows: int = 40) -> dict[str, torch.Tensor]:
    return {
        "w_tiles": torch.zeros(e, n * k // 2, dtype=torch.uint8),
        "w_tile_scales": torch.zeros(e, n * k // 16, dtype=torch.uint8),
        "alpha": torch.ones(e, dtype=torch.float32),
        "x": torch.zeros(rows, k, dtype=torch.bfloat16),
        "offsets": torch.zeros(e + 1, dtype=torch.int32),
        "out": torch.zeros(rows, n, dtype=torch.bfloat16),
    }


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """Record launches instead of running them, with the CUDA-only checks stubbed out."""
    calls: list[tuple] = []
    monkeypatch.setattr(sm90, "launch", lambda *args, **kwargs: calls.append((args, kwargs)))
    monkeypatch.setattr(sm90, "ptr", lambda tensor, align=1: np.uint64(0))
    monkeypatch.setattr(sm90, "_check_device", lambda named, align: None)
    return calls


def test_wrappers_match_kernel_signatures(launches: list[tuple]) -> None:
    signatures = _signatures()
    assert sorted(signatures) == ["sm90_gemm_decode", "sm90_gemm_prefill", "sm90_gemm_wgmma"]
    for variant in (sm90.DECODE, *PREFILL_VARIANTS, *DECODE_VARIANTS, *WGMMA_VARIANTS):
        launches.clear()
        sm90.grouped_gemm(**_gemm_args(), variant=variant)
        (source, name, _device, grid, block, args), kwargs = launches[0]
        assert (source, name) == (variant.source, variant.kernel)
        assert source == ("sm90/wgmma_gemm.cu" if name == "sm90_gemm_wgmma" else "sm90/grouped_gemm.cu")
        assert [type(a) for a in args] == [_ARG_TYPES[kind] for kind in signatures[name]]
        assert grid == (-(-128 // variant.feature_block), min(3, 40 // 8) + -(-40 // variant.tile_rows))
        assert block == variant.threads and kwargs["shared_mem"] == variant.shared_mem
        assert kwargs["extra_options"] == variant.options()


def _fused_args(layout: TokenLayout, activation: Any, e: int = 3, n: int = 256, k: int = 128, rows: int = 40,
                tokens: int = 7) -> dict[str, Any]:
    """grouped_gemm's arguments in the fused form: a gather from ``tokens`` rows and an activation epilogue."""
    args = _gemm_args(e, n, k, rows)
    row_to_slot = torch.zeros(rows, dtype=torch.int32)
    inter = n // 2 if activation.gated else n
    if layout.is_bf16:
        operand = TokenOperand(torch.zeros(rows, inter, dtype=torch.bfloat16), None, layout)
    else:
        operand = TokenOperand(torch.zeros(rows, inter // 2, dtype=torch.uint8),
                               torch.zeros(128 * inter // 16, dtype=torch.uint8), layout)  # room for 128x4 tiles
    args.update(x=None, out=None, gather=RowGather(torch.zeros(tokens, k, dtype=torch.bfloat16), row_to_slot, 2),
                epilogue=ActivationEpilogue(activation, row_to_slot, operand))
    return args


@pytest.mark.parametrize("layout", list(TokenLayout), ids=lambda t: t.name)
def test_fused_call_matches_kernel_signature(layout: TokenLayout, launches: list[tuple]) -> None:
    """The gather + activation epilogue form (wgmma), the epilogue form (decode) pass the kernel's arguments, the
    epilogue's options and the plain grid (gated: ceil(N / FB) blocks of FB / 2 outputs)."""
    signatures = _signatures()
    fitting = [v for v in DECODE_VARIANTS if v.epilogue_problem(SwiGLU()) is None]
    assert fitting
    for variant in [*{v.gathering() for v in WGMMA_VARIANTS}, *fitting]:
        for activation in (SwiGLU(), GELU()):
            launches.clear()
            args = _fused_args(layout, activation)
            if isinstance(variant, sm90.DecodeVariant):  # no gather: the rows come from x
                args.update(gather=None, x=torch.zeros(40, 128, dtype=torch.bfloat16))
            sm90.grouped_gemm(**args, variant=variant)
            (_source, name, _device, grid, _block, args), kwargs = launches[0]
            assert name == variant.kernel and [type(a) for a in args] == [_ARG_TYPES[t] for t in signatures[name]]
            assert grid == (-(-256 // variant.feature_block), min(3, 40 // 8) + -(-40 // variant.tile_rows))
            assert kwargs["extra_options"] == (*variant.options(), f"-DSM90_ACT={int(activation.kind)}",
                                               f"-DSM90_ACT_GATED={int(activation.gated)}")
            gathers = isinstance(variant, sm90.WgmmaVariant)
            assert (args[12], args[13]) == ((np.int32(2), np.int32(7)) if gathers else (0, 0))  # top_k, source rows
            assert args[17] == np.int32(layout) and args[18] == np.int32(1)  # the epilogue's layout, intermediate


@pytest.mark.parametrize("sm_count,want", [(132, 1056), (2, 16)])  # 8 CTAs an SM of 64 threads
def test_persistent_gemm1_launches_the_ctas_the_sms_hold(sm_count: int, want: int, launches: list[tuple]) -> None:
    """A persistent variant launches a 1-D grid of min(units, CTAs the SMs hold) with its -DSM90_PERSIST; its
    arguments are the decode grid's."""
    plain = sm90.DecodeVariant(mt=2, wm=2, wk=1, nt=1, prefetch=4)
    for variant in (plain, replace(plain, persist=2)):
        args = _fused_args(TokenLayout.BF16_ROWS, SwiGLU())
        args.update(gather=None, x=torch.zeros(40, 128, dtype=torch.bfloat16))
        sm90.grouped_gemm(**args, variant=variant, sm_count=sm_count)
    (_, _, _, grid0, _, args0), kwargs0 = launches[0]
    (_, _, _, grid1, _, args1), kwargs1 = launches[1]
    units = grid0[0] * grid0[1]
    assert grid1 == (min(units, want), 1) and units > 8
    assert kwargs1["extra_options"] == (*kwargs0["extra_options"][:5], "-DSM90_PERSIST=2", *kwargs0["extra_options"][5:])
    assert [type(a) for a in args1] == [type(a) for a in args0]


@pytest.mark.parametrize("name,update,needle", [
    ("no epilogue", dict(epilogue=None, out=torch.zeros(40, 256, dtype=torch.bfloat16)), "epilogue"),
    ("no sm_count", dict(sm_count=None), "sm_count"),
    ("zero sm_count", dict(sm_count=0), "sm_count"),
], ids=lambda x: x if isinstance(x, str) else "")
def test_persistent_gemm1_rejects_bad_arguments(name: str, update: dict, needle: str, launches: list[tuple]) -> None:
    args = _fused_args(TokenLayout.BF16_ROWS, SwiGLU())
    args.update(gather=None, x=torch.zeros(40, 128, dtype=torch.bfloat16), sm_count=132,
                variant=sm90.DecodeVariant(mt=2, wm=2, wk=1, nt=1, prefetch=4, persist=2))
    args.update(update)
    with pytest.raises(ValueError, match=needle):
        sm90.grouped_gemm(**args)
    assert not launches


def test_token_pointer_is_the_rows_the_form_reads(launches: list[tuple], monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernels' token argument (x) is x for the plain forms, the gather's source for the gathering form, and
    null for the routed form (its token comes through the route's arguments)."""
    address = lambda tensor, align=1: np.uint64(0 if tensor is None else tensor.data_ptr())  # noqa: E731
    for module in (sm90, kernel_stage, kernel_sort):
        monkeypatch.setattr(module, "ptr", address)
    plain = _gemm_args()
    sm90.grouped_gemm(**plain, variant=sm90.DECODE)
    gathering = _fused_args(TokenLayout.BF16_ROWS, SwiGLU())
    sm90.grouped_gemm(**gathering, variant=sm90.WgmmaVariant().gathering())
    routed = _route_args()
    sm90.grouped_gemm(**routed)
    tokens = [int(args[3]) for (_, _, _, _, _, args), _ in launches]
    assert tokens == [plain["x"].data_ptr(), gathering["gather"].source.data_ptr(), 0]
    assert int(launches[2][0][5][28 + 9]) == routed["route"].tokens.data_ptr()  # route_x


def test_mxint4_call_compiles_its_form_in(launches: list[tuple]) -> None:
    """An MXINT4 decode GEMM (BF16 epilogue of a BF16 intermediate, or plain) adds -DSM90_W_INT4=1 to its options and
    passes the same arguments as the NVFP4 form."""
    variant = sm90.DecodeVariant(mt=2, wm=2, wk=2)
    for plain in (False, True):
        launches.clear()
        args = _fused_args(TokenLayout.BF16_FRAGMENTS, SwiGLU())
        args["epilogue"] = ActivationEpilogue(SwiGLU(), args["epilogue"].row_to_slot, args["epilogue"].out,
                                                IntermediateCode.BF16)
        args.update(gather=None, x=torch.zeros(40, 128, dtype=torch.bfloat16), variant=variant, code=BlockCode.MXINT4)
        if plain:
            args.update(epilogue=None, out=torch.zeros(40, 256, dtype=torch.bfloat16))
        sm90.grouped_gemm(**args)
        (_source, name, _device, _grid, _block, _args), kwargs = launches[0]
        acts = () if plain else sm90.epilogue_options(SwiGLU())
        assert kwargs["extra_options"] == (*variant.options(), *acts, "-DSM90_W_INT4=1")


def test_bf16_call_compiles_its_form_in(launches: list[tuple]) -> None:
    """A BF16-weight decode GEMM reads bfloat16 [E, N*K] weights (the scales argument unread), natural token rows, and
    compiles -DSM90_W_BF16=1 in; it refuses 4-bit weights and MXINT4 codes."""
    e, n, k, rows = 3, 128, 128, 40
    args = {**_gemm_args(e, n, k, rows), "variant": BF16_VARIANT}
    args["w_tiles"] = torch.zeros(e, n * k, dtype=torch.bfloat16)
    sm90.grouped_gemm(**args)
    (_source, _name, _device, _grid, _block, call_args), kwargs = launches[0]
    assert kwargs["extra_options"] == BF16_VARIANT.options() and "-DSM90_W_BF16=1" in BF16_VARIANT.options()
    assert BF16_VARIANT.token_layout is TokenLayout.BF16_ROWS
    with pytest.raises(TypeError, match="w_tiles"):
        sm90.grouped_gemm(**{**args, "w_tiles": torch.zeros(e, n * k // 2, dtype=torch.uint8)})
    with pytest.raises(ValueError, match="w_tiles"):
        sm90.grouped_gemm(**{**args, "w_tiles": torch.zeros(e, n * k // 2, dtype=torch.bfloat16)})
    with pytest.raises(ValueError, match="mxint4 weights run on another form"):
        sm90.grouped_gemm(**args, code=BlockCode.MXINT4)
    assert len(launches) == 1


_FUSED_BAD = [
    ("gather on decode", lambda a: a.update(variant=sm90.DECODE), "gather needs a WgmmaVariant"),
    ("gather on tiled", lambda a: a.update(variant=sm90.WgmmaVariant(tiled_tokens=True)), "gather reads natural rows"),
    ("epilogue on tiled", lambda a: a.update(variant=sm90.WgmmaVariant(tiled_tokens=True), gather=None,
                                            x=torch.zeros(40, 128, dtype=torch.bfloat16)), "epilogue"),
    ("epilogue on prefill", lambda a: a.update(variant=sm90.PREFILL, gather=None,
                                              x=torch.zeros(40, 128, dtype=torch.bfloat16)), "no activation epilogue"),
    ("epilogue on odd WM", lambda a: a.update(variant=sm90.DecodeVariant(mt=2, wm=1, wk=4), gather=None,
                                             x=torch.zeros(40, 128, dtype=torch.bfloat16)), "WM must be even"),
    ("x with a gather", lambda a: a.update(x=torch.zeros(40, 128, dtype=torch.bfloat16)), "x must be None"),
    ("out with an epilogue", lambda a: a.update(out=torch.zeros(40, 256, dtype=torch.bfloat16)), "out must be None"),
    ("source K", lambda a: a.update(gather=RowGather(torch.zeros(7, 64, dtype=torch.bfloat16),
                                                     a["gather"].row_to_slot, 2)), "w_tiles"),
    ("source dtype", lambda a: a.update(gather=RowGather(torch.zeros(7, 128, dtype=torch.float16),
                                                         a["gather"].row_to_slot, 2)), "gather.source"),
    ("top_k", lambda a: a.update(gather=RowGather(a["gather"].source, a["gather"].row_to_slot, 0)), "top_k"),
    ("epilogue rows", lambda a: a.update(epilogue=ActivationEpilogue(
        SwiGLU(), a["gather"].row_to_slot,
        TokenOperand(torch.zeros(48, 128, dtype=torch.bfloat16), None, TokenLayout.BF16_ROWS))), "out must be"),
    ("epilogue inter", lambda a: a.update(epilogue=ActivationEpilogue(
        GELU(), a["gather"].row_to_slot,
        TokenOperand(torch.zeros(40, 128, dtype=torch.bfloat16), None, TokenLayout.BF16_ROWS))), "w_tiles"),
    ("epilogue row_to_slot", lambda a: a.update(epilogue=ActivationEpilogue(
        SwiGLU(), torch.zeros(40, dtype=torch.int32), a["epilogue"].out)), "one tensor"),
    ("mxint4 on wgmma", lambda a: a.update(code=BlockCode.MXINT4), "MXINT4 weights run on a DecodeVariant"),
    ("mxint4 requantizing", lambda a: a.update(variant=sm90.DecodeVariant(mt=2, wm=2, wk=2), gather=None, code=BlockCode.MXINT4,
                                              x=torch.zeros(40, 128, dtype=torch.bfloat16)), "BF16 intermediate"),
    ("nvfp4 of a bf16 intermediate", lambda a: a.update(epilogue=ActivationEpilogue(
        SwiGLU(), a["gather"].row_to_slot,
        TokenOperand(torch.zeros(40, 64, dtype=torch.uint8), torch.zeros(40 * 8, dtype=torch.uint8),
                     TokenLayout.NVFP4_LINEAR), IntermediateCode.BF16)), "BF16 intermediate"),
]


@pytest.mark.parametrize("name,mutate,needle", _FUSED_BAD, ids=[b[0] for b in _FUSED_BAD])
def test_fused_call_rejects_bad_arguments(name: str, mutate: Any, needle: str, launches: list[tuple]) -> None:
    args = {**_fused_args(TokenLayout.BF16_ROWS, SwiGLU()), "variant": WGMMA_VARIANTS[0]}
    mutate(args)
    with pytest.raises((ValueError, TypeError), match=needle):
        sm90.grouped_gemm(**args)
    assert not launches


def test_variant_macros_match_the_source() -> None:
    text = (SM90_DIR / "grouped_gemm.cu").read_text()
    defaults = dict(re.findall(r"#define (SM90_\w+) (\d+)", text))
    d = sm90.DecodeVariant()
    p = sm90.PrefillVariant()
    assert defaults == {"SM90_MT": str(d.mt), "SM90_WM": str(d.wm), "SM90_WK": str(d.wk), "SM90_NT": str(d.nt),
                        "SM90_PREFETCH": str(d.prefetch), "SM90_W_INT4": "0", "SM90_W_MXFP4": "0", "SM90_W_BF16": str(int(d.bf16_weights)),
                        "SM90_ACT_MXFP8": "0", "SM90_PERSIST": "0",
                        "SM90_W_ROWS": str(int(d.row_major)),
                        "SM90_PF_STAGES": str(p.stages),
                        "SM90_PF_MIN_BLOCKS": str(p.min_blocks), "SM90_PF_STMATRIX": str(int(p.stmatrix)),
                        "SM90_PF_FB": str(p.feature_block), "SM90_PF_TB": str(p.tile_rows),
                        "SM90_PF_ADEC": str(int(p.adec))}
    assert "#define PF_STAGE_BYTES (PF_X_OFFSET + PF_TB * PF_X_STRIDE)  // 23040 at 128 x 128" in text
    assert sm90.PrefillVariant(2).shared_mem == 2 * 23040 >= 128 * 272 and sm90.PrefillVariant(4).shared_mem == 4 * 23040
    assert p.threads == 256 and p.options()[:3] == ("-DSM90_PF_STAGES=4", "-DSM90_PF_MIN_BLOCKS=2", "-DSM90_PF_STMATRIX=1")
    assert sm90.PrefillVariant(feature_block=256, tile_rows=64).shared_mem == 4 * (256 * 36 + 64 * 144)
    assert sm90.PrefillVariant(3, adec=True).shared_mem == 3 * 23040 + 2 * 16384


def test_wgmma_variant_macros_match_the_source() -> None:
    text = (SM90_DIR / "wgmma_gemm.cu").read_text()
    defaults = dict(re.findall(r"#define (SM90_\w+) (\d+)", text))
    w = sm90.WgmmaVariant()
    assert defaults == {"SM90_WG_TB": str(w.tile_rows), "SM90_WG_GROUPS": str(w.groups), "SM90_WG_STAGES": str(w.stages),
                        "SM90_WG_MIN_BLOCKS": str(w.min_blocks), "SM90_WG_TILED_X": str(int(w.tiled_tokens)),
                        "SM90_WG_W_ROWS": str(int(w.row_major))}
    # stage = 128 B per token row + 576 B per m16 weight tile (codes + scales), rounded up to 1 KB
    assert w.stage_bytes == 16384 + 16 * 576  # already a multiple of 1 KB
    assert sm90.WgmmaVariant(64, 2).stage_bytes == 13312  # 8192 + 8 * 576 = 12800, rounded up and w.threads == 512 and w.feature_block == 256
    # the larger of the ring and the epilogue (the C tile rounded to 1 KB, then an image of up to four tiled planes
    # of 128 rows), + the ring's 1 KB alignment slack
    epilogue = 128 * 528 + 4 * 128 * 128  # 128 * 528 = 66 KB exactly
    assert w.shared_mem == max(5 * w.stage_bytes, epilogue) + 1024 == epilogue + 1024
    assert sm90.WgmmaVariant(128, 4, 8).shared_mem == 8 * w.stage_bytes + 1024
    assert sm90.WgmmaVariant(128, 2, 4).shared_mem == 4 * 21504 + 1024  # C and two planes: 67584
    assert sm90.WgmmaVariant(64, 2, 4).shared_mem == 4 * 13312 + 1024
    assert loader.ARCH_SPECIFIC in w.options() and w.token_layout is TokenLayout.BF16_ROWS
    tiled = sm90.WgmmaVariant(tiled_tokens=True)
    assert tiled.token_layout is TokenLayout.BF16_TILED and "-DSM90_WG_TILED_X=1" in tiled.options()
    assert tiled.gathering() == w and tiled.shared_mem == w.shared_mem


_GEMM_BAD = [
    ("w_tiles", "w_tiles dtype", lambda a: a["w_tiles"].to(torch.int8), "w_tiles"),
    ("w_tiles", "w_tiles shape", lambda a: a["w_tiles"][:, :-16].contiguous(), "w_tiles"),
    ("w_tile_scales", "w_tile_scales shape", lambda a: a["w_tile_scales"][:, :-1].contiguous(), "w_tile_scales"),
    ("alpha", "alpha dtype", lambda a: a["alpha"].double(), "alpha"),
    ("alpha", "alpha shape", lambda a: a["alpha"][:2].contiguous(), "alpha"),
    ("alpha", "alpha not a tensor", lambda a: a["alpha"].tolist(), "alpha"),
    ("x", "x dtype", lambda a: a["x"].half(), "x"),
    ("x", "x K", lambda a: torch.zeros(40, 96, dtype=torch.bfloat16), "K"),
    ("x", "x strided", lambda a: torch.zeros(128, 40, dtype=torch.bfloat16).t(), "x"),
    ("offsets", "offsets dtype", lambda a: a["offsets"].long(), "offsets"),
    ("offsets", "offsets shape", lambda a: a["offsets"][:3].contiguous(), "offsets"),
    ("out", "out N", lambda a: torch.zeros(40, 192, dtype=torch.bfloat16), "N"),
    ("out", "out rows", lambda a: torch.zeros(48, 128, dtype=torch.bfloat16), "out"),
    ("out", "out dtype", lambda a: a["out"].float(), "out"),
]


@pytest.mark.parametrize("key,name,mutate,needle", _GEMM_BAD, ids=[b[1] for b in _GEMM_BAD])
def test_grouped_gemm_rejects_bad_arguments(key: str, name: str, mutate: Any, needle: str,
                                            launches: list[tuple]) -> None:
    args = _gemm_args()
    args[key] = mutate(args)
    # cudnn_moe.validate's dialect: TypeError for a wrong type or dtype, ValueError for shapes and layouts.
    expected = TypeError if name.endswith(("dtype", "not a tensor")) else ValueError
    with pytest.raises(expected, match=needle):
        sm90.grouped_gemm(**args)
    assert not launches


def _finalize_args(tokens: int = 5, top_k: int = 4) -> dict[str, Any]:
    """grouped_gemm's arguments with a finalize of ``tokens`` tokens into a [T, N] output (N = 128)."""
    fin = FinalizeEpilogue(torch.zeros(tokens * top_k, dtype=torch.int32), torch.zeros(tokens * top_k), top_k,
                           torch.zeros(tokens, 128, dtype=torch.bfloat16))
    return {**_gemm_args(), "finalize": fin, "tickets": torch.zeros(8, dtype=torch.int32)}


def test_finalize_passes_its_operands_and_compiles_in(launches: list[tuple]) -> None:
    """The finalize form launches the decode kernel with SM90_FINALIZE and T; without one the same kernel gets
    null pointers and zeros there."""
    sm90.grouped_gemm(**_finalize_args(tokens=5, top_k=4), variant=sm90.DECODE)
    sm90.grouped_gemm(**_gemm_args(), variant=sm90.DECODE)
    (_, _, _, _, _, fused), fused_kwargs = launches[0]
    (_, _, _, _, _, plain), plain_kwargs = launches[1]
    assert fused_kwargs["extra_options"] == (*sm90.DECODE.options(), "-DSM90_FINALIZE=1")
    assert plain_kwargs["extra_options"] == sm90.DECODE.options()
    assert (int(fused[-4]), int(fused[-3])) == (4, 5) and (int(plain[-4]), int(plain[-3])) == (0, 0)
    assert len(fused) == len(plain) == len(_signatures()["sm90_gemm_decode"])


def _route_args(tokens: str = "nvfp4", top_k: int = 4, experts: int = 3, k: int = 128, rows: int = 40,
                routing_format: RoutingFormat = RoutingFormat.FP32) -> dict[str, Any]:
    """grouped_gemm's arguments of a routed GEMM1 (SwiGLU epilogue, N = 256) of a one-token bucket."""
    sorted_ = SortBuffers(torch.zeros(experts + 1, dtype=torch.int32), torch.zeros(top_k, dtype=torch.int32),
                          torch.zeros(rows, dtype=torch.int32), torch.zeros(rows, dtype=torch.int32),
                          torch.zeros(experts, dtype=torch.int32))
    x, scales = {"bf16": (torch.zeros(1, k, dtype=torch.bfloat16), None),
                 "nvfp4": (torch.zeros(1, k // 2, dtype=torch.uint8), torch.zeros(1, k // 16, dtype=torch.uint8)),
                 "mxfp8": (torch.zeros(1, k, dtype=torch.uint8).view(torch.float8_e4m3fn),
                           torch.zeros(1, k // 32, dtype=torch.uint8))}[tokens]
    ids = torch.zeros(1, top_k, dtype=torch.int32)
    weights = None if routing_format == RoutingFormat.PACKED else torch.zeros(1, top_k)
    route = RoutePrologue(x, scales, ids, weights, routing_format, torch.zeros(1, top_k, dtype=torch.int32),
                          torch.zeros(1, top_k), 0, 8, sorted_)
    epilogue = ActivationEpilogue(SwiGLU(), sorted_.row_to_slot,
                                  TokenOperand(torch.zeros(rows, 128, dtype=torch.bfloat16), None,
                                               TokenLayout.BF16_FRAGMENTS), IntermediateCode.BF16)
    return {**_gemm_args(e=experts, n=256, k=k, rows=rows), "x": None, "out": None, "offsets": sorted_.offsets,
            "epilogue": epilogue, "route": route, "variant": sm90.DecodeVariant(mt=2, wm=2, wk=4)}




def _param_count(define: str) -> int:
    """Parameters a DEC_*_PARAMS #define of the decode kernel adds (its continuation lines)."""
    text = (SM90_DIR / "grouped_gemm.cu").read_text()
    return re.search(rf"#define {define}\s*\\\n((?:.*\\\n)*.*\n)", text).group(1).count(",")


@pytest.mark.parametrize("tokens", ["bf16", "nvfp4"])
def test_route_passes_its_operands_and_compiles_in(tokens: str, launches: list[tuple],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The routed form launches the decode kernel with SM90_ROUTE (1: BF16 tokens, 2: NVFP4) after the epilogue's
    options, the kernel's arguments plus DEC_ROUTE_PARAMS' (no bucket rows: x is null), and 2K bytes of dynamic
    shared memory for the token row."""
    for module in (kernel_stage, kernel_sort):  # the routing's and the sort buffers' pointers
        monkeypatch.setattr(module, "ptr", lambda tensor, align=1: np.uint64(0))
    args = _route_args(tokens, top_k=4, k=128)
    sm90.grouped_gemm(**args)
    (_source, name, _device, grid, block, kernel_args), kwargs = launches[0]
    assert name == "sm90_gemm_decode" and block == 256
    assert kwargs["extra_options"] == (*args["variant"].options(), *sm90.epilogue_options(SwiGLU()),
                                       f"-DSM90_ROUTE={1 if tokens == 'bf16' else 2}")
    assert kwargs["shared_mem"] == 2 * 128
    assert len(kernel_args) == len(_signatures()["sm90_gemm_decode"]) + _param_count("DEC_ROUTE_PARAMS") == 28 + 18
    route = kernel_args[28:]
    assert [int(route[i]) for i in (2, 3, 4, 5, 6, 7, 8)] == [RoutingFormat.FP32, 0, 1, 4, 4, 0, 8]


_ROUTE_BAD = [
    ("prefill variant", lambda a: a.update(variant=sm90.PREFILL), ValueError, "DecodeVariant"),
    ("no epilogue", lambda a: a.update(epilogue=None, out=torch.zeros(40, 256, dtype=torch.bfloat16)), ValueError,
     "epilogue"),
    ("with x", lambda a: a.update(x=torch.zeros(40, 128, dtype=torch.bfloat16)), ValueError, "x None"),
    ("two tokens", lambda a: a.update(route=replace(a["route"], ids_out=torch.zeros(2, 4, dtype=torch.int32),
                                                    w_out=torch.zeros(2, 4))), ValueError, "sort"),
    ("token H", lambda a: a.update(route=replace(a["route"], tokens=torch.zeros(1, 32, dtype=torch.uint8),
                                                 token_scales=torch.zeros(1, 4, dtype=torch.uint8))),
     ValueError, "w_tiles"),
    ("mxfp8 tokens on NVFP4 tiles", lambda a: a.update(route=_route_args("mxfp8")["route"]), ValueError,
     "MXFP8 tokens .the MXFP4 pair.s. on MXFP4 tiles only"),
    ("token dtype", lambda a: a.update(route=replace(a["route"], tokens=torch.zeros(1, 64, dtype=torch.float16))),
     ValueError, "route"),
    ("routing shape", lambda a: a.update(route=replace(a["route"], ids=torch.zeros(1, 3, dtype=torch.int32))),
     ValueError, "routing"),
    ("w_out dtype", lambda a: a.update(route=replace(a["route"], w_out=torch.zeros(1, 4).double())), ValueError,
     "w_out"),
    ("foreign offsets", lambda a: a.update(offsets=torch.zeros(4, dtype=torch.int32)), ValueError,
     "route.sorted"),
    ("bad align", lambda a: a.update(route=replace(a["route"], align=0)), ValueError, "align"),
]


@pytest.mark.parametrize("name,mutate,error,needle", _ROUTE_BAD, ids=[b[0] for b in _ROUTE_BAD])
def test_route_rejects_bad_arguments(name: str, mutate: Any, error: type, needle: str, launches: list[tuple]) -> None:
    args = _route_args()
    mutate(args)
    with pytest.raises(error, match=needle):
        sm90.grouped_gemm(**args)
    assert not launches


def _early_args(ids: torch.Tensor | None = None, routing_format: RoutingFormat = RoutingFormat.FP32,
                local_start: int = 2) -> dict[str, Any]:
    """grouped_gemm's arguments of a decode GEMM1 (SwiGLU epilogue, N = 256, BF16 fragments) with early routing."""
    args = _fused_args(TokenLayout.BF16_FRAGMENTS, SwiGLU())
    ids = torch.zeros(5, 4, dtype=torch.int32) if ids is None else ids
    args.update(gather=None, x=torch.zeros(40, 128, dtype=torch.bfloat16), variant=sm90.DecodeVariant(2, 4, 1, 1, 4),
                early=EarlyRouting(ids, int(routing_format), local_start, ctas=9))
    return args


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_early_routing_passes_its_operands_and_compiles_in(dtype: torch.dtype, launches: list[tuple]) -> None:
    """GEMM1 with early routing launches the decode kernel with SM90_EARLY after the epilogue's options, and the
    kernel's arguments plus DEC_EARLY_PARAMS': format, int64 flag, slots, local start, guessing CTAs."""
    args = _early_args(torch.zeros(5, 4, dtype=dtype))
    sm90.grouped_gemm(**args)
    (_source, name, _device, _grid, _block, kernel_args), kwargs = launches[0]
    assert name == "sm90_gemm_decode"
    assert kwargs["extra_options"] == (*args["variant"].options(), *sm90.epilogue_options(SwiGLU()),
                                       "-DSM90_EARLY=1")
    assert len(kernel_args) == len(_signatures()["sm90_gemm_decode"]) + _param_count("DEC_EARLY_PARAMS") == 28 + 6
    early = kernel_args[28:]
    assert [int(a) for a in early[1:]] == [RoutingFormat.FP32, int(dtype == torch.int64), 20, 2, 9]


_EARLY_BAD = [
    ("GEMM2 awaiting a handoff", lambda a: a.update(
        epilogue=None, out=torch.zeros(40, 256, dtype=torch.bfloat16),
        handoff=TileHandoff(torch.zeros(8, dtype=torch.int32), torch.zeros(8, dtype=torch.int32), 1)),
     ValueError, "handoff"),
    ("with a route", lambda a: a.update(route=_route_args()["route"], x=None), ValueError, "route"),
    ("prefill variant", lambda a: a.update(variant=sm90.PREFILL), ValueError, "DecodeVariant"),
    ("ids dtype", lambda a: a.update(early=replace(a["early"], ids=torch.zeros(5, 4))), ValueError, "early.ids"),
    ("ids 1-D", lambda a: a.update(early=replace(a["early"], ids=torch.zeros(20, dtype=torch.int32))), ValueError,
     "early.ids"),
    ("packed int64", lambda a: a.update(early=replace(a["early"], ids=torch.zeros(5, 4, dtype=torch.int64),
                                                      routing_format=int(RoutingFormat.PACKED))), ValueError,
     "early.ids"),
    ("bad format", lambda a: a.update(early=replace(a["early"], routing_format=7)), ValueError, "routing_format"),
    ("negative start", lambda a: a.update(early=replace(a["early"], local_start=-1)), ValueError, "local_start"),
    ("negative ctas", lambda a: a.update(early=replace(a["early"], ctas=-1)), ValueError, "ctas"),
    ("not a tensor", lambda a: a.update(early=replace(a["early"], ids=[[0]])), TypeError, "early.ids"),
]


@pytest.mark.parametrize("name,mutate,error,needle", _EARLY_BAD, ids=[b[0] for b in _EARLY_BAD])
def test_early_routing_rejects_bad_arguments(name: str, mutate: Any, error: type, needle: str,
                                            launches: list[tuple]) -> None:
    args = _early_args()
    mutate(args)
    with pytest.raises(error, match=needle):
        sm90.grouped_gemm(**args)
    assert not launches


def test_gemm2_takes_early_routing(launches: list[tuple]) -> None:
    """GEMM2 behind a routed GEMM1 (no epilogue, no handoff) guesses early too: SM90_EARLY and its arguments after the
    finalize's."""
    args = {**_gemm_args(n=256), "variant": sm90.DecodeVariant(2, 4, 1, 1, 4),
            "early": EarlyRouting(torch.zeros(1, 4, dtype=torch.int32), int(RoutingFormat.FP32), 0, ctas=9)}
    sm90.grouped_gemm(**args)
    (_, _, _, _, _, kernel_args), kwargs = launches[0]
    assert kwargs["extra_options"] == (*args["variant"].options(), "-DSM90_EARLY=1")
    assert len(kernel_args) == len(_signatures()["sm90_gemm_decode"]) + _param_count("DEC_EARLY_PARAMS")
    assert int(kernel_args[-1]) == 9


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("weights", ["NVFP4", "MXINT4", "MXFP4"])
@pytest.mark.parametrize("gemm", ["GEMM1 + SwiGLU", "GEMM2 + finalize"])
@pytest.mark.parametrize("variant,arch", [(v, "90a") for v in LOW_LATENCY_DECODE_VARIANTS]
                         + [(LOW_LATENCY_DECODE_VARIANTS[0], "100a")], ids=str)
def test_early_routing_compiles(variant: Any, arch: str, gemm: str, weights: str) -> None:
    """GEMM1 with early routing (SwiGLU epilogue), and GEMM2 with it and the finalize (behind a routed GEMM1), build for
    the decode variants of small buckets, NVFP4, MXINT4 and MXFP4 tiles alike, without spills (MXINT4 at most the 8
    bytes its forms without early routing may spill, test_coded_decode_compiles; sm_100a's GEMM2 form takes them): the
    guess and the ring's first loads before the wait hold no registers the loop needs."""
    form = sm90.epilogue_options(SwiGLU()) if gemm.startswith("GEMM1") else ("-DSM90_FINALIZE=1",)
    code = CODE_OPTIONS.get(weights.lower(), ())
    result = _nvcc(SM90_DIR / "grouped_gemm.cu", arch, (*variant.options(), *code, *form, "-DSM90_EARLY=1"))
    report = ptxas_report(result, variant.kernel)
    _, spilled = register_usage(report)
    assert spilled <= (8 if weights == "MXINT4" else 0), report


_FINALIZE_BAD = [
    ("prefill variant", lambda a: a.update(variant=sm90.PREFILL), ValueError, "DecodeVariant"),
    ("tickets without finalize", lambda a: a.update(finalize=None), ValueError, "tickets"),
    ("finalize without tickets", lambda a: a.update(tickets=None), ValueError, "tickets"),
    ("too few tickets", lambda a: a.update(tickets=torch.zeros(1, dtype=torch.int32)), ValueError, "tickets"),
    ("tickets dtype", lambda a: a.update(tickets=torch.zeros(8, dtype=torch.int64)), TypeError, "tickets"),
    ("out N", lambda a: a.update(finalize=replace(a["finalize"], out=torch.zeros(5, 64, dtype=torch.bfloat16))),
     ValueError, "finalize.out"),
    ("out 1-D", lambda a: a.update(finalize=replace(a["finalize"], out=torch.zeros(128, dtype=torch.bfloat16))),
     ValueError, "finalize.out"),
    ("out dtype", lambda a: a.update(finalize=replace(a["finalize"], out=torch.zeros(5, 128))), TypeError,
     "finalize.out"),
    ("top_k", lambda a: a.update(finalize=replace(a["finalize"], top_k=0)), ValueError, "finalize.top_k"),
    ("short slot_to_row", lambda a: a.update(finalize=replace(a["finalize"],
                                                              slot_to_row=torch.zeros(19, dtype=torch.int32))),
     ValueError, "finalize.slot_to_row"),
    ("weights dtype", lambda a: a.update(finalize=replace(a["finalize"], weights=torch.zeros(20).double())),
     TypeError, "finalize.weights"),
    ("out overlaps the rows", lambda a: a.update(finalize=replace(a["finalize"], out=a["out"][:5])), ValueError,
     "finalize.out"),
]


@pytest.mark.parametrize("name,mutate,error,needle", _FINALIZE_BAD, ids=[b[0] for b in _FINALIZE_BAD])
def test_finalize_rejects_bad_arguments(name: str, mutate: Any, error: type, needle: str,
                                        launches: list[tuple]) -> None:
    args = _finalize_args()
    mutate(args)
    with pytest.raises(error, match=needle):
        sm90.grouped_gemm(**args)
    assert not launches


def test_tiled_tokens_need_whole_row_groups(launches: list[tuple]) -> None:
    """The tiled planes hold rows in groups of 8 (one bulk copy per stage): R = 44 is refused, naming x."""
    tiled = sm90.WgmmaVariant(128, 2, 4, 2, tiled_tokens=True)
    args = {**_gemm_args(rows=44), "variant": tiled}
    with pytest.raises(ValueError, match="x: BF16_TILED rows come in groups of 8"):
        sm90.grouped_gemm(**args)
    assert not launches
    sm90.grouped_gemm(**_gemm_args(rows=48), variant=tiled)
    assert launches[0][1]["extra_options"] == tiled.options()


def test_grouped_gemm_rejects_cpu_tensors_and_bad_variants() -> None:
    with pytest.raises(ValueError, match="CUDA"):
        sm90.grouped_gemm(**_gemm_args())  # valid shapes: fails on the device check, before any launch
    with pytest.raises(ValueError, match="variant"):
        sm90.grouped_gemm(**_gemm_args(), variant="decode")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="grid"):
        sm90.grouped_gemm(**_gemm_args(rows=8 * 70000))
    with pytest.raises(ValueError):
        sm90.DecodeVariant(mt=3)
    with pytest.raises(ValueError):
        sm90.DecodeVariant(wm=4, wk=16)
    with pytest.raises(ValueError):
        sm90.DecodeVariant(mt=2, wm=4, nt=8, wk=4)  # split-K buffer > 48 KB
    with pytest.raises(ValueError):
        sm90.PrefillVariant(1)
    for bad in ({"tile_rows": 256}, {"feature_block": 32}, {"adec": True, "tile_rows": 64}, {"adec": True, "stages": 2},
                {"min_blocks": 5}, {"min_blocks": 3, "feature_block": 256, "tile_rows": 128},
                {"stages": 8, "feature_block": 256, "tile_rows": 128, "adec": True}):
        with pytest.raises(ValueError):
            sm90.PrefillVariant(**bad)


# ---------------------------------------------------------------------------------------------------------------
# SASS budget of the decode main loop
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.skipif(NVCC is None or CUOBJDUMP is None, reason="nvcc or cuobjdump not found")
@pytest.mark.parametrize("variant", DECODE_VARIANTS[:3], ids=str)
def test_decode_sass_budget(variant: sm90.DecodeVariant) -> None:
    result, cubin = compiled(sass_budget.cubin_command("90a", _sass_defines(variant)), ".cubin")
    if result.returncode:
        raise RuntimeError(result.stderr)
    reports = sass_budget.budget_of(cubin, result.stderr)
    decode = reports["sm90_gemm_decode"]
    assert decode.local_memory == 0
    per_k16 = decode.per_k16(variant.mt * variant.nt)
    print(f"{variant}: {decode.registers} registers, {per_k16:.1f} instructions per k16 step per lane")
    assert decode.hmma == 4 * variant.prefetch * variant.mt * variant.nt  # the steady-state loop: PREFETCH k64 steps
    # every ring refill of the loop (per step: MT weight words, MT scale words, 2 NT token pieces) has a lead
    leads = [lead for opcode_leads in decode.load_leads.values() for lead in opcode_leads]
    assert len(leads) == variant.prefetch * 2 * (variant.mt + variant.nt)
    assert all(0 <= lead <= decode.hmma for lead in leads)
    if variant == sm90.DECODE:  # 19 with the eight-instruction word decode (22 with the eleven before it)
        assert per_k16 <= 20, f"decode main loop: {per_k16:.1f} instructions per k16 step (budget 20)"
    assert not math.isnan(per_k16)


def test_load_leads_count_the_hmma_before_the_first_read_around_the_back_edge() -> None:
    """sass_budget.load_leads on a hand-written loop body: register widths from the load's opcode, an HMMA reading its
    four A registers from the first one named, a guard predicate, stores reading every operand, the wrap, and no lead
    for an asynchronous copy to shared memory."""
    body = [
        "LDG.E.NA.128.CONSTANT R4, desc[UR6][R2.64]",             # 0: R4-R7, first read by 5 (R7): 2 HMMA between
        "LOP3.LUT R20, R8, 0xf, RZ, 0xc0, !PT",                   # 1: reads R8
        "HMMA.16816.F32.BF16 R40, R20, R30, R40",                 # 2: reads R20-R23, R30-R31, R40-R43
        "HMMA.16816.F32.BF16 R44, R20, R30, R44",                 # 3
        "@P0 LDG.E.NA.64.CONSTANT R8, desc[UR6][R2.64+0x200]",    # 4: R8-R9, read by 1 after the wrap: 1 HMMA (6)
        "IMAD.SHL.U32 R21, R7, 0x10, RZ",                         # 5
        "HMMA.16816.F32.BF16 R48, R20, R32, R48",                 # 6
        "LDG.E.CONSTANT R22, desc[UR6][R10.64]",                  # 7: R22, read by 2 (A = R20-R23) after the wrap: 0
        "STG.E.128 desc[UR4][R2.64], R12",                        # 8: reads R2-R3, R12-R15
        "LDGSTS.E.64 [R60], desc[UR6][R10.64]",                   # 9: a copy to shared memory, no register loaded
        "BRA 0x100",
    ]
    assert sass_budget.load_leads(body) == {"LDG.E.NA.128.CONSTANT": [2], "LDG.E.NA.64.CONSTANT": [1],
                                            "LDG.E.CONSTANT": [0]}


@pytest.mark.skipif(NVCC is None or CUOBJDUMP is None, reason="nvcc or cuobjdump not found")
def test_mxfp4_decode_sass_budget() -> None:
    """MXFP4 tiles decode their scale word with two shifts and two masks (one word per tile, both k32 blocks) where
    NVFP4 tiles take four multiplies more per scale word and two words: 16.4 instructions per k16 step per lane on
    sm90.DECODE against NVFP4's 19."""
    defines = [*_sass_defines(sm90.DECODE), "SM90_W_MXFP4=1"]
    result, cubin = compiled(sass_budget.cubin_command("90a", defines), ".cubin")
    if result.returncode:
        raise RuntimeError(result.stderr)
    decode = sass_budget.budget_of(cubin, result.stderr)["sm90_gemm_decode"]
    per_k16 = decode.per_k16(sm90.DECODE.mt * sm90.DECODE.nt)
    assert decode.local_memory == 0 and decode.hmma == 4 * sm90.DECODE.prefetch
    assert per_k16 <= 17, f"MXFP4 decode main loop: {per_k16:.1f} instructions per k16 step (budget 17)"


# ---------------------------------------------------------------------------------------------------------------
# Whole-kernel emulation: the address arithmetic of grouped_gemm.cu, CTA by CTA and lane by lane, with the
# bit-exact fragment decode above and the PTX fragment layouts of mma.m16n8k16 and stmatrix.trans
# ---------------------------------------------------------------------------------------------------------------

LANES = np.arange(32)
G, Q = LANES // 4, LANES % 4


def _words(data: np.ndarray, base: np.ndarray, count: int) -> np.ndarray:
    """[32, count] little-endian 32-bit words at byte offsets base[lane]."""
    raw = data[base[:, None] + np.arange(4 * count)].astype(np.uint64)
    return raw[:, 0::4] | (raw[:, 1::4] << 8) | (raw[:, 2::4] << 16) | (raw[:, 3::4] << 24)


def _half(x: np.ndarray, h: int) -> np.ndarray:
    return bf16_value((x >> (16 * h)) & 0xFFFF)


def a_matrix(a: list[np.ndarray]) -> np.ndarray:
    m = np.full((16, 16), np.nan)
    for r, (row, col) in enumerate(((0, 0), (8, 0), (0, 8), (8, 8))):
        for h in range(2):
            m[G + row, 2 * Q + col + h] = _half(a[r], h)
    return m


def b_matrix(b0: np.ndarray, b1: np.ndarray) -> np.ndarray:
    m = np.full((16, 8), np.nan)
    for h in range(2):
        m[2 * Q + h, G] = _half(b0, h)
        m[2 * Q + 8 + h, G] = _half(b1, h)
    return m


def _to_bf16(v: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.asarray(v, dtype=np.float32)).to(torch.bfloat16).double().numpy()


def emulate_decode(v: sm90.DecodeVariant, w: np.ndarray, s: np.ndarray, alpha: np.ndarray, xb: np.ndarray,
                   offsets: list[int], n: int, k: int, rows: int) -> np.ndarray:
    """sm90_gemm_decode, step by step as in the source."""
    experts, kt = len(offsets) - 1, k // 64
    fb, tb = v.feature_block, v.tile_rows
    grid = sm90.gemm_grid(v, experts, n, rows)
    out = np.full((rows, n), np.nan)
    for by in range(grid[1]):
        tile = find_tile(offsets, tb, rows, by)
        if tile is None:
            continue
        e, row0, row_end = tile
        for bx in range(grid[0]):
            red = np.zeros((v.wk, tb, fb))
            for warp in range(v.wm * v.wk):
                wm, wk = warp % v.wm, warp // v.wm
                expert_tiles = (n >> 4) * kt
                first_tile = (bx * (v.wm * v.mt) + wm * v.mt) * kt + wk
                wp = (e * expert_tiles + first_tile) * 512 + LANES * 16
                sp = (e * expert_tiles + first_tile) * 64 + G * 8
                xp = []
                for nt in range(v.nt):
                    row = row0 + nt * 8 + G
                    xp.append((np.where(row < row_end, row, row0) * k + wk * 64) * 2 + Q * 32)
                nsteps = (kt - wk + v.wk - 1) // v.wk if wk < kt else 0
                acc = np.zeros((v.mt, v.nt, 16, 8))
                for step in range(nsteps):
                    ww = [_words(w, wp + step * v.wk * 512 + mt * kt * 512, 4) for mt in range(v.mt)]
                    ss = [_words(s, sp + step * v.wk * 64 + mt * kt * 64, 2) for mt in range(v.mt)]
                    bb = [_words(xb, xp[nt] + step * v.wk * 128, 8) for nt in range(v.nt)]
                    for k16 in range(4):
                        for mt in range(v.mt):
                            sg, sg8 = decode_tile_scale_word(ss[mt][:, k16 >> 1])
                            a = a_matrix(scaled_a(ww[mt][:, k16], sg, sg8, k16))
                            for nt in range(v.nt):
                                acc[mt, nt] += a @ b_matrix(bb[nt][:, 2 * k16], bb[nt][:, 2 * k16 + 1])
                for mt in range(v.mt):
                    for nt in range(v.nt):
                        f = (wm * v.mt + mt) * 16
                        red[wk, nt * 8 : nt * 8 + 8, f : f + 16] = acc[mt, nt].T
            total = red.sum(axis=0)
            for t in range(tb):
                if row0 + t < row_end:
                    out[row0 + t, bx * fb : bx * fb + fb] = _to_bf16(np.float32(alpha[e] * 256.0) * total[t])
    return out


def emulate_prefill(w: np.ndarray, s: np.ndarray, alpha: np.ndarray, xb: np.ndarray, offsets: list[int], n: int,
                    k: int, rows: int, seed: int = 0, v: sm90.PrefillVariant = sm90.PREFILL) -> np.ndarray:
    """sm90_gemm_prefill as in the source: cp.async copies into the stage buffer (pre-filled with
    garbage, so a byte the copies miss shows; weight tiles past N read nothing), with ADEC the decode
    warps' stores and the mma warps' loads of the decoded A fragments, warp reads, mma,
    stmatrix.trans staging, guarded stores."""
    experts, kt = len(offsets) - 1, k // 64
    fb, tb, threads = v.feature_block, v.tile_rows, v.threads
    wmc, mtiles = fb // 32, fb // 16
    w_bytes, x_offset = mtiles * 512, mtiles * 576
    stage_bytes = v.stage_bytes
    grid = sm90.gemm_grid(v, experts, n, rows)
    rng = np.random.default_rng(seed)
    out = np.full((rows, n), np.nan)
    tid = np.arange(threads)
    lane = tid & 31
    guard = fb > 128
    for by in range(grid[1]):
        tile = find_tile(offsets, tb, rows, by)
        if tile is None:
            continue
        e, row0, row_end = tile
        for bx in range(grid[0]):
            mtiles_in = (n >> 4) - bx * mtiles
            expert_tiles = (n >> 4) * kt
            block_tile0 = e * expert_tiles + bx * mtiles * kt
            w_copies = []  # (src, dst, bytes) per thread and chunk
            for u in range(2 * fb // threads):
                m = (tid + u * threads) >> 5
                ok = (not guard) | (m < mtiles_in)
                w_copies.append(((block_tile0 + np.where(ok, m, 0) * kt) * 512 + lane * 16, (tid + u * threads) * 16,
                                 np.where(ok, 16, 0)))
            s_tile = (tid >> 2) & (mtiles - 1)
            s_ok = (not guard) | (s_tile < mtiles_in)
            s_src = (block_tile0 + np.where(s_ok, s_tile, 0) * kt) * 64 + (tid & 3) * 16
            s_dst = w_bytes + tid * 16
            x_first = row0 + (tid >> 3)
            x_step = threads // 8
            x_dst = x_offset + (tid >> 3) * 144 + (tid & 7) * 16
            acc = np.zeros((threads // 32, 2, 8, 16, 8))  # [warp, mt, nt]
            decoded = [None, None]
            stages = {}

            def load(j: int) -> None:
                stage = rng.integers(0, 256, stage_bytes).astype(np.uint8)  # stale bytes of an earlier stage
                for t in range(threads):
                    for src, dst, nbytes in w_copies:
                        stage[dst[t] : dst[t] + 16] = w[src[t] + j * 512 : src[t] + j * 512 + 16] if nbytes[t] else 0
                    if t < fb // 4:
                        stage[s_dst[t] : s_dst[t] + 16] = s[s_src[t] + j * 64 : s_src[t] + j * 64 + 16] if s_ok[t] else 0
                    for u in range(8 * tb // threads):
                        row = x_first[t] + x_step * u
                        src = (row0 * k * 2 + (tid[t] & 7) * 16) + (min(row, row_end - 1) - row0) * k * 2 + j * 128
                        dst = x_dst[t] + u * x_step * 144
                        stage[dst : dst + 16] = xb[src : src + 16] if row < row_end else 0
                stages[j] = stage

            def decode(j: int) -> np.ndarray:  # ADEC: warp w decodes m16 tile w -> [lane-major fragments]
                buf = rng.integers(0, 2**32, (mtiles, 4, 32, 4)).astype(np.uint64)
                for warp in range(threads // 32):
                    wq = _words(stages[j], warp * 512 + LANES * 16, 4)
                    sc = _words(stages[j], w_bytes + warp * 64 + G * 8, 2)
                    for st in range(4):
                        sg, sg8 = decode_tile_scale_word(sc[:, st >> 1])
                        buf[warp, st] = np.stack(scaled_a(wq[:, st], sg, sg8, st), axis=1)
                return buf

            for j in range(kt):
                load(j)
                if v.adec:
                    decoded[j & 1] = decode(j)
                stage = stages.pop(j)
                for warp in range(threads // 32):
                    wm, wn = warp % wmc, warp // wmc
                    if not v.adec:
                        wq = [_words(stage, (wm * 2 + mt) * 512 + LANES * 16, 4) for mt in range(2)]
                        sc = [_words(stage, w_bytes + (wm * 2 + mt) * 64 + G * 8, 2) for mt in range(2)]
                    xoff = x_offset + (wn * 64 + G) * 144 + Q * 32
                    for h in range(2):
                        a = {}
                        for mt in range(2):
                            if v.adec:  # da + mt * 2048 + (2h + s2) * 512 + 16 lane, da at tile 2 wm
                                for s2 in range(2):
                                    a[s2, mt] = a_matrix(list(decoded[j & 1][wm * 2 + mt, 2 * h + s2].T))
                            else:
                                sg, sg8 = decode_tile_scale_word(sc[mt][:, h])
                                a[0, mt] = a_matrix(scaled_a(wq[mt][:, 2 * h], sg, sg8, 2 * h))
                                a[1, mt] = a_matrix(scaled_a(wq[mt][:, 2 * h + 1], sg, sg8, 2 * h + 1))
                        for nt in range(8):
                            bq = _words(stage, xoff + nt * 8 * 144 + h * 16, 4)
                            for mt in range(2):
                                acc[warp, mt, nt] += a[0, mt] @ b_matrix(bq[:, 0], bq[:, 1])
                                acc[warp, mt, nt] += a[1, mt] @ b_matrix(bq[:, 2], bq[:, 3])
            # epilogue: stmatrix.x4.trans into [token][feature] (stride 2 FB + 16 bytes), then stores
            stride = fb + 8
            staged = np.full(tb * stride, np.nan)
            scale = np.float32(alpha[e] * 256.0)
            for warp in range(threads // 32):
                wm, wn = warp % wmc, warp // wmc
                for mt in range(2):
                    for nt in range(0, 8, 2):
                        c = [_to_bf16(scale * acc[warp, mt, nt + i // 2]) for i in range(4)]
                        row_addr = {}
                        for ln in range(32):
                            mi, r = ln >> 3, ln & 7
                            row_addr[mi, r] = (wn * 64 + (nt + (mi >> 1)) * 8 + r) * stride + wm * 32 + mt * 16 + (mi & 1) * 8
                        for i in range(4):  # register i = matrix i: (c0, c1) or (c2, c3) of its n8 tile
                            frag = c[i][8 * (i & 1) :][:8]  # rows g (+8) of C
                            for ln in range(32):
                                for hh in range(2):
                                    value = frag[ln // 4, 2 * (ln % 4) + hh]
                                    staged[row_addr[i, 2 * (ln % 4) + hh] + ln // 4] = value
            chunks = fb // 8
            for cidx in range(tb * chunks):
                row, chunk = cidx // chunks, cidx % chunks
                if row0 + row < row_end and (not guard or (chunk >> 1) < mtiles_in):
                    out[row0 + row, bx * fb + chunk * 8 : bx * fb + chunk * 8 + 8] = staged[row * stride + chunk * 8 :][:8]
    return out


def _emulation_problem(experts: int, n: int, k: int, lengths: list[int], spare: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    packed, scales = _random_weights(experts, n, k, seed)
    tiles, tile_scales = pack_weight_tiles(packed, scales)
    offsets = [0]
    for length in lengths:
        offsets.append(offsets[-1] + -(-length // 8) * 8)
    rows = offsets[-1] + spare
    x = dequantize_nvfp4(*quantize_nvfp4(torch.randn(rows, k, generator=gen)), 1.0, torch.bfloat16)
    x[offsets[-1] :] = math.nan  # rows past the last segment: garbage the kernels must not need
    alpha = (torch.rand(experts, generator=gen) + 0.5).numpy()
    xb = to_token_fragments(x).contiguous().view(torch.uint8).numpy().ravel()
    ref = np.full((rows, n), np.nan)
    w64 = _dequantized(packed, scales)
    x64 = x.double().numpy()
    for e in range(experts):
        lo, hi = offsets[e], offsets[e + 1]
        ref[lo:hi] = _to_bf16(alpha[e] * (x64[lo:hi] @ w64[e].T))
    return tiles.numpy().ravel(), tile_scales.numpy().ravel(), alpha, xb, offsets, rows, ref


def _compare(out: np.ndarray, ref: np.ndarray, used: int) -> None:
    assert not np.isnan(out[:used]).any(), "rows of a segment not written"
    assert np.isnan(out[used:]).all(), "rows outside the segments written"
    np.testing.assert_allclose(out[:used], ref[:used], rtol=1e-2, atol=1e-3 * np.abs(ref[:used]).max())


@pytest.mark.parametrize("variant", [sm90.DECODE, sm90.DecodeVariant(mt=2, wm=2, wk=2),
                                     sm90.DecodeVariant(wm=2, wk=4, nt=2), sm90.DecodeVariant(wm=1, wk=8, nt=4)], ids=str)
def test_decode_kernel_emulation(variant: sm90.DecodeVariant) -> None:
    w, s, alpha, xb, offsets, rows, ref = _emulation_problem(3, 128, 192, [13, 0, 21], 16, seed=4)
    out = emulate_decode(variant, w, s, alpha, xb, offsets, 128, 192, rows)
    _compare(out, ref, offsets[-1])


@pytest.mark.parametrize("variant", [sm90.PREFILL, sm90.PrefillVariant(3, adec=True)], ids=str)
def test_prefill_kernel_emulation(variant: sm90.PrefillVariant) -> None:
    w, s, alpha, xb, offsets, rows, ref = _emulation_problem(2, 128, 192, [131, 40], 8, seed=5)
    out = emulate_prefill(w, s, alpha, xb, offsets, 128, 192, rows, v=variant)
    _compare(out, ref, offsets[-1])


@pytest.mark.parametrize("variant", [sm90.PrefillVariant(feature_block=256, tile_rows=64),
                                     sm90.PrefillVariant(feature_block=64, tile_rows=128, min_blocks=4),
                                     sm90.PrefillVariant(3, 1, feature_block=256, adec=True)], ids=str)
def test_prefill_kernel_emulation_other_tiles(variant: sm90.PrefillVariant) -> None:
    """N = 384: a 256-feature CTA overhangs N by 128 features (skipped); 64-row tiles split segments."""
    w, s, alpha, xb, offsets, rows, ref = _emulation_problem(2, 384, 64, [75, 16], 8, seed=6)
    out = emulate_prefill(w, s, alpha, xb, offsets, 384, 64, rows, v=variant)
    _compare(out, ref, offsets[-1])


# ---------------------------------------------------------------------------------------------------------------
# NVRTC (the compiler CuPy uses at run time), when its library is installed
# ---------------------------------------------------------------------------------------------------------------


def _nvrtc_library() -> Any:
    import ctypes
    import ctypes.util

    candidates = [ctypes.util.find_library("nvrtc")]
    try:
        import nvidia  # type: ignore[import-not-found]

        for base in getattr(nvidia, "__path__", []):
            candidates += [str(p) for p in sorted(Path(base).glob("*/lib/libnvrtc.so*")) if "builtins" not in p.name]
    except ImportError:
        pass
    for candidate in candidates:
        if candidate:
            try:
                return ctypes.CDLL(candidate)
            except OSError:
                continue
    return None


NVRTC = _nvrtc_library()


@pytest.mark.skipif(NVRTC is None, reason="libnvrtc not found")
@pytest.mark.parametrize("arch", ["compute_90", "compute_100"])
@pytest.mark.parametrize("variant", [sm90.DECODE, *PREFILL_VARIANTS, *DECODE_VARIANTS[1:]], ids=str)
def test_nvrtc_compiles(arch: str, variant: Any) -> None:
    import ctypes

    from cudnn_moe.kernels import compile_options, module_source

    filename = "sm90/grouped_gemm.cu"
    options = [*compile_options(variant.options()), f"--gpu-architecture={arch}"]
    program = ctypes.c_void_p()
    assert NVRTC.nvrtcCreateProgram(ctypes.byref(program), module_source(filename).encode(), filename.encode(), 0,
                                    None, None) == 0
    status = NVRTC.nvrtcCompileProgram(program, len(options), (ctypes.c_char_p * len(options))(*[o.encode() for o in options]))
    size = ctypes.c_size_t()
    NVRTC.nvrtcGetProgramLogSize(program, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    NVRTC.nvrtcGetProgramLog(program, log)
    NVRTC.nvrtcDestroyProgram(ctypes.byref(program))
    assert status == 0, log.value.decode()
