"""CPU tests of the low-latency tactics (cudnn_moe.low_latency.tactics and the argument checks of
cudnn_moe.low_latency.tuning): the cache key (every field changes it), the round trip through a temporary cache
directory, the fixed rule without an entry, stale or corrupt entries ignored, one disk read per key per process,
explicit engine names winning, the op's call path running the stored engine (the engines' launches replaced by
recorders), and tune()'s bad arguments refused before anything runs. The measuring itself is
test_low_latency_tactics_gpu.py."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from cudnn_moe.cache import CacheWarning, DiskCache, Environment
from cudnn_moe.cache import runtime as cache_runtime
from cudnn_moe.engines import registry
from cudnn_moe.engines.base import LayerEngine
from cudnn_moe.engines.cuda_cores.engine import CudaCoresEngine
from cudnn_moe.engines.sm90.engine import Sm90GemmEngine
from cudnn_moe.low_latency import LowLatencyMoeConfig, TuningResult, WeightFormat, grouped, low_latency_moe, tactics
from cudnn_moe.low_latency import tuning
from cudnn_moe.low_latency.checks import token_dtypes
from cudnn_moe.low_latency.stand_in import stand_in_weights
from cudnn_moe.low_latency.tactics import TacticKey, entry_key, layer_request, select, store
from cudnn_moe.routing import Routing
from cudnn_moe.version import __version__
from tests.support.low_latency import NullWorkspace

op_module = importlib.import_module("cudnn_moe.low_latency.op")
NVFP4_WO = WeightFormat.NVFP4_WEIGHT_ONLY
E, H, I, TOP_K = 4, 256, 128, 2
ENV = Environment(gpu_name="NVIDIA H200", compute_capability=(9, 0))
BF16, FP16 = torch.bfloat16, torch.float16


def config(max_num_tokens: int = 4, engine: str = "auto") -> LowLatencyMoeConfig:
    return LowLatencyMoeConfig(max_num_tokens, arch="sm90", engine=engine)


@pytest.fixture(scope="module")
def weights():
    """NVFP4 weight-only stand-in weights both engines run on SM90 (2I and H multiples of 128)."""
    return stand_in_weights(config(), NVFP4_WO, E, H, I, torch.Generator().manual_seed(0))


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh process as far as tactics go: the active cache in a temporary directory, an empty table."""
    monkeypatch.setattr(cache_runtime, "_explicit", tmp_path / "cache")
    monkeypatch.setattr(tactics, "_table", {})
    return tmp_path / "cache"


def key_of(weights, tokens: int = 2, x_dtype=BF16, out_dtype=BF16, finalize: bool = True, arch=(9, 0),
           top_k: int = TOP_K) -> TacticKey:
    request = layer_request(weights, arch, tokens, x_dtype, out_dtype, finalize)
    return TacticKey(request, top_k, weights.gated, x_dtype, None)


def forget(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a new process knows: nothing in memory."""
    monkeypatch.setattr(tactics, "_table", {})


# ----------------------------------------------------------------------------- the key
def test_key_fields(weights) -> None:
    entry = entry_key(key_of(weights), ENV)
    assert entry.kind == "tactic"
    assert entry.name == "low-latency tactic nvfp4_weight_only E4 H256 Ip128 gated top-2 T2 bfloat16 -> bfloat16 finalized"
    assert entry.field_dict() == {
        "schema": tactics.TACTIC_SCHEMA, "arch": (9, 0), "format": "nvfp4_weight_only", "hidden": 256, "intermediate": 128,
        "padded_intermediate": 128, "experts": 4, "gated": True, "top_k": 2, "tokens": 2, "x_dtype": "bfloat16",
        "out_dtype": "bfloat16", "finalize": True, "engines": ("sm90", "cuda_cores"),
    }
    assert entry.environment == ENV and entry.environment.package_version == __version__


def test_every_field_changes_the_key(weights, monkeypatch: pytest.MonkeyPatch) -> None:
    base = key_of(weights)
    request = base.request
    g1, g2 = request.shapes

    def shapes(**changes):
        return dataclasses.replace(request, **changes)

    variants = {
        "arch": (base._replace(request=shapes(arch=(10, 0))), ENV),
        "device name": (base, dataclasses.replace(ENV, gpu_name="NVIDIA H100 80GB HBM3")),
        "compute capability": (base, dataclasses.replace(ENV, compute_capability=(10, 0))),
        "library version": (base, dataclasses.replace(ENV, package_version="99.0")),
        "format": (base._replace(request=shapes(weight_format="mxfp4_weight_only")), ENV),
        "H": (base._replace(request=shapes(shapes=(dataclasses.replace(g1, k=512), dataclasses.replace(g2, n=512)))), ENV),
        "I": (base._replace(request=shapes(shapes=(dataclasses.replace(g1, n=192), g2))), ENV),
        "Ip": (base._replace(request=shapes(shapes=(g1, dataclasses.replace(g2, k=256)))), ENV),
        "E": (base._replace(request=shapes(num_experts=8)), ENV),
        "gated": (base._replace(gated=False), ENV),
        "top_k": (base._replace(top_k=3), ENV),
        "tokens": (base._replace(request=shapes(tokens=3)), ENV),
        "x dtype": (base._replace(x_dtype=FP16), ENV),
        "out dtype": (base._replace(request=shapes(out_dtype=FP16)), ENV),
        "finalize": (base._replace(request=shapes(finalize=False)), ENV),
    }
    digests = {"base": entry_key(base, ENV).digest()}
    for what, (key, env) in variants.items():
        digests[what] = entry_key(key, env).digest()
    monkeypatch.setattr(tactics, "TACTIC_SCHEMA", tactics.TACTIC_SCHEMA + 1)
    digests["schema"] = entry_key(base, ENV).digest()
    monkeypatch.undo()
    monkeypatch.setattr(registry, "ENGINES", tuple(e for e in registry.ENGINES if e is not Sm90GemmEngine))
    digests["candidate engines"] = entry_key(base, ENV).digest()
    assert len(set(digests.values())) == len(digests), [w for w, d in digests.items() if list(digests.values()).count(d) > 1]
    monkeypatch.undo()
    assert entry_key(base._replace(device=3), ENV) == entry_key(base, ENV)  # identical GPUs share one entry


def test_token_dtypes_of_each_format() -> None:
    assert token_dtypes(WeightFormat.BF16) == (BF16,) and token_dtypes(WeightFormat.FP16) == (FP16,)
    for fmt in (NVFP4_WO, WeightFormat.MXFP4_WEIGHT_ONLY, WeightFormat.MXINT4_WEIGHT_ONLY, WeightFormat.FP8_WEIGHT_ONLY):
        assert token_dtypes(fmt) == (BF16, FP16)
    assert token_dtypes(WeightFormat.NVFP4_W_NVFP4_A) == (torch.uint8,)
    assert token_dtypes(WeightFormat.FP8_PER_TENSOR) == (torch.float8_e4m3fn,)
    assert token_dtypes(WeightFormat.DEEPSEEK_FP8) == (BF16, torch.float8_e4m3fn)
    assert tuning.request_token_dtype(WeightFormat.NVFP4_W_NVFP4_A, torch.uint8) is None
    assert tuning.request_token_dtype(WeightFormat.DEEPSEEK_FP8, torch.float8_e4m3fn) is None
    assert tuning.request_token_dtype(WeightFormat.DEEPSEEK_FP8, BF16) is BF16
    assert tuning.request_token_dtype(WeightFormat.FP8_PER_TENSOR, torch.float8_e4m3fn) is torch.float8_e4m3fn


# ----------------------------------------------------------------------------- store, load, fall back
def test_store_then_load_in_a_new_process(weights, cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key = key_of(weights)
    assert registry.choose(key.request) is Sm90GemmEngine  # the fixed rule
    result = TuningResult("cuda_cores", {"sm90": 12.5, "cuda_cores": 10.25})
    store(key, result, 20)
    entry = entry_key(key, tactics.tactic_environment(None))
    payload = DiskCache(cache_dir).get(entry)
    assert json.loads(payload) == {"engine": "cuda_cores", "times_us": {"sm90": 12.5, "cuda_cores": 10.25}, "iters": 20}
    assert tactics.decode_choice(payload) == result
    assert select("auto", key) is CudaCoresEngine  # this process: from the table
    forget(monkeypatch)
    assert select("auto", key) is CudaCoresEngine  # a new one: from the disk
    assert select("auto", key_of(weights, tokens=3)) is Sm90GemmEngine  # another token count: nothing stored


def test_missing_entry_takes_the_fixed_rule_and_creates_no_directory(weights, cache_dir: Path) -> None:
    assert select("auto", key_of(weights)) is Sm90GemmEngine
    assert select("auto", key_of(weights, x_dtype=FP16)) is CudaCoresEngine  # FP16 tokens: the CUDA cores only
    assert select("auto", key_of(weights, finalize=False)) is CudaCoresEngine
    assert not cache_dir.exists()


def test_each_key_is_read_once_per_process(weights, cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reads = []
    real = tactics.active_cache
    monkeypatch.setattr(tactics, "active_cache", lambda create=True: reads.append(create) or real(create))
    key = key_of(weights)
    for _ in range(3):
        assert select("auto", key) is Sm90GemmEngine
    assert reads == [False]
    store(key_of(weights, tokens=1), TuningResult("cuda_cores", {"sm90": 2.0, "cuda_cores": 1.0}), 5)  # writes once
    assert select("auto", key_of(weights, tokens=1)) is CudaCoresEngine and len(reads) == 2  # no read after store
    DiskCache(cache_dir).put(entry_key(key, tactics.tactic_environment(None)),
                             tactics.encode_choice(TuningResult("cuda_cores", {"cuda_cores": 1.0}), 5))
    assert select("auto", key) is Sm90GemmEngine  # stored by another process after this one looked: not seen
    assert len(reads) == 2


def _put(cache_dir: Path, key: TacticKey, payload: bytes) -> Path:
    disk = DiskCache(cache_dir)
    entry = entry_key(key, tactics.tactic_environment(None))
    disk.put(entry, payload)
    return disk.path_for(entry)


@pytest.mark.parametrize("payload, x_dtype, fixed", [
    (b'{"engine": "no_such_engine", "times_us": {}, "iters": 1}', BF16, Sm90GemmEngine),
    (b'{"engine": "sm90", "times_us": {"sm90": 1.0}, "iters": 1}', FP16, CudaCoresEngine),  # sm90 takes BF16 tokens
    (b'{"engine": "cuda_cores"', BF16, Sm90GemmEngine),
    (b'{"engine": 3, "times_us": {}}', BF16, Sm90GemmEngine),
    (b'{"engine": "cuda_cores", "times_us": {"cuda_cores": "fast"}}', BF16, Sm90GemmEngine),
    (b'["cuda_cores"]', BF16, Sm90GemmEngine),
    (b"\xff\xfe", BF16, Sm90GemmEngine),
], ids=["unknown-engine", "engine-that-no-longer-supports-it", "truncated-json", "engine-not-a-name",
        "time-not-a-number", "not-an-object", "not-ascii"])
def test_stale_or_unreadable_payloads_are_ignored(weights, cache_dir: Path, payload, x_dtype, fixed) -> None:
    key = key_of(weights, x_dtype=x_dtype)
    _put(cache_dir, key, payload)
    with pytest.warns(CacheWarning, match="ignoring the tactic low-latency tactic nvfp4_weight_only"):
        assert select("auto", key) is fixed
    assert select("auto", key) is fixed  # remembered: no second warning, no second read


def test_corrupt_entry_file_is_removed_and_the_fixed_rule_runs(weights, cache_dir: Path) -> None:
    key = key_of(weights)
    path = _put(cache_dir, key, tactics.encode_choice(TuningResult("cuda_cores", {"cuda_cores": 1.0}), 5))
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.warns(CacheWarning, match="checksum"):
        assert select("auto", key) is Sm90GemmEngine
    assert not path.exists()


def test_explicit_engine_names_win(weights, cache_dir: Path) -> None:
    key = key_of(weights)
    store(key, TuningResult("cuda_cores", {"sm90": 2.0, "cuda_cores": 1.0}), 5)
    assert select("sm90", key) is Sm90GemmEngine and select("cuda_cores", key) is CudaCoresEngine
    store(key, TuningResult("sm90", {"sm90": 1.0, "cuda_cores": 2.0}), 5)
    assert select("auto", key) is Sm90GemmEngine and select("cuda_cores", key) is CudaCoresEngine
    with pytest.raises(ValueError, match="engine must be one of auto, sm90, .*cuda_cores"):
        select("cudnn", key)


def test_store_refuses_an_engine_that_does_not_run_the_call(weights, cache_dir: Path) -> None:
    with pytest.raises(ValueError, match="result.engine 'sm90' does not run"):
        store(key_of(weights, x_dtype=FP16), TuningResult("sm90", {"sm90": 1.0}), 5)
    assert not cache_dir.exists()


# ----------------------------------------------------------------------------- the op's call path
@pytest.fixture
def runs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the engines the op's calls ran on: every engine's launches replaced by a recorder."""
    ran: list[str] = []
    monkeypatch.setattr(op_module, "check_devices", lambda x, ids, weights: x.device)
    monkeypatch.setattr(op_module, "device_arch", lambda device: (9, 0))
    monkeypatch.setattr(op_module, "workspace_for", lambda *args: NullWorkspace)
    monkeypatch.setattr(grouped, "run", lambda engine, call: ran.append(engine.name))
    for engine in registry.ENGINES:
        if issubclass(engine, LayerEngine):
            monkeypatch.setattr(engine, "run", classmethod(lambda cls, call, buffers: ran.append(cls.name)))
    return ran


def _call(cfg: LowLatencyMoeConfig, weights, tokens: int, x_dtype=BF16) -> torch.Tensor:
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, H, generator=gen).to(x_dtype)
    ids = torch.stack([torch.randperm(E, generator=gen)[:TOP_K] for _ in range(tokens)]).to(torch.int32)
    return low_latency_moe(cfg, x, weights, Routing.unpacked(ids, torch.rand(tokens, TOP_K, generator=gen)))


def test_the_call_runs_the_stored_engine(weights, cache_dir: Path, runs: list[str],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    _call(config(), weights, 2)
    assert runs == ["sm90"]  # nothing stored: the fixed rule
    store(key_of(weights, tokens=2), TuningResult("cuda_cores", {"sm90": 9.0, "cuda_cores": 7.0}), 5)
    forget(monkeypatch)  # as a new process would: from the disk
    _call(config(), weights, 2)
    _call(config(), weights, 1)  # another token count: nothing stored for it
    _call(config(engine="sm90"), weights, 2)  # an explicit name wins
    _call(config(), weights, 2, FP16)  # FP16 tokens: another key (the CUDA cores only)
    assert runs == ["sm90", "cuda_cores", "sm90", "sm90", "cuda_cores"]


# ----------------------------------------------------------------------------- tune()'s arguments
BAD_TUNE_ARGUMENTS = [
    ({"top_k": 0}, ValueError, r"top_k must lie in 1\.\.4"),
    ({"top_k": 5}, ValueError, r"top_k must lie in 1\.\.4 .*weights' 4"),
    ({"top_k": 2.0}, TypeError, "top_k must be an int"),
    ({"top_k": True}, TypeError, "top_k must be an int"),
    ({"tokens": [0]}, ValueError, r"tokens must lie in 1\.\.max_num_tokens=4"),
    ({"tokens": [2, 5]}, ValueError, r"tokens must lie in 1\.\.max_num_tokens=4 .*got 5"),
    ({"tokens": []}, ValueError, "tokens must name at least one"),
    ({"tokens": ["1"]}, TypeError, "tokens must hold ints"),
    ({"tokens": 1.5}, TypeError, "tokens must be an int, a sequence of ints or None"),
    ({"x_dtype": torch.float32}, ValueError, "x_dtype must be one of torch.bfloat16, torch.float16"),
    ({"x_dtype": "bfloat16"}, TypeError, "x_dtype must be a torch.dtype"),
    ({"out_dtype": torch.float32}, ValueError, "out_dtype must be torch.bfloat16 or torch.float16"),
    ({"finalize": "yes"}, TypeError, "finalize must be a bool"),
    ({"activation": "silu"}, ValueError, "activation SiLU is non-gated but the weights were prepared for a gated"),
    ({"activation": "swish"}, ValueError, "unknown activation 'swish'"),
    ({"iters": 0}, ValueError, "iters must be a positive int"),
    ({"progress": 3}, TypeError, "progress must be a callable"),
    ({}, ValueError, "weights must be on a CUDA device to be tuned"),  # everything else is right
]


@pytest.mark.parametrize("kwargs, error, message", BAD_TUNE_ARGUMENTS,
                         ids=[next(iter(k), "cpu-weights") + f"-{i}" for i, (k, _, _) in enumerate(BAD_TUNE_ARGUMENTS)])
def test_tune_refuses_bad_arguments_before_running_anything(weights, monkeypatch, kwargs, error, message) -> None:
    monkeypatch.setattr(tuning, "capture_graph", lambda *a, **k: pytest.fail("tune measured despite a bad argument"))
    with pytest.raises(error, match=message):
        config().tune(weights, **{"top_k": TOP_K, **kwargs})


def test_tune_refuses_other_weights_and_format_rules() -> None:
    with pytest.raises(TypeError, match="weights must be prepared by LowLatencyMoeConfig"):
        config().tune(None, top_k=1)
    pair = stand_in_weights(config(), WeightFormat.NVFP4_W_NVFP4_A, E, 512, 128, torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match="out_dtype must be torch.bfloat16 for the NVFP4 weight"):
        config().tune(pair, top_k=1, out_dtype=FP16)
    with pytest.raises(ValueError, match="x_dtype must be one of torch.uint8"):
        config().tune(pair, top_k=1, x_dtype=BF16)


def test_token_counts_to_tune() -> None:
    assert tuning._check_tokens(None, 4) == [1, 2, 3, 4]
    assert tuning._check_tokens(3, 8) == [3]
    assert tuning._check_tokens((4, 1, 4), 8) == [1, 4]


# ----------------------------------------------------------------------------- tune()'s loop, GPU steps replaced
FAKE_US = {"sm90": 5.0, "cuda_cores": 4.0}  # per engine: the CUDA cores "faster"


@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch, runs: list[str]) -> list[str]:
    """tune() on the CPU: the weights' device taken as the GPU, no CUDA-graph capture (the call runs eagerly, into
    the ``runs`` recorder), each replay's median = FAKE_US of the engine that ran it."""
    monkeypatch.setattr(tuning, "_cuda_device", lambda weights: weights_device(weights))
    monkeypatch.setattr(tuning, "device_arch", lambda device: (9, 0))
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(L2_cache_size=64))
    monkeypatch.setattr(tuning, "capture_graph", lambda fn: (fn(), SimpleNamespace(replay=fn))[1])

    def median_us(fn, iters, *, warmup, flush):
        assert (iters, warmup, flush.numel()) == (7, tuning.WARMUP_REPLAYS, 128)
        before = len(runs)
        fn()
        [engine] = runs[before:]
        return FAKE_US.get(engine, 1.0) * (1 + len(runs) / 1000)

    monkeypatch.setattr(tuning, "median_us", median_us)
    return runs


def weights_device(weights) -> torch.device:
    return next(iter(weights.canonical())).device


@pytest.mark.parametrize("fmt, x_dtype", [
    (NVFP4_WO, None), (NVFP4_WO, FP16), (WeightFormat.NVFP4_W_NVFP4_A, None), (WeightFormat.FP8_PER_TENSOR, None),
    (WeightFormat.DEEPSEEK_FP8, None), (WeightFormat.DEEPSEEK_FP8, torch.float8_e4m3fn), (WeightFormat.BF16, None),
    (WeightFormat.MXINT4_WEIGHT_ONLY, FP16),
], ids=["nvfp4_wo", "nvfp4_wo-fp16", "pair", "fp8_per_tensor", "deepseek", "deepseek-prequantized", "bf16",
        "mxint4-fp16"])
def test_tune_times_every_candidate_and_stores_the_fastest(fmt, x_dtype, fake_gpu, cache_dir, monkeypatch) -> None:
    cfg = config(4)
    weights = stand_in_weights(cfg, fmt, E, 512, I, torch.Generator().manual_seed(2))
    lines: list[str] = []
    table = cfg.tune(weights, top_k=TOP_K, tokens=[1, 3], x_dtype=x_dtype, iters=7, progress=lines.append)
    x_dtype = x_dtype or token_dtypes(fmt)[0]
    token_dtype = tuning.request_token_dtype(fmt, x_dtype)
    assert sorted(table) == [1, 3] and len(lines) == 2
    forget(monkeypatch)  # a new process: the choices come from the disk
    for t, result in table.items():
        key = TacticKey(layer_request(weights, (9, 0), t, token_dtype, BF16, True), TOP_K, True, x_dtype, None)
        names = [e.name for e in registry.supporting(key.request)]
        assert list(result.times_us) == names
        assert result.engine == min(names, key=lambda n: FAKE_US.get(n, 1.0))
        assert select("auto", key).name == result.engine
    assert fake_gpu == [n for t in (1, 3) for n in table[t].times_us for _ in range(2)]  # warm-up + captured call
    assert lines[1].startswith(f"{fmt.value} T=3: ") and lines[1].endswith(f"-> {table[3].engine}")
