"""Expert parallelism on two GPUs under pytest: tests/distributed/ep_check.py in two processes (torchrun), both
dispatches against single-GPU fused_moe, eager and captured in CUDA graphs. Skipped with fewer than two GPUs; run it
directly with ``torchrun --nproc-per-node 2 tests/distributed/ep_check.py``."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from tests.support import TESTS

pytestmark = pytest.mark.gpu


def test_ep_check_on_two_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA GPUs for two ranks, found {torch.cuda.device_count()}")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(TESTS / "distributed" / "ep_check.py"), "--random-cases", "10", "--dispatch", "all_gather", "all_to_all"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=1800,
                            env={**os.environ, "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE", "0")})
    log = result.stdout + result.stderr
    summary = re.search(r"^(\d+) passed, (\d+) failed$", result.stdout, re.MULTILINE)
    assert result.returncode == 0 and summary and summary.group(2) == "0", log[-6000:]
    # 7 fixed + 10 random cases, each for both dispatches
    assert int(summary.group(1)) == 2 * 17, log[-6000:]
