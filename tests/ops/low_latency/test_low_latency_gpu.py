"""GPU tests of the low-latency MoE call (contract 004): ``low_latency_moe`` against the float64 references of
cudnn_moe.low_latency.reference for every weight format, the ten activations, T = 1..8, packed and unpacked
routing, BF16 and FP16 outputs, raw rows (and their scores), unrouted slots with NaN scores (NVFP4 pair), duplicate experts,
CUDA-graph capture and replay, and bad inputs.

Every output is pre-filled with NaN before the call, so a missing write never passes; the checks then compare
real values (not only finiteness).

Tolerances: tests.support.low_latency.assert_close_to_reference (its module docstring gives the bounds and why).
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

from cudnn_moe.activations import (
    Activation,
    GeGLU,
    SiLU,
    SiTU,
    SwiGLU,
)
from cudnn_moe.weights.nvfp4 import Nvfp4Activations
from cudnn_moe.low_latency import (
    LowLatencyMoeConfig,
    RawOutput,
    RawReference,
    WeightFormat,
    low_latency_moe,
    reference_low_latency,
)
from cudnn_moe.routing import Routing
from tests.support.low_latency import (
    ACTIVATIONS, DEV, E, FORMAT_CASES, ROUTING_KINDS, SHAPES, TOP_K, assert_close_to_reference, make_inputs, make_layer,
    make_routing, nan_out, random_ids, replay_equals_eager, run_low_latency, shared_expert_ids,
)

pytestmark = pytest.mark.gpu



def _case_id(fmt: WeightFormat, x_dtype: torch.dtype) -> str:
    return f"{fmt.value}-{str(x_dtype).removeprefix('torch.')}"


# ----------------------------------------------------------------------------- layers and inputs
@functools.cache
def layer(fmt: WeightFormat, gated: bool):
    return make_layer(fmt, gated)


def run_and_check(fmt, x_dtype, act, tokens, kind, out_dtype, finalize=True, seed=0, ids=None, route_w=None):
    config, weights = layer(fmt, act.gated)
    hidden = weights.hidden_size
    inputs = make_inputs(config, fmt, x_dtype, tokens, hidden, seed=seed + 1)
    ids = random_ids(tokens, TOP_K, E, seed + 2) if ids is None else ids
    routing = make_routing(ids, kind, seed + 3, route_w)
    shape = (tokens, hidden) if finalize else (tokens, ids.shape[1], hidden)
    out = nan_out(shape, out_dtype)
    result = low_latency_moe(config, inputs, weights, routing, activation=act, out_dtype=out_dtype, finalize=finalize,
                             out=out)
    assert result is out
    want = reference_low_latency(inputs, weights, routing, act, out_dtype=out_dtype, finalize=finalize)
    torch.cuda.synchronize()
    return out, want


# ----------------------------------------------------------------------------- every format x activation x T
def _matrix() -> list:
    cases = []
    for fi, (fmt, x_dtype) in enumerate(FORMAT_CASES):
        for ai, act in enumerate(ACTIVATIONS):
            n = fi * len(ACTIVATIONS) + ai
            tokens = 1 + n % 8
            out_dtype = torch.bfloat16 if fmt is WeightFormat.NVFP4_W_NVFP4_A or n % 2 == 0 else torch.float16
            kind = ROUTING_KINDS[n % len(ROUTING_KINDS)]
            cases.append(pytest.param(fmt, x_dtype, act, tokens, kind, out_dtype,
                                      id=f"{_case_id(fmt, x_dtype)}-{type(act).__name__}-T{tokens}-{kind}"))
        for tokens in range(1, 9):
            out_dtype = torch.bfloat16 if fmt is WeightFormat.NVFP4_W_NVFP4_A or tokens % 2 else torch.float16
            kind = ROUTING_KINDS[(fi + tokens) % len(ROUTING_KINDS)]
            cases.append(pytest.param(fmt, x_dtype, SwiGLU(), tokens, kind, out_dtype,
                                      id=f"{_case_id(fmt, x_dtype)}-SwiGLU-default-T{tokens}-{kind}"))
    return cases


@pytest.mark.parametrize("fmt, x_dtype, act, tokens, kind, out_dtype", _matrix())
def test_matches_reference(fmt, x_dtype, act, tokens, kind, out_dtype):
    got, want = run_and_check(fmt, x_dtype, act, tokens, kind, out_dtype, seed=tokens)
    assert_close_to_reference(got, want, f"{fmt.value} x {x_dtype} {type(act).__name__} T={tokens} {kind} -> {out_dtype}")


@pytest.mark.parametrize("fmt", [WeightFormat.NVFP4_WEIGHT_ONLY, WeightFormat.NVFP4_W_NVFP4_A], ids=lambda f: f.value)
@pytest.mark.parametrize("tokens, act", [(1, SwiGLU()), (3, GeGLU()), (6, SiLU()), (8, SiTU(a=2.0, b=3.0))],
                         ids=["T1-SwiGLU", "T3-GeGLU", "T6-SiLU", "T8-SiTU"])
def test_cuda_core_kernels_where_the_tensor_core_path_is_dispatched(fmt, tokens, act, monkeypatch):
    """On SM90 the call sends finalized BF16 calls of the NVFP4 formats to the tensor-core path; the CUDA-core
    kernels (the path on every other arch) must still match the reference there."""
    monkeypatch.setattr(layer(fmt, act.gated)[0], "engine", "cuda_cores")  # the config's engine choice
    got, want = run_and_check(fmt, torch.bfloat16, act, tokens, "packed", torch.bfloat16, seed=tokens + 20)
    assert_close_to_reference(got, want, f"CUDA-core kernels {fmt.value} {type(act).__name__} T={tokens}")


@pytest.mark.parametrize("fmt, x_dtype", FORMAT_CASES, ids=[_case_id(*c) for c in FORMAT_CASES])
def test_raw_rows(fmt, x_dtype):
    out_dtype = torch.bfloat16 if fmt is WeightFormat.NVFP4_W_NVFP4_A else torch.float16
    got, want = run_and_check(fmt, x_dtype, GeGLU(), 3, "packed", out_dtype, finalize=False, seed=7)
    assert isinstance(want, RawReference)
    assert_close_to_reference(got, want.rows, f"raw rows {fmt.value} x {x_dtype}")


@pytest.mark.parametrize("fmt, x_dtype", FORMAT_CASES, ids=[_case_id(*c) for c in FORMAT_CASES])
@pytest.mark.parametrize("kind", ROUTING_KINDS)
def test_raw_rows_with_scores(fmt, x_dtype, kind):
    """return_scores=True: the rows as above, and every slot's score as given (packed: its BF16 value), bit for
    bit, written into a NaN-poisoned scores_out by the same call."""
    config, weights = layer(fmt, True)
    tokens, hidden = 5, weights.hidden_size
    inputs = make_inputs(config, fmt, x_dtype, tokens, hidden, seed=8)
    routing = make_routing(random_ids(tokens, TOP_K, E, 9), kind, 10)
    out, scores = nan_out((tokens, TOP_K, hidden), torch.bfloat16), nan_out((tokens, TOP_K), torch.float32)
    result = low_latency_moe(config, inputs, weights, routing, finalize=False, out=out, return_scores=True,
                             scores_out=scores)
    assert isinstance(result, RawOutput) and result.rows is out and result.scores is scores
    want = reference_low_latency(inputs, weights, routing, SwiGLU(), finalize=False)
    fresh = low_latency_moe(config, inputs, weights, routing, finalize=False, return_scores=True)
    torch.cuda.synchronize()
    assert_close_to_reference(out, want.rows, f"raw rows with scores {fmt.value} {kind}")
    assert torch.equal(scores.cpu().view(torch.int32), want.scores.cpu().view(torch.int32)), f"scores differ ({kind})"
    assert torch.equal(fresh.rows, out) and torch.equal(fresh.scores, scores)


@pytest.mark.parametrize("fmt, x_dtype", FORMAT_CASES, ids=[_case_id(*c) for c in FORMAT_CASES])
def test_duplicate_experts_and_shared_experts(fmt, x_dtype):
    """A token naming one expert twice, and all tokens naming one expert (8 tokens on one expert: the widest
    token loop), computed slot by slot as the reference does."""
    ids = shared_expert_ids()
    for finalize in (True, False):
        got, want = run_and_check(fmt, x_dtype, SwiGLU(), 8, "fp32", torch.bfloat16, finalize=finalize, seed=3, ids=ids)
        assert_close_to_reference(got, want if finalize else want.rows, f"duplicates {fmt.value} finalize={finalize}")


@pytest.mark.parametrize("path", ("dispatched", "cuda_core"))
@pytest.mark.parametrize("kind", ("packed", "fp32", "int64"))
def test_nvfp4_pair_unrouted_slots_with_nan_scores(kind, path, monkeypatch):
    """Ids outside [0, E) (negative, E, far beyond; int64 beyond int32) are unrouted: finalize ignores them and
    their NaN scores, raw rows are zero there. path: the call's own choice (on SM90 the tensor-core path for the
    finalized output), or the CUDA-core kernels forced."""
    fmt = WeightFormat.NVFP4_W_NVFP4_A
    config, weights = layer(fmt, True)
    if path == "cuda_core":
        monkeypatch.setattr(config, "engine", "cuda_cores")
    tokens = 4
    ids = random_ids(tokens, TOP_K, E, 21)
    bad = {"packed": (-1, E, 32767), "fp32": (-1, E, 1000), "int64": (-(2**40), E, 2**40)}[kind]
    ids[0, 1], ids[2, 0], ids[3, 3] = bad
    ids[1, :] = -1  # a token with no routed slot: finalize gives zeros
    nan_at = (ids < 0) | (ids >= E)
    if kind == "packed":
        w = torch.rand(ids.shape) + 0.05
        packed = (ids.to(torch.int32) * (1 << 16)) + (w.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF)
        packed = torch.where(nan_at, ids.to(torch.int32) * (1 << 16) + 0x7FC0, packed)  # BF16 NaN scores
        routing = Routing.packed(packed.to(DEV))
    else:
        w = torch.where(nan_at, torch.tensor(math.nan), torch.rand(ids.shape) + 0.05)
        routing = make_routing(ids, kind, weights=w)
    inputs = make_inputs(config, fmt, torch.bfloat16, tokens, weights.hidden_size, seed=5)
    out = nan_out((tokens, weights.hidden_size), torch.bfloat16)
    low_latency_moe(config, inputs, weights, routing, out=out)
    if kind != "int64":  # the reference reads int64 ids only inside the int32 range
        want = reference_low_latency(inputs, weights, routing, SwiGLU())
        assert_close_to_reference(out[[0, 2, 3]], want[[0, 2, 3]], f"pair with unrouted slots ({kind})")
    assert not bool(out.isnan().any()), "a NaN score of an unrouted slot reached the output"
    assert bool((out[1] == 0).all()), "a token without routed slots must give zeros"
    raw = nan_out((tokens, TOP_K, weights.hidden_size), torch.bfloat16)
    scores = low_latency_moe(config, inputs, weights, routing, finalize=False, out=raw, return_scores=True).scores
    torch.cuda.synchronize()
    assert bool(scores[nan_at.to(DEV)].isnan().all()), "unrouted slots' NaN scores must come back unchanged"
    assert not bool(scores[~nan_at.to(DEV)].isnan().any())
    unrouted = nan_at.to(DEV)
    assert bool((raw[unrouted].view(torch.int16) == 0).all()), "raw rows of unrouted slots must be +0"
    assert not bool(raw.isnan().any()), "raw rows left unwritten"
    if kind != "int64":
        ref = reference_low_latency(inputs, weights, routing, SwiGLU(), finalize=False)
        assert_close_to_reference(raw[~unrouted], ref.rows[~unrouted], f"pair raw rows ({kind})")


def test_top_k_32_and_256_slots():
    """The widest routing: 8 tokens x top-32 over 64 experts (256 slots, the plan's limit)."""
    config, weights = make_layer(WeightFormat.BF16, True, experts=64, seed=4)
    tokens, top_k = 8, 32
    ids = random_ids(tokens, top_k, 64, 9)
    routing = make_routing(ids, "bf16")
    x = make_inputs(config, WeightFormat.BF16, torch.bfloat16, tokens, weights.hidden_size)
    out = nan_out((tokens, weights.hidden_size), torch.bfloat16)
    low_latency_moe(config, x, weights, routing, out=out)
    want = reference_low_latency(x, weights, routing, SwiGLU())
    assert_close_to_reference(out, want, "top-32, 256 slots")


@pytest.mark.parametrize("fmt, shape", [
    (WeightFormat.NVFP4_WEIGHT_ONLY, (2048, 768)),   # Qwen3-30B-A3B rows: 64 chunks (32 lanes), GEMM2 24 chunks (8 lanes)
    (WeightFormat.MXFP4_WEIGHT_ONLY, (7168, 256)),   # DeepSeek-V3 H: 224 chunks, a partial last step
    (WeightFormat.BF16, (2048, 256)),
], ids=["nvfp4-qwen3-rows", "mxfp4-deepseek-h", "bf16-2048"])
def test_model_row_lengths(fmt, shape):
    config, weights = make_layer(fmt, True, experts=4, shape=shape, seed=6)
    tokens = 5
    ids = random_ids(tokens, 2, 4, 13)
    routing = make_routing(ids, "packed")
    x = make_inputs(config, fmt, torch.bfloat16, tokens, shape[0])
    out = nan_out((tokens, shape[0]), torch.bfloat16)
    low_latency_moe(config, x, weights, routing, out=out)
    want = reference_low_latency(x, weights, routing, SwiGLU())
    assert_close_to_reference(out, want, f"{fmt.value} H={shape[0]} I={shape[1]}")


# ----------------------------------------------------------------------------- CUDA graphs
GRAPH_CASES = [FORMAT_CASES[0], FORMAT_CASES[3], (WeightFormat.FP8_WEIGHT_ONLY, torch.bfloat16), FORMAT_CASES[-1]]


@pytest.mark.parametrize("fmt, x_dtype", GRAPH_CASES, ids=[_case_id(*c) for c in GRAPH_CASES])
@pytest.mark.parametrize("finalize", (True, False))
def test_cuda_graph_replay_equals_eager(fmt, x_dtype, finalize):
    """One call captured in a CUDA graph, replayed after the inputs and routing change in place, equals an eager
    call on the new inputs bit for bit."""
    config, weights = layer(fmt, True)
    hidden, tokens = weights.hidden_size, 6
    inputs = make_inputs(config, fmt, x_dtype, tokens, hidden, seed=1)
    ids = random_ids(tokens, TOP_K, E, 1)
    routing = make_routing(ids, "packed")
    shape = (tokens, hidden) if finalize else (tokens, TOP_K, hidden)

    def change_inputs() -> None:
        new_inputs = make_inputs(config, fmt, x_dtype, tokens, hidden, seed=2)
        if isinstance(inputs, Nvfp4Activations):
            inputs.packed.copy_(new_inputs.packed)
            inputs.scales.copy_(new_inputs.scales)
        else:
            inputs.copy_(new_inputs)
        routing.packed_tensor.copy_(make_routing(random_ids(tokens, TOP_K, E, 2), "packed").packed_tensor)

    replayed = replay_equals_eager(  # the raw rows with their scores when not finalize
        lambda out, scores: run_low_latency(config, inputs, weights, routing, out, scores, finalize),
        shape, TOP_K, torch.bfloat16, finalize, change_inputs)
    want = reference_low_latency(inputs, weights, routing, SwiGLU(), finalize=finalize)
    if not finalize:
        assert torch.equal(replayed.scores.view(torch.int32), want.scores.view(torch.int32)), "replayed scores"
    assert_close_to_reference(replayed.out, want if finalize else want.rows, "graph replay")


def test_zero_tokens_launch_nothing():
    config, weights = layer(WeightFormat.BF16, True)
    x = torch.empty(0, weights.hidden_size, dtype=torch.bfloat16, device=DEV)
    routing = Routing.unpacked(torch.empty(0, TOP_K, dtype=torch.int32, device=DEV),
                               torch.empty(0, TOP_K, device=DEV))
    assert low_latency_moe(config, x, weights, routing).shape == (0, weights.hidden_size)
    assert low_latency_moe(config, x, weights, routing, finalize=False).shape == (0, TOP_K, weights.hidden_size)


# ----------------------------------------------------------------------------- bad inputs
def _with(**change):
    """A change to the default bad-input call: argument name -> value, or a function of the default arguments."""
    return change


HIDDEN = SHAPES["dense"][0]
BAD_CASES = [  # (id, format, tokens, changes, error, match); built lazily in the test (no GPU work at collection)
    ("config", WeightFormat.BF16, 2, _with(config=object()), TypeError, "config"),
    ("weights", WeightFormat.BF16, 2, _with(weights=object()), TypeError, "weights"),
    ("routing", WeightFormat.BF16, 2, _with(routing=object()), TypeError, "routing"),
    ("x dtype", WeightFormat.BF16, 2, _with(inputs=lambda a: a["inputs"].half()), TypeError, "hidden_states"),
    ("x shape", WeightFormat.BF16, 2, _with(inputs=lambda a: a["inputs"][:, :8].contiguous()), ValueError, "hidden_states"),
    ("x on cpu", WeightFormat.BF16, 2, _with(inputs=lambda a: a["inputs"].cpu()), ValueError, "CUDA"),
    ("x misaligned", WeightFormat.BF16, 2,
     _with(inputs=lambda a: torch.empty(2 * HIDDEN + 1, dtype=torch.bfloat16, device=DEV)[1:].view(2, HIDDEN)),
     ValueError, "aligned"),
    ("too many tokens", WeightFormat.BF16, 8, _with(config=lambda a: LowLatencyMoeConfig(2)), ValueError, "max_num_tokens"),
    ("routing tokens", WeightFormat.BF16, 2, _with(routing=lambda a: make_routing(random_ids(3, TOP_K, E, 0), "fp32")),
     ValueError, "routing"),
    ("top_k", WeightFormat.BF16, 2,
     _with(routing=lambda a: Routing.unpacked(torch.zeros(2, 33, dtype=torch.int32, device=DEV), torch.zeros(2, 33, device=DEV))),
     ValueError, "top_k"),
    ("activation gating", WeightFormat.BF16, 2, _with(activation=SiLU()), ValueError, "gated"),
    ("activation name", WeightFormat.BF16, 2, _with(activation="nope"), ValueError, "activation"),
    ("out_dtype", WeightFormat.BF16, 2, _with(out_dtype=torch.float32), ValueError, "out_dtype"),
    ("finalize", WeightFormat.BF16, 2, _with(finalize=1), TypeError, "finalize"),
    ("out shape", WeightFormat.BF16, 2, _with(out=lambda a: torch.empty(2, HIDDEN + 8, dtype=torch.bfloat16, device=DEV)),
     ValueError, "out"),
    ("out dtype", WeightFormat.BF16, 2, _with(out=lambda a: torch.empty(2, HIDDEN, dtype=torch.float16, device=DEV)),
     TypeError, "out"),
    ("out overlaps x", WeightFormat.BF16, 2, _with(out=lambda a: a["inputs"]), ValueError, "out"),
    ("raw out shape", WeightFormat.BF16, 2,
     _with(finalize=False, out=lambda a: torch.empty(2, HIDDEN, dtype=torch.bfloat16, device=DEV)), ValueError, "out"),
    ("pair fp16 out", WeightFormat.NVFP4_W_NVFP4_A, 2, _with(out_dtype=torch.float16), ValueError, "out_dtype"),
    ("pair plain x", WeightFormat.NVFP4_W_NVFP4_A, 2,
     _with(inputs=lambda a: torch.zeros(2, 512, dtype=torch.bfloat16, device=DEV)), TypeError, "Nvfp4Activations"),
    ("nvfp4 weight-only given NVFP4 x", WeightFormat.NVFP4_WEIGHT_ONLY, 2,
     _with(inputs=lambda a: LowLatencyMoeConfig(8).prepare_nvfp4_activations(torch.zeros(2, 512, device=DEV))),
     TypeError, "BF16/FP16"),
]


@pytest.mark.parametrize("fmt, tokens, change, error, match", [c[1:] for c in BAD_CASES], ids=[c[0] for c in BAD_CASES])
def test_bad_inputs(fmt, tokens, change, error, match):
    """Each bad argument raises before anything is launched, naming the argument."""
    config, weights = layer(fmt, True)
    args = {
        "config": config, "inputs": make_inputs(config, fmt, torch.bfloat16, tokens, weights.hidden_size),
        "weights": weights, "routing": make_routing(random_ids(tokens, TOP_K, E, 0), "fp32"),
        "activation": SwiGLU(), "out_dtype": torch.bfloat16, "finalize": True, "out": None,
    }
    args.update({name: value(args) if callable(value) and not isinstance(value, Activation) else value
                 for name, value in change.items()})
    with pytest.raises(error, match=match):
        low_latency_moe(args["config"], args["inputs"], args["weights"], args["routing"], activation=args["activation"],
                        out_dtype=args["out_dtype"], finalize=args["finalize"], out=args["out"])
