"""Persistent cache of built artifacts (serialized cuDNN plans, kernel binaries) and measured choices
(the low-latency op's tactics).

Backend-neutral: entries are bytes under an EntryKey that names what they are and the
environment they are valid in. Pure Python: importing this package imports neither CuPy nor
cuDNN (current_environment does, when called).

    disk = DiskCache()                      # cache_dir(): $CUDNN_MOE_CACHE_DIR or ~/.cache/cudnn_moe
    key = EntryKey(KIND_CUDNN_PLAN, "gemm1 ...", {"experts": 128, ...}, current_environment(device))
    payload = disk.get(key)                 # None: absent or invalid (reported once, removed)
    disk.put_or_report(key, built_bytes)    # an unwritable directory is reported once, never raised

The GPU paths (cuDNN plans, kernel binaries, tactics) use ``active_cache()``: the directory of
``set_cache_dir(path)``, else $CUDNN_MOE_CACHE_DIR, else the user's cache home.
"""

from .keys import KIND_CUDNN_PLAN, KIND_KERNEL, KIND_TACTIC, EntryKey, Environment, current_environment
from .paths import ENV_VAR, cache_dir, default_cache_dir
from .runtime import active_cache, record, reset_stats, set_cache_dir, stats
from .store import MARKER, CacheEntry, CacheWarning, CorruptEntry, DiskCache, EntryCheck, NotACacheError

__all__ = [
    "ENV_VAR",
    "KIND_CUDNN_PLAN",
    "KIND_KERNEL",
    "KIND_TACTIC",
    "MARKER",
    "CacheEntry",
    "CacheWarning",
    "CorruptEntry",
    "DiskCache",
    "EntryCheck",
    "EntryKey",
    "NotACacheError",
    "Environment",
    "active_cache",
    "cache_dir",
    "current_environment",
    "default_cache_dir",
    "record",
    "reset_stats",
    "set_cache_dir",
    "stats",
]
