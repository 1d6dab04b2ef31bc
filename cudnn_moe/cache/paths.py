"""Where the persistent cache lives: an explicit path, $CUDNN_MOE_CACHE_DIR, or the user's cache home."""

from __future__ import annotations

import os
from pathlib import Path

ENV_VAR = "CUDNN_MOE_CACHE_DIR"
DIR_MODE = 0o700


def default_cache_dir() -> Path:
    """$CUDNN_MOE_CACHE_DIR if set and non-empty, else $XDG_CACHE_HOME/cudnn_moe (absolute only,
    as the XDG spec asks), else ~/.cache/cudnn_moe. Nothing is created."""
    explicit = os.environ.get(ENV_VAR, "")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "cudnn_moe"


def cache_dir(path: str | os.PathLike[str] | None = None, *, create: bool = True) -> Path:
    """The cache directory: ``path`` if given, else default_cache_dir().

    create=True makes a missing directory (and its parents) with mode 0700, fixing the mode
    where the umask narrowed it; a directory that already exists is used as it is, its mode
    untouched. Raises ValueError for an empty path (it would mean the current directory) and
    NotADirectoryError when the path names something else.
    """
    if path is not None and not os.fspath(path).strip():
        raise ValueError("the cache directory must not be empty (an empty path would mean the current directory)")
    root = (Path(path) if path is not None else default_cache_dir()).expanduser()
    if root.exists() and not root.is_dir():
        raise NotADirectoryError(f"cache directory {root} exists and is not a directory")
    if create and not root.exists():
        try:
            root.mkdir(mode=DIR_MODE, parents=True)
        except FileExistsError:  # another process made it first: theirs, with its own mode
            return root
        os.chmod(root, DIR_MODE)
    return root
