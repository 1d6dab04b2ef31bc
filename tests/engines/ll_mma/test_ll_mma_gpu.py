"""GPU tests of the ll_mma engine (tensor-core dot products of the low-latency FP8 formats and MX pairs), called through
``low_latency_moe`` with ``LowLatencyMoeConfig(engine="ll_mma")``: FP8 weight-only (BF16 and FP16 tokens, BF16 and
FP16 outputs), per-tensor FP8 and DeepSeek FP8 (BF16 and prequantized tokens) against the float64 references, for
the ten activations (gated and non-gated) and default SwiGLU over T = 1..8 and the four routing forms; raw rows
with their scores; duplicate and shared experts (8 tokens on one expert: all 8 B columns); CUDA-graph capture and
replay; every K split and round count of the kernels (forced); model-size rows (DeepSeek-V3's expert shape). The MX
pairs (MXFP4 / MXFP8 weights, MXFP8 tokens): three activations x T in {1, 5, 8}, raw rows and scores, unrouted
slots with NaN scores, agreement with the CUDA-core engine, forced K splits, model rows, graph capture, through
tests.support.low_latency_mx's checks (the engine's MXFP8 intermediate, then the rows on it).

Written without a GPU in reach: not run yet when committed. Run: pytest -q tests/engines/ll_mma

Every output is pre-filled with NaN, so a missing write never passes. Comparisons: FP8 weight-only against its
reference within tests.support.low_latency's bounds, and against the CUDA-core engine's output on the same call
within the same bounds (the same rounding points; the FP32 sums differ in order and, on tensor cores, in their
inner rounding, so not bitwise); per-tensor and DeepSeek FP8 through tests.support.low_latency_fp8's checks, which
read the intermediate this engine left in its own workspace.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

from cudnn_moe.activations import Activation, GeGLU, SiLU, SwiGLU
from cudnn_moe.engines.cuda_cores import engine as cc_engine
from cudnn_moe.engines.ll_mma import kernels as mma_kernels
from cudnn_moe.formats.fp8 import quantize_fp8_act128
from cudnn_moe.low_latency import (
    LowLatencyMoeConfig,
    RawOutput,
    WeightFormat,
    low_latency_moe,
    reference_low_latency,
    reference_mx_pair,
)
from cudnn_moe.routing import Routing
from tests.support.low_latency import (
    ACTIVATIONS, DEV, E, ROUTING_KINDS, TOP_K, assert_close_to_reference, make_inputs, make_layer, make_routing, nan_out,
    random_ids, replay_equals_eager, run_low_latency, shared_expert_ids,
)
from tests.support.low_latency_fp8 import (
    check_deepseek_fp8_call,
    check_fp8_per_tensor_call,
    deepseek_fp8_layer,
    engine_workspace,
    fp8_per_tensor_layer,
    scaled_tokens_bf16,
    tokens_bf16,
)
from tests.support.low_latency_mx import HIDDEN as MX_HIDDEN
from tests.support.low_latency_mx import INTER as MX_INTER
from tests.support.low_latency_mx import KINDS as MX_KINDS
from tests.support.low_latency_mx import check_call as check_mx_call
from tests.support.low_latency_mx import layer as support_mx_layer
from tests.support.low_latency_mx import tokens_bf16 as mx_tokens

pytestmark = pytest.mark.gpu

ENGINE = "ll_mma"
# The MX layers this engine runs: row-major (a config naming ll_mma keeps an MXFP4 pair so on SM90).
mx_layer = functools.partial(support_mx_layer, engine=ENGINE)
WO, PT, DS = WeightFormat.FP8_WEIGHT_ONLY, WeightFormat.FP8_PER_TENSOR, WeightFormat.DEEPSEEK_FP8
FORMATS = (WO, PT, DS)
SPLIT_SHAPES = {WO: (640, 160), PT: (640, 160), DS: (640, 256)}  # 5 K units in GEMM1, Ip = 256 (2 units) in GEMM2


@functools.cache
def mma_config() -> LowLatencyMoeConfig:
    return LowLatencyMoeConfig(8, engine=ENGINE)


@functools.cache
def layer(fmt: WeightFormat, gated: bool, experts: int = E, shape: tuple[int, int] | None = None, seed: int = 0):
    """Prepared weights of one random layer of ``fmt`` (the records every engine reads)."""
    if fmt is WO:
        return make_layer(fmt, gated, experts, shape, seed)[1]
    build = fp8_per_tensor_layer if fmt is PT else deepseek_fp8_layer
    return build(gated, experts, *(() if shape is None else (shape,)), seed=seed)[1]


def inputs_for(fmt: WeightFormat, weights, tokens: int, seed: int, x_dtype: torch.dtype = torch.bfloat16,
               prequantized: bool = False):
    """The call's inputs: x_dtype tokens (FP8 weight-only), quantized tokens (per-tensor), BF16 or prequantized
    tokens (DeepSeek FP8)."""
    config, hidden = mma_config(), weights.hidden_size
    if fmt is WO:
        return make_inputs(config, fmt, x_dtype, tokens, hidden, seed=seed)
    if fmt is PT:
        return config.prepare_fp8_per_tensor_activations(tokens_bf16(tokens, hidden, seed), weights)
    x = scaled_tokens_bf16(tokens, hidden, seed)
    return config.prepare_deepseek_fp8_activations(*quantize_fp8_act128(x), weights) if prequantized else x


def check(fmt: WeightFormat, weights, inputs, routing, act: Activation, got: torch.Tensor, finalize: bool,
          out_dtype: torch.dtype, what: str) -> None:
    """got: the ll_mma call's output that has just been computed (nothing else since on these weights)."""
    if fmt is PT:
        check_fp8_per_tensor_call(mma_config(), weights, inputs, routing, act, got, finalize, what, ENGINE)
    elif fmt is DS:
        check_deepseek_fp8_call(mma_config(), weights, inputs, routing, act, got, finalize, what, ENGINE)
    else:
        want = reference_low_latency(inputs, weights, routing, act, out_dtype=out_dtype, finalize=finalize)
        torch.cuda.synchronize()
        assert_close_to_reference(got, want if finalize else want.rows, what)


def run(fmt: WeightFormat, act: Activation, tokens: int, kind: str, *, out_dtype: torch.dtype = torch.bfloat16,
        x_dtype: torch.dtype = torch.bfloat16, finalize: bool = True, seed: int = 0, ids=None,
        prequantized: bool = False, weights=None) -> torch.Tensor:
    """One ll_mma call into a NaN-filled output, checked; returns the output."""
    weights = weights if weights is not None else layer(fmt, act.gated)
    inputs = inputs_for(fmt, weights, tokens, seed + 1, x_dtype, prequantized)
    ids = random_ids(tokens, TOP_K, E, seed + 2) if ids is None else ids
    routing = make_routing(ids, kind, seed + 3)
    shape = (tokens, weights.hidden_size) if finalize else (tokens, ids.shape[1], weights.hidden_size)
    out = nan_out(shape, out_dtype)
    result = low_latency_moe(mma_config(), inputs, weights, routing, activation=act, out_dtype=out_dtype,
                             finalize=finalize, out=out)
    assert result is out
    what = f"ll_mma {fmt.value} {type(act).__name__} T={tokens} {kind} finalize={finalize} -> {out_dtype}"
    check(fmt, weights, inputs, routing, act, out, finalize, out_dtype, what)
    return out


# ----------------------------------------------------------------------------- formats x activations x T
def _matrix() -> list:
    cases = []
    for fi, fmt in enumerate(FORMATS):
        x_dtypes = (torch.bfloat16, torch.float16) if fmt is WO else (torch.bfloat16,)
        for xi, x_dtype in enumerate(x_dtypes):
            for ai, act in enumerate(ACTIVATIONS):
                n = fi * 31 + xi * 10 + ai
                tokens, kind = 1 + n % 8, ROUTING_KINDS[n % len(ROUTING_KINDS)]
                out_dtype = torch.float16 if fmt is WO and n % 2 else torch.bfloat16
                tag = f"{fmt.value}-{str(x_dtype)[6:]}-{type(act).__name__}-T{tokens}-{kind}-{str(out_dtype)[6:]}"
                cases.append(pytest.param(fmt, x_dtype, act, tokens, kind, out_dtype, n % 3 == 0, id=tag))
        for tokens in range(1, 9):
            x_dtype = torch.float16 if fmt is WO and tokens % 2 else torch.bfloat16
            out_dtype = torch.float16 if fmt is WO and tokens % 3 == 0 else torch.bfloat16
            kind = ROUTING_KINDS[(fi + tokens) % len(ROUTING_KINDS)]
            tag = f"{fmt.value}-{str(x_dtype)[6:]}-SwiGLU-default-T{tokens}-{kind}-{str(out_dtype)[6:]}"
            cases.append(pytest.param(fmt, x_dtype, SwiGLU(), tokens, kind, out_dtype, tokens % 2 == 0, id=tag))
    return cases


@pytest.mark.parametrize("fmt, x_dtype, act, tokens, kind, out_dtype, prequantized", _matrix())
def test_matches_reference(fmt, x_dtype, act, tokens, kind, out_dtype, prequantized):
    run(fmt, act, tokens, kind, out_dtype=out_dtype, x_dtype=x_dtype, seed=tokens, prequantized=prequantized)


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("act, tokens", [(SwiGLU(), 1), (GeGLU(), 5), (SiLU(), 8)], ids=["SwiGLU-T1", "GeGLU-T5", "SiLU-T8"])
def test_fp8_weight_only_agrees_with_the_cuda_core_engine(x_dtype, act, tokens):
    """The same call on the CUDA-core engine (the default config): the same rounding points, so the outputs agree
    within the reference bounds (FP32 sums in another order, not bitwise)."""
    got = run(WO, act, tokens, "packed", x_dtype=x_dtype, seed=40 + tokens)
    weights = layer(WO, act.gated)
    inputs = inputs_for(WO, weights, tokens, 41 + tokens, x_dtype)
    routing = make_routing(random_ids(tokens, TOP_K, E, 42 + tokens), "packed", 43 + tokens)
    cuda_cores = low_latency_moe(LowLatencyMoeConfig(8, engine="cuda_cores"), inputs, weights, routing, activation=act,
                                 out=nan_out(got.shape, got.dtype))
    torch.cuda.synchronize()
    assert_close_to_reference(got, cuda_cores, f"ll_mma vs cuda_cores {type(act).__name__} T={tokens} {x_dtype}")


# ----------------------------------------------------------------------------- raw rows, duplicates
@pytest.mark.parametrize("kind", ("packed", "fp32"))
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.value)
def test_raw_rows_with_scores(fmt, kind):
    """Raw rows [T, k, H] into a NaN-filled output and every slot's score (packed: its BF16 value) bit for bit."""
    weights, tokens = layer(fmt, True), 5
    inputs = inputs_for(fmt, weights, tokens, 8)
    routing = make_routing(random_ids(tokens, TOP_K, E, 9), kind, 10)
    out = nan_out((tokens, TOP_K, weights.hidden_size), torch.bfloat16)
    scores = nan_out((tokens, TOP_K), torch.float32)
    result = low_latency_moe(mma_config(), inputs, weights, routing, finalize=False, out=out, return_scores=True,
                             scores_out=scores)
    assert isinstance(result, RawOutput) and result.rows is out and result.scores is scores
    check(fmt, weights, inputs, routing, SwiGLU(), out, False, torch.bfloat16, f"raw rows {fmt.value} {kind}")
    want = reference_low_latency(inputs, weights, routing, SwiGLU(), finalize=False)
    assert torch.equal(scores.cpu().view(torch.int32), want.scores.cpu().view(torch.int32)), f"scores differ ({kind})"


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.value)
def test_duplicate_and_shared_experts(fmt):
    """Every token names expert 5 (8 tokens on one expert: every B column of the mma), one token names an expert
    twice, another twice more: each slot computed and written on its own."""
    for finalize in (True, False):
        run(fmt, SwiGLU(), 8, "fp32", finalize=finalize, seed=3, ids=shared_expert_ids())


# ----------------------------------------------------------------------------- work split and rounds
@pytest.mark.parametrize("split", (1, 2, 4, 8))
@pytest.mark.parametrize("fmt, gated", [(WO, True), (WO, False), (PT, True), (DS, True)],
                         ids=["fp8_weight_only", "fp8_weight_only-non-gated", "fp8_per_tensor", "deepseek_fp8"])
def test_every_k_split_and_round_count(fmt, gated, split, monkeypatch):
    """Forced K splits (warps per tile pair; some warps get no unit at split 4 and 8 of a 5-unit row, others two)
    on a GPU of one SM as far as the round choice knows (so CTAs take 2-4 feature blocks, the last ones past the
    rows): the split partial sums, the rounds loop and the ragged last CTA give the reference's results."""
    monkeypatch.setattr(mma_kernels, "choose_split", lambda units: split)
    monkeypatch.setattr(cc_engine, "_sm_count", lambda index: 1)
    weights = layer(fmt, gated, shape=SPLIT_SHAPES[fmt], seed=5)
    act = SwiGLU(alpha=1.702, beta=1.0, limit=7.0) if gated else SiLU()
    for tokens, finalize in ((3, True), (8, False)):
        run(fmt, act, tokens, "packed", finalize=finalize, seed=60 + split, weights=weights)


@pytest.mark.parametrize("fmt, shape", [(WO, (2048, 768)), (WO, (7168, 2048)), (PT, (7168, 2048)), (DS, (7168, 2048))],
                         ids=["fp8_weight_only-qwen3", "fp8_weight_only-deepseek-v3", "fp8_per_tensor-deepseek-v3",
                              "deepseek_fp8-deepseek-v3"])
def test_model_row_lengths(fmt, shape):
    """Rows of model size: Qwen3-30B-A3B's (GEMM2 K = 768: split 2) and DeepSeek-V3's expert (H = 7168: 56 units,
    split 8; Ip = 2048: 16 units, split 8), 4 experts, top-2."""
    weights = layer(fmt, True, experts=4, shape=shape, seed=6)
    run(fmt, SwiGLU(), 5, "packed", seed=12, ids=random_ids(5, 2, 4, 13), weights=weights)


# ----------------------------------------------------------------------------- CUDA graphs
@pytest.mark.parametrize("finalize", (True, False))
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.value)
def test_cuda_graph_replay_equals_eager(fmt, finalize):
    """One call captured in a CUDA graph, replayed after the tokens and the routing change in place, equals an
    eager call on the new tokens bit for bit (and the reference)."""
    weights, tokens, hidden = layer(fmt, True), 6, layer(fmt, True).hidden_size
    inputs = inputs_for(fmt, weights, tokens, 1)
    routing = make_routing(random_ids(tokens, TOP_K, E, 1), "packed")
    shape = (tokens, hidden) if finalize else (tokens, TOP_K, hidden)

    def change_inputs() -> None:
        fresh = inputs_for(fmt, weights, tokens, 2)
        if fmt is PT:
            inputs.codes.copy_(fresh.codes)
        else:
            inputs.copy_(fresh)
        routing.packed_tensor.copy_(make_routing(random_ids(tokens, TOP_K, E, 2), "packed").packed_tensor)

    replayed = replay_equals_eager(
        lambda out, scores: run_low_latency(mma_config(), inputs, weights, routing, out, scores, finalize),
        shape, TOP_K, torch.bfloat16, finalize, change_inputs)
    check(fmt, weights, inputs, routing, SwiGLU(), replayed.out, finalize, torch.bfloat16,
          f"eager after the replay {fmt.value}")


# ----------------------------------------------------------------------------- the MX pairs
# MXFP4 / MXFP8 weights with MXFP8 tokens on tensor cores, through tests.support.low_latency_mx's checks (the MXFP8
# intermediate this engine left in its workspace against reference_mx_pair's step 2, then the rows or output on
# that intermediate): the block-pure K order, the warp-shared rings and the per-32 E8M0 scales of mma_gemm.cuh.
MX_ACTS = (SwiGLU(), GeGLU(), SiLU())


def run_mx(kind: str, act: Activation, tokens: int, routing_kind: str, out_dtype: torch.dtype = torch.bfloat16, *,
           finalize: bool = True, seed: int = 0, ids=None, experts: int = E, shape=(MX_HIDDEN, MX_INTER),
           top_k: int = TOP_K) -> torch.Tensor:
    """One ll_mma call of an MX pair into a NaN-filled output, checked; returns the output."""
    _, weights = mx_layer(kind, act.gated, experts, shape)
    acts = mma_config().prepare_mxfp8_activations(mx_tokens(tokens, weights.hidden_size, seed + 1))
    ids = random_ids(tokens, top_k, experts, seed + 2) if ids is None else ids
    routing = make_routing(ids, routing_kind, seed + 3)
    out_shape = (tokens, weights.hidden_size) if finalize else (tokens, ids.shape[1], weights.hidden_size)
    out = nan_out(out_shape, out_dtype)
    assert low_latency_moe(mma_config(), acts, weights, routing, activation=act, out_dtype=out_dtype,
                           finalize=finalize, out=out) is out
    what = f"ll_mma {kind} {type(act).__name__} T={tokens} {routing_kind} {out_dtype} finalize={finalize}"
    check_mx_call(mma_config(), weights, acts, routing, act, out, out_dtype, finalize, what, engine=ENGINE)
    return out


def _mx_matrix() -> list:
    cases = []
    for ki, kind in enumerate(MX_KINDS):
        for ai, act in enumerate(MX_ACTS):
            for ti, tokens in enumerate((1, 5, 8)):
                n = ki + ai + ti
                routing_kind = ROUTING_KINDS[n % len(ROUTING_KINDS)]
                out_dtype = torch.float16 if n % 2 else torch.bfloat16
                finalize = n % 3 != 2
                cases.append(pytest.param(kind, act, tokens, routing_kind, out_dtype, finalize,
                                          id=f"{kind}-{type(act).__name__}-T{tokens}-{routing_kind}-"
                                             f"{str(out_dtype)[6:]}-{'final' if finalize else 'raw'}"))
    return cases


@pytest.mark.parametrize("kind, act, tokens, routing_kind, out_dtype, finalize", _mx_matrix())
def test_mx_pairs_match_reference(kind, act, tokens, routing_kind, out_dtype, finalize):
    run_mx(kind, act, tokens, routing_kind, out_dtype, finalize=finalize, seed=tokens)


@pytest.mark.parametrize("kind", MX_KINDS)
def test_mx_raw_rows_with_scores(kind):
    """Raw rows [T, k, H] (FP16) and every slot's score bit for bit, into NaN-poisoned outputs."""
    _, weights = mx_layer(kind, True)
    tokens, hidden = 5, weights.hidden_size
    acts = mma_config().prepare_mxfp8_activations(mx_tokens(tokens, hidden, 8))
    routing = make_routing(random_ids(tokens, TOP_K, E, 9), "packed", 10)
    out, scores = nan_out((tokens, TOP_K, hidden), torch.float16), nan_out((tokens, TOP_K), torch.float32)
    result = low_latency_moe(mma_config(), acts, weights, routing, out_dtype=torch.float16, finalize=False, out=out,
                             return_scores=True, scores_out=scores)
    assert isinstance(result, RawOutput) and result.rows is out and result.scores is scores
    check_mx_call(mma_config(), weights, acts, routing, SwiGLU(), out, torch.float16, False, f"ll_mma {kind} raw",
                  engine=ENGINE)
    want = reference_mx_pair(acts, weights, routing, SwiGLU(), finalize=False)
    assert torch.equal(scores.cpu().view(torch.int32), want.scores.cpu().view(torch.int32)), "scores differ"


@pytest.mark.parametrize("routing_kind", ("packed", "fp32"))
@pytest.mark.parametrize("kind", MX_KINDS)
def test_mx_unrouted_slots_with_nan_scores(kind, routing_kind):
    """Ids outside [0, E) are unrouted: finalize ignores them and their NaN scores, raw rows are +0 there, the scores
    come back unchanged, a token without routed slots gives zeros."""
    _, weights = mx_layer(kind, True)
    tokens = 4
    ids = random_ids(tokens, TOP_K, E, 21)
    ids[0, 1], ids[2, 0], ids[3, 3] = -1, E, 1000
    ids[1, :] = -1
    nan_at = (ids < 0) | (ids >= E)
    w = torch.rand(ids.shape) + 0.05
    if routing_kind == "packed":
        packed = ids.to(torch.int32) * (1 << 16) + (w.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF)
        routing = Routing.packed(torch.where(nan_at, ids.to(torch.int32) * (1 << 16) + 0x7FC0, packed).to(DEV))
    else:
        routing = make_routing(ids, routing_kind, weights=torch.where(nan_at, torch.tensor(math.nan), w))
    acts = mma_config().prepare_mxfp8_activations(mx_tokens(tokens, weights.hidden_size, 5))
    out = nan_out((tokens, weights.hidden_size), torch.bfloat16)
    low_latency_moe(mma_config(), acts, weights, routing, out=out)
    torch.cuda.synchronize()
    assert not bool(out.isnan().any()), "a NaN score of an unrouted slot reached the output"
    assert bool((out[1] == 0).all()), "a token without routed slots must give zeros"
    check_mx_call(mma_config(), weights, acts, routing, SwiGLU(), out, torch.bfloat16, True,
                  f"ll_mma {kind} unrouted ({routing_kind})", engine=ENGINE)
    raw = nan_out((tokens, TOP_K, weights.hidden_size), torch.bfloat16)
    scores = low_latency_moe(mma_config(), acts, weights, routing, finalize=False, out=raw, return_scores=True).scores
    torch.cuda.synchronize()
    unrouted = nan_at.to(DEV)
    assert bool(scores[unrouted].isnan().all()) and bool(scores[~unrouted].isfinite().all())
    assert bool((raw[unrouted].view(torch.int16) == 0).all()), "raw rows of unrouted slots must be +0"
    check_mx_call(mma_config(), weights, acts, routing, SwiGLU(), raw, torch.bfloat16, False,
                  f"ll_mma {kind} unrouted raw", engine=ENGINE)


@pytest.mark.parametrize("act, tokens", [(SwiGLU(), 1), (SiLU(), 8)], ids=["SwiGLU-T1", "SiLU-T8"])
@pytest.mark.parametrize("kind", MX_KINDS)
def test_mx_agrees_with_the_cuda_core_engine(kind, act, tokens):
    """The same call on the CUDA-core engine: the MXFP8 intermediates agree (a code may flip where a value lies within
    FP32 ulps of a rounding boundary: at most 1%), and where they are equal the outputs agree within the reference
    bounds (the same rounding points, FP32 sums in another order)."""
    got = run_mx(kind, act, tokens, "packed", seed=40 + tokens)
    _, weights = mx_layer(kind, act.gated, E, (MX_HIDDEN, MX_INTER))  # run_mx's arguments: the same cached layer
    mine = {k: v.clone() for k, v in engine_workspace(mma_config(), weights, TOP_K, ENGINE).items()}
    acts = mma_config().prepare_mxfp8_activations(mx_tokens(tokens, weights.hidden_size, 41 + tokens))
    routing = make_routing(random_ids(tokens, TOP_K, E, 42 + tokens), "packed", 43 + tokens)
    cc_config = LowLatencyMoeConfig(8, engine="cuda_cores")
    cuda_cores = low_latency_moe(cc_config, acts, weights, routing, activation=act, out=nan_out(got.shape, got.dtype))
    torch.cuda.synchronize()
    theirs = engine_workspace(cc_config, weights, TOP_K, "cuda_cores")
    slots = tokens * TOP_K
    flips = mine["inter_codes"][:slots] != theirs["inter_codes"][:slots]
    assert float(flips.double().mean()) <= 0.01, f"{int(flips.sum())} intermediate codes differ between the engines"
    if not bool(flips.any()) and torch.equal(mine["inter_scales"][:slots], theirs["inter_scales"][:slots]):
        assert_close_to_reference(got, cuda_cores, f"ll_mma vs cuda_cores {kind} {type(act).__name__} T={tokens}")


@pytest.mark.parametrize("split", (1, 2, 4, 8))
@pytest.mark.parametrize("kind", MX_KINDS)
def test_mx_every_k_split(kind, split, monkeypatch):
    """Forced K splits (GEMM1's raised to keep a CTA at one 32-feature block) on a 5-unit H and Ip = 256 (I = 160)."""
    monkeypatch.setattr(mma_kernels, "choose_split", lambda units: split)
    monkeypatch.setattr(cc_engine, "_sm_count", lambda index: 1)
    for tokens, finalize in ((3, True), (8, False)):
        run_mx(kind, SwiGLU(alpha=1.702, beta=1.0, limit=7.0), tokens, "packed", finalize=finalize, seed=60 + split,
               shape=(640, 160))


@pytest.mark.parametrize("shape", [(2048, 768), (7168, 256)], ids=["qwen3-rows", "deepseek-h"])
@pytest.mark.parametrize("kind", MX_KINDS)
def test_mx_model_row_lengths(kind, shape):
    """Qwen3-30B-A3B's rows (H = 2048: split 8, two GEMM1 rounds; Ip = 768: GEMM2 split 2) and H = 7168 (56 units)."""
    run_mx(kind, SwiGLU(), 5, "packed", seed=6, experts=4, shape=shape, top_k=2)


@pytest.mark.parametrize("finalize", (True, False))
@pytest.mark.parametrize("kind", MX_KINDS)
def test_mx_cuda_graph_replay_equals_eager(kind, finalize):
    """The token quantization and the ll_mma call captured in one CUDA graph, replayed after the BF16 tokens and the
    routing change in place, equal an eager call on the new tokens bit for bit (and the reference)."""
    _, weights = mx_layer(kind, True)
    hidden, tokens = weights.hidden_size, 6
    x = mx_tokens(tokens, hidden, 1)
    routing = make_routing(random_ids(tokens, TOP_K, E, 1), "packed")
    shape = (tokens, hidden) if finalize else (tokens, TOP_K, hidden)

    def call(out: torch.Tensor, scores: torch.Tensor):
        acts = mma_config().prepare_mxfp8_activations(x)
        run_low_latency(mma_config(), acts, weights, routing, out, scores, finalize, out_dtype=torch.float16)
        return acts

    def change_inputs() -> None:
        x.copy_(mx_tokens(tokens, hidden, 2))
        routing.packed_tensor.copy_(make_routing(random_ids(tokens, TOP_K, E, 2), "packed").packed_tensor)

    replayed = replay_equals_eager(call, shape, TOP_K, torch.float16, finalize, change_inputs)
    check_mx_call(mma_config(), weights, replayed.eager, routing, SwiGLU(), replayed.out, torch.float16, finalize,
                  f"ll_mma {kind} eager after the replay", engine=ENGINE)
