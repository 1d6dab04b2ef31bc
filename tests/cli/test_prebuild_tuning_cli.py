"""``cudnn-moe prebuild --low-latency FORMAT``: tuning the low-latency tactics of layer shapes (arguments, the
no-GPU error, the loop and its table with tune_layer replaced, --verify's loading of tactic entries)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cudnn_moe import prebuild
from cudnn_moe.cache import KIND_TACTIC, EntryKey, Environment
from cudnn_moe.cache import runtime as cache_runtime
from cudnn_moe.low_latency import TuningResult
from cudnn_moe.low_latency.tactics import encode_choice
from tests.support.cli import run


@pytest.mark.parametrize(("argv", "message"), [
    (["--low-latency", "nvfp5"], "argument --low-latency: invalid choice: 'nvfp5'"),
    (["--low-latency-tokens", "9"], "argument --low-latency-tokens: must be an integer in 1..8, got '9'"),
    (["--low-latency-tokens", "0"], "argument --low-latency-tokens: must be an integer in 1..8, got '0'"),
    (["--low-latency-tokens", "two"], "argument --low-latency-tokens: must be an integer in 1..8, got 'two'"),
])
def test_bad_arguments_exit_2(argv, message, capsys, no_gpu) -> None:
    code, _, err = run(["prebuild", "--preset", "qwen3-30b-a3b", *argv], capsys)
    assert code == 2 and message in err


def test_help_lists_the_tuning_options(capsys) -> None:
    code, out, _ = run(["prebuild", "--help"], capsys)
    assert code == 0 and "--low-latency FORMAT" in out and "--low-latency-tokens N" in out


def test_no_gpu_error(capsys, no_gpu, tmp_path: Path) -> None:
    code, out, err = run(["prebuild", "--shape", "8,256,128,2", "--low-latency", "bf16",
                          "--cache-dir", str(tmp_path / "c")], capsys)
    assert code == 1 and out == ""
    assert err.strip() == f"cudnn-moe prebuild: error: {prebuild.NO_GPU}"
    assert not (tmp_path / "c").exists()


def test_tuning_loop_with_a_fake_layer(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys) -> None:
    monkeypatch.setattr(prebuild, "_low_latency_gpu_problem", lambda: None)
    monkeypatch.setattr(prebuild, "build_layer", lambda *a: pytest.fail("--low-latency builds no fused buckets"))
    monkeypatch.setenv("CUDNN_MOE_CACHE_DIR", "restored after the test")
    monkeypatch.setattr(cache_runtime, "_explicit", cache_runtime._explicit)  # run_prebuild sets it
    seen = []

    def fake_tune_layer(shape, weight_format, activation, max_tokens):
        seen.append((shape.name, weight_format, type(activation).__name__, max_tokens))
        if weight_format == "fp8_per_tensor":
            raise ValueError("intermediate must be a positive multiple of 128, got 1408")
        return {t: TuningResult("sm90" if t > 1 else "cuda_cores", {"sm90": 10.0 / t + 1.0, "cuda_cores": 3.0 * t})
                for t in range(1, max_tokens + 1)}

    monkeypatch.setattr(prebuild, "tune_layer", fake_tune_layer)
    cache = tmp_path / "c"
    code, out, err = run(["prebuild", "--shape", "8,256,128,2", "--low-latency", "nvfp4_weight_only",
                          "--low-latency", "fp8_per_tensor", "--low-latency", "nvfp4_weight_only",
                          "--low-latency-tokens", "2", "--activation", "geglu", "--cache-dir", str(cache)], capsys)
    assert code == 1
    assert seen == [("custom 8,256,128,2", "nvfp4_weight_only", "GeGLU", 2),
                    ("custom 8,256,128,2", "fp8_per_tensor", "GeGLU", 2)]
    lines = out.splitlines()
    assert lines[0].split() == ["layer", "format", "T", "engine", "times", "(us)"]
    assert lines[1].split()[-7:] == ["nvfp4_weight_only", "1", "cuda_cores", "sm90", "11.0,", "cuda_cores", "3.0"]
    assert lines[2].split()[-7:] == ["nvfp4_weight_only", "2", "sm90", "sm90", "6.0,", "cuda_cores", "6.0"]
    assert lines[3] == ("failed: custom 8,256,128,2 (E8 H256 I128 top-2) fp8_per_tensor: ValueError: intermediate "
                        "must be a positive multiple of 128, got 1408")
    assert len(lines) == 4
    assert cache_runtime._explicit == cache and os.environ["CUDNN_MOE_CACHE_DIR"] == str(cache)
    assert "2/2" in err


def test_verify_loads_tactic_entries() -> None:
    key = EntryKey(KIND_TACTIC, "low-latency tactic", {"tokens": 1}, Environment())
    assert prebuild.load_entry(key, encode_choice(TuningResult("sm90", {"sm90": 1.0}), 3), 0) == "ok"
    with pytest.raises(ValueError, match="not a tactic payload"):
        prebuild.load_entry(key, b"{}", 0)
