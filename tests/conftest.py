"""Shared pytest setup: the `gpu` marker skips cleanly on machines without a usable CUDA stack."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import pytest
import torch


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
    parallel in the background, each once per session (tests/kernel_sources.py); at the end drop what is left."""
    import kernel_sources

    kernel_sources.prefetch(request.session.items)
    yield
    kernel_sources.shutdown()
