"""GPU test of Programmatic Dependent Launch: the same layers run in two processes, one launching every kernel
with the programmatic-stream-serialization attribute (the default on SM90+) and one without ($CUDNN_MOE_PDL=0),
give bitwise the same outputs, none of them NaN (outputs are poisoned first) or all zero: fused_moe on both
engines, eager and replayed from its own CUDA graphs, and the low-latency op on CUDA cores and tensor cores."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support import REPO

pytestmark = pytest.mark.gpu


def _run(tmp_path: Path, pdl: str) -> dict:
    path = tmp_path / f"pdl{pdl}.pt"
    env = {**os.environ, "CUDNN_MOE_PDL": pdl, "PYTHONPATH": os.pathsep.join([str(REPO), *sys.path])}
    result = subprocess.run([sys.executable, "-m", "tests.support.launch_modes", str(path)], env=env, cwd=REPO,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-4000:]
    return torch.load(path)


def test_programmatic_launch_gives_the_serialized_results(tmp_path: Path) -> None:
    with_pdl, without = _run(tmp_path, "1"), _run(tmp_path, "0")
    assert with_pdl["programmatic"] is (torch.cuda.get_device_capability()[0] >= 9)
    assert without["programmatic"] is False
    assert with_pdl["outputs"].keys() == without["outputs"].keys()
    for name, got in with_pdl["outputs"].items():
        want = without["outputs"][name]
        assert not got.isnan().any() and got.abs().sum() > 0, name
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), name
