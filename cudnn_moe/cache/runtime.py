"""The process-wide cache the GPU code paths use: which directory, and what came from where.

``active_cache()`` is the DiskCache of ``set_cache_dir(path)`` when called, else of
``$CUDNN_MOE_CACHE_DIR``, else of the user's cache home (read at each call, so a changed
environment variable takes effect). A directory that cannot be created is reported once and the
process runs without a disk cache (everything is built in memory). ``record`` / ``stats`` count,
per entry kind, how many lookups were served from memory, loaded from disk or built, so the
prebuild command and the benchmarks can report it honestly.
"""

from __future__ import annotations

import os
import threading
from collections import Counter
from pathlib import Path

from .paths import cache_dir
from .store import DiskCache, report_once

_lock = threading.Lock()
_explicit: Path | None = None
_caches: dict[Path, DiskCache] = {}
_counts: Counter[tuple[str, str]] = Counter()


def set_cache_dir(path: str | os.PathLike[str] | None) -> None:
    """Use ``path`` as the cache directory for the rest of the process (None: back to the default)."""
    global _explicit
    if path is not None and not os.fspath(path).strip():
        raise ValueError("set_cache_dir: the path must not be empty (an empty path would mean the current directory); "
                         "pass None for the default")
    with _lock:
        _explicit = None if path is None else Path(path).expanduser()


def active_cache(create: bool = True) -> DiskCache | None:
    """The DiskCache of the selected directory (created 0700 on first use), or None when it
    cannot be created (reported once). create=False: None when the directory does not exist yet
    (for lookups that would find nothing there)."""
    with _lock:
        explicit = _explicit
    try:
        root = cache_dir(explicit, create=False)
    except OSError as exc:
        report_once(f"cache dir {explicit}", f"no usable cache directory ({exc}); building everything in memory")
        return None
    with _lock:
        disk = _caches.get(root)
        if disk is not None:
            return disk
    if not create and not root.is_dir():
        return None
    try:
        disk = DiskCache(root)
    except OSError as exc:
        report_once(str(root), f"cannot create the cache directory {root} ({exc}); building everything in memory")
        return None
    with _lock:
        return _caches.setdefault(root, disk)


def record(kind: str, source: str) -> None:
    """Count one lookup of an entry of ``kind`` served from ``source`` ('memory', 'disk' or 'built')."""
    with _lock:
        _counts[(kind, source)] += 1


def stats() -> dict[tuple[str, str], int]:
    """{(kind, source): count} since the process started or the last reset_stats()."""
    with _lock:
        return dict(_counts)


def reset_stats() -> None:
    with _lock:
        _counts.clear()
