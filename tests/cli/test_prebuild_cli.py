"""The prebuild command line: help, argument errors, cache management without a GPU, the no-GPU error."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cudnn_moe import prebuild
from tests.support.cli import run
from cudnn_moe.cache import KIND_CUDNN_PLAN, KIND_KERNEL, DiskCache, EntryKey, Environment
from cudnn_moe.cache import runtime as cache_runtime
from cudnn_moe.prebuild import DEFAULT_BUCKETS, PRESETS_FILE, LayerShape, Progress, load_presets

ENV = Environment(gpu_name="NVIDIA H200", compute_capability=(9, 0), cudnn_backend=91900, cudnn_frontend="1.32.0")


@pytest.fixture
def filled(tmp_path: Path) -> Path:
    disk = DiskCache(tmp_path / "cache")
    disk.put(EntryKey(KIND_CUDNN_PLAN, "gemm1 E8 bucket 1", {"experts": 8, "bucket": 1}, ENV), b"p" * 100)
    disk.put(EntryKey(KIND_CUDNN_PLAN, "gemm2 E8 bucket 1", {"experts": 8, "bucket": 1}, ENV), b"q" * 50)
    disk.put(EntryKey(KIND_KERNEL, "sort", {"threads": 1024}, ENV), b"cubin")
    return disk.root


def test_help_via_module_subprocess() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "cudnn_moe", "prebuild", "--help"], capture_output=True, text=True, check=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    ).stdout
    for option in ("--preset NAME|PATH", "--shape E,H,I,TOPK", "--buckets", "--activation", "--engine",
                   "--cache-dir", "--list", "--verify", "--clear", "--quiet"):
        assert option in out


def test_top_level_help_lists_prebuild(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["--help"], capsys)
    assert code == 0 and "prebuild" in out and "demo" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--preset", "no-such-model"], "argument --preset: unknown preset 'no-such-model'; known: qwen3-30b-a3b"),
        (["--preset", "missing.json"], "argument --preset: cannot read preset file missing.json"),
        (["--shape", "8,4096,14336"], "argument --shape: bad shape '8,4096,14336': expected 4"),
        (["--shape", "8,4096,x,2"], "argument --shape: bad shape"),
        (["--shape", "8,4096,1024,9"], "top_k (9) cannot exceed experts (8)"),
        (["--shape", "8,0,1024,2"], "hidden must be a positive integer"),
        (["--shape", "8,100,256,2"], "argument --shape: bad shape '8,100,256,2': hidden size H must be a multiple of 128"),
        (["--shape", "8,128,200,2"], "argument --shape: bad shape '8,128,200,2': intermediate size I must be a multiple of 128"),
        (["--buckets", "1,3"], "argument --buckets: bad buckets '1,3': 3 is not a power of two"),
        (["--buckets", "8192"], "argument --buckets: bad buckets '8192'"),
        (["--buckets", "max=0"], "argument --buckets: bad buckets 'max=0': max must be >= 1"),
        (["--buckets", "max=5000"], "argument --buckets: bad buckets 'max=5000': max must be <= 4096"),
        (["--buckets", "a,b"], "argument --buckets: bad buckets 'a,b'"),
        (["--activation", "swish"], "argument --activation: unknown activation 'swish'"),
        (["--engine", "fast"], "argument --engine: invalid choice: 'fast'"),
        ([], "nothing to do: give --preset or --shape"),
    ],
)
def test_bad_arguments_exit_2_naming_the_argument(argv, message, capsys, no_gpu) -> None:
    code, out, err = run(["prebuild", *argv], capsys)
    assert code == 2
    assert message in err


def test_bad_preset_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.json"
    for text, message in [
        ("{", "is not JSON"),
        ("[]", "non-empty JSON object"),
        ('{"m": {"name": "M", "experts": 8}}', "preset 'm'"),
        ('{"m": {"name": "M", "experts": 8, "hidden": 128, "intermediate": 128, "top_k": true}}', "top_k must be a positive integer"),
    ]:
        bad.write_text(text)
        code, _, err = run(["prebuild", "--preset", str(bad)], capsys)
        assert code == 2 and "argument --preset" in err and message in err


def test_parsing_of_good_arguments(tmp_path: Path) -> None:
    assert prebuild.parse_buckets("max=4096") == DEFAULT_BUCKETS
    assert prebuild.parse_buckets("max=100") == (1, 2, 4, 8, 16, 32, 64, 128)
    assert prebuild.parse_buckets("max=5") == (1, 2, 4, 8)  # N rounded up to a power of two, as --help says
    assert prebuild.parse_buckets("8,1,8,2") == (1, 2, 8)
    assert DEFAULT_BUCKETS[0] == 1 and DEFAULT_BUCKETS[-1] == 4096 and len(DEFAULT_BUCKETS) == 13
    assert prebuild.parse_shape("64,4096,1408,6") == LayerShape("custom 64,4096,1408,6", 64, 4096, 1408, 6)
    assert prebuild.parse_preset("mixtral-8x7b") == [LayerShape("Mixtral-8x7B", 8, 4096, 14336, 2)]
    mine = tmp_path / "mine.json"
    mine.write_text(json.dumps({"a": {"name": "A", "experts": 4, "hidden": 256, "intermediate": 128, "top_k": 1},
                                "b": {"name": "B", "experts": 8, "hidden": 128, "intermediate": 256, "top_k": 2}}))
    assert [s.name for s in prebuild.parse_preset(str(mine))] == ["A", "B"]


def test_shipped_presets() -> None:
    presets = load_presets(PRESETS_FILE)
    assert {"qwen3-30b-a3b", "deepseek-v3", "mixtral-8x7b", "gpt-oss-120b"} <= set(presets)
    assert presets["gpt-oss-120b"] == LayerShape("gpt-oss-120b", 128, 2880, 2880, 4)
    assert presets["deepseek-v3"] == LayerShape("DeepSeek-V3", 256, 7168, 2048, 8)


def test_no_gpu_error(capsys: pytest.CaptureFixture[str], no_gpu, tmp_path: Path) -> None:
    code, out, err = run(["prebuild", "--preset", "qwen3-30b-a3b", "--cache-dir", str(tmp_path / "c"), "--quiet"], capsys)
    assert code == 1
    assert err.strip() == "cudnn-moe prebuild: error: prebuild needs a CUDA GPU; --list/--verify/--clear work without one"
    assert out == ""


def test_list(filled: Path, capsys: pytest.CaptureFixture[str], no_gpu) -> None:
    code, out, err = run(["prebuild", "--list", "--cache-dir", str(filled)], capsys)
    assert code == 0 and err == ""
    assert "gemm1 E8 bucket 1" in out and "gemm2 E8 bucket 1" in out and "kernel  sort" in out
    assert '"experts": 8' in out and "NVIDIA H200 sm90 cuDNN 91900" in out
    assert out.strip().splitlines()[-1].startswith("3 entries, ")


def test_list_via_environment_variable(filled: Path, capsys, no_gpu, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDNN_MOE_CACHE_DIR", str(filled))
    code, out, _ = run(["prebuild", "--list"], capsys)
    assert code == 0 and "3 entries" in out and str(filled) in out


def test_list_of_a_missing_cache_creates_nothing(tmp_path: Path, capsys, no_gpu) -> None:
    code, out, _ = run(["prebuild", "--list", "--verify", "--cache-dir", str(tmp_path / "none")], capsys)
    assert code == 0 and "0 entries" in out and not (tmp_path / "none").exists()


def test_verify_good_then_bad(filled: Path, capsys, no_gpu) -> None:
    code, out, _ = run(["prebuild", "--verify", "--cache-dir", str(filled)], capsys)
    assert code == 0 and "3 ok, 0 bad" in out
    victim = sorted(filled.glob("*.entry"))[0]
    victim.write_bytes(victim.read_bytes()[:-1])
    code, out, _ = run(["prebuild", "--verify", "--cache-dir", str(filled)], capsys)
    assert code == 1 and "2 ok, 1 bad" in out and f"BAD  {victim.name}" in out and "truncated" in out


def test_clear(filled: Path, capsys, no_gpu) -> None:
    code, out, _ = run(["prebuild", "--clear", "--list", "--cache-dir", str(filled)], capsys)
    assert code == 0 and "removed 3 files" in out and "0 entries" in out
    assert list(filled.iterdir()) == [filled / "CACHEDIR.TAG"]  # the cache's marker stays


def test_build_path_with_a_fake_layer(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys) -> None:
    """The loop around build_layer: progress, summary table, failures and exit code (no GPU touched)."""
    monkeypatch.setattr(prebuild, "_gpu_problem", lambda engine: None)
    monkeypatch.setenv("CUDNN_MOE_CACHE_DIR", "restored after the test")
    monkeypatch.setattr(cache_runtime, "_explicit", cache_runtime._explicit)  # run_prebuild sets it
    seen = []

    def fake_build_layer(shape, buckets, cache, activation, engine, progress):
        seen.append((shape.name, tuple(buckets), cache.root, type(activation).__name__, engine))
        if shape.experts == 128:
            raise ValueError("hidden size (w1_bf16.shape[2]) must be a positive multiple of 128, got 2880")
        results = []
        for b in buckets:
            results.append(prebuild.BuildResult(shape, b, "disk" if b == 1 else "built", 0.5,
                                                entries_built=0 if b == 1 else 2, entries_loaded=3 if b == 1 else 0))
            progress.advance(f"{shape.name} bucket {b}")
        return results

    monkeypatch.setattr(prebuild, "build_layer", fake_build_layer)
    cache = tmp_path / "c"
    code, out, err = run(["prebuild", "--preset", "mixtral-8x7b", "--preset", "gpt-oss-120b", "--buckets", "1,2,4",
                          "--activation", "geglu", "--cache-dir", str(cache)], capsys)
    assert code == 1
    assert seen == [("Mixtral-8x7B", (1, 2, 4), cache, "GeGLU", "auto"), ("gpt-oss-120b", (1, 2, 4), cache, "GeGLU", "auto")]
    assert os.environ["CUDNN_MOE_CACHE_DIR"] == str(cache)
    lines = out.splitlines()
    assert lines[0].split() == ["layer", "buckets", "built", "loaded", "failed", "seconds", "entries_built",
                                "entries_loaded"]
    assert lines[1].split()[-7:] == ["3", "2", "1", "0", "1.50", "4", "3"]
    assert lines[2].split()[-7:] == ["3", "0", "0", "3", "0.00", "0", "0"]
    assert lines[3].split() == ["total", "6", "2", "1", "3", "1.50", "4", "3"]
    assert cache_runtime._explicit == cache  # the engines' plans and kernels go there
    assert "failed: gpt-oss-120b (E128 H2880 I2880 top-4) buckets 1, 2, 4: ValueError: hidden size" in out
    assert "6/6" in err and "ETA" in err


def test_progress_bar() -> None:
    stream = io.StringIO()
    bar = Progress(4, stream=stream, width=8)
    for i in range(4):
        bar.advance(f"step {i}")
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("[##......] 1/4 step 0") and "ETA" in lines[0]
    assert lines[-1].startswith("[########] 4/4 step 3") and "ETA 0.0s" in lines[-1]
    quiet = io.StringIO()
    Progress(2, stream=quiet, enabled=False).advance()
    assert quiet.getvalue() == ""
