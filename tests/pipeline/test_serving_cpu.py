"""The serving path on the CPU: remembered call signatures, full-call graph bookkeeping, launch-argument
packing, kernel and plan cache keys, corrupt-entry recovery of the plan cache, the process cache dir,
and the serving benchmarks' command lines."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import warnings
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch

from cudnn_moe import Nvfp4MoeConfig, Routing, SwiGLU, fused_moe
from cudnn_moe.fused import op as ops
from cudnn_moe.pipeline import executor as executor_module
from cudnn_moe.arch import SM90
from cudnn_moe.cache import KIND_CUDNN_PLAN, CacheWarning, DiskCache, Environment, active_cache, set_cache_dir
from cudnn_moe.cache import runtime as cache_runtime
from cudnn_moe.cache import store as store_module
from cudnn_moe.weights.nvfp4 import Nvfp4Activations
from cudnn_moe.engines.cudnn import GroupedGemmKey, ScaleLayout
from cudnn_moe.engines.cudnn import plan_cache
from cudnn_moe.engines.base import Stage
from cudnn_moe.kernels.loader import PackedArgs, kernel_key, packed_args
from tests.support import REPO

ENV = Environment(gpu_name="NVIDIA H200", compute_capability=(9, 0), cudnn_backend=91900, cudnn_frontend="1.32.0")


@pytest.fixture(autouse=True)
def _fresh_reports(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store_module, "_reported", set())
    ops.clear_checked_signatures()


# ---------------------------------------------------------------- remembered signatures


def _call_args(tokens: int = 1):
    config = Nvfp4MoeConfig(arch="sm90", max_num_tokens=64)
    acts = Nvfp4Activations(torch.zeros(tokens, 128, dtype=torch.uint8), torch.zeros(tokens, 16, dtype=torch.float8_e4m3fn))
    routing = Routing.unpacked(torch.zeros(tokens, 2, dtype=torch.int32), torch.zeros(tokens, 2))
    out = torch.zeros(tokens, 256, dtype=torch.bfloat16)
    return config, acts, routing, out


class _Weights:
    """Stands in for Nvfp4Weights (only identity and weak references matter here)."""


class _Executor:
    def __init__(self) -> None:
        self.calls = []

    def run(self, activations, routing, **kwargs):
        self.calls.append(kwargs)
        return "ran"


def _key(config, acts, routing, weights, out, **changes):
    args = dict(activation=SwiGLU(), local_expert_start=0, finalize=True, out=out, use_cuda_graph=True)
    args.update(changes)
    return ops.signature_key(config, acts, routing, weights, args["activation"], args["local_expert_start"],
                             args["finalize"], args["out"], args["use_cuda_graph"])


def test_remembered_signature_skips_the_checks_and_passes_the_key() -> None:
    config, acts, routing, out = _call_args()
    weights, executor = _Weights(), _Executor()
    key = _key(config, acts, routing, weights, out)
    ops._checked.remember(key, config, weights, executor)
    assert fused_moe(config, acts, routing, weights, out=out) == "ran"  # CPU tensors: the checks would refuse them
    assert executor.calls == [dict(finalize=True, out=out, use_cuda_graph=True, signature=key)]


@pytest.mark.parametrize("change", [
    "packed_ptr", "scales_shape", "ids_dtype", "weights_stride", "out_ptr", "tokens", "finalize", "graph",
    "local_start", "local_start_bool", "activation", "max_tokens",
])
def test_any_changed_field_misses_and_runs_the_checks(change: str) -> None:
    config, acts, routing, out = _call_args()
    weights, executor = _Weights(), _Executor()
    ops._checked.remember(_key(config, acts, routing, weights, out), config, weights, executor)
    kwargs = dict(out=out)
    if change == "packed_ptr":
        acts = Nvfp4Activations(acts.packed.clone(), acts.scales)
    elif change == "scales_shape":
        acts = Nvfp4Activations(acts.packed, torch.zeros(1, 32, dtype=torch.float8_e4m3fn)[:, :16])
    elif change == "ids_dtype":
        routing = Routing.unpacked(routing.ids.view(torch.float32).view(torch.int32).to(torch.int64), routing.weights)
    elif change == "weights_stride":
        routing = Routing.unpacked(routing.ids, torch.zeros(2, 1).t())
    elif change == "out_ptr":
        kwargs["out"] = out.clone()
    elif change == "tokens":
        config, acts, routing, out = _call_args(2)
        kwargs["out"] = out
    elif change == "finalize":
        kwargs["finalize"] = False
    elif change == "graph":
        kwargs["use_cuda_graph"] = False
    elif change == "local_start":
        kwargs["local_expert_start"] = 1
    elif change == "local_start_bool":
        ops._checked.remember(_key(config, acts, routing, weights, out, local_expert_start=1), config, weights, executor)
        kwargs["local_expert_start"] = True
    elif change == "activation":
        kwargs["activation"] = SwiGLU(alpha=1.5)
    elif change == "max_tokens":
        config.max_num_tokens = 32
    with pytest.raises((TypeError, ValueError)):
        fused_moe(config, acts, routing, weights, **kwargs)
    assert executor.calls == []


def test_a_freed_weights_object_is_never_matched() -> None:
    config, acts, routing, out = _call_args()
    weights, executor = _Weights(), _Executor()
    ops._checked.remember(_key(config, acts, routing, weights, out), config, weights, executor)
    other = _Weights()
    with pytest.raises(TypeError, match="weights must be the Nvfp4Weights"):
        fused_moe(config, acts, routing, other, out=out)  # another object, maybe at a reused id
    assert executor.calls == []


def test_failures_are_not_remembered_and_check_routing_always_checks() -> None:
    config, acts, routing, out = _call_args()
    with pytest.raises(TypeError):
        fused_moe(config, acts, routing, _Weights(), out=out)
    assert ops._checked.get(_key(config, acts, routing, _Weights(), out)) is None
    weights, executor = _Weights(), _Executor()
    ops._checked.remember(_key(config, acts, routing, weights, out), config, weights, executor)
    with pytest.raises(TypeError):
        fused_moe(config, acts, routing, weights, out=out, check_routing=True)
    assert executor.calls == []


def test_signature_cache_is_bounded() -> None:
    config, acts, routing, out = _call_args()
    weights, executor = _Weights(), _Executor()
    keys = [("k", n) for n in range(ops._checked.size + 10)]
    for key in keys:
        ops._checked.remember(key, config, weights, executor)
    assert sum(ops._checked.get(key) is not None for key in keys) == ops._checked.size
    assert ops._checked.get(keys[0]) is None and ops._checked.get(keys[-1]) is not None


def test_signature_of_garbage_is_none() -> None:
    config, acts, routing, out = _call_args()
    assert ops.signature_key(config, "not activations", routing, None, SwiGLU(), 0, True, out, True) is None
    assert ops.signature_key(config, acts, routing, None, ["unhashable"], 0, True, out, True) is None


# ---------------------------------------------------------------- full-call graph bookkeeping


class _FakeGraph:
    captured = 0

    def __init__(self) -> None:
        _FakeGraph.captured += 1


@pytest.fixture
def fake_executor(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", lambda graph: contextlib.nullcontext())
    _FakeGraph.captured = 0
    ex = object.__new__(executor_module.MoeExecutor)
    ex._lock = __import__("threading").Lock()
    launched = []
    ex._ensure_graph = lambda bucket: None
    # The chain: one launch, which also stages the caller's inputs when given them (the decode chain's sort + permute).
    ex._call_chain = lambda bucket, caller: ([Stage("chain", lambda: launched.append("chain"))], caller is not None, False)
    bucket = type("B", (), {})()
    bucket.full_graphs, bucket.last_signature = OrderedDict(), None

    def full_graph(signature, caller=None):
        stage, finish = lambda b: launched.append("stage"), lambda b: launched.append("finalize")
        return ex._full_graph(bucket, signature, stage, finish, caller)

    return full_graph, bucket, launched


def test_full_graph_is_captured_on_the_second_consecutive_call(fake_executor) -> None:
    full_graph, bucket, launched = fake_executor
    assert full_graph("A") is None  # first call: usual path
    graph = full_graph("A")  # second: captured
    assert isinstance(graph, _FakeGraph) and launched == ["stage", "chain", "finalize"]
    assert full_graph("A") is graph and _FakeGraph.captured == 1


def test_full_graph_launches_no_stage_when_the_chain_stages_the_inputs(fake_executor) -> None:
    full_graph, bucket, launched = fake_executor
    caller = object()
    assert full_graph("A", caller) is None
    assert isinstance(full_graph("A", caller), _FakeGraph) and launched == ["chain", "finalize"]


def test_alternating_fresh_signatures_never_capture(fake_executor) -> None:
    full_graph, bucket, _ = fake_executor
    for n in range(10):
        assert full_graph(("fresh", n)) is None
    assert _FakeGraph.captured == 0


def test_full_graphs_are_an_lru_of_four(fake_executor) -> None:
    full_graph, bucket, _ = fake_executor
    for sig in "ABCDE":
        full_graph(sig)
        full_graph(sig)
    assert list(bucket.full_graphs) == list("BCDE") and executor_module.FULL_GRAPHS_PER_BUCKET == 4
    full_graph("B")  # a hit refreshes B
    full_graph("F")
    full_graph("F")
    assert list(bucket.full_graphs) == list("DEBF")


# ---------------------------------------------------------------- launch arguments


def test_packed_args_layout_and_values() -> None:
    args = (np.uint64(0x1122334455667788), np.int32(-2), np.uint64(7), np.int32(3), np.float32(1.5), np.int32(9))
    packed = PackedArgs(args)
    assert packed.offsets == (0, 8, 16, 24, 28, 32)  # each argument aligned to its own size
    assert packed.argument_bytes(0, 8) == (0x1122334455667788).to_bytes(8, "little")
    assert packed.argument_bytes(1, 4) == (-2).to_bytes(4, "little", signed=True)
    assert packed.argument_bytes(4, 4) == np.float32(1.5).tobytes()
    assert PackedArgs((np.int32(1), np.uint64(2))).offsets == (0, 8)  # padding before the 8-byte argument


def test_packed_args_reuse_per_layout_and_refuse_python_ints() -> None:
    first = packed_args((np.uint64(1), np.int32(2)))
    second = packed_args((np.uint64(5), np.int32(6)))
    assert first is second and second.argument_bytes(0, 8) == (5).to_bytes(8, "little")
    with pytest.raises(TypeError, match="argument 1 must be a numpy scalar"):
        PackedArgs((np.int32(1), 2))


# ---------------------------------------------------------------- kernel binaries


def test_kernel_key_covers_source_options_and_environment() -> None:
    base = kernel_key("sort.cu", "src", ("-std=c++17", "-I/a", "-DX=1"), ENV)
    assert base == kernel_key("sort.cu", "src", ("-std=c++17", "-I/elsewhere", "-DX=1"), ENV)  # include path left out
    assert base != kernel_key("sort.cu", "src2", ("-std=c++17", "-I/a", "-DX=1"), ENV)
    assert base != kernel_key("sort.cu", "src", ("-std=c++17", "-I/a", "-DX=2"), ENV)
    other = Environment(gpu_name="NVIDIA H100", compute_capability=(9, 0), compiler="cupy 14, nvrtc 13.0")
    assert base != kernel_key("sort.cu", "src", ("-std=c++17", "-I/a", "-DX=1"), other)


# ---------------------------------------------------------------- cuDNN plans


def _gemm_key(device: int = 0, rows: int = 64) -> GroupedGemmKey:
    return GroupedGemmKey(rows=rows, k=256, n=512, num_experts=8, scale_layout=ScaleLayout.LINEAR, offsets_len=8,
                          device=device, arch=SM90, backend=91900)


class _Plan:
    def __init__(self, key, origin: str) -> None:
        self.key, self.origin = key, origin


class _Serializer:
    def __init__(self, *, fail_load: bool = False, fail_save: bool = False) -> None:
        self.fail_load, self.fail_save, self.loaded = fail_load, fail_save, []

    def serialize(self, gemm) -> bytes:
        if self.fail_save:
            raise RuntimeError("engine is not runtime compiled")
        return f"plan {gemm.key.rows}".encode()

    def deserialize(self, key, payload: bytes):
        if self.fail_load:
            raise RuntimeError("CUDNN_STATUS_BAD_PARAM")
        self.loaded.append(payload)
        return _Plan(key, "disk")


def test_plan_entry_key_fields_and_round_trip() -> None:
    entry = plan_cache.plan_entry_key(_gemm_key(device=3), ENV)
    assert entry.kind == KIND_CUDNN_PLAN and entry.environment == ENV
    assert entry.field_dict() == {"rows": 64, "k": 256, "n": 512, "num_experts": 8, "scale_layout": "linear",
                                  "offsets_len": 8, "arch": (9, 0), "backend": 91900}
    assert entry == plan_cache.plan_entry_key(_gemm_key(device=0), ENV)  # one entry for every identical GPU
    assert entry != plan_cache.plan_entry_key(_gemm_key(rows=128), ENV)
    assert plan_cache.gemm_key_of(entry, 1) == _gemm_key(device=1)


def test_plans_built_then_loaded_from_disk(tmp_path: Path) -> None:
    disk, serializer = DiskCache(tmp_path), _Serializer()
    build = lambda key: _Plan(key, "built")  # noqa: E731
    plan, source = plan_cache.load_or_build(_gemm_key(), build, disk, serializer, ENV)
    assert source == "built" and plan.origin == "built" and len(disk.entries()) == 1
    plan, source = plan_cache.load_or_build(_gemm_key(), build, disk, serializer, ENV)
    assert source == "disk" and serializer.loaded == [b"plan 64"]
    assert plan_cache.load_or_build(_gemm_key(), build, None, serializer, ENV)[1] == "built"  # no disk cache


def test_a_plan_that_fails_to_deserialize_is_reported_once_and_replaced(tmp_path: Path) -> None:
    disk = DiskCache(tmp_path)
    build = lambda key: _Plan(key, "built")  # noqa: E731
    plan_cache.load_or_build(_gemm_key(), build, disk, _Serializer(), ENV)
    path = disk.path_for(plan_cache.plan_entry_key(_gemm_key(), ENV))
    before = path.stat().st_mtime_ns
    with pytest.warns(CacheWarning, match="cannot deserialize the cached plan"):
        plan, source = plan_cache.load_or_build(_gemm_key(), build, disk, _Serializer(fail_load=True), ENV)
    assert source == "built" and plan.origin == "built"
    assert path.is_file() and path.stat().st_mtime_ns >= before  # replaced by the fresh build
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan_cache.load_or_build(_gemm_key(), build, disk, _Serializer(fail_load=True), ENV)  # not reported twice


def test_a_corrupt_plan_file_is_rebuilt(tmp_path: Path) -> None:
    disk, serializer = DiskCache(tmp_path), _Serializer()
    build = lambda key: _Plan(key, "built")  # noqa: E731
    plan_cache.load_or_build(_gemm_key(), build, disk, serializer, ENV)
    path = disk.path_for(plan_cache.plan_entry_key(_gemm_key(), ENV))
    path.write_bytes(path.read_bytes()[:-3])  # truncated
    with pytest.warns(CacheWarning, match="truncated"):
        assert plan_cache.load_or_build(_gemm_key(), build, disk, serializer, ENV)[1] == "built"
    assert plan_cache.load_or_build(_gemm_key(), build, disk, serializer, ENV)[1] == "disk"


def test_an_unserializable_plan_is_built_and_reported(tmp_path: Path) -> None:
    disk = DiskCache(tmp_path)
    with pytest.warns(CacheWarning, match="cannot be serialized"):
        plan, source = plan_cache.load_or_build(_gemm_key(), lambda key: _Plan(key, "built"), disk,
                                                _Serializer(fail_save=True), ENV)
    assert source == "built" and disk.entries() == []


# ---------------------------------------------------------------- process cache dir


def test_set_cache_dir_and_environment_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cache_runtime, "_explicit", None)
    monkeypatch.setenv("CUDNN_MOE_CACHE_DIR", str(tmp_path / "from-env"))
    assert active_cache().root == tmp_path / "from-env"
    set_cache_dir(tmp_path / "explicit")
    disk = active_cache()
    assert disk.root == tmp_path / "explicit" and disk is active_cache()
    assert (os.stat(disk.root).st_mode & 0o777) == 0o700
    set_cache_dir(None)
    assert active_cache().root == tmp_path / "from-env"


def test_an_unusable_cache_dir_means_no_disk_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setattr(cache_runtime, "_explicit", blocker)
    with pytest.warns(CacheWarning, match="no usable cache directory"):
        assert active_cache() is None


def test_stats_count_sources() -> None:
    cache_runtime.reset_stats()
    cache_runtime.record(KIND_CUDNN_PLAN, "disk")
    cache_runtime.record(KIND_CUDNN_PLAN, "disk")
    cache_runtime.record("kernel", "built")
    assert cache_runtime.stats() == {(KIND_CUDNN_PLAN, "disk"): 2, ("kernel", "built"): 1}
    cache_runtime.reset_stats()


# ---------------------------------------------------------------- benchmark command lines


@pytest.mark.parametrize(("script", "options"), [
    ("bench_host.py", ("--calls", "--markdown", "--engine")),
    ("bench_cache.py", ("--preset", "--engine", "--tokens", "--markdown")),
])
def test_benchmark_help_runs_on_cpu(script: str, options: tuple[str, ...]) -> None:
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / script), "--help"], capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}).stdout
    for option in options:
        assert option in out
