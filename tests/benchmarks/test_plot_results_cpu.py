"""benchmarks/plot_results.py on the saved benchmark outputs (benchmarks/data): the tables are read into the
right series and a PNG per model is written (skipped without matplotlib, an optional extra)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import plot_results  # noqa: E402


def test_tables_become_series() -> None:
    series = plot_results.read_tables((BENCHMARKS / "data" / "bench_moe.md").read_text())
    assert set(series) == {"Qwen3-30B-A3B", "DeepSeek-V3"}
    qwen = series["Qwen3-30B-A3B"]
    assert {"sm90", "FP4 floor", "torch BF16 layer (graph)", "BF16 floor"} <= set(qwen)
    assert sorted(qwen["sm90"])[0] == (1.0, 50.0) and len(qwen["sm90"]) == 5
    low_latency = plot_results.read_tables((BENCHMARKS / "data" / "bench_low_latency.md").read_text())
    assert any(name.startswith("nvfp4_weight_only tensor cores") for name in low_latency["DeepSeek-V3"])


def test_one_png_per_model(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    assert plot_results.main([str(BENCHMARKS / "data" / "bench_moe.md"), "--out", str(tmp_path)]) == 0
    pngs = sorted(p.name for p in tmp_path.glob("*.png"))
    assert pngs == ["bench-moe-deepseek-v3.png", "bench-moe-qwen3-30b-a3b.png"]
    assert all((tmp_path / p).read_bytes().startswith(b"\x89PNG") for p in pngs)
