"""GPU tests of the low-latency fallback (cudnn_moe.low_latency.fallback; SM90 only): calls above max_num_tokens
written into NaN-poisoned outputs against the float64 reference (applied per 8 tokens: every token's output
depends on its own inputs only), repeated calls bitwise equal, the pair's unrouted NaN slots, CUDA-graph capture,
and calls at or below max_num_tokens still on the low-latency path.
Tolerances: tests.support.low_latency (the same rounding points; only the FP32 summation order differs)."""

from __future__ import annotations

import pytest
import torch

from cudnn_moe.activations import GeGLU, ReLU2, SiTU, SwiGLU
from cudnn_moe.fused.config import Nvfp4MoeConfig
from cudnn_moe.low_latency import (
    MAX_NUM_TOKENS,
    WeightFormat,
    grouped,
    low_latency_moe,
    reference_low_latency,
)
from cudnn_moe.weights.nvfp4 import Nvfp4Activations
from tests.support.low_latency import (
    DEV,
    TOP_K,
    E,
    assert_close_to_reference,
    make_layer,
    make_routing,
    nan_out,
    random_ids,
)

pytestmark = pytest.mark.gpu
NVFP4_WO, PAIR = WeightFormat.NVFP4_WEIGHT_ONLY, WeightFormat.NVFP4_W_NVFP4_A
FUSED_MAX = 256


@pytest.fixture(autouse=True)
def _sm90_only() -> None:
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the fallback runs on the SM90 engine")


def layer(fmt: WeightFormat, gated: bool, seed: int):
    """(config with max_num_tokens 8, weights holding a fallback up to FUSED_MAX tokens, fused config)."""
    config, weights = make_layer(fmt, gated, shape=(512, 256), seed=seed)
    fused = Nvfp4MoeConfig(max_num_tokens=FUSED_MAX)
    return config, config.prepare_fallback(weights, fused), fused


def tokens_for(fmt: WeightFormat, fused: Nvfp4MoeConfig, tokens: int, seed: int) -> torch.Tensor | Nvfp4Activations:
    """BF16 tokens [T, 512]; for the pair quantized by the fused config (the low-latency quantizer, any T)."""
    x = torch.randn(tokens, 512, generator=torch.Generator().manual_seed(seed)).to(DEV)
    return fused.prepare_activations(x) if fmt is PAIR else x.to(torch.bfloat16)


def reference_in_chunks(x, weights, ids: torch.Tensor, route_w: torch.Tensor, kind: str, act) -> torch.Tensor:
    """reference_low_latency (at most 8 tokens a call) over the tokens 8 at a time, concatenated: bfloat16 [T, H]."""
    parts = []
    for start in range(0, ids.shape[0], MAX_NUM_TOKENS):
        rows = slice(start, start + MAX_NUM_TOKENS)
        chunk = Nvfp4Activations(x.packed[rows], x.scales[rows]) if isinstance(x, Nvfp4Activations) else x[rows]
        routing = make_routing(ids[rows], kind, weights=route_w[rows])
        parts.append(reference_low_latency(chunk, weights, routing, act, out_dtype=torch.bfloat16))
    return torch.cat(parts)


CASES = [
    (NVFP4_WO, 9, SwiGLU(), "fp32"), (NVFP4_WO, 16, GeGLU(), "packed"), (NVFP4_WO, 37, ReLU2(), "bf16"),
    (NVFP4_WO, FUSED_MAX, SwiGLU(alpha=1.702, beta=1.0, limit=7.0), "int64"),
    (PAIR, 9, SwiGLU(), "packed"), (PAIR, 33, SiTU(a=2.0, b=3.0), "fp32"), (PAIR, 200, GeGLU(), "int64"),
]


@pytest.mark.parametrize("fmt, tokens, act, kind", CASES,
                         ids=[f"{f.value}-T{t}-{type(a).__name__}-{k}" for f, t, a, k in CASES])
def test_calls_above_max_num_tokens_match_the_reference(fmt, tokens, act, kind) -> None:
    config, weights, fused = layer(fmt, act.gated, seed=tokens)
    x = tokens_for(fmt, fused, tokens, seed=tokens + 1)
    ids = random_ids(tokens, TOP_K, E, tokens + 2)
    route_w = torch.rand(ids.shape, generator=torch.Generator().manual_seed(tokens + 3)) + 0.05
    routing = make_routing(ids, kind, weights=route_w)
    out = nan_out((tokens, weights.hidden_size), torch.bfloat16)
    low_latency_moe(config, x, weights, routing, activation=act, out=out)
    want = reference_in_chunks(x, weights, ids, route_w, kind, act)
    torch.cuda.synchronize()
    assert_close_to_reference(out, want, f"fallback {fmt.value} T={tokens} {type(act).__name__} {kind}")
    assert torch.equal(low_latency_moe(config, x, weights, routing, activation=act), out)  # a fresh output
    again = nan_out((tokens, weights.hidden_size), torch.bfloat16)
    for _ in range(3):  # the cached signature, then its full-call graph: bitwise the same
        again.fill_(float("nan"))
        low_latency_moe(config, x, weights, routing, activation=act, out=again)
        assert torch.equal(again, out)


def test_pair_unrouted_nan_slots_above_max_num_tokens() -> None:
    """The pair's ids outside [0, E) carry NaN route weights: skipped on the fallback too."""
    tokens = 24
    config, weights, fused = layer(PAIR, True, seed=5)
    x = tokens_for(PAIR, fused, tokens, seed=6)
    ids = random_ids(tokens, TOP_K, E, 7)
    ids[0, 1], ids[13, 0], ids[-1, 3] = -1, E, E + 5
    unrouted = (ids < 0) | (ids >= E)
    route_w = torch.where(unrouted, torch.tensor(float("nan")), torch.rand(ids.shape) + 0.05)
    out = nan_out((tokens, weights.hidden_size), torch.bfloat16)
    low_latency_moe(config, x, weights, make_routing(ids, "fp32", weights=route_w), out=out)
    want = reference_in_chunks(x, weights, ids, route_w, "fp32", SwiGLU())
    torch.cuda.synchronize()
    assert_close_to_reference(out, want, "fallback pair with unrouted NaN slots")


@pytest.mark.parametrize("fmt", [NVFP4_WO, PAIR], ids=["weight_only", "pair"])
def test_calls_at_or_below_max_num_tokens_stay_on_the_low_latency_path(monkeypatch, fmt) -> None:
    """T = 8 runs grouped.run (the low-latency SM90 path, 8-token buckets), T = 9 the fallback's view; both
    follow the reference."""
    config, weights, fused = layer(fmt, True, seed=11)
    paths: list[str] = []
    run, run_on = grouped.run, grouped.run_on

    def spy_run(engine, call):
        paths.append("low_latency")
        return run(engine, call)

    def spy_run_on(view, call, max_tokens):
        paths.append("fallback" if view is weights.fallback.weights and max_tokens == FUSED_MAX else "low_latency")
        return run_on(view, call, max_tokens)

    monkeypatch.setattr(grouped, "run", spy_run)
    monkeypatch.setattr(grouped, "run_on", spy_run_on)
    for tokens in (MAX_NUM_TOKENS, MAX_NUM_TOKENS + 1):
        x = tokens_for(fmt, fused, tokens, seed=tokens)
        ids = random_ids(tokens, TOP_K, E, tokens + 1)
        route_w = torch.rand(ids.shape) + 0.05
        out = nan_out((tokens, weights.hidden_size), torch.bfloat16)
        low_latency_moe(config, x, weights, make_routing(ids, "fp32", weights=route_w), out=out)
        want = reference_in_chunks(x, weights, ids, route_w, "fp32", SwiGLU())
        torch.cuda.synchronize()
        assert_close_to_reference(out, want, f"{fmt.value} T={tokens}")
    # T = 8: grouped.run, which runs its own view through run_on with 8-token buckets; T = 9: the fallback
    assert paths == ["low_latency", "low_latency", "fallback"]


def test_fallback_call_captured_in_a_cuda_graph_reads_new_tokens() -> None:
    """After one eager call, a fallback call records into the caller's graph; replays follow new token values."""
    tokens = 40
    config, weights, fused = layer(NVFP4_WO, True, seed=21)
    x = tokens_for(NVFP4_WO, fused, tokens, seed=22)
    ids = random_ids(tokens, TOP_K, E, 23)
    route_w = torch.rand(ids.shape) + 0.05
    routing = make_routing(ids, "fp32", weights=route_w)
    out = nan_out((tokens, weights.hidden_size), torch.bfloat16)
    low_latency_moe(config, x, weights, routing, out=out)  # warm-up: bucket, kernels, plans
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        low_latency_moe(config, x, weights, routing, out=out)
    x.copy_(tokens_for(NVFP4_WO, fused, tokens, seed=24))
    out.fill_(float("nan"))
    graph.replay()
    want = reference_in_chunks(x, weights, ids, route_w, "fp32", SwiGLU())
    torch.cuda.synchronize()
    assert_close_to_reference(out, want, "fallback replayed from the caller's graph")
