"""The low-latency benchmark on the CPU: floors, targets, arguments (the timings themselves need a GPU)."""

from __future__ import annotations

import sys

import pytest
import torch

from tests.support import REPO

sys.path.insert(0, str(REPO / "benchmarks"))

import bench_low_latency as bench  # noqa: E402
import common  # noqa: E402

from cudnn_moe.low_latency import WeightFormat  # noqa: E402

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
    assert set(bench.BYTES_PER_WEIGHT) == set(WeightFormat)


def test_targets() -> None:
    text, met = bench.target(QWEN3, 1, WeightFormat.NVFP4_WEIGHT_ONLY)
    assert text == "<= 20 us" and met(19.9, 5.0) and not met(20.1, 5.0)
    text, met = bench.target(QWEN3, 8, WeightFormat.MXINT4_WEIGHT_ONLY)
    assert text == "<= 1.5x floor" and met(45.0, 30.0) and not met(45.1, 30.0)
    assert bench.target(QWEN3, 4, WeightFormat.MXFP4_WEIGHT_ONLY) is None
    assert bench.target(DEEPSEEK, 2, WeightFormat.MXFP4_WEIGHT_ONLY)[0] == "<= 1.6x floor"
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
    assert args.engine == "auto" and bench.parse_args(["--cuda-cores"]).engine == "cuda_cores"
    assert bench.parse_args(["--engine", "ll_mma", "--formats", "deepseek_fp8"]).engine == "ll_mma"
    with pytest.raises(SystemExit):
        bench.parse_args(["--cuda-cores", "--engine", "ll_mma"])
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(["--tokens", "16"])
    assert exc.value.code == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_main_without_gpu_returns_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
