"""CPU checks of the SM90 kernels' row-major NVFP4 forms (the aligned op's raw weights read in place): the byte decode
of fragments.cuh, emulated in Python, gives the exact E2M1 values of both nibbles of every code byte; the forms the
engine picks compile for sm_90a within their register budgets (and the decode form for sm_100a); the engine runs
row-major views on those forms with natural token rows; the launch passes the half swap; the aligned op's
preparation holds the caller's tensors and no copy."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch

from cudnn_moe.activations import SwiGLU
from cudnn_moe.aligned import prepare_aligned_weights
from cudnn_moe.engines.base import BlockCode, GemmShape
from cudnn_moe.engines.sm90 import engine as sm90_engine
from cudnn_moe.engines.sm90 import kernels as sm90
from cudnn_moe.formats import decode_e2m1
from cudnn_moe.kernels import TokenLayout, kernels_dir

from tests.engines.sm90.test_sm90_kernels_cpu import _gemm_args, _nvcc, launches  # noqa: F401 (fixture)
from tests.engines.sm90.gpus import bare_engine
from tests.support.kernel_sources import NVCC, ptxas_report, register_usage

SM90_DIR = kernels_dir() / "sm90"
ENGINE_DECODE = [sm90_engine._WIDE, sm90_engine._SPLIT, sm90_engine._SPLIT_DEEP, sm90_engine._MID,
                 sm90_engine._MID_LONG_K]
ENGINE_WGMMA = [sm90_engine._WGMMA_SHORT, sm90_engine._WGMMA, sm90_engine._WGMMA_WIDE]


# ---------------------------------------------------------------------------------------------------------------
# The byte decode (fragments.cuh decode_row_byte), emulated
# ---------------------------------------------------------------------------------------------------------------


def _prmt(a: np.ndarray, b: np.ndarray, selector: int) -> np.ndarray:
    """PTX prmt.b32 (default mode): byte i of the result is byte (selector >> 4i) & 7 of {b, a}."""
    pool = (b.astype(np.uint64) << np.uint64(32)) | a.astype(np.uint64)
    out = np.zeros_like(a, dtype=np.uint64)
    for i in range(4):
        pick = (selector >> (4 * i)) & 7
        out |= ((pool >> np.uint64(8 * pick)) & np.uint64(0xFF)) << np.uint64(8 * i)
    return out.astype(np.uint32)


def _decode_row_byte(words: np.ndarray, b: int) -> np.ndarray:
    selector = (b << 12) | ((b + 4) << 4)  # row_byte_selector
    r = _prmt(words, (words << np.uint32(4)).astype(np.uint32), selector)
    return (r & np.uint32(0x80008000)) | ((r >> np.uint32(6)) & np.uint32(0x01C001C0))


def _bf16_values(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32).astype(np.float64)


def test_row_byte_decode_every_byte_in_every_place() -> None:
    """Each of the 256 code bytes, at each of the four bytes of a word whose other bytes are random, decodes to
    (E2M1 of its low nibble, of its high nibble) x 2^-126 in the (low, high) BF16 halves, exactly."""
    rng = np.random.default_rng(0)
    codes = np.arange(256, dtype=np.uint32)
    for b in range(4):
        noise = rng.integers(0, 2**32, size=256, dtype=np.uint64).astype(np.uint32) & np.uint32(~(0xFF << (8 * b)) & 0xFFFFFFFF)
        words = noise | (codes << np.uint32(8 * b))
        got = _decode_row_byte(words, b)
        low = _bf16_values(got & np.uint32(0xFFFF))
        high = _bf16_values(got >> np.uint32(16))
        want_low = decode_e2m1(torch.from_numpy((codes & 15).astype(np.uint8))).double().numpy() * 2.0**-126
        want_high = decode_e2m1(torch.from_numpy((codes >> 4).astype(np.uint8))).double().numpy() * 2.0**-126
        np.testing.assert_array_equal(low, want_low)
        np.testing.assert_array_equal(high, want_high)
        # -0 stays -0 (the sign bit of code 8)
        assert np.signbit(low[8]) and np.signbit(high[0x80])


# ---------------------------------------------------------------------------------------------------------------
# Compilation of the forms the engine picks
# ---------------------------------------------------------------------------------------------------------------


DECODE_FORMS = {"plain": (), "swiglu": sm90.epilogue_options(SwiGLU())}  # no early routing (engine.py: _early)


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("variant,form,arch", [(v, f, "90a") for v in ENGINE_DECODE for f in DECODE_FORMS]
                         + [(ENGINE_DECODE[0], "swiglu", "100a")], ids=str)
def test_row_major_decode_compiles(variant: Any, form: str, arch: str) -> None:
    """The decode kernel's row-major form builds in the forms the aligned op's chain runs; for sm_90a (the engine's
    GPU) without spills, the forms of one or two m16 x n8 tiles a warp within 128 registers (four CTAs of 128 threads
    an SM, as the tile form)."""
    variant = replace(variant, row_major=True)
    result = _nvcc(SM90_DIR / "grouped_gemm.cu", arch, (*variant.options(), *DECODE_FORMS[form]))
    registers, spilled = register_usage(ptxas_report(result, variant.kernel))
    assert arch != "90a" or (spilled == 0 and (variant.mt * variant.nt > 2 or registers <= 128))


# The forms the MXFP4 pair's chain runs on its row-major MXFP4 weights (BlockCode.MXFP4_ROWS): GEMM1 with the SwiGLU
# epilogue quantizing to MXFP8, GEMM2 plain or finalizing (no tile handoff, no early routing: engine.py).
MXFP4_ROWS_FORMS = {"swiglu-mxfp8": (*sm90.epilogue_options(SwiGLU()), "-DSM90_ACT_MXFP8=1"), "plain": (),
                    "finalize": ("-DSM90_FINALIZE=1",)}
# The variants the engine picks for low-latency buckets (at most 8 tokens), in their row-major form.
LOW_LATENCY_ROWS = [replace(v, row_major=True) for v in (sm90_engine._SPLIT, sm90_engine._SPLIT_DEEP, sm90_engine._WIDE)]


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("variant,form,arch", [(v, f, "90a") for v in LOW_LATENCY_ROWS for f in MXFP4_ROWS_FORMS]
                         + [(LOW_LATENCY_ROWS[0], "swiglu-mxfp8", "100a")], ids=str)
def test_mxfp4_row_major_decode_compiles(variant: Any, form: str, arch: str) -> None:
    """The row-major form on MXFP4 weights (-DSM90_W_MXFP4: one E8M0 byte a lane a row and step, made into the
    shifted form's multiplier) builds in every form the MXFP4 pair's chain runs within 128 registers (four CTAs of 128
    threads an SM), for sm_90a without spills (NVFP4's finalizing split-K row-major forms spill 20 bytes)."""
    options = (*variant.options(), "-DSM90_W_MXFP4=1", *MXFP4_ROWS_FORMS[form])
    result = _nvcc(SM90_DIR / "grouped_gemm.cu", arch, options)
    registers, spilled = register_usage(ptxas_report(result, variant.kernel))
    assert arch != "90a" or (registers <= 128 and spilled == 0)


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("variant,gemm", [(v, g) for v in ENGINE_WGMMA for g in (1, 2)], ids=str)
def test_row_major_wgmma_compiles(variant: Any, gemm: int) -> None:
    """The wgmma kernel's row-major form builds as GEMM1 (gathering natural rows, SwiGLU epilogue) and GEMM2 (tiled
    tokens); without spills but for the 64-row GEMM1, whose tile form (three CTAs an SM) spills too."""
    variant = replace(variant, row_major=True)
    options = (*variant.gathering().options(), *sm90.epilogue_options(SwiGLU())) if gemm == 1 else variant.options()
    _, spilled = register_usage(ptxas_report(_nvcc(SM90_DIR / "wgmma_gemm.cu", "90a", options), variant.kernel))
    assert spilled == 0 or (gemm == 1 and variant.tile_rows == 64)


# ---------------------------------------------------------------------------------------------------------------
# The engine and the launch
# ---------------------------------------------------------------------------------------------------------------


def _engine() -> sm90_engine.Sm90GemmEngine:
    return bare_engine()


@pytest.mark.parametrize("rows", [8, 64, 512, 4096, 65536])
@pytest.mark.parametrize("gemm", [1, 2])
def test_engine_runs_row_major_views_on_the_row_major_forms(rows: int, gemm: int) -> None:
    """A row-major view runs the variant a tiled one would, in its row-major form (GEMM1 on the split variant where
    the tiles take the wide one, GEMM2 on the wide one where the tiles take its four-block form): the decode kernel
    reads natural token rows, wgmma the tokens the tile form reads."""
    engine = _engine()
    shape = GemmShape(7168, 4096, 256) if gemm == 1 else GemmShape(2048, 7168, 256)
    tiled = engine.variant(rows, shape, gemm=gemm)
    rows_form = engine.variant(rows, shape, gemm=gemm, code=BlockCode.NVFP4_ROWS)
    expected = {sm90_engine._WIDE: sm90_engine._SPLIT if gemm == 1 else tiled,
                sm90_engine._WIDE_MT4: sm90_engine._WIDE}.get(tiled, tiled)
    assert rows_form == replace(expected, row_major=True)
    layout = engine.token_layout_for(rows, shape, gemm=gemm, code=BlockCode.NVFP4_ROWS)
    if isinstance(tiled, sm90.DecodeVariant):
        assert layout is TokenLayout.BF16_ROWS and "-DSM90_W_ROWS=1" in rows_form.options()
    else:
        assert layout is tiled.token_layout and "-DSM90_WG_W_ROWS=1" in rows_form.options()


def test_launch_passes_the_half_swap(launches: list[tuple]) -> None:
    """swap_halves reaches the kernels as the int after the fused arguments (decode and wgmma); row-major variants
    compile their form in; the prefill kernel and a route refuse them."""
    args = _gemm_args()
    for variant, swap in ((replace(sm90.DECODE, row_major=True), True), (sm90.DECODE, False),
                          (sm90.WgmmaVariant(row_major=True), True)):
        sm90.grouped_gemm(**args, variant=variant, swap_halves=swap)
        (_source, _name, _device, _grid, _block, kernel_args), kwargs = launches[-1]
        assert int(kernel_args[21]) == int(swap) and kwargs["extra_options"] == variant.options()
    with pytest.raises(ValueError, match="swap_halves needs"):
        sm90.grouped_gemm(**args, variant=sm90.PREFILL, swap_halves=True)
    with pytest.raises(ValueError, match="bf16_weights and row_major"):
        sm90.DecodeVariant(bf16_weights=True, row_major=True)


# ---------------------------------------------------------------------------------------------------------------
# The aligned op's weights
# ---------------------------------------------------------------------------------------------------------------


def _raw(experts: int = 3, n: int = 256, k: int = 512) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(3)
    return (torch.randint(0, 256, (experts, n, k // 2), dtype=torch.uint8, generator=gen),
            torch.rand(experts, n, k // 16, generator=gen).to(torch.float8_e4m3fn),
            torch.randint(0, 256, (experts, k, n // 4), dtype=torch.uint8, generator=gen),
            torch.rand(experts, k, n // 32, generator=gen).to(torch.float8_e4m3fn))


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("in_place", [True, None])
def test_aligned_weights_are_read_in_place(in_place: bool | None) -> None:
    """On the sm90 engine, by default or with in_place=True, the prepared layer holds the caller's four tensors
    themselves (same memory, flattened per expert), marked row-major with w1's halves swapped; canonical() gives the
    caller's values back. in_place=False lays the weights out in the engine's tiles, a copy with the same values."""
    raw = _raw()
    prepared = prepare_aligned_weights(*raw, arch="sm90", in_place=in_place)
    layer = prepared.layer
    assert prepared.in_place and layer.code is BlockCode.NVFP4_ROWS and layer.w1_halves_swapped
    for held, t in zip((layer.w1, layer.w1_scales, layer.w2, layer.w2_scales), raw):
        assert held.data_ptr() == t.data_ptr() and held.shape == (t.shape[0], t[0].numel())
    assert all(_same_bytes(a, b) for a, b in zip(prepared.canonical(), raw))
    up, gate = raw[0].chunk(2, dim=1)
    assert _same_bytes(layer.canonical()[0], torch.cat((gate, up), dim=1))  # the pipeline's [up; gate]
    copied = prepare_aligned_weights(*raw, arch="sm90", in_place=False)
    assert not copied.in_place and copied.layer.code is BlockCode.NVFP4
    assert copied.layer.w1.data_ptr() != raw[0].data_ptr()
    assert all(_same_bytes(a, b) for a, b in zip(copied.canonical(), raw))


@pytest.mark.parametrize("case,needle", [("non-contiguous", "gemm2_weights as it is: it must be contiguous"),
                                         ("unaligned", "gemm1_weights_scale as it is"),
                                         ("cudnn", "needs the sm90 engine")])
def test_in_place_refuses_what_it_cannot_read(case: str, needle: str) -> None:
    """in_place=True names the tensor it cannot read as it is, or the engine that reads its own layout; the default
    (in_place=None) lays such weights out in the engine's layout instead, with the same values."""
    raw = list(_raw())
    arch, engine = "sm90", "auto"
    if case == "non-contiguous":
        raw[2] = raw[2].transpose(1, 2).contiguous().transpose(1, 2)
    elif case == "unaligned":
        unaligned = torch.empty(raw[1].numel() + 1, dtype=torch.uint8)[1:]  # the same scales, one byte off
        raw[1] = unaligned.copy_(raw[1].view(torch.uint8).reshape(-1)).view(torch.float8_e4m3fn).view(raw[1].shape)
    else:
        arch, engine = "sm100", "cudnn"
    with pytest.raises(ValueError, match=needle):
        prepare_aligned_weights(*raw, arch=arch, engine=engine, in_place=True)
    fallback = prepare_aligned_weights(*raw, arch=arch, engine=engine)  # the default lays them out instead
    assert not fallback.in_place and all(_same_bytes(a, b) for a, b in zip(fallback.canonical(), raw))
