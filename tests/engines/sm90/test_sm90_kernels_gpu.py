"""GPU tests of the SM90 kernels (kernels_cuda/sm90/) against float64 references of their documented
semantics. Outputs are poisoned with NaN before every launch so that missing and stray writes show."""

from __future__ import annotations

import math

import pytest
import torch

from cudnn_moe.engines.base import BlockCode, FinalizeEpilogue
from cudnn_moe.engines.sm90 import kernels as sm90
from cudnn_moe.engines.sm90.layout import (
    from_token_fragments, pack_int4_weight_tiles, pack_mxfp4_weight_tiles, pack_weight_tiles, to_token_fragments,
    to_token_layout,
)
from cudnn_moe.formats import dequantize_mxfp4, dequantize_mxint4, dequantize_nvfp4, quantize_nvfp4
from cudnn_moe import kernels
from cudnn_moe.kernels import TokenLayout
from tests.support.sm90_variants import BASIC_PREFILL_VARIANTS, DECODE_VARIANTS, OTHER_PREFILL_VARIANTS, WGMMA_VARIANTS

pytestmark = pytest.mark.gpu

DEV = torch.device("cuda")

# The CPU tests' variants, plus one more combination of the other tile with the fallback epilogue.
NEW_PREFILL_VARIANTS = [*OTHER_PREFILL_VARIANTS, sm90.PrefillVariant(3, stmatrix=False, feature_block=256, tile_rows=64)]
PREFILL_VARIANTS = BASIC_PREFILL_VARIANTS + NEW_PREFILL_VARIANTS
VARIANTS = DECODE_VARIANTS + PREFILL_VARIANTS + WGMMA_VARIANTS


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


class Problem:
    """Random NVFP4 experts, ragged segments and exact-NVFP4 BF16 tokens, with the float64 reference."""

    def __init__(self, experts: int, n: int, k: int, lengths: list[int], spare_rows: int, seed: int,
                 cover_scales: bool = False) -> None:
        gen = _gen(seed)
        self.e, self.n, self.k = experts, n, k
        padded = [-(-length // 8) * 8 for length in lengths]
        self.offsets = [0]
        for p in padded:
            self.offsets.append(self.offsets[-1] + p)
        self.rows = self.offsets[-1] + spare_rows
        # Weights: per-row magnitudes over a wide range, quantized with a per-expert global scale.
        w = torch.randn(experts, n, k, generator=gen) * torch.exp2(torch.randint(-6, 6, (experts, n, 1), generator=gen).float())
        global_scale = torch.exp2(torch.randint(-3, 4, (experts,), generator=gen).float())
        packed, scales = quantize_nvfp4(w, global_scale)
        if cover_scales:
            # every finite non-negative E4M3 byte 0x00..0x7E, each in many places, random codes
            count = scales.numel()
            raw = (torch.arange(count) % 127).to(torch.uint8)
            raw = raw[torch.randperm(count, generator=gen)]
            scales = raw.reshape(scales.shape).view(torch.float8_e4m3fn)
            packed = torch.randint(0, 256, packed.shape, dtype=torch.uint8, generator=gen)
        self.alpha = (torch.rand(experts, generator=gen) + 0.5) / global_scale
        self.w_deq = dequantize_nvfp4(packed, scales, 1.0, torch.float64)  # w * s, no global
        tiles, tile_scales = pack_weight_tiles(packed, scales)
        # Tokens: exact NVFP4 values (global scale 1) as BF16; rows past the used ones are NaN garbage.
        xt = torch.randn(self.rows, k, generator=gen) * torch.exp2(torch.randint(-4, 4, (self.rows, 1), generator=gen).float())
        x_deq = dequantize_nvfp4(*quantize_nvfp4(xt), 1.0, torch.float32)
        x_deq[self.offsets[-1]:] = math.nan
        self.x_bf16 = x_deq.to(torch.bfloat16)
        assert torch.equal(self.x_bf16.float()[: self.offsets[-1]], x_deq[: self.offsets[-1]])
        self.tiles, self.tile_scales = tiles.to(DEV), tile_scales.to(DEV)
        self.codes, self.scales = packed.to(DEV), scales.to(DEV)  # the canonical layout (row-major forms)
        self.alpha_dev = self.alpha.to(DEV)
        self.x = {layout: to_token_layout(self.x_bf16, layout).contiguous().to(DEV)
                  for layout in (TokenLayout.BF16_FRAGMENTS, TokenLayout.BF16_ROWS, TokenLayout.BF16_TILED)}
        self.offsets_dev = torch.tensor(self.offsets, dtype=torch.int32, device=DEV)

    def reference(self) -> torch.Tensor:
        """float64 [offsets[E], N]: alpha[e] * x[r] @ W_e^T for the rows of each segment."""
        w = self.w_deq.to(DEV)
        x = self.x_bf16.to(DEV).double()
        out = torch.empty(self.offsets[-1], self.n, dtype=torch.float64, device=DEV)
        for e in range(self.e):
            lo, hi = self.offsets[e], self.offsets[e + 1]
            if hi > lo:
                out[lo:hi] = float(self.alpha[e]) * (x[lo:hi] @ w[e].T)
        return out

    def run(self, variant: sm90.GemmVariant) -> torch.Tensor:
        out = torch.full((self.rows, self.n), math.nan, dtype=torch.bfloat16, device=DEV)
        sm90.grouped_gemm(self.tiles, self.tile_scales, self.alpha_dev, self.x[variant.token_layout], self.offsets_dev,
                          out, variant)
        torch.cuda.synchronize()
        return out


def check(problem: Problem, out: torch.Tensor) -> None:
    used = problem.offsets[-1]
    got = out[:used].double()
    want = problem.reference().to(torch.bfloat16).double()  # bf16(alpha * acc64)
    assert not got.isnan().any(), f"NaN (unwritten) rows: {sorted(set(got.isnan().any(1).nonzero().flatten().tolist()))[:10]}"
    assert out[used:].isnan().all(), "rows outside every segment were written"
    diff = (got - want).norm(dim=1)
    scale = want.norm(dim=1).clamp_min(1e-30)
    row_error = diff / scale
    worst = int(row_error.argmax())
    assert row_error.max() <= 1e-2, f"row {worst}: relative error {row_error.max():.3g}"
    overall = (got - want).norm() / want.norm().clamp_min(1e-30)
    assert overall <= 2e-3, f"overall relative error {overall:.3g}"


def _lengths(experts: int, seed: int, max_len: int = 300) -> list[int]:
    gen = _gen(seed)
    lengths = torch.randint(1, max_len + 1, (experts,), generator=gen)
    lengths[torch.rand(experts, generator=gen) < 0.25] = 0  # empty experts
    return lengths.tolist()


CASES = [
    # (experts, N, K, max segment length, spare rows)
    (1, 128, 64, 300, 0),
    (3, 384, 128, 300, 24),
    (8, 1536, 704, 64, 8),
    (64, 128, 2048, 40, 0),
    (8, 384, 2048, 300, 128),
    (3, 1536, 64, 200, 16),
]


@pytest.mark.parametrize("variant", VARIANTS, ids=str)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_grouped_gemm_matches_reference(variant: sm90.GemmVariant, case: int) -> None:
    experts, n, k, max_len, spare = CASES[case]
    problem = Problem(experts, n, k, _lengths(experts, seed=case, max_len=max_len), spare, seed=100 + case)
    out = problem.run(variant)
    check(problem, out)
    again = problem.run(variant)
    assert torch.equal(out.view(torch.int16), again.view(torch.int16)), "results differ between runs"


MXINT4_CASES = [(1, 128, 64, 8, 0), (3, 384, 128, 16, 24), (8, 1536, 704, 8, 8), (64, 128, 2048, 30, 0)]


@pytest.mark.parametrize("variant", DECODE_VARIANTS, ids=str)
@pytest.mark.parametrize("case", range(len(MXINT4_CASES)))
def test_mxint4_decode_gemm_matches_reference(variant: sm90.DecodeVariant, case: int) -> None:
    """MXINT4 weights (random codes, BF16 scales over a wide range) in the SM90 MXINT4 tiles: out = bf16(alpha * 256
    * acc) against float64 of alpha * 256 * x @ (int4 * scale)^T, rows outside the segments untouched (NaN)."""
    experts, n, k, max_len, spare = MXINT4_CASES[case]
    problem = Problem(experts, n, k, _lengths(experts, seed=case, max_len=max_len), spare, seed=300 + case)
    gen = _gen(400 + case)
    packed = torch.randint(0, 256, (experts, n, k // 2), dtype=torch.uint8, generator=gen)
    scales = (torch.rand(experts, n, k // 32, generator=gen) + 0.5) * torch.exp2(
        torch.randint(-12, 4, (experts, n, k // 32), generator=gen).float())
    scales = scales.to(torch.bfloat16)
    tiles, tile_scales = pack_int4_weight_tiles(packed, scales)
    problem.w_deq = dequantize_mxint4(packed, scales).double()
    problem.tiles, problem.tile_scales = tiles.to(DEV), tile_scales.to(DEV)
    problem.alpha = torch.ones(experts)  # the reference: x @ W^T; the kernel's alpha * 256 = 1
    outs = []
    for _ in range(2):  # twice: bitwise the same
        out = torch.full((problem.rows, n), math.nan, dtype=torch.bfloat16, device=DEV)
        sm90.grouped_gemm(problem.tiles, problem.tile_scales, torch.full((experts,), 1 / 256, device=DEV),
                          problem.x[variant.token_layout], problem.offsets_dev, out, variant, code=BlockCode.MXINT4)
        torch.cuda.synchronize()
        check(problem, out)
        outs.append(out)
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16)), "results differ between runs"


@pytest.mark.parametrize("variant", [*DECODE_VARIANTS, sm90.DecodeVariant(mt=4, wm=2, wk=1, nt=1, prefetch=2)], ids=str)
@pytest.mark.parametrize("case", range(len(MXINT4_CASES)))
def test_mxfp4_decode_gemm_matches_reference_and_nvfp4_tiles(variant: sm90.DecodeVariant, case: int) -> None:
    """MXFP4 weights in their exact shifted form (random codes, every recoded power 2^-9 .. 2^8, all-zero blocks with
    scale byte 0) in the SM90 MXFP4 tiles, alpha the global 2^a: out against float64 of alpha * x @ W^T, and
    bitwise equal to the NVFP4 tiles of the same form (each block's E4M3 scale 2^p on both halves), whose products,
    sums and rounding are the same; rows outside the segments untouched (NaN)."""
    experts, n, k, max_len, spare = MXINT4_CASES[case]
    problem = Problem(experts, n, k, _lengths(experts, seed=case, max_len=max_len), spare, seed=500 + case)
    gen = _gen(600 + case)
    packed = torch.randint(0, 256, (experts, n, k // 2), dtype=torch.uint8, generator=gen)
    form = torch.randint(127 - 9, 127 + 9, (experts, n, k // 32), dtype=torch.uint8, generator=gen)
    zero = torch.rand(experts, n, k // 32, generator=gen) < 0.1
    packed.view(experts, n, k // 32, 16)[zero] &= 0x88  # +-0 codes only
    form[zero] = 0
    scales = form.view(torch.float8_e8m0fnu)
    as_e4m3 = torch.where(form == 0, 0.0, torch.exp2(form.double() - 127)).to(torch.float8_e4m3fn)
    problem.w_deq = dequantize_mxfp4(packed, scales, dtype=torch.float64)
    problem.alpha = torch.exp2(torch.randint(-4, 5, (experts,), generator=gen).float())  # the globals 2^a
    alpha = problem.alpha.to(DEV)  # out = bf16(alpha * 256 * acc), acc of the products e2m1 * 2^(p - 8)
    outs = {}
    for code, (tiles, tile_scales) in ((BlockCode.MXFP4, pack_mxfp4_weight_tiles(packed, scales)),
                                       (BlockCode.NVFP4, pack_weight_tiles(packed, as_e4m3.repeat_interleave(2, -1)))):
        out = torch.full((problem.rows, n), math.nan, dtype=torch.bfloat16, device=DEV)
        sm90.grouped_gemm(tiles.to(DEV), tile_scales.to(DEV), alpha, problem.x[variant.token_layout],
                          problem.offsets_dev, out, variant, code=code)
        torch.cuda.synchronize()
        check(problem, out)
        outs[code] = out
    assert torch.equal(outs[BlockCode.MXFP4].view(torch.int16), outs[BlockCode.NVFP4].view(torch.int16))


@pytest.mark.parametrize("variant", [sm90.DECODE, sm90.PREFILL, *NEW_PREFILL_VARIANTS, *WGMMA_VARIANTS], ids=str)
def test_every_scale_byte(variant: sm90.GemmVariant) -> None:
    problem = Problem(3, 384, 704, [40, 0, 135], 8, seed=7, cover_scales=True)
    check(problem, problem.run(variant))


@pytest.mark.parametrize("variant", [sm90.DECODE, sm90.DecodeVariant(nt=4, wm=2, wk=4), sm90.PREFILL,
                                     *NEW_PREFILL_VARIANTS, *WGMMA_VARIANTS], ids=str)
def test_segment_edges(variant: sm90.GemmVariant) -> None:
    """Single-row segments, a segment ending exactly at the row capacity, experts beyond the 32 a
    lane of the tile finder holds alone, segments of exactly one tile and one row more."""
    lengths = [1, 0, 8, 127, 128, 129, 0, 0, 256, 9] * 7
    problem = Problem(len(lengths), 128, 128, lengths, 0, seed=11)
    check(problem, problem.run(variant))


def test_decode_and_prefill_on_one_problem() -> None:
    """The two kernels sum in different FP32 orders; both must meet the reference."""
    problem = Problem(4, 256, 256, [100, 3, 0, 77], 0, seed=5)
    a, b = problem.run(sm90.DECODE), problem.run(sm90.PREFILL)
    check(problem, a)
    check(problem, b)


def test_prefill_variants_agree_bitwise() -> None:
    """Every prefill variant sums each output in the same FP32 order (k64 steps in order, the same
    mma sequence per k64): the tile shapes and the decode path must not change a single bit."""
    problem = Problem(5, 384, 320, [200, 0, 64, 129, 7], 16, seed=13)
    want = problem.run(sm90.PREFILL)
    check(problem, want)
    for variant in NEW_PREFILL_VARIANTS:
        got = problem.run(variant)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), f"{variant} differs from the default"


@pytest.mark.parametrize("variant", [sm90.DECODE, sm90.DecodeVariant(mt=2, wm=2, wk=4), sm90.DecodeVariant(mt=2, wm=4, wk=1),
                                     sm90.DecodeVariant(wm=2, wk=4, nt=4)], ids=str)
@pytest.mark.parametrize("tokens,top_k", [(1, 8), (5, 8), (16, 4), (3, 1)])
def test_decode_finalize_equals_the_finalize_kernel_bitwise(variant: sm90.DecodeVariant, tokens: int, top_k: int) -> None:
    """GEMM2 with the finalize folded in writes the rows the plain GEMM writes, and the finalize kernel's output from
    them bit for bit (random slots, some masked, random FP32 weights), twice in a row (the tickets reset); outputs
    poisoned with NaN; final rows past T untouched."""
    problem = Problem(9, 256, 320, [9, 0, 16, 1, 40, 0, 7, 3, 24], 8, seed=29 + tokens)
    gen = _gen(31 + tokens)
    used = problem.offsets[-1]
    slot_to_row = torch.randperm(used, generator=gen)[: tokens * top_k].to(torch.int32)
    slot_to_row[torch.rand(tokens * top_k, generator=gen) < 0.2] = -1
    weights = torch.rand(tokens * top_k, generator=gen) * 2 - 0.5
    slot_to_row, weights = slot_to_row.to(DEV), weights.to(DEV)
    want_rows = problem.run(variant)
    want = torch.full((tokens, problem.n), math.nan, dtype=torch.bfloat16, device=DEV)
    kernels.finalize(want_rows, slot_to_row, weights, top_k, want)
    tickets = torch.zeros(problem.n // 16, dtype=torch.int32, device=DEV)
    for attempt in range(2):
        rows = torch.full((problem.rows, problem.n), math.nan, dtype=torch.bfloat16, device=DEV)
        final = torch.full((tokens + 1, problem.n), math.nan, dtype=torch.bfloat16, device=DEV)
        sm90.grouped_gemm(problem.tiles, problem.tile_scales, problem.alpha_dev, problem.x[TokenLayout.BF16_FRAGMENTS],
                          problem.offsets_dev, rows, variant,
                          finalize=FinalizeEpilogue(slot_to_row, weights, top_k, final[:tokens]), tickets=tickets)
        torch.cuda.synchronize()
        assert torch.equal(rows[:used].view(torch.int16), want_rows[:used].view(torch.int16)), f"rows, launch {attempt}"
        assert not final[:tokens].isnan().any() and final[tokens:].isnan().all(), f"launch {attempt}"
        assert torch.equal(final[:tokens].view(torch.int16), want.view(torch.int16)), f"finalize, launch {attempt}"
        assert not tickets.any(), "the tickets must be zero after a launch"


def test_wgmma_matches_mma_sync() -> None:
    """The wgmma kernel multiplies the same exactly decoded BF16 operands as the mma.sync prefill kernel, k16
    step after k16 step into FP32: the tensor cores' accumulation may differ in the last bits, no more."""
    problem = Problem(6, 768, 1024, [300, 0, 64, 129, 7, 256], 16, seed=17)
    want = problem.run(sm90.PREFILL)
    for variant in WGMMA_VARIANTS:
        got = problem.run(variant)
        check(problem, got)
        used = problem.offsets[-1]
        differ = (got[:used].view(torch.int16) != want[:used].view(torch.int16)).float().mean().item()
        close = torch.allclose(got[:used].float(), want[:used].float(), rtol=2 ** -7, atol=0)
        print(f"{variant}: {differ:.2%} of outputs differ from mma.sync")
        assert close and differ <= 0.01, f"{variant}: {differ:.2%} of outputs differ from the mma.sync kernel's"


def test_wgmma_tiled_tokens_equal_natural_rows_bitwise() -> None:
    """The bulk-copied tiled planes put the same values in the same shared-memory places as the per-thread copies
    of natural rows: every output bit equal, on ragged segments with short last tiles of 1..127 rows."""
    problem = Problem(7, 384, 704, [300, 0, 64, 129, 7, 256, 33], 24, seed=19)
    for tiled in (v for v in WGMMA_VARIANTS if v.tiled_tokens):
        want = problem.run(tiled.gathering())
        got = problem.run(tiled)
        check(problem, got)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), f"{tiled} differs from {tiled.gathering()}"


def test_graph_capture_follows_device_offsets() -> None:
    """A captured launch reads offsets at replay: changing them on the device changes the work."""
    problem = Problem(3, 256, 128, [40, 16, 24], 64, seed=9)
    out = torch.full((problem.rows, problem.n), math.nan, dtype=torch.bfloat16, device=DEV)
    args = (problem.tiles, problem.tile_scales, problem.alpha_dev, problem.x[TokenLayout.BF16_FRAGMENTS], problem.offsets_dev, out, sm90.DECODE)
    sm90.grouped_gemm(*args)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sm90.grouped_gemm(*args)
    out.fill_(math.nan)
    graph.replay()
    torch.cuda.synchronize()
    check(problem, out)
    # shrink the last segment on the device and replay: its tail rows must stay untouched
    problem.offsets_dev[3] = problem.offsets[3] - 16
    out.fill_(math.nan)
    graph.replay()
    torch.cuda.synchronize()
    assert out[problem.offsets[3] - 16 :].isnan().all()
    assert not out[: problem.offsets[3] - 16].isnan().any()


# ---------------------------------------------------------------------------------------------------------------
# token gather + decode (the permute stage for the BF16-fragment token layout)
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("hidden", [64, 192, 7168])
def test_permute_to_bf16_fragments_matches_formats(hidden: int) -> None:
    gen = _gen(hidden)
    tokens, top_k, rows = 37, 4, 200
    packed = torch.randint(0, 256, (tokens, hidden // 2), dtype=torch.uint8, generator=gen)
    scales = torch.randint(0, 127, (tokens, hidden // 16), dtype=torch.uint8, generator=gen)
    slots = tokens * top_k
    slot_to_row = torch.randperm(rows, generator=gen)[:slots].to(torch.int32)
    slot_to_row[torch.rand(slots, generator=gen) < 0.2] = -1
    want = to_token_fragments(dequantize_nvfp4(packed, scales.view(torch.float8_e4m3fn), 1.0, torch.bfloat16))
    out = torch.full((rows, hidden), math.nan, dtype=torch.bfloat16, device=DEV)
    kernels.permute_tokens(packed.to(DEV), scales.to(DEV), slot_to_row.to(DEV), slots, top_k,
                           TokenLayout.BF16_FRAGMENTS, out, None)
    torch.cuda.synchronize()
    got = out.cpu()
    written = torch.zeros(rows, dtype=torch.bool)
    for slot, row in enumerate(slot_to_row.tolist()):
        if row >= 0:
            assert torch.equal(got[row].view(torch.int16), want[slot // top_k].view(torch.int16)), f"slot {slot}"
            written[row] = True
    assert got[~written].isnan().all()


def test_permute_to_bf16_fragments_nan_scale_gives_nan() -> None:
    hidden = 128
    packed = torch.full((2, hidden // 2), 0x21, dtype=torch.uint8)
    scales = torch.full((2, hidden // 16), 0x38, dtype=torch.uint8)
    scales[1, 3] = 0x7F
    scales[1, 5] = 0xFF
    out = torch.zeros(2, hidden, dtype=torch.bfloat16, device=DEV)
    kernels.permute_tokens(packed.to(DEV), scales.to(DEV), torch.tensor([0, 1], dtype=torch.int32, device=DEV), 2, 1,
                           TokenLayout.BF16_FRAGMENTS, out, None)
    torch.cuda.synchronize()
    natural = from_token_fragments(out).cpu().float()
    assert not natural[0].isnan().any()
    blocks = natural[1].reshape(hidden // 16, 16).isnan().all(dim=1)
    assert blocks.tolist() == [i in (3, 5) for i in range(hidden // 16)]
