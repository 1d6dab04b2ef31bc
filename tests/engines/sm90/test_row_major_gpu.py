"""GPU tests of the SM90 kernels' row-major NVFP4 forms (the aligned op's raw weights read in place) and MXFP4 forms
(the MXFP4 pair's weights read in place) against the float64 reference and against the tile forms or each other,
with NaN-poisoned outputs (tests.engines.sm90.test_sm90_kernels_gpu's
Problem and check)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from cudnn_moe.engines.base import ActivationEpilogue, BlockCode, RowGather, TokenOperand
from cudnn_moe.engines.sm90 import engine as sm90_engine
from cudnn_moe.engines.sm90 import kernels as sm90
from cudnn_moe.activations import SwiGLU
from cudnn_moe.kernels import IntermediateCode, TokenLayout
from cudnn_moe.kernels.codes import SM90_ROWS_STEP_K
from cudnn_moe.formats import dequantize_mxfp4
from tests.engines.sm90.test_sm90_kernels_gpu import CASES, DEV, MXINT4_CASES, Problem, _gen, _lengths, check
from tests.support.sm90_variants import DECODE_VARIANTS, WGMMA_VARIANTS

pytestmark = pytest.mark.gpu

ROW_DECODE = [replace(v, row_major=True) for v in (*DECODE_VARIANTS, sm90_engine._WIDE, sm90_engine._MID,
                                                   sm90_engine._MID_LONG_K)]
ROW_WGMMA = [replace(v, row_major=True) for v in WGMMA_VARIANTS]


def _halves_swapped(t: torch.Tensor) -> torch.Tensor:
    """[E, N, X] rows [a; b] -> [b; a], a new tensor."""
    a, b = t.chunk(2, dim=1)
    return torch.cat((b, a), dim=1).contiguous()


def run_rows(problem: Problem, variant: sm90.GemmVariant, swap: bool = False) -> torch.Tensor:
    """The row-major form on the problem's canonical codes and scales (stored with their halves swapped and read back
    with ``swap_halves`` when ``swap``)."""
    codes, scales = problem.codes, problem.scales
    if swap:
        codes, scales = _halves_swapped(codes), _halves_swapped(scales)
    out = torch.full((problem.rows, problem.n), math.nan, dtype=torch.bfloat16, device=DEV)
    sm90.grouped_gemm(codes.reshape(problem.e, -1), scales.reshape(problem.e, -1), problem.alpha_dev,
                      problem.x[variant.token_layout], problem.offsets_dev, out, variant, swap_halves=swap)
    torch.cuda.synchronize()
    return out


@pytest.mark.parametrize("variant,case", [(v, c) for v in ROW_DECODE + ROW_WGMMA for c in range(len(CASES))
                                          if isinstance(v, sm90.WgmmaVariant) or CASES[c][2] % SM90_ROWS_STEP_K == 0],
                         ids=str)
def test_row_major_forms_match_reference(variant: sm90.GemmVariant, case: int) -> None:
    """Every row-major form matches the float64 reference on ragged segments, repeats bitwise, and reads halves
    stored the other way round (swap_halves) to the same bits (the decode form on K multiples of 128, its step)."""
    experts, n, k, max_len, spare = CASES[case]
    problem = Problem(experts, n, k, _lengths(experts, seed=case, max_len=max_len), spare, seed=100 + case)
    out = run_rows(problem, variant)
    check(problem, out)
    assert torch.equal(out.view(torch.int16), run_rows(problem, variant).view(torch.int16)), "results differ"
    if n % 32 == 0:
        assert torch.equal(out.view(torch.int16), run_rows(problem, variant, swap=True).view(torch.int16)), "swap"


def test_row_major_forms_against_the_tile_forms() -> None:
    """wgmma: the row-major form decodes the same values into the same k steps as the tile form, so every output bit
    is equal. Decode kernel: its k16 steps group other k (natural token rows), so FP32 rounding differs a little."""
    problem = Problem(6, 768, 1024, [300, 0, 64, 129, 7, 256], 16, seed=17, cover_scales=True)
    used = problem.offsets[-1]
    for variant in WGMMA_VARIANTS:
        got = run_rows(problem, replace(variant, row_major=True))
        assert torch.equal(got.view(torch.int16), problem.run(variant).view(torch.int16)), f"{variant}"
    for variant in DECODE_VARIANTS:
        got, want = run_rows(problem, replace(variant, row_major=True)), problem.run(variant)
        check(problem, got)
        differ = (got[:used].view(torch.int16) != want[:used].view(torch.int16)).float().mean().item()
        gap = (got[:used].double() - want[:used].double()).norm() / want[:used].double().norm()
        assert differ <= 0.05 and gap <= 1e-3, f"{variant}: {differ:.2%} of outputs differ from the tile form, {gap:.3g}"


@pytest.mark.parametrize("variant", [sm90_engine._SPLIT, sm90_engine._WIDE, sm90_engine._WGMMA.gathering()], ids=str)
def test_row_major_swiglu_epilogue_reads_swapped_halves(variant: sm90.GemmVariant) -> None:
    """GEMM1 with the SwiGLU epilogue (BF16 rows out) on [gate; up] weights read with swap_halves writes what the tile
    form writes on [up; gate] tiles: bitwise on wgmma, on the decode kernel up to the rounding of its k order."""
    experts, n, k = 4, 512, 512
    problem = Problem(experts, n, k, [40, 8, 0, 17], 8, seed=23)
    rows = problem.rows
    row_to_slot = torch.arange(rows, dtype=torch.int32, device=DEV)

    def epilogue_out() -> TokenOperand:
        return TokenOperand(torch.full((rows, n // 2), math.nan, dtype=torch.bfloat16, device=DEV), None,
                            TokenLayout.BF16_ROWS)

    def launch(v: sm90.GemmVariant, codes: torch.Tensor, scales: torch.Tensor, swap: bool) -> torch.Tensor:
        out = epilogue_out()
        epilogue = ActivationEpilogue(SwiGLU(), row_to_slot, out, IntermediateCode.BF16)
        gather = None
        x = problem.x[v.token_layout]
        if isinstance(v, sm90.WgmmaVariant):
            gather, x = RowGather(problem.x[v.token_layout], row_to_slot, 1), None
        sm90.grouped_gemm(codes, scales, problem.alpha_dev, x, problem.offsets_dev, None, v, gather=gather,
                          epilogue=epilogue, swap_halves=swap)
        torch.cuda.synchronize()
        return out.data

    rows_variant = replace(variant, row_major=True)
    tile_variant = replace(rows_variant, row_major=False)
    got = launch(rows_variant, _halves_swapped(problem.codes).reshape(experts, -1),
                 _halves_swapped(problem.scales).reshape(experts, -1), True)
    want = launch(tile_variant, problem.tiles, problem.tile_scales, False)
    used = problem.offsets[-1]
    assert not got[:used].isnan().any()
    if isinstance(variant, sm90.WgmmaVariant):
        assert torch.equal(got[:used].view(torch.int16), want[:used].view(torch.int16))
    else:
        assert torch.allclose(got[:used].float(), want[:used].float(), rtol=2**-5, atol=1e-30)


# The variants the MXFP4 pair's chain runs, in their row-major form (engine.py: low-latency buckets).
MXFP4_ROWS_DECODE = [replace(v, row_major=True) for v in (sm90_engine._SPLIT, sm90_engine._SPLIT_DEEP, sm90_engine._WIDE)]


@pytest.mark.parametrize("variant", MXFP4_ROWS_DECODE, ids=str)
@pytest.mark.parametrize("case", [c for c in range(len(MXINT4_CASES)) if MXINT4_CASES[c][2] % SM90_ROWS_STEP_K == 0])
def test_mxfp4_row_major_matches_reference_and_nvfp4_rows(variant: sm90.DecodeVariant, case: int) -> None:
    """MXFP4 weights read in place (BlockCode.MXFP4_ROWS: codes and E8M0 bytes row-major, each expert's global 2^a
    as alpha, a in -4 .. 4): random codes at every shifted power 2^-9 .. 2^8, and all-zero blocks whose scale bytes
    are anything but NaN (the kernel clamps their multiplier). out against float64 of alpha * x @ W^T, and equal to
    the row-major NVFP4 form of the same weights (each block's E4M3 scale 2^(j - a) on both halves), whose products and
    k order are the same; rows outside the segments untouched (NaN)."""
    experts, n, k, max_len, spare = MXINT4_CASES[case]
    problem = Problem(experts, n, k, _lengths(experts, seed=case, max_len=max_len), spare, seed=700 + case)
    gen = _gen(800 + case)
    packed = torch.randint(0, 256, (experts, n, k // 2), dtype=torch.uint8, generator=gen)
    form = torch.randint(127 - 9, 127 + 9, (experts, n, k // 32), dtype=torch.int32, generator=gen)  # 2^(j - a)
    zero = torch.rand(experts, n, k // 32, generator=gen) < 0.1
    packed.view(experts, n, k // 32, 16)[zero] &= 0x88  # +-0 codes only
    shifts = torch.randint(-4, 5, (experts,), generator=gen, dtype=torch.int32)
    raw = torch.where(zero, torch.randint(0, 255, form.shape, generator=gen, dtype=torch.int32),
                      form + shifts[:, None, None]).to(torch.uint8)  # E8M0 bytes j + 127
    as_e4m3 = torch.where(zero, 0.0, torch.exp2(form.double() - 127)).to(torch.float8_e4m3fn)
    problem.w_deq = dequantize_mxfp4(packed, torch.where(zero, 0, form).to(torch.uint8).view(torch.float8_e8m0fnu),
                                     dtype=torch.float64)
    problem.alpha = torch.exp2(shifts.float())
    alpha = problem.alpha.to(DEV)
    outs = {}
    for code, scales in ((BlockCode.MXFP4_ROWS, raw), (BlockCode.NVFP4_ROWS, as_e4m3.repeat_interleave(2, -1))):
        out = torch.full((problem.rows, n), math.nan, dtype=torch.bfloat16, device=DEV)
        sm90.grouped_gemm(packed.reshape(experts, -1).to(DEV), scales.reshape(experts, -1).to(DEV), alpha,
                          problem.x[variant.token_layout], problem.offsets_dev, out, variant, code=code)
        torch.cuda.synchronize()
        check(problem, out)
        outs[code] = out
    assert torch.equal(outs[BlockCode.MXFP4_ROWS].view(torch.int16), outs[BlockCode.NVFP4_ROWS].view(torch.int16))
