"""benchmarks/triton_peer.py on the CPU, with a stand-in for FlagGems: below TUNE_MIN_TOKENS the peer runs FlagGems'
default tiles; from there on it runs the fastest of the default and the candidates (a candidate that fails is left
out), says which in the notes, and leaves FlagGems' config lookup as it found it."""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import pytest
import torch

from tests.support import REPO

sys.path.insert(0, str(REPO / "benchmarks"))

import common  # noqa: E402
import triton_peer  # noqa: E402

FAST = triton_peer.CANDIDATES[3]
BROKEN = triton_peer.CANDIDATES[0]


def _default_lookup(*args: object, **kwargs: object) -> dict[str, int]:
    return {"default": 1}


@pytest.fixture
def fake_flag_gems(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """flag_gems.fused.fused_moe with a config lookup and a layer whose 'time' is the config it ran with."""
    module = types.ModuleType("flag_gems.fused.fused_moe")
    module.try_get_optimal_moe_config = _default_lookup
    module.ran = []

    def fused_experts_impl(x, w1, w2, route_w, ids, inplace, activation):  # noqa: ANN001, ANN202
        config = module.try_get_optimal_moe_config()
        if config == BROKEN:
            raise RuntimeError("out of resources: shared memory")
        module.ran.append(config)
        return x

    module.fused_experts_impl = fused_experts_impl
    package = types.ModuleType("flag_gems")
    package.__version__ = "0.0-test"
    fused = types.ModuleType("flag_gems.fused")
    fused.fused_moe = module
    package.fused = fused
    monkeypatch.setitem(sys.modules, "flag_gems", package)
    monkeypatch.setitem(sys.modules, "flag_gems.fused", fused)
    monkeypatch.setitem(sys.modules, "flag_gems.fused.fused_moe", module)

    def fake_median_us(fn, iters, flush=None):  # noqa: ANN001, ANN202
        fn()
        return 10.0 if module.ran[-1] == FAST else 20.0 + len(module.ran[-1])

    monkeypatch.setattr(triton_peer, "median_us", fake_median_us)
    monkeypatch.setattr(triton_peer, "capture", lambda fn: SimpleNamespace(replay=fn))
    return module


def _time(peer: triton_peer.TritonPeer, tokens: int) -> tuple[float | None, str]:
    timer = SimpleNamespace(flush=None, median_us=lambda fn: (fn(), 42.0)[1])
    x = torch.zeros(tokens, 8)
    return peer.time_us(timer, x, torch.zeros(tokens, 2, dtype=torch.int64), torch.zeros(tokens, 2), x, x)


def test_default_tiles_below_the_tuning_size(fake_flag_gems: types.ModuleType) -> None:
    report = common.Report()
    peer = triton_peer.TritonPeer(report)
    assert peer.available
    assert _time(peer, triton_peer.TUNE_MIN_TOKENS - 1) == (42.0, common.fmt(42.0))
    assert fake_flag_gems.ran and all(config == {"default": 1} for config in fake_flag_gems.ran)
    assert not any("tiles" in note for note in report.notes)


def test_fastest_tiles_from_the_tuning_size(fake_flag_gems: types.ModuleType) -> None:
    report = common.Report()
    peer = triton_peer.TritonPeer(report)
    assert _time(peer, triton_peer.TUNE_MIN_TOKENS) == (42.0, common.fmt(42.0))
    assert fake_flag_gems.ran[-1] == FAST  # the timed call ran the winner
    tried = {str(config) for config in fake_flag_gems.ran}
    assert str(BROKEN) not in tried and len(tried) == len(triton_peer.CANDIDATES)  # the default and all but one
    assert any(triton_peer.describe(FAST) in note and f"of {len(triton_peer.CANDIDATES)} tried" in note
               for note in report.notes)
    assert fake_flag_gems.try_get_optimal_moe_config is _default_lookup  # restored


def test_describe() -> None:
    assert triton_peer.describe(None) == "default"
    assert triton_peer.describe(FAST) == "128x128x64 group 16, 8 warps, 3 stages"
