"""GPU tests of the low-latency per-tensor FP8 format (contract 004): ``low_latency_moe`` with E4M3 tokens and
weights and static calibration scales against ``reference_fp8_per_tensor``, the ten activations, T = 1..8, the
four routing forms, raw rows with their scores, duplicate and shared experts, model-size rows, and CUDA-graph
capture of the tokens' quantization and the call together. BF16 output only (the contract's per-tensor FP8
produces BF16 expert and final outputs; FP16 is refused, see the CPU tests). Every output is pre-filled with
NaN, so a missing write never passes.

How the results are compared. The kernels round where the reference does (BF16 preactivation, E4M3
intermediate, BF16 rows, the ordered FP32 combine); only the order of the FP32 sums inside each GEMM and the
FP32 activation formulas differ. A value within a few FP32 ulps of a rounding boundary may round the other
way: for a BF16 rounding that is one BF16 ulp (the other formats' tests allow for it), but an E4M3 flip of one
intermediate value moves it by 2^-3 and its row by about 2^-6, more than any BF16-level bound. So every call is
checked in two parts (tests.support.low_latency_fp8.check_fp8_per_tensor_call): (1) the GPU's intermediate (read from the call's workspace, where it stays after the
call) equals ``fp8_per_tensor_intermediate`` except for at most 0.5% of the values, each of them at most one
E4M3 step away (the rare flip), and its padding features are +0; (2) the rows and outputs match
``reference_fp8_per_tensor`` run on the GPU's own intermediate, within tests.support.low_latency's bounds for
the other formats (2 BF16 ulps + 2^-9 of max |reference|, relative L2 <= 2^-8, most elements bitwise equal).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from cudnn_moe.activations import Activation, GeGLU, SwiGLU
from cudnn_moe.low_latency import RawOutput, low_latency_moe, reference_fp8_per_tensor
from tests.support.low_latency import (
    ACTIVATIONS, E, ROUTING_KINDS, TOP_K, make_routing, nan_out, random_ids, replay_equals_eager, run_low_latency,
    shared_expert_ids,
)
from tests.support.low_latency_fp8 import (
    check_fp8_per_tensor_call,
    fp8_per_tensor_layer,
    tokens_bf16,
)

pytestmark = pytest.mark.gpu

layer = fp8_per_tensor_layer
check_call = check_fp8_per_tensor_call  # on the default (CUDA-core) engine's workspace


def run(act: Activation, tokens: int, kind: str, *, finalize: bool = True, seed: int = 0, ids=None) -> None:
    config, weights = layer(act.gated)
    acts = config.prepare_fp8_per_tensor_activations(tokens_bf16(tokens, weights.hidden_size, seed + 1), weights)
    ids = random_ids(tokens, TOP_K, E, seed + 2) if ids is None else ids
    routing = make_routing(ids, kind, seed + 3)
    shape = (tokens, weights.hidden_size) if finalize else (tokens, ids.shape[1], weights.hidden_size)
    out = nan_out(shape, torch.bfloat16)
    result = low_latency_moe(config, acts, weights, routing, activation=act, finalize=finalize, out=out)
    assert result is out
    check_call(config, weights, acts, routing, act, out, finalize,
               f"fp8 per-tensor {type(act).__name__} T={tokens} {kind} finalize={finalize}")


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
    run(act, tokens, kind, seed=tokens)


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
    check_call(config, weights, acts, routing, GeGLU(), out, False, f"raw rows {kind}")
    want = reference_fp8_per_tensor(acts, weights, routing, GeGLU(), finalize=False)
    assert torch.equal(scores.cpu().view(torch.int32), want.scores.cpu().view(torch.int32)), f"scores differ ({kind})"


def test_duplicate_and_shared_experts():
    """Every token names expert 5 (8 tokens on one expert: two passes of 4), one token names an expert twice."""
    ids = shared_expert_ids()
    for finalize in (True, False):
        run(SwiGLU(), 8, "fp32", finalize=finalize, seed=3, ids=ids)


@pytest.mark.parametrize("shape", [(2048, 768), (7168, 256)], ids=["qwen3-rows", "deepseek-h"])
def test_model_row_lengths(shape):
    """Rows of model size: 2048 bytes (32 lanes a row) and GEMM2 768 (16 lanes); 7168 bytes (448 chunks)."""
    config, weights = layer(True, experts=4, shape=shape, seed=6)
    tokens = 5
    acts = config.prepare_fp8_per_tensor_activations(tokens_bf16(tokens, shape[0], 12), weights)
    routing = make_routing(random_ids(tokens, 2, 4, 13), "packed")
    out = nan_out((tokens, shape[0]), torch.bfloat16)
    low_latency_moe(config, acts, weights, routing, out=out)
    check_call(config, weights, acts, routing, SwiGLU(), out, True, f"H={shape[0]} I={shape[1]}")


@pytest.mark.parametrize("finalize", (True, False))
def test_cuda_graph_replay_equals_eager(finalize):
    """The tokens' quantization and the call captured in one CUDA graph, replayed after the BF16 tokens and the
    routing change in place, equal an eager quantization + call on the new tokens bit for bit."""
    config, weights = layer(True)
    hidden, tokens = weights.hidden_size, 6
    x = tokens_bf16(tokens, hidden, 1)
    routing = make_routing(random_ids(tokens, TOP_K, E, 1), "packed")
    shape = (tokens, hidden) if finalize else (tokens, TOP_K, hidden)

    def call(out: torch.Tensor, scores: torch.Tensor) -> Any:
        acts = config.prepare_fp8_per_tensor_activations(x, weights)
        run_low_latency(config, acts, weights, routing, out, scores, finalize)
        return acts

    def change_inputs() -> None:
        x.copy_(tokens_bf16(tokens, hidden, 2))
        routing.packed_tensor.copy_(make_routing(random_ids(tokens, TOP_K, E, 2), "packed").packed_tensor)

    replayed = replay_equals_eager(call, shape, TOP_K, torch.bfloat16, finalize, change_inputs)
    assert torch.equal(replayed.captured.codes.view(torch.uint8), replayed.eager.codes.view(torch.uint8)), \
        "replayed token codes"
    check_call(config, weights, replayed.eager, routing, SwiGLU(), replayed.out, finalize, "eager after the replay")


def test_static_scales_stay_live():
    """The kernels read the factors and the intermediate multiplier from device memory at every call: doubling
    fc2_factor in place doubles the output exactly (a power of two), with no new preparation."""
    config, weights = layer(True, seed=9)
    acts = config.prepare_fp8_per_tensor_activations(tokens_bf16(3, weights.hidden_size, 14), weights)
    routing = make_routing(random_ids(3, TOP_K, E, 15), "fp32")
    first = low_latency_moe(config, acts, weights, routing, finalize=False)
    check_call(config, weights, acts, routing, SwiGLU(), first, False, "before the change")
    weights.fc2_factor.mul_(2)
    try:
        second = low_latency_moe(config, acts, weights, routing, finalize=False)
        torch.cuda.synchronize()
    finally:
        weights.fc2_factor.div_(2)
    assert torch.equal(second.float(), 2 * first.float())
