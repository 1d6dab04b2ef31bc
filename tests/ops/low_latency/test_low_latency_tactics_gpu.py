"""GPU tests of the low-latency tactics (LowLatencyMoeConfig.tune, cudnn_moe.low_latency.tuning and tactics): the
tuner times every engine that supports a call (positive medians, the fastest chosen) and stores its choice in a
temporary cache directory; the following "auto" calls run on that choice, eagerly and captured in a CUDA graph,
and match the float64 reference with NaN-poisoned outputs. Tolerances: tests.support.low_latency.

    pytest -q tests/ops/low_latency/test_low_latency_tactics_gpu.py
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from cudnn_moe.activations import SwiGLU
from cudnn_moe.cache import KIND_TACTIC, DiskCache
from cudnn_moe.cache import runtime as cache_runtime
from cudnn_moe.engines.registry import supporting
from cudnn_moe.formats.fp8 import quantize_fp8_act128
from cudnn_moe.low_latency import LowLatencyMoeConfig, WeightFormat, low_latency_moe, reference_low_latency, tactics
from cudnn_moe.low_latency.stand_in import stand_in_weights
from cudnn_moe.low_latency.tactics import TacticKey, layer_request, select
from tests.support.low_latency import (
    E, FORMAT_CASES, TOP_K, assert_close_to_reference, make_inputs, make_layer, make_routing, nan_out, random_ids,
)

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")
NVFP4_WO = WeightFormat.NVFP4_WEIGHT_ONLY


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The tactics of this test only: the active cache in a temporary directory, an empty in-memory table."""
    monkeypatch.setattr(cache_runtime, "_explicit", tmp_path / "cache")
    monkeypatch.setattr(tactics, "_table", {})
    return tmp_path / "cache"


def _key(weights, tokens: int, x_dtype: torch.dtype, out_dtype: torch.dtype = torch.bfloat16) -> TacticKey:
    token_dtype = None if weights.format is WeightFormat.NVFP4_W_NVFP4_A else x_dtype
    request = layer_request(weights, tuple(torch.cuda.get_device_capability()), tokens, token_dtype, out_dtype, True)
    return TacticKey(request, TOP_K, weights.gated, x_dtype, torch.cuda.current_device())


def _check_table(table: dict, tokens: list[int], key_of) -> None:
    assert sorted(table) == tokens
    for t, result in table.items():
        names = [e.name for e in supporting(key_of(t).request)]
        assert list(result.times_us) == names, f"T={t}: timed {list(result.times_us)}, candidates {names}"
        assert all(us > 0 and math.isfinite(us) for us in result.times_us.values()), result
        assert result.engine == min(result.times_us, key=result.times_us.get)


def test_tune_nvfp4_weight_only_then_calls_run_the_choice(cache_dir: Path, monkeypatch) -> None:
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the SM90 tensor-core engine and the CUDA cores both run this layer on SM90 only")
    config, weights = make_layer(NVFP4_WO, True, shape=(512, 256), seed=3)
    lines: list[str] = []
    table = config.tune(weights, top_k=TOP_K, tokens=[1, 4], iters=5, progress=lines.append)
    _check_table(table, [1, 4], lambda t: _key(weights, t, torch.bfloat16))
    for result in table.values():
        assert {"sm90", "cuda_cores"} <= set(result.times_us)
    assert len(lines) == 2 and lines[1].startswith("nvfp4_weight_only T=4: ")
    assert "sm90 " in lines[1] and "cuda_cores " in lines[1] and lines[1].endswith(f"-> {table[4].engine}")
    # one tactic entry per T (a process that compiles its kernels here also stores them: kind "kernel")
    tactic = [e for e in DiskCache(cache_dir).entries() if e.key.kind == KIND_TACTIC]
    assert sorted(e.key.field_dict()["tokens"] for e in tactic) == [1, 4]

    monkeypatch.setattr(tactics, "_table", {})  # a new process: the choice comes from the disk
    tokens, act = 4, SwiGLU()
    assert select("auto", _key(weights, tokens, torch.bfloat16)).name == table[tokens].engine
    x = make_inputs(config, NVFP4_WO, torch.bfloat16, tokens, weights.hidden_size, seed=5)
    routing = make_routing(random_ids(tokens, TOP_K, E, 6), "fp32", 7)
    want = reference_low_latency(x, weights, routing, act)
    out = nan_out((tokens, weights.hidden_size), torch.bfloat16)
    low_latency_moe(config, x, weights, routing, activation=act, out=out)
    torch.cuda.synchronize()
    assert_close_to_reference(out, want, f"tuned ({table[tokens].engine}) eager")

    captured = nan_out((tokens, weights.hidden_size), torch.bfloat16)
    low_latency_moe(config, x, weights, routing, activation=act, out=captured)  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        low_latency_moe(config, x, weights, routing, activation=act, out=captured)
    captured.fill_(math.nan)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, out), f"tuned ({table[tokens].engine}) captured differs from eager"


@pytest.mark.parametrize("fmt, x_dtype", FORMAT_CASES, ids=[f"{f.value}-{str(d).removeprefix('torch.')}"
                                                            for f, d in FORMAT_CASES])
def test_tune_every_format_then_the_call_matches_the_reference(cache_dir: Path, fmt, x_dtype) -> None:
    """Whatever engines run a format (one or more), tune times each and the tuned call stays exact."""
    config, weights = make_layer(fmt, True, seed=4)
    code_dtype = torch.uint8 if fmt is WeightFormat.NVFP4_W_NVFP4_A else x_dtype
    out_dtype = torch.float16 if fmt is WeightFormat.FP16 else torch.bfloat16
    table = config.tune(weights, top_k=TOP_K, tokens=2, out_dtype=out_dtype, x_dtype=code_dtype, iters=3)
    _check_table(table, [2], lambda t: _key(weights, t, code_dtype, out_dtype))
    x = make_inputs(config, fmt, x_dtype, 2, weights.hidden_size, seed=8)
    routing = make_routing(random_ids(2, TOP_K, E, 9), "packed", 10)
    out = nan_out((2, weights.hidden_size), out_dtype)
    low_latency_moe(config, x, weights, routing, activation=SwiGLU(), out_dtype=out_dtype, out=out)
    want = reference_low_latency(x, weights, routing, SwiGLU(), out_dtype=out_dtype)
    torch.cuda.synchronize()
    assert_close_to_reference(out, want, f"tuned {fmt.value} ({table[2].engine})")


@pytest.mark.parametrize("fmt, x_dtype", [(WeightFormat.FP8_PER_TENSOR, torch.float8_e4m3fn),
                                          (WeightFormat.DEEPSEEK_FP8, torch.bfloat16),
                                          (WeightFormat.DEEPSEEK_FP8, torch.float8_e4m3fn)],
                         ids=["fp8_per_tensor", "deepseek_fp8-bf16", "deepseek_fp8-prequantized"])
def test_tune_the_fp8_formats_with_their_own_tokens(cache_dir: Path, fmt, x_dtype) -> None:
    """The tuner makes these formats' tokens itself (E4M3 with the static scale; BF16 or prequantized per 128);
    their numerics are their own GPU tests' (their intermediates need checks of their own), so here: the times,
    and a finite, written output of the tuned call."""
    config = LowLatencyMoeConfig(8)
    weights = stand_in_weights(config, fmt, E, 512, 256, torch.Generator(device=DEV).manual_seed(5))
    table = config.tune(weights, top_k=TOP_K, tokens=[1, 3], x_dtype=x_dtype, iters=3)
    token_dtype = None if x_dtype is torch.float8_e4m3fn and fmt is WeightFormat.DEEPSEEK_FP8 else x_dtype
    _check_table(table, [1, 3], lambda t: TacticKey(
        layer_request(weights, tuple(torch.cuda.get_device_capability()), t, token_dtype, torch.bfloat16, True),
        TOP_K, True, x_dtype, torch.cuda.current_device()))
    x = torch.randn(3, 512, device=DEV)
    if fmt is WeightFormat.FP8_PER_TENSOR:
        inputs = config.prepare_fp8_per_tensor_activations(x, weights)
    elif x_dtype is torch.float8_e4m3fn:
        inputs = config.prepare_deepseek_fp8_activations(*quantize_fp8_act128(x), weights)
    else:
        inputs = x.to(torch.bfloat16)
    out = nan_out((3, 512), torch.bfloat16)
    low_latency_moe(config, inputs, weights, make_routing(random_ids(3, TOP_K, E, 11), "fp32", 12), out=out)
    torch.cuda.synchronize()
    assert bool(torch.isfinite(out).all()) and float(out.abs().max()) > 0
