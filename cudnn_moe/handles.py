"""Integer handles for objects passed through torch custom ops (which take tensors and scalars only).

``register(obj)`` gives the same int for an object while it lives; ``resolve(handle)`` returns it, or raises
ValueError once it has been freed (or for an int that was never a handle). Objects are held weakly.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import Any


class HandleRegistry:
    """Weakly held objects by handle (see the module docstring); ``kind`` names them in errors."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._objects: dict[int, weakref.ref] = {}
        self._handles: dict[int, int] = {}  # id(obj) -> handle, while obj lives
        self._counter = itertools.count(1)
        self._lock = threading.Lock()

    def register(self, obj: object) -> int:
        with self._lock:
            handle = self._handles.get(id(obj))
            if handle is not None and self._objects[handle]() is obj:
                return handle
            handle = next(self._counter)
            self._objects[handle] = weakref.ref(obj)
            self._handles[id(obj)] = handle
        weakref.finalize(obj, self._forget, handle, id(obj))
        return handle

    def resolve(self, handle: int) -> Any:
        ref = self._objects.get(handle)
        obj = ref() if ref is not None else None
        if obj is None:
            raise ValueError(f"handle {handle} names no live {self.kind} (it was freed, or the int is not a handle)")
        return obj

    def _forget(self, handle: int, key: int) -> None:
        with self._lock:
            self._objects.pop(handle, None)
            if self._handles.get(key) == handle:
                del self._handles[key]
