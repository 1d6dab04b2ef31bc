"""Shared pytest setup: the `gpu` marker skips cleanly on machines without a usable CUDA stack, and the session's
nvcc builds start before the first test."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

# tests/ is a package whose folders mirror cudnn_moe (tests/ops/fused/, tests/engines/sm90/, ...); its modules share
# helpers through tests.support only (`from tests.support.moe_checks import check_close`). pytest's default import
# mode puts the checkout's root on sys.path for a package like this; so does this line under --import-mode=importlib.
_REPO = str(Path(__file__).resolve().parent.parent)
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)


def _gpu_stack_missing() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    for module in ("cupy", "cudnn"):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = _gpu_stack_missing()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"gpu test skipped: {reason}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def nvcc_builds(request: pytest.FixtureRequest) -> Iterator[None]:
    """Before the first test: start every nvcc build the selected tests need (their modules' ``nvcc_jobs``), in
    parallel in the background, each once per session (tests/support/kernel_sources.py); at the end drop what is
    left."""
    from tests.support import kernel_sources

    kernel_sources.prefetch(request.session.items)
    yield
    kernel_sources.shutdown()


@pytest.fixture
def no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """A machine without a GPU, on which prebuild must never reach build_layer (the CLI and cache tests)."""
    from cudnn_moe import prebuild

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(prebuild, "build_layer", lambda *a, **k: pytest.fail("build_layer reached without a GPU"))
