"""The executor cache's lifetimes on the CPU: executors live as long as their weights object, and what dies
during a (simulated) CUDA-graph capture is destroyed only by the next release outside a capture."""

from __future__ import annotations

import gc

import pytest

from cudnn_moe.pipeline import lifetime
from cudnn_moe.pipeline.lifetime import cached, defer, cached_count, pending_count, release_deferred


class Weights:
    """Stands for a prepared weights object."""


class Tracked:
    """Stands for an executor (or a CUDA graph): records when it is destroyed."""

    destroyed: list[str] = []

    def __init__(self, name: str) -> None:
        self.name = name

    def __del__(self) -> None:
        Tracked.destroyed.append(self.name)


@pytest.fixture(autouse=True)
def clean(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lifetime, "capturing", lambda: False)
    release_deferred()
    Tracked.destroyed = []


def capturing(monkeypatch: pytest.MonkeyPatch, value: bool) -> None:
    monkeypatch.setattr(lifetime, "capturing", lambda: value)


def test_one_executor_per_weights_and_key() -> None:
    w = Weights()
    built = []
    make = lambda: built.append(1) or Tracked("a")  # noqa: E731
    first = cached(w, "k", make)
    assert cached(w, "k", make) is first and len(built) == 1
    assert cached(w, "other", lambda: Tracked("b")) is not first
    assert cached_count(w) == 2 and cached_count(Weights()) == 0


def test_executors_go_with_their_weights_after_the_next_release() -> None:
    w = Weights()
    cached(w, "k", lambda: Tracked("x"))
    del w  # reference count: the finalizer only notes the death
    assert Tracked.destroyed == [] and pending_count() == 1
    assert release_deferred() == 1
    assert Tracked.destroyed == ["x"] and pending_count() == 0


def test_a_cycle_collected_during_a_capture_destroys_nothing_until_after(monkeypatch: pytest.MonkeyPatch) -> None:
    w = Weights()
    w.cycle = w  # the caller's own reference cycle
    cached(w, "k", lambda: Tracked("in-cycle"))
    cached(w, "k2", lambda: Tracked("in-cycle-2"))
    del w
    capturing(monkeypatch, True)
    gc.collect()  # as a GC pass inside the caller's capture would
    assert release_deferred() == 0  # refused while capturing
    assert Tracked.destroyed == [] and pending_count() == 1
    capturing(monkeypatch, False)
    release_deferred()
    assert sorted(Tracked.destroyed) == ["in-cycle", "in-cycle-2"]


def test_a_reused_id_never_finds_a_dead_owners_executor(monkeypatch: pytest.MonkeyPatch) -> None:
    capturing(monkeypatch, True)  # nothing is released, so the dead owner's entry is still pending
    w = Weights()
    old = cached(w, "k", lambda: Tracked("old"))
    owner = id(w)
    del w
    new_owner = Weights()
    monkeypatch.setattr(lifetime, "id", lambda obj: owner if obj is new_owner else id(obj), raising=False)
    fresh = cached(new_owner, "k", lambda: Tracked("new"))
    assert fresh is not old and fresh.name == "new"
    del old
    assert "old" not in Tracked.destroyed  # still kept for a release outside the capture
    capturing(monkeypatch, False)
    release_deferred()
    assert Tracked.destroyed == ["old"]


def test_defer_keeps_an_object_until_a_release_outside_a_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    capturing(monkeypatch, True)
    defer(Tracked("graph"))
    assert release_deferred() == 0 and Tracked.destroyed == []
    capturing(monkeypatch, False)
    assert release_deferred() == 1 and Tracked.destroyed == ["graph"]
