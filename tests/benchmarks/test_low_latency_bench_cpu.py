"""The low-latency benchmark on the CPU: floors, targets, arguments, its small helpers (GB/s, the engine cells, the
tactic key of a row's call, launch counting) (the timings themselves need a GPU)."""

from __future__ import annotations

import importlib
import sys
from types import SimpleNamespace

import pytest
import torch

from tests.support import REPO

sys.path.insert(0, str(REPO / "benchmarks"))

import bench_low_latency as bench  # noqa: E402
import common  # noqa: E402

from cudnn_moe.engines import registry  # noqa: E402
from cudnn_moe.engines.base import LayerEngine  # noqa: E402
from cudnn_moe.low_latency import LowLatencyMoeConfig, WeightFormat, grouped  # noqa: E402
from cudnn_moe.low_latency.stand_in import stand_in_weights  # noqa: E402
from tests.support.low_latency import NullWorkspace  # noqa: E402

QWEN3, DEEPSEEK = common.MODELS["qwen3-30b-a3b"], common.MODELS["deepseek-v3"]


def test_floors() -> None:
    # Qwen3-30B-A3B, 8 touched experts: 8 * 3 * 2048 * 768 weights
    weights = 8 * 3 * 2048 * 768
    assert bench.floor_us(QWEN3, 8, WeightFormat.NVFP4_WEIGHT_ONLY, 4.3) == pytest.approx(weights * 0.5625 / 4.3e6)
    assert bench.floor_us(QWEN3, 8, WeightFormat.NVFP4_WEIGHT_ONLY, 4.3) == pytest.approx(4.938, abs=1e-3)
    assert bench.floor_us(QWEN3, 8, WeightFormat.MXFP4_WEIGHT_ONLY, 4.3) == pytest.approx(weights * 0.53125 / 4.3e6)
    assert bench.floor_us(QWEN3, 8, WeightFormat.MXINT4_WEIGHT_ONLY, 4.3) == pytest.approx(weights * 0.5625 / 4.3e6)
    assert bench.floor_us(DEEPSEEK, 8, WeightFormat.BF16, 4.3) == pytest.approx(8 * 3 * 7168 * 2048 * 2 / 4.3e6)
    assert bench.floor_us(DEEPSEEK, 8, WeightFormat.FP8_WEIGHT_ONLY, 4.3) == pytest.approx(8 * 3 * 7168 * 2048 / 4.3e6)
    assert bench.floor_us(DEEPSEEK, 8, WeightFormat.FP8_PER_TENSOR, 4.3) == pytest.approx(8 * 3 * 7168 * 2048 / 4.3e6)
    assert bench.floor_us(DEEPSEEK, 8, WeightFormat.DEEPSEEK_FP8, 4.3) == pytest.approx(
        8 * 3 * 7168 * 2048 * (1 + 4 / 128**2) / 4.3e6)
    assert bench.floor_us(QWEN3, 8, WeightFormat.MXFP4_W_MXFP8_A, 4.3) == pytest.approx(weights * 0.53125 / 4.3e6)
    assert bench.floor_us(QWEN3, 8, WeightFormat.MXFP8_W_MXFP8_A, 4.3) == pytest.approx(weights * 1.03125 / 4.3e6)
    assert set(bench.BYTES_PER_WEIGHT) == set(WeightFormat)


def test_targets() -> None:
    text, met = bench.target(QWEN3, 1, WeightFormat.NVFP4_WEIGHT_ONLY)
    assert text == "<= 15 us" and met(14.9, 5.0) and not met(15.1, 5.0)
    text, met = bench.target(QWEN3, 8, WeightFormat.MXINT4_WEIGHT_ONLY)
    assert text == "<= 1.3x floor" and met(39.0, 30.0) and not met(39.1, 30.0)
    assert bench.target(QWEN3, 4, WeightFormat.MXFP4_WEIGHT_ONLY) is None
    assert bench.target(DEEPSEEK, 2, WeightFormat.MXFP4_WEIGHT_ONLY) is None
    assert bench.target(DEEPSEEK, 1, WeightFormat.MXFP4_WEIGHT_ONLY)[0] == "<= 1.3x floor"
    assert bench.target(DEEPSEEK, 8, WeightFormat.FP16)[0] == "<= 1.1x floor"
    assert bench.target(QWEN3, 1, WeightFormat.BF16) is None
    assert bench.target(DEEPSEEK, 1, WeightFormat.NVFP4_W_NVFP4_A) is None
    assert bench.target(DEEPSEEK, 8, WeightFormat.FP8_WEIGHT_ONLY)[0] == "<= 1.3x floor"
    assert bench.target(DEEPSEEK, 1, WeightFormat.FP8_WEIGHT_ONLY)[0] == "<= 1.6x floor"
    assert bench.target(QWEN3, 1, WeightFormat.FP8_WEIGHT_ONLY)[0] == "<= 20 us"
    assert "fp8_weight_only" in bench.parse_args(["--formats", "fp8_weight_only"]).formats
    assert bench.target(DEEPSEEK, 8, WeightFormat.FP8_PER_TENSOR)[0] == "<= 1.3x floor"
    assert bench.target(QWEN3, 1, WeightFormat.FP8_PER_TENSOR)[0] == "<= 20 us"
    assert "fp8_per_tensor" in bench.parse_args(["--formats", "fp8_per_tensor"]).formats
    assert bench.target(DEEPSEEK, 8, WeightFormat.DEEPSEEK_FP8)[0] == "<= 1.3x floor"
    assert bench.target(DEEPSEEK, 1, WeightFormat.DEEPSEEK_FP8)[0] == "<= 1.6x floor"
    assert bench.target(QWEN3, 1, WeightFormat.DEEPSEEK_FP8)[0] == "<= 20 us"
    assert "deepseek_fp8" in bench.parse_args(["--formats", "deepseek_fp8"]).formats


def test_arguments() -> None:
    args = bench.parse_args([])
    assert args.tokens == [1, 2, 4, 8] and args.engines == ["sm90"] and args.peers
    assert args.formats == [f.value for f in WeightFormat] and args.bandwidth_tbs == 4.3
    assert bench.parse_args(["--formats", "bf16", "--no-peers"]).formats == ["bf16"]
    assert not args.cuda_cores and bench.parse_args(["--cuda-cores"]).cuda_cores
    assert not args.tune and bench.parse_args(["--tune"]).tune
    assert args.engine == "auto" and bench.parse_args(["--cuda-cores"]).engine == "cuda_cores"
    assert bench.parse_args(["--engine", "ll_mma", "--formats", "deepseek_fp8"]).engine == "ll_mma"
    with pytest.raises(SystemExit):
        bench.parse_args(["--cuda-cores", "--engine", "ll_mma"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--tune", "--engine", "ll_mma"])
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(["--tokens", "16"])
    assert exc.value.code == 2


def test_tune_and_cuda_cores_exclude_each_other(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(["--tune", "--cuda-cores"])
    assert exc.value.code == 2 and "--tune measures which engine runs each call" in capsys.readouterr().err


def test_weight_gbps_and_engine_cells() -> None:
    floor = bench.floor_us(QWEN3, 8, WeightFormat.NVFP4_WEIGHT_ONLY, 4.3)
    assert bench.weight_gbps(QWEN3, 8, WeightFormat.NVFP4_WEIGHT_ONLY, floor) == pytest.approx(4300.0)
    assert bench.weight_gbps(DEEPSEEK, 3, WeightFormat.BF16, 100.0) == pytest.approx(3 * 3 * 7168 * 2048 * 2 / 100e-6 / 1e9)
    assert bench.engine_times_cell({"sm90": 12.34, "cuda_cores": "error", "mma": 7.0}) == "sm90 12.3, cuda_cores error, mma 7.0"


def test_kernel_launches_count_the_kernel_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(common.driver, "graph_node_types", lambda graph: [0, 2, 0, 5, 0] if graph == 1234 else [])
    assert bench.kernel_launches(SimpleNamespace(raw_cuda_graph=lambda: 1234)) == 3


@pytest.mark.parametrize("fmt", list(WeightFormat), ids=[f.value for f in WeightFormat])
def test_tactic_key_is_the_one_the_rows_call_looks_up(fmt, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine column (select of tactic_key) names the engine ll_call's call runs: the op asks the same key."""
    op_module = importlib.import_module("cudnn_moe.low_latency.op")
    config = LowLatencyMoeConfig(4, arch="sm90")
    weights = stand_in_weights(config, fmt, 4, 512, 128, torch.Generator().manual_seed(0))
    asked = []
    monkeypatch.setattr(op_module, "check_devices", lambda x, ids, w: x.device)
    monkeypatch.setattr(op_module, "device_arch", lambda device: (9, 0))
    monkeypatch.setattr(op_module, "workspace_for", lambda *args: NullWorkspace)
    real_select = op_module.select
    monkeypatch.setattr(op_module, "select", lambda name, key: asked.append(key) or real_select(name, key))
    monkeypatch.setattr(grouped, "run", lambda engine, call: None)
    for engine in registry.ENGINES:
        if issubclass(engine, LayerEngine):
            monkeypatch.setattr(engine, "run", classmethod(lambda cls, call, buffers: None))
    x = torch.randn(3, 512).to(torch.bfloat16)
    ids = torch.tensor([[0, 1], [2, 3], [1, 2]], dtype=torch.int32)
    bench.ll_call(config, weights, x, ids, torch.rand(3, 2))()
    assert asked == [bench.tactic_key(weights, 3, 2, (9, 0), None)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_main_without_gpu_returns_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


class _FakeTimer:
    def __init__(self, iters: int = 2) -> None:
        self.iters = iters
        self.clock = common.GpuClock(lambda: None)  # no nvidia-smi

    def median_us(self, fn) -> float:
        fn()
        return 10.0


def test_tables_with_fake_cuda(monkeypatch: pytest.MonkeyPatch, tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """The whole --tune run on the CPU: the GPU steps (capture, timing, the op, the tuner) replaced; the FP8 peer
    really runs (torch._scaled_mm per expert: _scaled_grouped_mm has no CPU kernel)."""
    import fp8_peer

    from cudnn_moe.cache import runtime as cache_runtime
    from cudnn_moe.low_latency import TuningResult, tactics

    tiny = common.ModelShape("tiny", "Tiny", experts=8, hidden=256, intermediate=128, top_k=2)
    real_generator = torch.Generator
    monkeypatch.setitem(common.MODELS, "tiny", tiny)
    monkeypatch.setattr(torch, "Generator", lambda device=None: real_generator())
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(common, "Timer", _FakeTimer)
    monkeypatch.setattr(cache_runtime, "_explicit", tmp_path / "cache")
    monkeypatch.setattr(tactics, "_table", {})
    monkeypatch.setattr(bench, "gpu_missing", lambda name: False)
    monkeypatch.setattr(bench, "device_arch", lambda: (9, 0))
    graph = lambda fn, keep_graph=False: SimpleNamespace(replay=fn, raw_cuda_graph=lambda: 7)  # noqa: E731
    monkeypatch.setattr(bench, "capture", graph)
    monkeypatch.setattr(fp8_peer, "capture", graph)
    monkeypatch.setattr(common.driver, "graph_node_types", lambda handle: [0, 0, 2, 0] if handle == 7 else [])
    monkeypatch.setattr(bench.LowLatencyBench, "peers", lambda self, *args: None)  # the BF16 and fused peers
    ran = []
    monkeypatch.setattr(bench, "low_latency_moe", lambda config, inputs, weights, routing, **kw: ran.append(
        (weights.format.value, config.engine)))

    def fake_tune(config, weights, *, top_k, out_dtype, tokens, iters, progress):
        for t in tokens:  # the CUDA cores "win" every NVFP4 weight-only count
            key = bench.tactic_key(weights, t, top_k, (9, 0), 0)
            tactics.store(key, TuningResult("cuda_cores", {e.name: 1.0 for e in registry.supporting(key.request)}), 2)
            progress(f"{weights.format.value} T={t}")

    monkeypatch.setattr(LowLatencyMoeConfig, "tune", fake_tune)
    md = tmp_path / "ll.md"
    assert bench.main(["--models", "tiny", "--tokens", "1", "2", "--formats", "nvfp4_weight_only", "fp8_weight_only",
                       "--tune", "--iters", "2", "--markdown", str(md)]) == 0
    rows = [line.strip("| ").split(" | ") for line in md.read_text().splitlines() if line.startswith("| Tiny |")]
    assert [r[:5] for r in rows] == [["Tiny", "1", "nvfp4_weight_only", "cuda_cores", "3"],
                                     ["Tiny", "2", "nvfp4_weight_only", "cuda_cores", "3"],
                                     ["Tiny", "1", "fp8_weight_only", "cuda_cores", "3"],
                                     ["Tiny", "2", "fp8_weight_only", "cuda_cores", "3"]]
    assert all(len(r) == 14 for r in rows)
    assert [r[12] for r in rows] == ["-", "-", "10.0 (per expert)", "10.0 (per expert)"]
    assert [r[13] for r in rows] == ["sm90 10.0, cuda_cores 10.0"] * 2 + ["cuda_cores 10.0, ll_mma 10.0"] * 2
    assert rows[0][6] == "10.0" and float(rows[0][9]) == pytest.approx(
        bench.weight_gbps(tiny, int(rows[0][5]), WeightFormat.NVFP4_WEIGHT_ONLY, 10.0), abs=0.5)
    # per row (one timed call each here): every engine on its own, then the tuned call
    assert ran[:3] == [("nvfp4_weight_only", "sm90"), ("nvfp4_weight_only", "cuda_cores"), ("nvfp4_weight_only", "auto")]
    assert len(ran) == 2 * 3 + 2 * 3
    assert "tuned nvfp4_weight_only T=2" in capsys.readouterr().err
    # --engine ll_mma: the FP8 rows name it, the NVFP4 rows (which it does not run) say none
    assert bench.main(["--models", "tiny", "--tokens", "1", "--formats", "nvfp4_weight_only", "fp8_weight_only",
                       "--engine", "ll_mma", "--no-peers", "--iters", "2", "--markdown", str(md)]) == 0
    rows = [line.strip("| ").split(" | ") for line in md.read_text().splitlines() if line.startswith("| Tiny |")]
    assert [r[2:4] for r in rows] == [["nvfp4_weight_only", "none"], ["fp8_weight_only", "ll_mma"]]
