"""Two-level lookup: this process's memory, then the disk cache, then build and store."""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from typing import Literal

from .keys import EntryKey
from .store import DiskCache, report_once

Source = Literal["memory", "disk", "built"]


def lookup_or_build(
    key: EntryKey,
    build: Callable[[], bytes],
    memory: MutableMapping[EntryKey, bytes],
    disk: DiskCache | None = None,
) -> tuple[bytes, Source]:
    """(payload, where it came from) for ``key``.

    memory first; then ``disk`` (an invalid entry there is reported once and rebuilt); then
    ``build()``, whose bytes are stored on disk and in memory. A disk that cannot be written is
    reported once and the built payload is still returned; errors from ``build`` propagate.
    """
    payload = memory.get(key)
    if payload is not None:
        return payload, "memory"
    if disk is not None:
        payload = disk.get(key)
        if payload is not None:
            memory[key] = payload
            return payload, "disk"
    payload = build()
    if not isinstance(payload, bytes):
        raise TypeError(f"build() must return bytes, got {type(payload).__name__}")
    if disk is not None:
        try:
            disk.put(key, payload)
        except OSError as exc:
            report_once(str(disk.root), f"cannot write entries under {disk.root} ({exc}); continuing without storing")
    memory[key] = payload
    return payload, "built"
