"""Where the benchmark scripts find the ``cudnn_moe`` package: this checkout's, placed on ``sys.path`` behind the
entries of PYTHONPATH. A package named on PYTHONPATH wins (``scripts/ab_trees.sh`` times other trees' packages with
this checkout's scripts that way), and the checkout's wins over an installed one."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def add_checkout() -> None:
    """Insert ROOT into sys.path right after the last entry that came from PYTHONPATH (after the script's folder
    when there is none), unless it already stands at or before that place."""
    named = {os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    place = max((i + 1 for i, p in enumerate(sys.path) if p and os.path.abspath(p) in named), default=1)
    if str(ROOT) not in sys.path[:place]:
        sys.path.insert(place, str(ROOT))
