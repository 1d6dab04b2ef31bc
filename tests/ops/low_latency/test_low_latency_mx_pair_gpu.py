"""GPU tests of the low-latency MX pairs (contract 004): ``low_latency_moe`` with MXFP4 or MXFP8 weights and MXFP8
tokens (``prepare_weights`` / ``prepare_mxfp8_activations``) against ``reference_mx_pair``: both weight kinds x the
ten activations (gated and non-gated) over sampled T = 1..8, the four routing forms and BF16 / FP16 output; raw
rows with their scores; unrouted slots (ids outside [0, E)) with NaN / Inf scores; duplicate and shared experts;
top-k 32 (256 slots); model-size rows (8, 16 and 32 lanes a row, 1, 2 and 4 GEMM1 rounds); CUDA-graph capture of
the token quantization and the call. Every output is pre-filled with NaN, so a missing write never passes.

Written without a GPU in reach: not run yet when committed. Run with
    python -m pytest -q tests/ops/low_latency/test_low_latency_mx_pair_gpu.py

How the results are compared. GEMM1 writes the MXFP8 intermediate (codes and E8M0 scales) into the CUDA-core
engine's workspace of the weights, which the tests read after the call:
(1) the intermediate against the reference's step 2 (``mx_pair_intermediate``). The GPU sums GEMM1 in FP32 in its
    own order and evaluates the activation in FP32 (the reference: an exact sum rounded once, the activation in
    float64 rounded to FP32), so a BF16 preactivation or an E4M3 code can land one step away where a value lies
    within FP32 ulps of a rounding boundary, and a block's scale one binade away where its amax lies that close
    to a power of two. So: at most 1% of the codes and 1% of the block scales differ, scales by at most one
    byte, and every dequantized value is within one E4M3 step of the coarser of the two scales (2^-3 |v| + the
    subnormal step 2^-9 * scale) plus a BF16 flip propagated through the activation (2^-7 |v|); padding features
    (I .. Ip) hold zero codes and zero scale bytes;
(2) the rows and outputs against ``reference_mx_pair`` run on the GPU's own intermediate, within
    tests.support.low_latency's bounds (the same products summed in FP32 in another order, so a row or output
    can differ only where it lies within FP32 ulps of a 16-bit rounding boundary: 2 ulps relative plus 2^-9 of
    the largest |reference| absolute, relative L2 below 2^-8, most elements bitwise equal).
"""

from __future__ import annotations

import math

import pytest
import torch

from cudnn_moe.activations import Activation, SwiGLU
from cudnn_moe.low_latency import Mxfp8Activations, RawOutput, low_latency_moe, reference_mx_pair
from cudnn_moe.routing import Routing
from tests.support.low_latency import (
    ACTIVATIONS, DEV, E, ROUTING_KINDS, TOP_K, make_routing, nan_out, random_ids, replay_equals_eager, run_low_latency,
    shared_expert_ids,
)
from tests.support.low_latency_mx import HIDDEN, INTER, KINDS, OUT_DTYPES, check_call, layer, tokens_bf16

pytestmark = pytest.mark.gpu


def run(kind: str, act: Activation, tokens: int, routing_kind: str, out_dtype: torch.dtype, *, finalize: bool = True,
        seed: int = 0, ids=None, experts: int = E, shape: tuple[int, int] = (HIDDEN, INTER), top_k: int = TOP_K):
    config, weights = layer(kind, act.gated, experts, shape)
    acts = config.prepare_mxfp8_activations(tokens_bf16(tokens, weights.hidden_size, seed + 1))
    ids = random_ids(tokens, top_k, experts, seed + 2) if ids is None else ids
    routing = make_routing(ids, routing_kind, seed + 3)
    out_shape = (tokens, weights.hidden_size) if finalize else (tokens, ids.shape[1], weights.hidden_size)
    out = nan_out(out_shape, out_dtype)
    result = low_latency_moe(config, acts, weights, routing, activation=act, out_dtype=out_dtype, finalize=finalize,
                             out=out)
    assert result is out
    check_call(config, weights, acts, routing, act, out, out_dtype, finalize,
               f"{kind} {type(act).__name__} T={tokens} {routing_kind} {out_dtype} finalize={finalize}")


def _matrix() -> list:
    """Both kinds x the ten activations, each at two token counts (together T = 1..8 for every kind), the routing
    forms and output dtypes in turn, every fourth case raw rows."""
    cases = []
    for ki, kind in enumerate(KINDS):
        for ai, act in enumerate(ACTIVATIONS):
            for rep in range(2):
                tokens = 1 + (ai + 4 * rep + ki) % 8
                routing_kind = ROUTING_KINDS[(ai + rep + 2 * ki) % len(ROUTING_KINDS)]
                out_dtype = OUT_DTYPES[(ai + rep + ki) % 2]
                finalize = (ai + 2 * rep + ki) % 4 != 3
                cases.append(pytest.param(kind, act, tokens, routing_kind, out_dtype, finalize,
                                          id=f"{kind}-{type(act).__name__}-T{tokens}-{routing_kind}-"
                                             f"{str(out_dtype).removeprefix('torch.')}-{'final' if finalize else 'raw'}"))
    return cases


@pytest.mark.parametrize("kind, act, tokens, routing_kind, out_dtype, finalize", _matrix())
def test_matches_reference(kind, act, tokens, routing_kind, out_dtype, finalize):
    run(kind, act, tokens, routing_kind, out_dtype, finalize=finalize, seed=tokens)


@pytest.mark.parametrize("routing_kind", ("packed", "fp32"))
@pytest.mark.parametrize("kind", KINDS)
def test_raw_rows_with_scores(kind, routing_kind):
    """Raw rows [T, k, H] and every slot's score (packed: its BF16 value) bit for bit, into NaN-poisoned outputs."""
    config, weights = layer(kind, True)
    tokens, hidden = 5, weights.hidden_size
    acts = config.prepare_mxfp8_activations(tokens_bf16(tokens, hidden, 8))
    routing = make_routing(random_ids(tokens, TOP_K, E, 9), routing_kind, 10)
    out, scores = nan_out((tokens, TOP_K, hidden), torch.float16), nan_out((tokens, TOP_K), torch.float32)
    result = low_latency_moe(config, acts, weights, routing, out_dtype=torch.float16, finalize=False, out=out,
                             return_scores=True, scores_out=scores)
    assert isinstance(result, RawOutput) and result.rows is out and result.scores is scores
    check_call(config, weights, acts, routing, SwiGLU(), out, torch.float16, False, f"{kind} raw rows {routing_kind}")
    want = reference_mx_pair(acts, weights, routing, SwiGLU(), finalize=False)
    assert torch.equal(scores.cpu().view(torch.int32), want.scores.cpu().view(torch.int32)), f"scores differ ({routing_kind})"


@pytest.mark.parametrize("routing_kind", ("packed", "fp32", "int64"))
@pytest.mark.parametrize("kind", KINDS)
def test_unrouted_slots_with_nan_scores(kind, routing_kind):
    """Ids outside [0, E) (negative, E, far beyond; int64 beyond int32) are unrouted: finalize ignores them and their
    NaN / Inf scores, raw rows are +0 there and the scores come back unchanged; a token with no routed slot gives
    zeros."""
    config, weights = layer(kind, True)
    tokens = 4
    ids = random_ids(tokens, TOP_K, E, 21)
    bad = {"packed": (-1, E, 32767), "fp32": (-1, E, 1000), "int64": (-(2**40), E, 2**40)}[routing_kind]
    ids[0, 1], ids[2, 0], ids[3, 3] = bad
    ids[1, :] = -1
    nan_at = (ids < 0) | (ids >= E)
    w = torch.rand(ids.shape) + 0.05
    if routing_kind == "packed":  # packed by hand: BF16 NaN scores at the unrouted slots
        packed = ids.to(torch.int32) * (1 << 16) + (w.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF)
        routing = Routing.packed(torch.where(nan_at, ids.to(torch.int32) * (1 << 16) + 0x7FC0, packed).to(DEV))
    else:
        w = torch.where(nan_at, torch.tensor(math.nan), w)
        w[3, 3] = math.inf  # slot (3, 3) is unrouted too
        routing = make_routing(ids, routing_kind, weights=w)
    acts = config.prepare_mxfp8_activations(tokens_bf16(tokens, weights.hidden_size, 5))
    out = nan_out((tokens, weights.hidden_size), torch.bfloat16)
    low_latency_moe(config, acts, weights, routing, out=out)
    torch.cuda.synchronize()
    assert not bool(out.isnan().any()), "a NaN score of an unrouted slot reached the output"
    assert bool((out[1] == 0).all()), "a token without routed slots must give zeros"
    if routing_kind != "int64":  # the reference reads int64 ids only inside the int32 range
        check_call(config, weights, acts, routing, SwiGLU(), out, torch.bfloat16, True, f"{kind} unrouted ({routing_kind})")
    raw = nan_out((tokens, TOP_K, weights.hidden_size), torch.bfloat16)
    scores = low_latency_moe(config, acts, weights, routing, finalize=False, out=raw, return_scores=True).scores
    torch.cuda.synchronize()
    unrouted = nan_at.to(DEV)
    assert bool((~scores[unrouted].isfinite()).all()), "unrouted slots' NaN / Inf scores must come back unchanged"
    assert bool(scores[~unrouted].isfinite().all())
    assert bool((raw[unrouted].view(torch.int16) == 0).all()), "raw rows of unrouted slots must be +0"
    assert not bool(raw.isnan().any()), "raw rows left unwritten"
    if routing_kind != "int64":
        check_call(config, weights, acts, routing, SwiGLU(), raw, torch.bfloat16, False, f"{kind} unrouted raw")


@pytest.mark.parametrize("kind", KINDS)
def test_duplicate_and_shared_experts(kind):
    """Every token names expert 5 (8 tokens on one expert: two passes of 4), one token names an expert twice."""
    for finalize in (True, False):
        run(kind, SwiGLU(), 8, "fp32", torch.bfloat16, finalize=finalize, seed=3, ids=shared_expert_ids())


def test_top_k_32_and_256_slots():
    """The widest routing: 8 tokens x top-32 over 64 experts (256 slots, the plan's limit)."""
    run("mxfp4", SwiGLU(), 8, "bf16", torch.bfloat16, seed=4, experts=64, top_k=32)


@pytest.mark.parametrize("shape", [(512, 64), (1024, 160), (2048, 768), (7168, 256)],
                         ids=["h512", "h1024-i160", "qwen3-rows", "deepseek-h"])
@pytest.mark.parametrize("kind", KINDS)
def test_model_row_lengths(kind, shape):
    """Rows of 8, 16 and 32 lanes (GEMM1 in 1, 2 and 4 rounds of a 32-feature block per CTA): H = 512 (MXFP8: 16
    lanes), 1024 (I = 160 padded to 256), Qwen3-30B-A3B's 2048 x 768 and H = 7168 (32 lanes). On SM90 the MXFP4 pair
    is stored as tiles: a row pair of 16 lanes at H = 512 (one round of two features a group), 32 lanes from H = 1024
    (two rounds)."""
    run(kind, SwiGLU(), 5, "packed", torch.bfloat16, seed=6, experts=4, shape=shape, top_k=2)


@pytest.mark.parametrize("finalize", (True, False))
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_graph_replay_equals_eager(kind, finalize):
    """The token quantization (prepare_mxfp8_activations) and the call captured in one CUDA graph, replayed after
    the BF16 tokens and the routing change in place, equal an eager call on the new tokens bit for bit."""
    config, weights = layer(kind, True)
    hidden, tokens = weights.hidden_size, 6
    x = tokens_bf16(tokens, hidden, 1)
    routing = make_routing(random_ids(tokens, TOP_K, E, 1), "packed")
    shape = (tokens, hidden) if finalize else (tokens, TOP_K, hidden)

    def call(out: torch.Tensor, scores: torch.Tensor) -> Mxfp8Activations:
        acts = config.prepare_mxfp8_activations(x)
        run_low_latency(config, acts, weights, routing, out, scores, finalize, out_dtype=torch.float16)
        return acts

    def change_inputs() -> None:
        x.copy_(tokens_bf16(tokens, hidden, 2))
        routing.packed_tensor.copy_(make_routing(random_ids(tokens, TOP_K, E, 2), "packed").packed_tensor)

    replayed = replay_equals_eager(call, shape, TOP_K, torch.float16, finalize, change_inputs)
    check_call(config, weights, replayed.eager, routing, SwiGLU(), replayed.out, torch.float16, finalize,
               f"{kind} eager after the replay")
