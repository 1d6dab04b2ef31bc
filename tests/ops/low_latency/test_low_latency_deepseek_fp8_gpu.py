"""GPU tests of the low-latency DeepSeek FP8 format (contract 004): ``low_latency_moe`` with E4M3 weights and FP32
128 x 128 block scales against ``reference_deepseek_fp8``: the ten activations and default SwiGLU over T = 1..8
and the four routing forms, BF16 and prequantized tokens, raw rows with their scores, duplicate and shared
experts, model-size rows, the token scales read live, and CUDA-graph capture. BF16 output only (FP16 is
refused, see the CPU tests). Every output is pre-filled with NaN, so a missing write never passes.

Written without a GPU in reach: not run yet when committed.

How the results are compared (tests.support.low_latency_fp8.check_deepseek_fp8_call). The call's steps leave their
results in the CUDA-core engine's workspace of the weights, which the tests read after the call:
(0) BF16 tokens: the token codes and scales equal ``quantize_fp8_act128`` of the tokens bit for bit;
(1) the FP32 activation (``inter``) matches the reference's step 2 activation within FP32 summation-order
    error (the kernels sum in FP32 in another order and evaluate the activation in FP32);
(2) the intermediate codes and scales equal ``quantize_fp8_act128`` of the GPU's own FP32 activation bit for
    bit (ll_quant128 is exact), and differ from the reference's step 2 codes at no more than 0.5% of the values,
    each at most one E4M3 step (a value within FP32 ulps of a rounding boundary, or a block's amax an ulp apart);
(3) the rows and outputs match ``reference_deepseek_fp8`` run on the GPU's own intermediate codes and scales,
    within tests.support.low_latency's bounds for the other formats.
"""

from __future__ import annotations

import math

import pytest
import torch

from cudnn_moe.activations import Activation, SwiGLU
from cudnn_moe.formats.fp8 import quantize_fp8_act128
from cudnn_moe.low_latency import RawOutput, low_latency_moe, reference_deepseek_fp8
from tests.support.low_latency import (
    ACTIVATIONS, E, ROUTING_KINDS, TOP_K, make_routing, nan_out, random_ids, replay_equals_eager, run_low_latency,
    shared_expert_ids,
)
from tests.support.low_latency_fp8 import (
    check_deepseek_fp8_call,
    deepseek_fp8_layer,
    scaled_tokens_bf16,
)

pytestmark = pytest.mark.gpu

layer = deepseek_fp8_layer
tokens_bf16 = scaled_tokens_bf16
check_call = check_deepseek_fp8_call  # on the default (CUDA-core) engine's workspace


def run(act: Activation, tokens: int, kind: str, *, finalize: bool = True, seed: int = 0, ids=None,
        prequantized: bool = False) -> None:
    config, weights = layer(act.gated)
    x = tokens_bf16(tokens, weights.hidden_size, seed + 1)
    inputs = config.prepare_deepseek_fp8_activations(*quantize_fp8_act128(x), weights) if prequantized else x
    ids = random_ids(tokens, TOP_K, E, seed + 2) if ids is None else ids
    routing = make_routing(ids, kind, seed + 3)
    shape = (tokens, weights.hidden_size) if finalize else (tokens, ids.shape[1], weights.hidden_size)
    out = nan_out(shape, torch.bfloat16)
    result = low_latency_moe(config, inputs, weights, routing, activation=act, finalize=finalize, out=out)
    assert result is out
    check_call(config, weights, inputs, routing, act, out, finalize,
               f"deepseek fp8 {type(act).__name__} T={tokens} {kind} finalize={finalize} prequantized={prequantized}")


def _matrix() -> list:
    cases = []
    for ai, act in enumerate(ACTIVATIONS):
        for tokens in range(1, 9):
            kind = ROUTING_KINDS[(ai + tokens) % len(ROUTING_KINDS)]
            cases.append(pytest.param(act, tokens, kind, id=f"{type(act).__name__}-T{tokens}-{kind}"))
    for tokens in range(1, 9):
        kind = ROUTING_KINDS[tokens % len(ROUTING_KINDS)]
        cases.append(pytest.param(SwiGLU(), tokens, kind, id=f"SwiGLU-default-T{tokens}-{kind}"))
    return cases


@pytest.mark.parametrize("act, tokens, kind", _matrix())
def test_matches_reference(act, tokens, kind):
    run(act, tokens, kind, seed=tokens)


@pytest.mark.parametrize("tokens", (1, 4, 8))
def test_prequantized_tokens(tokens):
    run(SwiGLU(), tokens, "packed", seed=20 + tokens, prequantized=True)


def test_prequantized_equals_bf16_tokens_bitwise():
    """Tokens quantized on the host with quantize_fp8_act128 give the BF16 call's output bit for bit."""
    config, weights = layer(True)
    x = tokens_bf16(6, weights.hidden_size, 30)
    routing = make_routing(random_ids(6, TOP_K, E, 31), "fp32")
    a = low_latency_moe(config, x, weights, routing, out=nan_out((6, weights.hidden_size), torch.bfloat16))
    acts = config.prepare_deepseek_fp8_activations(*quantize_fp8_act128(x), weights)
    b = low_latency_moe(config, acts, weights, routing, out=nan_out((6, weights.hidden_size), torch.bfloat16))
    torch.cuda.synchronize()
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_token_scales_are_used_as_given():
    """Prequantized scales that are not amax / 448 (each block's doubled, one halved) are used as they are."""
    config, weights = layer(True, seed=3)
    codes, scales = quantize_fp8_act128(tokens_bf16(3, weights.hidden_size, 40))
    scales = scales * 2
    scales[1, 0] /= 4
    acts = config.prepare_deepseek_fp8_activations(codes, scales.contiguous(), weights)
    routing = make_routing(random_ids(3, TOP_K, E, 41), "bf16")
    out = nan_out((3, weights.hidden_size), torch.bfloat16)
    low_latency_moe(config, acts, weights, routing, out=out)
    check_call(config, weights, acts, routing, SwiGLU(), out, True, "scales as given")


@pytest.mark.parametrize("kind", ("packed", "fp32"))
def test_raw_rows_with_scores(kind):
    """Raw rows [T, k, H] and every slot's score (packed: its BF16 value) bit for bit, into NaN-poisoned outputs."""
    config, weights = layer(True)
    tokens, hidden = 5, weights.hidden_size
    x = tokens_bf16(tokens, hidden, 8)
    routing = make_routing(random_ids(tokens, TOP_K, E, 9), kind, 10)
    out, scores = nan_out((tokens, TOP_K, hidden), torch.bfloat16), nan_out((tokens, TOP_K), torch.float32)
    result = low_latency_moe(config, x, weights, routing, activation=SwiGLU(), finalize=False, out=out,
                             return_scores=True, scores_out=scores)
    assert isinstance(result, RawOutput) and result.rows is out and result.scores is scores
    check_call(config, weights, x, routing, SwiGLU(), out, False, f"raw rows {kind}")
    want = reference_deepseek_fp8(x, weights, routing, SwiGLU(), finalize=False)
    assert torch.equal(scores.cpu().view(torch.int32), want.scores.cpu().view(torch.int32)), f"scores differ ({kind})"


def test_duplicate_and_shared_experts():
    """Every token names expert 5 (8 tokens on one expert: two passes of 4), one token names an expert twice."""
    ids = shared_expert_ids()
    for finalize in (True, False):
        run(SwiGLU(), 8, "fp32", finalize=finalize, seed=3, ids=ids)


@pytest.mark.parametrize("shape", [(2048, 768), (7168, 256), (7168, 2048)],
                         ids=["qwen3-rows", "deepseek-h", "deepseek-v3"])
def test_model_row_lengths(shape):
    """Rows of model size: H = 2048 (32 lanes a row) with GEMM2 rows of 768 (16 lanes), H = 7168 (448 chunks,
    56 scale blocks), and DeepSeek-V3's expert shape."""
    config, weights = layer(True, experts=4, shape=shape, seed=6)
    tokens = 5
    x = tokens_bf16(tokens, shape[0], 12)
    routing = make_routing(random_ids(tokens, 2, 4, 13), "packed")
    out = nan_out((tokens, shape[0]), torch.bfloat16)
    low_latency_moe(config, x, weights, routing, out=out)
    check_call(config, weights, x, routing, SwiGLU(), out, True, f"H={shape[0]} I={shape[1]}")


@pytest.mark.parametrize("finalize", (True, False))
def test_cuda_graph_replay_equals_eager(finalize):
    """The call (token quantization included) captured in one CUDA graph, replayed after the BF16 tokens and the
    routing change in place, equals an eager call on the new tokens bit for bit."""
    config, weights = layer(True)
    hidden, tokens = weights.hidden_size, 6
    x = tokens_bf16(tokens, hidden, 1)
    routing = make_routing(random_ids(tokens, TOP_K, E, 1), "packed")
    shape = (tokens, hidden) if finalize else (tokens, TOP_K, hidden)

    def change_inputs() -> None:
        x.copy_(tokens_bf16(tokens, hidden, 2))
        routing.packed_tensor.copy_(make_routing(random_ids(tokens, TOP_K, E, 2), "packed").packed_tensor)

    replayed = replay_equals_eager(lambda out, scores: run_low_latency(config, x, weights, routing, out, scores, finalize),
                                   shape, TOP_K, torch.bfloat16, finalize, change_inputs)
    check_call(config, weights, x, routing, SwiGLU(), replayed.out, finalize, "eager after the replay")


def test_cuda_graph_reads_prequantized_tokens_live():
    """A captured call on prequantized tokens reads their codes and scales at replay: doubling the scales in
    place doubles every block's factor, and the replay matches the reference on the new scales."""
    config, weights = layer(True, seed=4)
    hidden, tokens = weights.hidden_size, 4
    acts = config.prepare_deepseek_fp8_activations(*quantize_fp8_act128(tokens_bf16(tokens, hidden, 50)), weights)
    routing = make_routing(random_ids(tokens, TOP_K, E, 51), "fp32")
    out = nan_out((tokens, hidden), torch.bfloat16)
    low_latency_moe(config, acts, weights, routing, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        low_latency_moe(config, acts, weights, routing, out=out)
    acts.scales.mul_(2)
    out.fill_(math.nan)
    graph.replay()
    check_call(config, weights, acts, routing, SwiGLU(), out, True, "replay on doubled token scales")
