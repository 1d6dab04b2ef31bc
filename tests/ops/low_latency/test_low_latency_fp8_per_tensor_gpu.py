"""GPU tests of the low-latency per-tensor FP8 format (contract 004): ``low_latency_moe`` with E4M3 tokens and
weights and static calibration scales against ``reference_fp8_per_tensor``, the ten activations, T = 1..8, the
four routing forms, raw rows with their scores, duplicate and shared experts, model-size rows, and CUDA-graph
capture of the tokens' quantization and the call together. BF16 output only (the contract's per-tensor FP8
produces BF16 expert and final outputs; FP16 is refused, see the CPU tests). Every output is pre-filled with
NaN, so a missing write never passes.

Tolerance. The kernels round where the reference does (BF16 preactivation, E4M3 intermediate, BF16 rows, the
ordered FP32 combine); only the order of the FP32 sums inside each GEMM and the FP32 activation formulas differ.
As for the other formats (tests.support.low_latency), a value lying within a few FP32 ulps of a rounding
boundary can round the other way. For the BF16 roundings that moves an output by about one BF16 ulp; but when
the intermediate's E4M3 rounding flips (rare: the activation's FP32 value must sit within ~2^-20 of an E4M3
midpoint), one of I terms of a row moves by an E4M3 ulp (2^-3 of the term, about 2^-6 of the row). So: every
element within 2 BF16 ulps (relative) + 2^-9 of max |reference| except at most 2% of the elements, and those
within 2^-5 of max |reference|; relative L2 error <= 2^-7; at least half the elements bitwise equal.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

from cudnn_moe.activations import (
    GELU,
    Activation,
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
from cudnn_moe.low_latency import (
    LowLatencyMoeConfig,
    RawOutput,
    RawReference,
    low_latency_moe,
    reference_fp8_per_tensor,
)
from tests.support.low_latency import (
    DEV,
    ROUTING_KINDS,
    TOP_K,
    E,
    make_routing,
    nan_out,
    random_ids,
)

pytestmark = pytest.mark.gpu

ACTIVATIONS: tuple[Activation, ...] = (
    Identity(), ReLU(), GELU(), SiLU(), ReLU2(),
    SwiGLU(alpha=1.702, beta=1.0, limit=7.0), GeGLU(), GeGLUTanh(), SwiGLUStep(limit=2.0), SiTU(a=2.0, b=3.0),
)
HIDDEN, INTER = 256, 96  # I = 96 pads to 128
INPUT_SCALE = 4.0 / 448  # N(0, 1) tokens: |x| up to about 4
INTERMEDIATE_SCALE = 8.0 / 448


@functools.cache
def layer(gated: bool, experts: int = E, shape: tuple[int, int] = (HIDDEN, INTER), seed: int = 0):
    """(config, Fp8PerTensorWeights) quantized from random BF16 weights (preactivations near unit size)."""
    hidden, inter = shape
    gen = torch.Generator().manual_seed(seed)
    w1 = (torch.randn(experts, (2 if gated else 1) * inter, hidden, generator=gen) / hidden**0.5).bfloat16().to(DEV)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) / inter**0.5).bfloat16().to(DEV)
    config = LowLatencyMoeConfig(8)
    weights = config.prepare_fp8_per_tensor_weights(w1, w2, INPUT_SCALE, INTERMEDIATE_SCALE,
                                                    activation=SwiGLU() if gated else SiLU())
    return config, weights


def tokens_bf16(tokens: int, hidden: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, hidden, generator=gen).bfloat16().to(DEV)


def assert_close_fp8(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """The bounds of the module docstring (got and want BF16 of one shape)."""
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape, f"{what}: {got.dtype} {tuple(got.shape)}"
    assert not bool(want.isnan().any()), f"{what}: the reference has NaN (test inputs are wrong)"
    nan = got.isnan()
    assert not bool(nan.any()), f"{what}: {int(nan.sum())} of {got.numel()} outputs are NaN (not written, or NaN leaked)"
    g, w = got.double(), want.double()
    scale = float(w.abs().max())
    assert scale > 0, f"{what}: the reference is all zero, the test proves nothing"
    err = (g - w).abs()
    tight = 2 * 2.0**-8 * w.abs() + 2.0**-9 * scale
    outside = err > tight
    assert float(outside.double().mean()) <= 0.02, f"{what}: {int(outside.sum())} of {err.numel()} elements beyond the tight bound"
    worst = float(err.max())
    assert worst <= 2.0**-5 * scale, f"{what}: max |diff| {worst:.3g} > 2^-5 of max |ref| {scale:.3g}"
    rel_l2 = float((g - w).norm() / w.norm())
    assert rel_l2 <= 2.0**-7, f"{what}: relative L2 error {rel_l2:.3g} > 2^-7"
    equal = float((got.view(torch.int16) == want.view(torch.int16)).double().mean())
    assert equal >= 0.5, f"{what}: only {equal:.1%} of elements are bitwise equal to the reference"


def run(act: Activation, tokens: int, kind: str, *, finalize: bool = True, seed: int = 0, ids=None):
    config, weights = layer(act.gated)
    acts = config.prepare_fp8_per_tensor_activations(tokens_bf16(tokens, weights.hidden_size, seed + 1), weights)
    ids = random_ids(tokens, TOP_K, E, seed + 2) if ids is None else ids
    routing = make_routing(ids, kind, seed + 3)
    shape = (tokens, weights.hidden_size) if finalize else (tokens, ids.shape[1], weights.hidden_size)
    out = nan_out(shape, torch.bfloat16)
    result = low_latency_moe(config, acts, weights, routing, activation=act, finalize=finalize, out=out)
    assert result is out
    want = reference_fp8_per_tensor(acts, weights, routing, act, finalize=finalize)
    torch.cuda.synchronize()
    return out, want


def _matrix() -> list:
    cases = []
    for ai, act in enumerate(ACTIVATIONS):
        tokens = 1 + ai % 8
        kind = ROUTING_KINDS[ai % len(ROUTING_KINDS)]
        cases.append(pytest.param(act, tokens, kind, id=f"{type(act).__name__}-T{tokens}-{kind}"))
    for tokens in range(1, 9):
        kind = ROUTING_KINDS[tokens % len(ROUTING_KINDS)]
        cases.append(pytest.param(SwiGLU(), tokens, kind, id=f"SwiGLU-default-T{tokens}-{kind}"))
    return cases


@pytest.mark.parametrize("act, tokens, kind", _matrix())
def test_matches_reference(act, tokens, kind):
    got, want = run(act, tokens, kind, seed=tokens)
    assert_close_fp8(got, want, f"fp8 per-tensor {type(act).__name__} T={tokens} {kind}")


@pytest.mark.parametrize("kind", ("packed", "fp32"))
def test_raw_rows_with_scores(kind):
    """Raw rows [T, k, H] and every slot's score (packed: its BF16 value) bit for bit, into NaN-poisoned outputs."""
    config, weights = layer(True)
    tokens, hidden = 5, weights.hidden_size
    acts = config.prepare_fp8_per_tensor_activations(tokens_bf16(tokens, hidden, 8), weights)
    routing = make_routing(random_ids(tokens, TOP_K, E, 9), kind, 10)
    out, scores = nan_out((tokens, TOP_K, hidden), torch.bfloat16), nan_out((tokens, TOP_K), torch.float32)
    result = low_latency_moe(config, acts, weights, routing, activation=GeGLU(), finalize=False, out=out,
                             return_scores=True, scores_out=scores)
    assert isinstance(result, RawOutput) and result.rows is out and result.scores is scores
    want = reference_fp8_per_tensor(acts, weights, routing, GeGLU(), finalize=False)
    torch.cuda.synchronize()
    assert isinstance(want, RawReference)
    assert_close_fp8(out, want.rows, f"raw rows {kind}")
    assert torch.equal(scores.cpu().view(torch.int32), want.scores.cpu().view(torch.int32)), f"scores differ ({kind})"


def test_duplicate_and_shared_experts():
    """Every token names expert 5 (8 tokens on one expert: two passes of 4), one token names an expert twice."""
    ids = random_ids(8, TOP_K, E, 11)
    ids[:, 0] = 5
    ids[2, 1] = ids[2, 3] = 5 if ids[2, 2] != 5 else 6
    ids[4, 2] = ids[4, 3]
    for finalize in (True, False):
        got, want = run(SwiGLU(), 8, "fp32", finalize=finalize, seed=3, ids=ids)
        assert_close_fp8(got, want if finalize else want.rows, f"duplicates finalize={finalize}")


@pytest.mark.parametrize("shape", [(2048, 768), (7168, 256)], ids=["qwen3-rows", "deepseek-h"])
def test_model_row_lengths(shape):
    """Rows of model size: 2048 bytes (32 lanes a row) and GEMM2 768 (16 lanes); 7168 bytes (448 chunks)."""
    config, weights = layer(True, experts=4, shape=shape, seed=6)
    tokens = 5
    acts = config.prepare_fp8_per_tensor_activations(tokens_bf16(tokens, shape[0], 12), weights)
    routing = make_routing(random_ids(tokens, 2, 4, 13), "packed")
    out = nan_out((tokens, shape[0]), torch.bfloat16)
    low_latency_moe(config, acts, weights, routing, out=out)
    want = reference_fp8_per_tensor(acts, weights, routing, SwiGLU())
    assert_close_fp8(out, want, f"H={shape[0]} I={shape[1]}")


@pytest.mark.parametrize("finalize", (True, False))
def test_cuda_graph_replay_equals_eager(finalize):
    """The tokens' quantization and the call captured in one CUDA graph, replayed after the BF16 tokens and the
    routing change in place, equal an eager quantization + call on the new tokens bit for bit."""
    config, weights = layer(True)
    hidden, tokens = weights.hidden_size, 6
    x = tokens_bf16(tokens, hidden, 1)
    routing = make_routing(random_ids(tokens, TOP_K, E, 1), "packed")
    shape = (tokens, hidden) if finalize else (tokens, TOP_K, hidden)
    captured, captured_scores = nan_out(shape, torch.bfloat16), nan_out((tokens, TOP_K), torch.float32)
    held = {}

    def call(out: torch.Tensor, scores: torch.Tensor) -> None:
        held["acts"] = acts = config.prepare_fp8_per_tensor_activations(x, weights)
        if finalize:
            low_latency_moe(config, acts, weights, routing, out=out)
        else:
            low_latency_moe(config, acts, weights, routing, finalize=False, out=out, return_scores=True,
                            scores_out=scores)

    call(captured, captured_scores)  # warm-up: kernels and workspace
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call(captured, captured_scores)
    graph_acts = held["acts"]
    x.copy_(tokens_bf16(tokens, hidden, 2))
    routing.packed_tensor.copy_(make_routing(random_ids(tokens, TOP_K, E, 2), "packed").packed_tensor)
    captured.fill_(math.nan)
    captured_scores.fill_(math.nan)
    graph.replay()
    eager, eager_scores = nan_out(shape, torch.bfloat16), nan_out((tokens, TOP_K), torch.float32)
    call(eager, eager_scores)
    torch.cuda.synchronize()
    assert torch.equal(graph_acts.codes.view(torch.uint8), held["acts"].codes.view(torch.uint8)), "replayed token codes"
    assert not bool(captured.isnan().any()), "the replay left outputs unwritten"
    same = captured.view(torch.int16) == eager.view(torch.int16)
    assert bool(same.all()), f"replay differs from eager at {int((~same).sum())} of {same.numel()} elements"
    if not finalize:
        assert torch.equal(captured_scores.view(torch.int32), eager_scores.view(torch.int32))
    want = reference_fp8_per_tensor(held["acts"], weights, routing, SwiGLU(), finalize=finalize)
    assert_close_fp8(captured, want if finalize else want.rows, "graph replay")


def test_static_scales_stay_live():
    """The kernels read the factors and the intermediate multiplier from device memory at every call: doubling
    fc2_factor in place doubles the output exactly (a power of two), with no new preparation."""
    config, weights = layer(True, seed=9)
    acts = config.prepare_fp8_per_tensor_activations(tokens_bf16(3, weights.hidden_size, 14), weights)
    routing = make_routing(random_ids(3, TOP_K, E, 15), "fp32")
    first = low_latency_moe(config, acts, weights, routing, finalize=False)
    weights.fc2_factor.mul_(2)
    try:
        second = low_latency_moe(config, acts, weights, routing, finalize=False)
        torch.cuda.synchronize()
    finally:
        weights.fc2_factor.div_(2)
    assert torch.equal(second.float(), 2 * first.float())
