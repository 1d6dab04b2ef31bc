"""Lifetimes of the GPU objects the library owns: the one cache of executors and workspaces per prepared
weights object, and their capture-safe release.

Destroying a CUDA graph while a stream of the process is capturing invalidates that capture (torch
warns "operation not permitted when stream is capturing" and the next launch fails), and a Python
object can die at any moment: when the caller drops its last reference, or when the cyclic garbage
collector frees a reference cycle holding it, which may happen in the middle of the caller's
``torch.cuda.graph`` capture. So nothing that owns CUDA graphs is destroyed where its owner dies:

- Executors (cudnn_moe.pipeline.executor.MoeExecutor: buckets, GEMM plans, CUDA graphs) and workspaces
  (cudnn_moe.pipeline.workspaces) are cached here per (prepared weights object, key) and live as long as
  that weights object. The weights hold nothing;
  an executor holds a copy of the weights record (same tensors), never the caller's object, so
  dropping the weights is what releases its executors.
- When a weights object dies, its finalizer only notes its id (an atomic append, no lock, no
  destruction). The next cache lookup or ``release_deferred`` moves that owner's executors to the
  pending list, and ``release_deferred`` drops the pending list when the calling thread's stream is
  not capturing. Every op call, executor build and warm-up calls it.
- ``defer(obj)`` hands anything else (an evicted CUDA graph) to the same list.

So the GPU memory of dropped weights returns at the next op call outside a capture; a caller that wants
it back at once (to load another model, say) calls ``cudnn_moe.release_deferred()``. A capture on another
thread at the moment of a release is the caller's to avoid, as for any CUDA call made concurrently with a
global-mode capture.
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from collections.abc import Callable, Hashable
from typing import TypeVar

from ..capture import capturing

E = TypeVar("E")

_pending: deque[object] = deque()  # kept alive until released outside a capture
_dead_owners: deque[int] = deque()  # ids of weights objects that died (appended by finalizers)
_by_owner: dict[int, dict[Hashable, object]] = {}
_lock = threading.Lock()  # guards _by_owner; never taken by a finalizer


def defer(obj: object) -> None:
    """Keep ``obj`` alive until the next release_deferred() outside a capture (safe anywhere, finalizers too)."""
    _pending.append(obj)


def _owner_died(owner_id: int) -> None:
    _dead_owners.append(owner_id)


def _collect_dead_owners() -> None:
    """Move the executors of dead owners to the pending list (caller holds _lock)."""
    while _dead_owners:
        executors = _by_owner.pop(_dead_owners.popleft(), None)
        if executors:
            _pending.append(executors)


def release_deferred() -> int:
    """Destroy what is pending (dead owners' executors, deferred objects) unless the current stream is
    capturing; returns how many pending items went."""
    if not (_pending or _dead_owners) or capturing():
        return 0
    with _lock:
        _collect_dead_owners()
    count = 0
    while _pending:
        try:
            _pending.popleft()  # the last reference: destroyed here
        except IndexError:  # another thread released it first
            break
        count += 1
    return count


def cached(weights: object, key: Hashable, make: Callable[[], E]) -> E:
    """The object (an executor, a workspace) cached for ``weights`` (by identity, while it lives) under ``key``;
    ``make()`` builds it on first use, outside the lock (two racing threads may both build one; the first
    stored wins)."""
    owner = id(weights)
    with _lock:
        _collect_dead_owners()  # an id of a dead owner may be reused by ``weights``
        found = _by_owner.get(owner)
        executor = found.get(key) if found is not None else None
    if executor is not None:
        return executor  # type: ignore[return-value]
    release_deferred()
    built = make()
    with _lock:
        _collect_dead_owners()
        per_owner = _by_owner.get(owner)
        if per_owner is None:
            per_owner = _by_owner[owner] = {}
            weakref.finalize(weights, _owner_died, owner)
        return per_owner.setdefault(key, built)  # type: ignore[return-value]


def cached_count(weights: object) -> int:
    """How many objects are cached for ``weights`` (for tests and diagnostics)."""
    with _lock:
        _collect_dead_owners()
        return len(_by_owner.get(id(weights), {}))


def pending_count() -> int:
    """How many items wait for release_deferred() (for tests and diagnostics)."""
    return len(_pending) + len(_dead_owners)
