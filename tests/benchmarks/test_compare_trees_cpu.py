"""CPU check of scripts/compare_trees.py: a worker that imported another folder's package than its tree's stops the
comparison (the workers themselves need a GPU; here they are stood in for)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
from pathlib import Path

import pytest

from tests.support import REPO


def _script():
    spec = importlib.util.spec_from_file_location("compare_trees", REPO / "scripts" / "compare_trees.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_worker_of_another_package_stops_the_comparison(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    compare_trees = _script()
    old, new = tmp_path / "old", tmp_path / "new"
    old.mkdir(), new.mkdir()

    def stand_in(cmd: list[str], env: dict[str, str], **kwargs) -> None:
        """A worker that names the first PYTHONPATH entry's parent (another folder) as its package's."""
        out = Path(cmd[cmd.index("--worker") + 1])
        out.with_suffix(".from").write_text(str(Path(env["PYTHONPATH"].split(os.pathsep)[0]).parent))

    monkeypatch.setattr(subprocess, "run", stand_in)
    with pytest.raises(SystemExit, match=f"the old worker imported cudnn_moe from {tmp_path}, not {old}"):
        compare_trees.main([str(old), str(new)])
