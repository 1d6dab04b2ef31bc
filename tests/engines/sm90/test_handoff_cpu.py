"""CPU checks of the tile handoff between the SM90 decode GEMM1 and GEMM2 (TileHandoff): the launches pass the
counters (GEMM1 one, GEMM2 both and GEMM1's CTAs per tile) after the kernel's arguments and compile the signalling
and awaiting forms in; bad counters are refused before any launch; the engine hands off only between decode variants
of the same tiles in buckets of at most 64 slots, with its counters at the end of the bucket's workspace, clear of
the finalize tickets; the forms compile for sm_90a and sm_100a without spills."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch

from cudnn_moe.activations import SwiGLU
from cudnn_moe.engines.base import GemmShape, TileHandoff
from cudnn_moe.engines.sm90 import engine as sm90_engine
from cudnn_moe.engines.sm90 import kernels as sm90
from cudnn_moe.kernels import kernels_dir
from cudnn_moe.pipeline.executor import row_capacity
from tests.engines.sm90.test_sm90_kernels_cpu import (  # noqa: F401 (launches: a fixture)
    _early_args, _gemm_args, _nvcc, _signatures, launches,
)
from tests.engines.sm90.gpus import H100_TBS, H200_TBS, bare_engine
from tests.support.kernel_sources import NVCC, ptxas_report, register_usage

SM90_DIR = kernels_dir() / "sm90"


class _Ops:
    """The fields of a bucket's GemmOperands that Sm90GemmEngine.tile_handoff reads."""

    def __init__(self, rows: int, shape: GemmShape, workspace: torch.Tensor) -> None:
        self.rows, self.shape, self.workspace = rows, shape, workspace
        self.weights = type("W", (), {"code": sm90_engine.BlockCode.NVFP4})()


def _handoff(tiles: int = 16, producers: int = 3) -> TileHandoff:
    counters = torch.zeros(2 * tiles, dtype=torch.int32)
    return TileHandoff(counters[:tiles], counters[tiles:], producers)


def test_handoff_passes_its_counters_and_compiles_in(launches: list[tuple]) -> None:
    """GEMM1 (an epilogue) signals: DEC_HANDOFF_PARAMS' one counter, SM90_SIGNAL; GEMM2 awaits: both counters and the
    producers, SM90_AWAIT."""
    signature = len(_signatures()["sm90_gemm_decode"])
    gemm1 = {**_early_args(), "early": None}  # N = 256 on 128-feature CTAs: two per tile
    sm90.grouped_gemm(**gemm1, handoff=_handoff(producers=2))
    sm90.grouped_gemm(**_gemm_args(), variant=sm90.DecodeVariant(2, 4, 1, 1, 4), handoff=_handoff(producers=5))
    (_, _, _, _, _, first), first_kwargs = launches[0]
    (_, _, _, _, _, second), second_kwargs = launches[1]
    assert first_kwargs["extra_options"] == (*gemm1["variant"].options(), *sm90.epilogue_options(SwiGLU()),
                                             "-DSM90_SIGNAL=1")
    assert second_kwargs["extra_options"] == (*sm90.DecodeVariant(2, 4, 1, 1, 4).options(), "-DSM90_AWAIT=1")
    assert len(first) == signature + 1 and len(second) == signature + 3 == 28 + 3
    assert int(second[-1]) == 5


_BAD = [
    ("prefill variant", lambda a: a.update(variant=sm90.PREFILL), ValueError, "DecodeVariant"),
    ("short counters", lambda a: a.update(handoff=_handoff(tiles=2)), ValueError, "handoff.done"),
    ("counters dtype", lambda a: a.update(handoff=TileHandoff(torch.zeros(16), torch.zeros(16), 3)), TypeError,
     "handoff.done"),
    ("2-D counters", lambda a: a.update(handoff=TileHandoff(torch.zeros(2, 8, dtype=torch.int32),
                                                            torch.zeros(16, dtype=torch.int32), 3)), ValueError,
     "handoff.done"),
    ("overlapping counters", lambda a: a.update(handoff=replace(a["handoff"], passed=a["handoff"].done)), ValueError,
     "overlap"),
    ("no producers", lambda a: a.update(handoff=_handoff(producers=0)), ValueError, "handoff.producers"),
    ("counters in the output", lambda a: a.update(handoff=TileHandoff(a["out"].view(torch.int32).view(-1)[:16],
                                                                      torch.zeros(16, dtype=torch.int32), 3)),
     ValueError, "handoff.done must not overlap"),
]


def test_signalling_gemm1_checks_its_producers(launches: list[tuple]) -> None:
    """GEMM1's own feature blocks are the producers GEMM2 waits for: any other count is refused."""
    with pytest.raises(ValueError, match="handoff.producers must be this GEMM1's 2 feature blocks"):
        sm90.grouped_gemm(**{**_early_args(), "early": None}, handoff=_handoff(producers=3))
    assert not launches


@pytest.mark.parametrize("name,mutate,error,needle", _BAD, ids=[b[0] for b in _BAD])
def test_handoff_rejects_bad_arguments(name: str, mutate: Any, error: type, needle: str, launches: list[tuple]) -> None:
    args = {**_gemm_args(), "variant": sm90.DecodeVariant(2, 4, 1, 1, 4), "handoff": _handoff()}
    mutate(args)
    with pytest.raises(error, match=needle):
        sm90.grouped_gemm(**args)
    assert not launches


@pytest.mark.parametrize("rows,experts", [(64, 128), (512, 128), (120, 8)])  # 8, 64 and 64 slots
def test_engine_hands_off_decode_tiles_in_its_workspace(rows: int, experts: int) -> None:
    """The counters sit at the end of the bucket's workspace, after the finalize tickets of either GEMM, one per
    possible tile each; GEMM1's feature blocks produce each tile."""
    engine = bare_engine()
    shape1, shape2 = GemmShape(2048, 1536, experts), GemmShape(768, 2048, experts)
    size = max(engine.workspace_bytes(rows, shape1), engine.workspace_bytes(rows, shape2))
    workspace = torch.zeros(size, dtype=torch.uint8)
    handoff = engine.tile_handoff(_Ops(rows, shape1, workspace), _Ops(rows, shape2, workspace))
    v1 = engine.variant(rows, shape1, gemm=1)
    assert handoff is not None and handoff.producers == 1536 // v1.feature_block
    tiles = sm90.gemm_grid(v1, experts, shape1.n, rows)[1]
    assert handoff.done.numel() == handoff.passed.numel() >= tiles
    ints = workspace.view(torch.int32)
    assert handoff.passed.data_ptr() + 4 * handoff.passed.numel() == ints.data_ptr() + 4 * ints.numel()
    assert handoff.done.data_ptr() >= ints.data_ptr() + 4 * (2048 // 16)  # clear of the widest GEMM's tickets


@pytest.mark.parametrize("rows,experts", [(8192, 8), (1408, 128), (576, 128)])  # wgmma; 512 and 72 slots
def test_engine_hands_off_small_decode_buckets_only(rows: int, experts: int) -> None:
    """Past 64 slots (T = 8 at top-8) the handoff measured no gain (Qwen3-30B-A3B T=64 lost 1-2 us), and wgmma
    buckets never hand off."""
    engine = bare_engine()
    workspace = torch.zeros(1 << 20, dtype=torch.uint8)
    shapes = GemmShape(2048, 1536, experts), GemmShape(768, 2048, experts)
    assert engine.tile_handoff(*(_Ops(rows, shape, workspace) for shape in shapes)) is None


_FORMS = ["-DSM90_SIGNAL=1", "-DSM90_AWAIT=1", "-DSM90_AWAIT=1 -DSM90_FINALIZE=1"]
# (variant, arch, weights form, spill bytes allowed): MXINT4's SwiGLU forms spill 8 bytes with or without the signal,
# and its finalizing GEMM2 4 bytes with the wait (none without); so does _WIDE_MT4's NVFP4 one, held to 128 registers
# (one word stored before the main loop, loaded after it); _WIDE_MT4_SPLIT, GEMM2 behind the handoff past one wave,
# spills none. Row-major weights never hand off (tile_handoff).
_COMPILED = [(v, "90a", "", 0) for v in (sm90_engine._WIDE, sm90_engine._SPLIT, sm90_engine._SPLIT_DEEP,
                                          sm90_engine._MID)] + [
    (sm90_engine._WIDE_MT4, "90a", "", 4),
    (sm90_engine._WIDE_MT4, "90a", "-DSM90_W_MXFP4=1", 0),
    (sm90_engine._WIDE_MT4_SPLIT, "90a", "", 0),
    (sm90_engine._WIDE_MT4_SPLIT, "90a", "-DSM90_W_MXFP4=1", 0),
    (sm90_engine._WIDE_MT4_SPLIT, "100a", "", 0),
    (sm90_engine._WIDE, "100a", "", 0),
    (sm90_engine._BF16, "90a", "", 0),
    (sm90_engine._SPLIT, "90a", "-DSM90_W_INT4=1", 8),
    (sm90_engine._WIDE, "90a", "-DSM90_W_INT4=1", 8),
]


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("form", _FORMS)
@pytest.mark.parametrize("variant,arch,weights,spill", _COMPILED, ids=str)
def test_handoff_forms_compile_within_their_spills(variant: sm90.DecodeVariant, arch: str, weights: str, spill: int,
                                                   form: str) -> None:
    options = (*variant.options(), *weights.split(), *form.split())
    if "SIGNAL" in form:
        options += sm90.epilogue_options(SwiGLU())
    result = _nvcc(SM90_DIR / "grouped_gemm.cu", arch, options)
    report = ptxas_report(result, variant.kernel)
    _, spilled = register_usage(report)
    assert spilled <= spill, report


# (variant, arch, weights form, spill bytes allowed): the persistent GEMM1 the engine runs behind a handoff (two ring
# steps of the next unit loaded ahead); on sm_90a _WIDE's spills 8 bytes with NVFP4 tiles and 4 with MXFP4 (none with
# early routing); on sm_100a none.
_PERSISTENT = [(replace(v, persist=sm90_engine._PERSIST_AHEAD), "90a", weights, spill)
               for v, spills in ((sm90_engine._WIDE, (8, 4, 4)), (sm90_engine._SPLIT, (0, 0, 0)),
                                 (sm90_engine._SPLIT_DEEP, (0, 0, 0)))
               for weights, spill in zip(("", "-DSM90_W_MXFP4=1", "-DSM90_W_MXFP4=1 -DSM90_ACT_MXFP8=1"), spills)] + [
    (replace(v, persist=sm90_engine._PERSIST_AHEAD), "100a", "", 0) for v in (sm90_engine._WIDE, sm90_engine._SPLIT)]


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("early", ["", "-DSM90_EARLY=1"])
@pytest.mark.parametrize("variant,arch,weights,spill", _PERSISTENT, ids=str)
def test_persistent_gemm1_compiles_within_its_spills(variant: sm90.DecodeVariant, arch: str, weights: str, spill: int,
                                                     early: str) -> None:
    options = (*variant.options(), *weights.split(), "-DSM90_SIGNAL=1", *early.split(),
               *sm90.epilogue_options(SwiGLU()))
    assert f"-DSM90_PERSIST={sm90_engine._PERSIST_AHEAD}" in options
    result = _nvcc(SM90_DIR / "grouped_gemm.cu", arch, options)
    report = ptxas_report(result, variant.kernel)
    assert register_usage(report)[1] <= spill, report


@pytest.mark.parametrize("bad", [dict(persist=5), dict(persist=-1), dict(persist=2, bf16_weights=True),
                                 dict(persist=2, row_major=True)], ids=str)
def test_persistent_variant_rejects_forms_it_lacks(bad: dict) -> None:
    with pytest.raises(ValueError, match="persist"):
        sm90.DecodeVariant(mt=1, wm=4, wk=1, nt=1, prefetch=4, **bad)


class _Gemm1Ops(_Ops):
    """What Sm90GemmEngine.persists reads of GEMM1's operands: a handoff, an epilogue, no route."""

    def __init__(self, rows: int, shape: GemmShape, code: Any = sm90_engine.BlockCode.NVFP4, **fields: Any) -> None:
        super().__init__(rows, shape, torch.zeros(0, dtype=torch.uint8))
        self.weights = type("W", (), {"code": code})()
        self.gemm, self.handoff, self.route, self.epilogue = 1, object(), None, object()
        self.__dict__.update(fields)


@pytest.mark.parametrize("tokens,experts,n,dram_tbs,persists", [
    (8, 128, 1536, H200_TBS, False),  # Qwen3-30B-A3B T=8 on the H200: 1.45 waves of _WIDE (slower persistent)
    (8, 128, 1536, H100_TBS, False),  # on the H100 too: _WIDE's 768 CTAs held to six an SM, one wave
    (4, 128, 1536, H100_TBS, False),  # T=4 and T=2: one wave (measured 1.4 and 0.4 us slower persistent)
    (2, 128, 1536, H100_TBS, False),
    (8, 256, 4096, H200_TBS, True),   # DeepSeek-V3 T=8
])
def test_gemm1_persists_past_two_waves_behind_a_handoff(tokens: int, experts: int, n: int, dram_tbs: float,
                                                        persists: bool) -> None:
    engine = bare_engine(dram_tbs)
    rows, shape = row_capacity(tokens, 8, experts, 8), GemmShape(2048, n, experts)
    variant = engine.variant(rows, shape, gemm=1)
    assert engine.persists(_Gemm1Ops(rows, shape), variant) is persists
    if persists:  # not without a handoff, an epilogue, with a route, on GEMM2, or on other weights
        for fields in (dict(handoff=None), dict(epilogue=None), dict(route=object()), dict(gemm=2)):
            assert not engine.persists(_Gemm1Ops(rows, shape, **fields), variant), fields
        for code in (sm90_engine.BlockCode.MXINT4, sm90_engine.BlockCode.NVFP4_ROWS, sm90_engine.BlockCode.BF16):
            assert not engine.persists(_Gemm1Ops(rows, shape, code), variant), code
        assert engine.persists(_Gemm1Ops(rows, shape, sm90_engine.BlockCode.MXFP4), variant)
