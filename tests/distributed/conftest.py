"""Fixtures of the distributed CPU tests: gloo, and a one-rank process group in this process."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist


@pytest.fixture
def gloo() -> None:
    """Skips the test where torch.distributed or its gloo backend is missing."""
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("torch.distributed with gloo is not available")


@pytest.fixture
def group(gloo: None, tmp_path: Path) -> Iterator[dist.ProcessGroup]:
    """The default process group: gloo, one rank (this process), destroyed after the test."""
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()
