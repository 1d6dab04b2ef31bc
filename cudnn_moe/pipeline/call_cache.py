"""The one call cache: signatures of calls whose checks passed, so a repeated call skips them.

A signature is what the checks of a call read: object identities, scalars, and per tensor its address,
shape, strides, dtype and device (``tensor_signature``). It maps to weak references to the objects the
call was checked against (config, weights, executor, ...); an entry whose objects died is a miss. Bounded:
the least recently used signature goes first.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Hashable
from typing import Any

import torch

MAX_SIGNATURES = 64


def tensor_signature(t: torch.Tensor | None) -> tuple[Any, ...] | None:
    """What the checks of a tensor argument depend on: address, shape, strides, dtype, device."""
    if t is None:
        return None
    return (t.data_ptr(), t.shape, t.stride(), t.dtype, t.get_device())


class CheckedCalls:
    """signature -> the live objects a call with it was checked against (see the module docstring)."""

    def __init__(self, size: int = MAX_SIGNATURES) -> None:
        self.size = size
        self._entries: OrderedDict[Hashable, tuple[weakref.ref, ...]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable | None) -> tuple[Any, ...] | None:
        """The objects remembered under ``key`` if every one still lives, else None."""
        if key is None:
            return None
        refs = self._entries.get(key)
        if refs is None:
            return None
        objects = tuple(ref() for ref in refs)
        if any(obj is None for obj in objects):
            return None
        try:  # no lock on the hit path: a concurrent eviction of this key only makes it a miss next time
            self._entries.move_to_end(key)
        except KeyError:
            pass
        return objects

    def remember(self, key: Hashable | None, *objects: object) -> None:
        """Record that ``key`` passed every check against ``objects`` (the oldest signature goes when full)."""
        if key is None:
            return
        refs = tuple(weakref.ref(obj) for obj in objects)
        with self._lock:
            self._entries[key] = refs
            self._entries.move_to_end(key)
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)

    def clear(self) -> None:
        """Forget every signature (the next call of each is checked in full again)."""
        with self._lock:
            self._entries.clear()
