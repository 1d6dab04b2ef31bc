"""CPU checks of scripts/ab_trees.sh: the trees take turns round by round, each run imports the package of its own
tree, every run's log is kept, and a failed or overlong run makes the exit status 1."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import REPO

BASH = shutil.which("bash")
pytestmark = pytest.mark.skipif(BASH is None, reason="no bash")


def _checkout(tmp_path: Path) -> Path:
    """A checkout holding only the scripts, the benchmarks' path setup and a package of its own (no carried wheels to
    install)."""
    root = tmp_path / "checkout"
    shutil.copytree(REPO / "scripts", root / "scripts")
    (root / "benchmarks").mkdir()
    shutil.copy(REPO / "benchmarks" / "checkout.py", root / "benchmarks")
    for tree, name in ((root, "checkout"), (root / ".t" / "new", "new")):
        (tree / "cudnn_moe").mkdir(parents=True)
        (tree / "cudnn_moe" / "__init__.py").write_text(f"TREE = {name!r}\n")
    return root


def _run(root: Path, out: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    environ = {**os.environ, "OUT": str(out), **env}
    environ.pop("PYTHONPATH", None)
    return subprocess.run([BASH, str(root / "scripts" / "ab_trees.sh"), *args], cwd=root, env=environ,
                          capture_output=True, text=True, timeout=60)


def test_trees_alternate_and_import_their_own_package(tmp_path: Path) -> None:
    root, out, order = _checkout(tmp_path), tmp_path / "logs", tmp_path / "order"
    # a benchmark script of the checkout, which puts the checkout's package on sys.path as benchmarks/common.py does
    probe = root / "benchmarks" / "probe.py"
    probe.write_text("import pathlib, checkout\ncheckout.add_checkout()\nimport cudnn_moe\n"
                     f"p = pathlib.Path({str(order)!r})\n"
                     "p.write_text((p.read_text() if p.exists() else '') + cudnn_moe.TREE + ' ')\n"
                     "print('| tree |', cudnn_moe.TREE, '|')\n")
    result = _run(root, out, ".", ".t/new", "--", sys.executable, str(probe), ROUNDS="3")
    assert result.returncode == 0, result.stdout + result.stderr
    assert order.read_text().split() == ["checkout", "new"] * 3
    assert sorted(p.name for p in out.iterdir()) == sorted(
        f"ab_{r}_{n}.log" for r in (1, 2, 3) for n in ("checkout", "new"))
    assert (out / "ab_2_new.log").read_text() == "| tree | new |\n"
    assert result.stdout.count("| tree | new |") == 3 and result.stdout.count("| tree | checkout |") == 3


def test_failure_timeout_and_bad_arguments(tmp_path: Path) -> None:
    root, out = _checkout(tmp_path), tmp_path / "logs"
    failed = _run(root, out, ".t/new", "--", sys.executable, "-c", "raise SystemExit(3)", ROUNDS="1")
    assert failed.returncode == 1 and "tree .t/new: exit 3" in failed.stdout
    slow = _run(root, out, ".", "--", "sleep", "5", ROUNDS="1", LIMIT="1")
    assert slow.returncode == 1 and "exit 124" in slow.stdout
    missing = _run(root, out, "nowhere", "--", "true")
    assert missing.returncode == 2 and "nowhere holds no cudnn_moe package" in missing.stdout
    usage = _run(root, out, ".")
    assert usage.returncode == 2 and "Usage:" in usage.stdout
