"""The SM90 engine's choices on the CPU: the kernel variant, how GEMM1 is fused, and the chain of stages a bucket
runs (Sm90GemmEngine.stages against a stand-in for the executor's LayerStages)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from cudnn_moe.activations import GELU, SwiGLU
from cudnn_moe.engines.base import BlockCode, EarlyRouting, Gemm1Fusion, GemmShape, LayerStages, Stage
from cudnn_moe.engines.sm90.engine import choose_variant, gemm1_fusion
from cudnn_moe.engines.sm90.kernels import DecodeVariant, WgmmaVariant, decode_wave
from cudnn_moe.kernels.codes import TokenLayout
from cudnn_moe.pipeline.executor import bucket_size, row_capacity
from tests.engines.sm90.gpus import H100_TBS, H200_TBS, SMS, bare_engine
from tests.support.sm90_variants import SIX_CTAS_AN_SM

QWEN3 = (128, 2048, 768)  # experts, hidden, intermediate
DEEPSEEK_V3 = (256, 7168, 2048)
MIXTRAL = (8, 4096, 14336)


def _bucket(model: tuple[int, int, int], tokens: int, top_k: int = 8) -> tuple[int, GemmShape]:
    experts, hidden, inter = model
    return row_capacity(bucket_size(tokens), top_k, experts, 8), GemmShape(hidden, 2 * inter, experts)


def _gemm2(rows: int, shape: GemmShape, code: BlockCode = BlockCode.NVFP4, *, handoff: object = None,
           workspace: object = object()) -> SimpleNamespace:
    """What Sm90GemmEngine.can_finalize reads of GEMM2's operands."""
    return SimpleNamespace(gemm=2, rows=rows, shape=shape, workspace=workspace, weights=SimpleNamespace(code=code),
                           handoff=handoff, route=None, epilogue=None)


@pytest.mark.parametrize("model,tokens,kind,fusion", [
    (QWEN3, 1, DecodeVariant, Gemm1Fusion(epilogue=True)),
    (QWEN3, 8, DecodeVariant, Gemm1Fusion(epilogue=True)),
    (QWEN3, 64, DecodeVariant, Gemm1Fusion(epilogue=True)),  # 2112 CTAs: 16 per SM
    (QWEN3, 4096, WgmmaVariant, Gemm1Fusion(epilogue=True, gather=True)),
    (DEEPSEEK_V3, 1, DecodeVariant, Gemm1Fusion(epilogue=True)),
    (DEEPSEEK_V3, 8, DecodeVariant, Gemm1Fusion(epilogue=True)),
    (DEEPSEEK_V3, 64, DecodeVariant, Gemm1Fusion()),  # 16384 CTAs: the epilogue's latency would hit every wave
    (DEEPSEEK_V3, 512, DecodeVariant, Gemm1Fusion()),
    (DEEPSEEK_V3, 1024, WgmmaVariant, Gemm1Fusion(epilogue=True, gather=True)),
])
@pytest.mark.parametrize("dram_tbs", [H100_TBS, H200_TBS])
def test_variant_and_gemm1_fusion(model, tokens: int, kind: type, fusion: Gemm1Fusion, dram_tbs: float) -> None:
    rows, shape = _bucket(model, tokens)
    assert isinstance(choose_variant(rows, shape, SMS, gemm=1, dram_tbs=dram_tbs), kind)
    assert gemm1_fusion(rows, shape, SwiGLU(), SMS, dram_tbs) == fusion


@pytest.mark.parametrize("model,tokens,split_k", [
    (QWEN3, 1, (4, 4)),  # 192 / 256 CTAs of 64 features: fewer than two per SM, so eight warps with four-way split-K
    (QWEN3, 2, (2, 2)),
    (QWEN3, 4, (1, 1)),  # 128 features per CTA: 384 / 512 CTAs, one wave
    (QWEN3, 8, (1, 1)),  # GEMM1: 768 CTAs, 1.45 waves, kept past one wave on the H200 (test below)
    (DEEPSEEK_V3, 1, (2, 1)),
    (DEEPSEEK_V3, 2, (1, 1)),  # GEMM1: 512 CTAs, 97% of one wave
    (DEEPSEEK_V3, 4, (1, 1)),
    (DEEPSEEK_V3, 8, (1, 1)),
    (MIXTRAL, 4, (1, 2)),
    (MIXTRAL, 8, (1, 2)),
])
def test_decode_split_k_grows_as_ctas_get_few(model, tokens: int, split_k: tuple[int, int]) -> None:
    """(GEMM1, GEMM2) of a decode bucket on the H200: 128-feature CTAs while every SM gets two, else 64-feature ones
    with two-way split-K, and four-way where even those leave an SM fewer than two (benchmarks/RESULTS.md, twelfth
    session); GEMM1 and GEMM2 alike."""
    rows, shape1 = _bucket(model, tokens, top_k=2 if model is MIXTRAL else 8)
    shape2 = GemmShape(model[2], model[1], model[0])
    for gemm, shape in ((1, shape1), (2, shape2)):
        variant = choose_variant(rows, shape, SMS, gemm=gemm, dram_tbs=H200_TBS)
        assert isinstance(variant, DecodeVariant) and variant.wk == split_k[gemm - 1], (gemm, variant)


@pytest.mark.parametrize("model,tokens,gemm1_wk", [
    (QWEN3, 8, 2),  # 768 CTAs of 128 features fill 45% of their last wave, 1536 of 64 features 91%
    (QWEN3, 4, 1),  # one wave
    (DEEPSEEK_V3, 4, 1),  # 94% of the last wave against 88%
    (DEEPSEEK_V3, 8, 1),  # 2048 CTAs fill 88% of their last wave, 4096 76%
    (MIXTRAL, 4, 1),  # 64-feature CTAs would fill the last wave better, but 3584 of them are past the epilogue's CTAs
])
def test_gemm1_fills_its_last_wave_where_dram_is_slower(model, tokens: int, gemm1_wk: int) -> None:
    """Below _SLOW_DRAM_TBS (an H100's 3.35 TB/s) GEMM1 past one wave of 128-feature CTAs takes 64-feature ones
    with two-way split-K where they fill the last wave by a quarter of it more and keep the activation epilogue (at
    most 16 CTAs an SM); GEMM2 keeps the H200's choice everywhere."""
    top_k = 2 if model is MIXTRAL else 8
    rows, shape1 = _bucket(model, tokens, top_k)
    shape2 = GemmShape(model[2], model[1], model[0])
    variant = choose_variant(rows, shape1, SMS, gemm=1, dram_tbs=H100_TBS)
    assert isinstance(variant, DecodeVariant) and variant.wk == gemm1_wk, variant
    assert (choose_variant(rows, shape2, SMS, gemm=2, dram_tbs=H100_TBS)
            == choose_variant(rows, shape2, SMS, gemm=2, dram_tbs=H200_TBS))


def test_decode_epilogue_needs_a_variant_that_fits() -> None:
    """A non-gated activation fits every decode variant the engine picks; the rule only looks at what fits."""
    rows, shape = _bucket(QWEN3, 1)
    variant = choose_variant(rows, shape, SMS, gemm=1, dram_tbs=H200_TBS)
    assert variant.epilogue_problem(GELU()) is None and variant.epilogue_problem(SwiGLU()) is None
    assert DecodeVariant(mt=2, wm=1, wk=4).epilogue_problem(SwiGLU()) is not None
    assert DecodeVariant(mt=1, wm=1, wk=8, nt=4).epilogue_problem(GELU()) is not None  # 16 outputs per CTA


class _Layer(LayerStages):
    """LayerStages whose stages are only names."""

    def __init__(self, rows: int, shape: GemmShape, finalizes: bool = False, routes: bool = False,
                 hands_off: bool = False) -> None:
        self.rows, self.finalizes, self.routes, self.hands_off = rows, finalizes, routes, hands_off
        self.gemm1_fusion = gemm1_fusion(rows, shape, SwiGLU(), SMS, H200_TBS)

    def sort(self) -> Stage:
        return Stage("sort", lambda: None)

    def permute(self) -> Stage:
        return Stage("permute", lambda: None)

    def sort_permute(self) -> Stage | None:
        return Stage("sort+permute", lambda: None) if self.rows <= 4096 else None

    def gemm1(self) -> Stage:
        return Stage("gemm1", lambda: None)

    def activation(self) -> Stage:
        return Stage("activation", lambda: None)

    def gemm1_activation(self, gather: bool) -> Stage:
        return Stage("gemm1+activation (gather)" if gather else "gemm1+activation", lambda: None)

    def gemm1_routed(self) -> Stage | None:
        return Stage("stage+sort+permute+gemm1+activation", lambda: None) if self.routes else None

    def gemm1_gemm2(self) -> Stage | None:
        if not self.hands_off:
            return None
        return Stage(f"gemm1+activation+{'gemm2+finalize' if self.finalizes else 'gemm2'}", lambda: None)

    def gemm2(self) -> Stage:
        return Stage("gemm2", lambda: None)

    def gemm2_finalize(self) -> Stage | None:
        return Stage("gemm2+finalize", lambda: None) if self.finalizes else None


@pytest.mark.parametrize("finalizes", [False, True])
@pytest.mark.parametrize("model,tokens,chain", [
    (QWEN3, 1, ["sort+permute", "gemm1+activation", "gemm2"]),
    (DEEPSEEK_V3, 64, ["sort+permute", "gemm1", "activation", "gemm2"]),
    (QWEN3, 4096, ["sort", "gemm1+activation (gather)", "gemm2"]),
])
def test_stage_chains(model, tokens: int, chain: list[str], finalizes: bool) -> None:
    """The decode chains end with GEMM2 finalizing where the layer offers it (the wgmma chain never asks)."""
    engine = bare_engine()
    rows, shape = _bucket(model, tokens)
    if finalizes and tokens < 4096:
        chain = [*chain[:-1], "gemm2+finalize"]
    assert [name for name, _ in engine.stages(_Layer(rows, shape, finalizes))] == chain


@pytest.mark.parametrize("finalizes", [False, True])
@pytest.mark.parametrize("model,tokens,chain", [
    (QWEN3, 1, ["sort+permute", "gemm1+activation+gemm2"]),
    (QWEN3, 8, ["sort+permute", "gemm1+activation+gemm2"]),
    (DEEPSEEK_V3, 64, ["sort+permute", "gemm1", "activation", "gemm2"]),
    (QWEN3, 4096, ["sort", "gemm1+activation (gather)", "gemm2"]),
])
def test_handoff_chains(model, tokens: int, chain: list[str], finalizes: bool) -> None:
    """Where the layer offers GEMM1 and GEMM2 with a tile handoff, a decode chain with the epilogue runs them as one
    stage after the sort + permute; GEMM1 without the epilogue and the wgmma chain never ask."""
    engine = bare_engine()
    rows, shape = _bucket(model, tokens)
    if finalizes and tokens < 4096:
        chain = [*chain[:-1], chain[-1].replace("gemm2", "gemm2+finalize")]
    assert [name for name, _ in engine.stages(_Layer(rows, shape, finalizes, hands_off=True))] == chain


@pytest.mark.parametrize("model,tokens,chain", [
    (QWEN3, 1, ["stage+sort+permute+gemm1+activation", "gemm2+finalize"]),
    (DEEPSEEK_V3, 1, ["stage+sort+permute+gemm1+activation", "gemm2+finalize"]),
    (DEEPSEEK_V3, 64, ["sort+permute", "gemm1", "activation", "gemm2+finalize"]),
    (QWEN3, 4096, ["sort", "gemm1+activation (gather)", "gemm2"]),
])
def test_routed_chains(model, tokens: int, chain: list[str]) -> None:
    """Where the layer offers GEMM1 with the stage and the sort folded in (a one-token bucket of a call whose launches
    know its inputs), the decode chain is two launches; GEMM1 without the epilogue and the wgmma chain never ask."""
    engine = bare_engine()
    rows, shape = _bucket(model, tokens)
    assert [name for name, _ in engine.stages(_Layer(rows, shape, finalizes=True, routes=True))] == chain


@pytest.mark.parametrize("model,tokens,routes", [
    (QWEN3, 1, True), (DEEPSEEK_V3, 1, True), (QWEN3, 4096, False),
])
def test_can_route(model, tokens: int, routes: bool) -> None:
    """can_route: GEMM1 on the decode kernel, its token row within 48 KB of dynamic shared memory; MXINT4 weights with
    BF16 tokens only; MXFP8 tokens (the MXFP4 pair's) on MXFP4 tiles only."""
    engine = bare_engine()
    rows, shape = _bucket(model, tokens)
    nvfp4, mxint4 = SimpleNamespace(code=BlockCode.NVFP4), SimpleNamespace(code=BlockCode.MXINT4)
    mxfp4 = SimpleNamespace(code=BlockCode.MXFP4)
    bf16_tokens = SimpleNamespace(token_scales=None, tokens=torch.empty(0, dtype=torch.bfloat16))
    nvfp4_tokens = SimpleNamespace(token_scales=object(), tokens=torch.empty(0, dtype=torch.uint8))
    mxfp8_tokens = SimpleNamespace(token_scales=object(), tokens=torch.empty(0, dtype=torch.float8_e4m3fn))
    for tokens_kind in (bf16_tokens, nvfp4_tokens):
        assert engine.can_route(SimpleNamespace(rows=rows, shape=shape, weights=nvfp4, route=tokens_kind)) is routes
    assert engine.can_route(SimpleNamespace(rows=rows, shape=shape, weights=mxint4, route=bf16_tokens)) is routes
    assert not engine.can_route(SimpleNamespace(rows=rows, shape=shape, weights=mxint4, route=nvfp4_tokens))
    for weights in (nvfp4, mxint4):
        assert not engine.can_route(SimpleNamespace(rows=rows, shape=shape, weights=weights, route=mxfp8_tokens))
    assert engine.can_route(SimpleNamespace(rows=rows, shape=shape, weights=mxfp4, route=mxfp8_tokens)) is routes
    assert not engine.can_route(SimpleNamespace(rows=rows, shape=shape, weights=mxfp4, route=nvfp4_tokens))
    bf16 = SimpleNamespace(code=BlockCode.BF16)  # its form reads natural rows, not the staged token row
    assert not engine.can_route(SimpleNamespace(rows=rows, shape=shape, weights=bf16, route=bf16_tokens))
    wide = GemmShape(32768, shape.n, shape.num_experts)  # K = 32768: a 64 KB token row
    assert not engine.can_route(SimpleNamespace(rows=rows, shape=wide, weights=nvfp4, route=bf16_tokens))


@pytest.mark.parametrize("model,tokens,finalizes", [
    (QWEN3, 1, True), (QWEN3, 4, True), (QWEN3, 8, True), (DEEPSEEK_V3, 1, True), (DEEPSEEK_V3, 8, False),
    (DEEPSEEK_V3, 64, False), (QWEN3, 4096, False),
])
def test_gemm2_finalizes_in_one_wave(model, tokens: int, finalizes: bool) -> None:
    """can_finalize without a handoff: the decode kernel in one wave of its CTAs (Qwen3-30B-A3B T=1: 256 CTAs of 256
    threads, T=4: 480 of 128; T=8: about 800 of 64, _WIDE_MT4's), the finalizing CTA in at most two passes; not
    DeepSeek-V3 T=8 (about 3200 of 64)."""
    engine = bare_engine()
    experts, hidden, inter = model
    rows, shape2 = _bucket(model, tokens)[0], GemmShape(inter, hidden, experts)
    assert engine.can_finalize(_gemm2(rows, shape2), tokens) is finalizes
    assert not engine.can_finalize(_gemm2(rows, shape2, workspace=None), tokens)


@pytest.mark.parametrize("model,tokens,four_blocks", [
    (QWEN3, 1, False), (QWEN3, 4, False), (QWEN3, 8, True), (QWEN3, 64, True), (DEEPSEEK_V3, 1, False),
    (DEEPSEEK_V3, 2, True),  # 896 CTAs: past one wave of four-warp CTAs, within one of the two-warp ones
    (DEEPSEEK_V3, 8, True), (DEEPSEEK_V3, 64, True),
])
def test_gemm2_past_one_wave_takes_four_blocks_a_warp(model, tokens: int, four_blocks: bool) -> None:
    """GEMM2 of NVFP4 tiles past one wave of 128-feature CTAs (Qwen3-30B-A3B T=8: about 800 of 528 slots; not
    DeepSeek-V3 T=1: 448) runs them with four m16 blocks a warp and two steps in flight: the same grid and token tiles
    (so the tile handoff still pairs it with GEMM1), finalizing where its own two-warp CTAs fit one wave (Qwen3-30B-A3B
    T=8, DeepSeek-V3 T=2); MXINT4 and row-major weights keep two blocks, and GEMM1 never takes it."""
    engine = bare_engine()
    experts, hidden, inter = model
    rows, shape1 = _bucket(model, tokens)
    shape2 = GemmShape(inter, hidden, experts)
    variant = engine.variant(rows, shape2, gemm=2)
    assert (variant == DecodeVariant(mt=4, wm=2, wk=1, nt=1, prefetch=2)) is four_blocks
    if four_blocks:
        wide = choose_variant(rows, shape2, SMS, gemm=2, dram_tbs=H200_TBS)
        assert (variant.feature_block, variant.tile_rows) == (wide.feature_block, wide.tile_rows)
        one_wave = (model, tokens) in ((QWEN3, 8), (DEEPSEEK_V3, 2))
        assert engine.can_finalize(_gemm2(rows, shape2), tokens) is one_wave
        for code in (BlockCode.MXINT4, BlockCode.NVFP4_ROWS):
            assert engine.variant(rows, shape2, gemm=2, code=code).mt == 2
    assert engine.variant(rows, shape1, gemm=1).mt == 2


@pytest.mark.parametrize("model,tokens,dram_tbs,one_wave", [
    (QWEN3, 8, H100_TBS, True),  # 768 CTAs of _WIDE: 1.45 waves of 528, one of 792; in place of 1536 of _SPLIT
    (QWEN3, 8, H200_TBS, False),  # _WIDE there (not measured in this form)
    (QWEN3, 4, H100_TBS, False),  # one wave of _WIDE already
    (QWEN3, 16, H100_TBS, False), (DEEPSEEK_V3, 8, H100_TBS, False),  # past one wave of six CTAs an SM too
])
def test_gemm1_of_nvfp4_tiles_fits_one_wave_at_six_ctas_an_sm(model, tokens: int, dram_tbs: float,
                                                              one_wave: bool) -> None:
    """GEMM1 of NVFP4 tiles on _SPLIT past one wave of _WIDE (below 4 TB/s of DRAM) takes _WIDE's CTAs held to six
    an SM where that holds all of them at once: _WIDE's feature blocks and token tiles, two ring steps, a wave of six
    CTAs an SM. Other weight codes keep the bucket's variant."""
    engine = bare_engine(dram_tbs)
    rows, shape = _bucket(model, tokens)
    chosen = choose_variant(rows, shape, SMS, gemm=1, dram_tbs=dram_tbs)
    variant = engine.variant(rows, shape, gemm=1)
    assert (variant == SIX_CTAS_AN_SM) is one_wave
    if one_wave:
        wide = choose_variant(rows, shape, SMS, gemm=1, dram_tbs=H200_TBS)  # _WIDE
        assert (variant.feature_block, variant.tile_rows) == (wide.feature_block, wide.tile_rows)
        assert decode_wave(variant, SMS) == 6 * SMS and "-DSM90_MIN_BLOCKS=6" in variant.options()
        for code in (BlockCode.MXFP4, BlockCode.MXINT4):
            assert engine.variant(rows, shape, gemm=1, code=code) == chosen
    else:
        assert variant.min_blocks == 0


@pytest.mark.parametrize("model,tokens,split", [
    (QWEN3, 4, False),  # _WIDE in one wave: kept
    (QWEN3, 8, True), (DEEPSEEK_V3, 4, True), (DEEPSEEK_V3, 8, True),
])
def test_gemm2_behind_a_handoff_splits_four_block_warps(model, tokens: int, split: bool) -> None:
    """Behind a tile handoff, GEMM2 launches _WIDE_MT4's CTAs with two-way split-K (the same feature blocks and token
    tiles, so the same grid and handoff counters) and finalizes in any number of waves (DeepSeek-V3 T=8: about 3200
    CTAs); without a handoff it launches _WIDE_MT4 itself; MXINT4 (no _WIDE_MT4) keeps its variant and the one-wave
    rule."""
    engine = bare_engine()
    experts, hidden, inter = model
    rows = _bucket(model, tokens)[0]
    shape2 = GemmShape(inter, hidden, experts)
    bucket = engine.variant(rows, shape2, gemm=2)
    for code in (BlockCode.NVFP4, BlockCode.MXFP4):
        behind = engine._launch_variant(_gemm2(rows, shape2, code, handoff=object()))
        assert engine._launch_variant(_gemm2(rows, shape2, code)) == bucket
        if not split:
            assert behind == bucket
            continue
        assert behind == DecodeVariant(mt=4, wm=2, wk=2, nt=1, prefetch=2)
        assert (behind.feature_block, behind.tile_rows) == (bucket.feature_block, bucket.tile_rows)
        assert engine.can_finalize(_gemm2(rows, shape2, code, handoff=object()), tokens)
    mxint4 = _gemm2(rows, shape2, BlockCode.MXINT4, handoff=object())
    assert engine._launch_variant(mxint4) == engine.variant(rows, shape2, gemm=2, code=BlockCode.MXINT4)
    assert engine.can_finalize(mxint4, tokens) is (model == QWEN3 and tokens == 4)


@pytest.mark.parametrize("model,tokens,finalizes", [
    (QWEN3, 1, True), (QWEN3, 8, False), (DEEPSEEK_V3, 1, False), (DEEPSEEK_V3, 8, False),
])
def test_bf16_weights_take_the_bf16_decode_form(model, tokens: int, finalizes: bool) -> None:
    """BF16 weights run one decode variant (one m16 block a warp, four steps in flight) reading natural token rows at
    every T <= 8, for both GEMMs; GEMM2 finalizes where that variant's CTAs fit one wave (Qwen3-30B-A3B T=1: 256 CTAs
    of 128 threads; DeepSeek-V3 T=1: 896); buckets past the decode kernel are refused."""
    engine = bare_engine()
    experts, hidden, inter = model
    rows, shape1 = _bucket(model, tokens)
    shape2 = GemmShape(inter, hidden, experts)
    for gemm, shape in ((1, shape1), (2, shape2)):
        variant = engine.variant(rows, shape, gemm=gemm, code=BlockCode.BF16)
        assert variant == DecodeVariant(mt=1, wm=4, wk=1, nt=1, prefetch=4, bf16_weights=True)
        assert "-DSM90_W_BF16=1" in variant.options()
        assert engine.token_layout_for(rows, shape, gemm=gemm, code=BlockCode.BF16) is TokenLayout.BF16_ROWS
        assert engine.token_layout_for(rows, shape, gemm=gemm) is TokenLayout.BF16_FRAGMENTS
    assert engine.can_finalize(_gemm2(rows, shape2, BlockCode.BF16), tokens) is finalizes
    long_rows, _ = _bucket(model, 4096)
    with pytest.raises(ValueError, match="BF16 weights run on the decode kernel only"):
        engine.variant(long_rows, shape1, gemm=1, code=BlockCode.BF16)


@pytest.mark.parametrize("model,tokens,early", [
    (QWEN3, 1, True), (QWEN3, 4, True), (QWEN3, 8, False), (DEEPSEEK_V3, 2, True), (DEEPSEEK_V3, 64, False),
    (QWEN3, 4096, False),
])
def test_early_routing_for_calls_of_few_tokens(model, tokens: int, early: bool) -> None:
    """Early routing reaches the kernel for calls of at most four tokens on the decode kernel with NVFP4 or MXINT4
    tiles, with one wave of CTAs guessing (512 threads an SM): GEMM1, signalling a handoff or not, and GEMM2 behind a
    routed GEMM1; never with a route, or on a GEMM2 that waits for a handoff's tiles."""
    engine = bare_engine()
    rows, shape = _bucket(model, tokens)
    variant = engine.variant(rows, shape, gemm=1)
    routing = EarlyRouting(torch.zeros(tokens, 8, dtype=torch.int32), 1, 0)

    def ops(epilogue: object = object(), route: object = None, handoff: object = None, early=routing):
        return SimpleNamespace(early=early, epilogue=epilogue, route=route, handoff=handoff)

    got = engine._early(ops(), variant)
    assert (got is not None) is early
    if early:
        assert got.ids is routing.ids and got.ctas == SMS * (512 // variant.threads)
    assert (engine._early(ops(handoff=object()), variant) is not None) is early  # GEMM1 signalling
    assert (engine._early(ops(epilogue=None), variant) is not None) is early  # GEMM2, routed GEMM1
    assert engine._early(ops(epilogue=None, handoff=object()), variant) is None  # GEMM2 awaiting
    assert engine._early(ops(route=object()), variant) is None
    assert engine._early(ops(early=None), variant) is None
    if isinstance(variant, DecodeVariant):  # never for BF16 weights
        assert engine._early(ops(), engine.variant(rows, shape, gemm=1, code=BlockCode.BF16)) is None


@pytest.mark.parametrize("model,tokens,code,dram_tbs,experts,code_bytes,scale_bytes,blocks", [
    (QWEN3, 8, BlockCode.NVFP4, H200_TBS, 44, 14 * 512, 896, 96),  # 528 slots / 12 feature blocks; 14 of 32 tiles
    (QWEN3, 8, BlockCode.MXFP4, H200_TBS, 44, 14 * 512, 512, 96),  # 32-byte tile scales: 448 bytes, whole lines
    (QWEN3, 8, BlockCode.MXINT4, H200_TBS, 44, 14 * 512, 896, 96),  # 64-byte tile scales
    (QWEN3, 8, BlockCode.NVFP4, H100_TBS, 44, 14 * 512, 896, 32),  # _WIDE's first wave there too (six CTAs an SM)
    (QWEN3, 8, BlockCode.MXFP4, H100_TBS, 22, 14 * 512, 512, 32),  # 64-feature CTAs: 528 / 24 feature blocks
    (DEEPSEEK_V3, 4, BlockCode.NVFP4, H200_TBS, 16, 50 * 512, 3200, 96),  # 1024 CTAs
    (DEEPSEEK_V3, 8, BlockCode.NVFP4, H200_TBS, 16, 50 * 512, 3200, 96),  # 528 / 32 feature blocks; 50 of 112 tiles
    (DEEPSEEK_V3, 8, BlockCode.NVFP4, H100_TBS, 16, 50 * 512, 3200, 32),
    (DEEPSEEK_V3, 16, BlockCode.NVFP4, H200_TBS, 16, 50 * 512, 3200, 96),  # past 64 slots: K = 7168 >= 4096
    (DEEPSEEK_V3, 64, BlockCode.NVFP4, H200_TBS, 16, 50 * 512, 3200, 96),
])
def test_l2_warm_covers_the_first_wave(model, tokens: int, code: BlockCode, dram_tbs: float, experts: int,
                                       code_bytes: int, scale_bytes: int, blocks: int) -> None:
    """l2_warm before a decode GEMM1 of weight tiles past one wave of CTAs: the first _L2_WARM_SHARE of every row
    block's K/64 tiles (and their scales, in whole 128-byte lines) of the experts of GEMM1's first wave, with 96 extra
    blocks (32 below 4 TB/s of DRAM)."""
    engine = bare_engine(dram_tbs)
    rows, shape = _bucket(model, tokens)
    tiles, scale_tile = shape.k // 64, 32 if code is BlockCode.MXFP4 else 64
    weights = SimpleNamespace(code=code, data=torch.empty(2, shape.n * shape.k // 2, dtype=torch.uint8),
                              scales=torch.empty(2, shape.n // 16 * tiles * scale_tile, dtype=torch.uint8))
    warm = engine.l2_warm(SimpleNamespace(rows=rows, shape=shape, weights=weights))
    assert (warm.row_blocks, warm.code_row, warm.scale_row) == (shape.n // 16, tiles * 512, tiles * scale_tile)
    assert (warm.experts, warm.code_bytes, warm.scale_bytes, warm.blocks) == (experts, code_bytes, scale_bytes, blocks)
    assert warm.codes.data_ptr() == weights.data.data_ptr() and warm.scales.data_ptr() == weights.scales.data_ptr()


@pytest.mark.parametrize("model,tokens,code", [
    (QWEN3, 8, BlockCode.BF16), (QWEN3, 8, BlockCode.NVFP4_ROWS), (QWEN3, 8, BlockCode.MXFP4_ROWS),
    (QWEN3, 4096, BlockCode.NVFP4),  # wgmma
    (QWEN3, 2, BlockCode.NVFP4), (QWEN3, 4, BlockCode.NVFP4), (DEEPSEEK_V3, 2, BlockCode.NVFP4),  # <= 512 CTAs
    (QWEN3, 16, BlockCode.NVFP4), (QWEN3, 64, BlockCode.NVFP4),  # past 64 slots with K = 2048
])
def test_l2_warm_only_before_decode_tiles(model, tokens: int, code: BlockCode) -> None:
    """No warming where GEMM1 does not stream weight tiles on the decode kernel past one wave of CTAs: BF16 and
    row-major weights, wgmma, one wave; nor past the handoff's 64 slots with K < 4096 (measured slower there)."""
    engine = bare_engine()
    rows, shape = _bucket(model, tokens)
    weights = SimpleNamespace(code=code, data=torch.empty(0, dtype=torch.uint8), scales=torch.empty(0, dtype=torch.uint8))
    assert engine.l2_warm(SimpleNamespace(rows=rows, shape=shape, weights=weights)) is None
