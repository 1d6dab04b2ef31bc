"""benchmarks/bench_glue.py on the CPU: it imports, parses its options, sizes token rows per layout, and the
stages it takes from the executor exist there (the timings themselves need a GPU)."""

from __future__ import annotations

import sys

from tests.support import REPO

sys.path.insert(0, str(REPO / "benchmarks"))

import bench_glue  # noqa: E402
import bench_stages  # noqa: E402

from cudnn_moe.kernels import TokenLayout  # noqa: E402


def test_token_bytes_per_layout() -> None:
    assert bench_glue.token_bytes(2048, TokenLayout.BF16_FRAGMENTS) == 4096
    assert bench_glue.token_bytes(2048, TokenLayout.NVFP4_LINEAR) == 1024 + 128
    assert bench_glue.token_bytes(2048, TokenLayout.NVFP4_SWIZZLED_128X4) == 1024 + 128


def test_glue_stages_are_executor_stages() -> None:
    assert set(bench_glue.GLUE) - {"stage", "finalize"} <= set(bench_stages.STAGES)


def test_main_without_gpu_says_so(monkeypatch) -> None:
    monkeypatch.setattr(bench_glue, "gpu_missing", lambda script: True)
    assert bench_glue.main(["--models", "qwen3-30b-a3b", "--tokens", "1", "--bandwidth", "3.35"]) == 2


def test_cost_in_a_chain() -> None:
    """The in-chain column: what each launch after the first adds to a graph of back-to-back launches."""
    calls: list[int] = []
    bench_glue.chained(lambda: calls.append(1), bench_glue.CHAIN_LAUNCHES)()
    assert len(calls) == bench_glue.CHAIN_LAUNCHES
    assert bench_glue.per_launch_in_chain(9.6, 27.6, 4) == 6.0
    assert bench_glue.per_launch_in_chain(5.0, 5.0, 4) == 0.0
