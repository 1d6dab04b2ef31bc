"""GPU tests of the serving path: the full-call graph equals the eager path bitwise (repeated calls,
inputs changed in place, a changed signature), capture into a caller's graph still works, and plans
and kernels loaded from a disk cache give bitwise the output of fresh builds."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cudnn_moe import Routing, SwiGLU, fused_moe
from cudnn_moe.fused import op as ops
from cudnn_moe.weights.nvfp4 import Nvfp4Activations
from tests.support import REPO
from tests.support.serving import layer

pytestmark = pytest.mark.gpu


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


@pytest.mark.parametrize("engine", ["sm90", "cudnn"])
def test_full_call_graph_equals_eager_and_follows_in_place_changes(engine: str) -> None:
    config, weights, acts, ids, route = layer(engine)
    routing = Routing.unpacked(ids, route)
    out = torch.full((3, 256), float("nan"), dtype=torch.bfloat16, device="cuda")
    eager = fused_moe(config, acts, routing, weights, use_cuda_graph=False)
    for _ in range(3):  # 1st: usual path, 2nd: capture, 3rd: replay
        out.fill_(float("nan"))
        fused_moe(config, acts, routing, weights, out=out)
        torch.cuda.synchronize()
        assert torch.equal(_bits(out), _bits(eager))
    bucket = ops.get_executor(config, weights, top_k=2, activation=SwiGLU(), local_expert_start=0).bucket(3)
    assert len(bucket.full_graphs) == 1
    # the caller writes new inputs into the same tensors: the replay reads them
    _, _, acts2, ids2, route2 = layer(engine, seed=1)
    acts.packed.copy_(acts2.packed)
    acts.scales.copy_(acts2.scales)
    ids.copy_(ids2)
    route.copy_(route2)
    fused_moe(config, acts, routing, weights, out=out)
    expected = fused_moe(config, acts, routing, weights, use_cuda_graph=False)
    torch.cuda.synchronize()
    assert torch.equal(_bits(out), _bits(expected)) and len(bucket.full_graphs) == 1


def test_changed_signature_falls_back_and_is_still_exact() -> None:
    config, weights, acts, ids, route = layer()
    routing = Routing.unpacked(ids, route)
    out = torch.empty(3, 256, dtype=torch.bfloat16, device="cuda")
    fused_moe(config, acts, routing, weights, out=out)
    fused_moe(config, acts, routing, weights, out=out)  # full-call graph of this signature
    other_out = torch.empty_like(out)
    fused_moe(config, acts, routing, weights, out=other_out)  # new out: usual path
    two = Routing.unpacked(ids[:2], route[:2])
    acts2 = Nvfp4Activations(acts.packed[:2], acts.scales[:2])
    first_two = fused_moe(config, acts2, two, weights)  # T=2: another bucket, no out
    expected = fused_moe(config, acts, routing, weights, use_cuda_graph=False)
    torch.cuda.synchronize()
    assert torch.equal(_bits(other_out), _bits(expected)) and torch.equal(_bits(out), _bits(expected))
    assert torch.equal(_bits(first_two), _bits(expected[:2]))
    with pytest.raises(ValueError, match="out must have shape"):  # a new signature is checked in full
        fused_moe(config, acts, routing, weights, out=torch.empty(2, 256, dtype=torch.bfloat16, device="cuda"))


def test_capture_into_callers_graph_with_a_remembered_signature() -> None:
    config, weights, acts, ids, route = layer()
    routing = Routing.unpacked(ids, route)
    out = torch.empty(3, 256, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        fused_moe(config, acts, routing, weights, out=out)
    torch.cuda.synchronize()
    expected = out.clone()
    out.fill_(float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_moe(config, acts, routing, weights, out=out)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(_bits(out), _bits(expected))


_CHILD = """
import sys, torch
sys.path.insert(0, {repo!r})
from tests.support.serving import layer
from cudnn_moe import Routing, fused_moe
from cudnn_moe.cache import stats
config, weights, acts, ids, route = layer({engine!r})
out = fused_moe(config, acts, Routing.unpacked(ids, route), weights)
torch.cuda.synchronize()
torch.save(out.cpu(), {path!r})
print("STATS", sorted(stats().items()))
print("CUPY IMPORTED", "cupy" in sys.modules)
"""


def _fresh_then_from_disk(tmp_path: Path, engine: str) -> tuple[list[torch.Tensor], list[str]]:
    """Two child processes on one new cache directory: (outputs, stdout reports)."""
    cache = tmp_path / "cache"
    env = {**os.environ, "CUDNN_MOE_CACHE_DIR": str(cache), "PYTHONPATH": os.pathsep.join([str(REPO), *sys.path])}
    outputs, reports = [], []
    for run in ("fresh", "from-disk"):
        path = tmp_path / f"{run}.pt"
        code = _CHILD.format(repo=str(REPO), path=str(path), engine=engine)
        result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        reports.append(result.stdout)
        outputs.append(torch.load(path))
    return outputs, reports


def test_kernels_from_disk_load_without_importing_cupy(tmp_path: Path) -> None:
    outputs, reports = _fresh_then_from_disk(tmp_path, "sm90")
    assert "('kernel', 'built')" in reports[0] and "CUPY IMPORTED True" in reports[0]  # compiling needs NVRTC
    assert "('kernel', 'built')" not in reports[1] and "CUPY IMPORTED False" in reports[1], reports[1]
    assert torch.equal(_bits(outputs[0]), _bits(outputs[1]))


def test_plans_and_kernels_loaded_from_disk_equal_fresh_builds(tmp_path: Path) -> None:
    outputs, reports = _fresh_then_from_disk(tmp_path, "cudnn")
    assert "('cudnn-plan', 'built')" in reports[0] and "('cudnn-plan', 'disk')" not in reports[0]
    assert "('cudnn-plan', 'disk')" in reports[1] and "('cudnn-plan', 'built')" not in reports[1], reports[1]
    assert "('kernel', 'disk')" in reports[1] and "('kernel', 'built')" not in reports[1], reports[1]
    assert torch.equal(_bits(outputs[0]), _bits(outputs[1]))


_WARM_CHILD = """
import sys, torch
sys.path.insert(0, {repo!r})
from tests.support.serving import layer
from cudnn_moe import Routing, SwiGLU, fused_moe, get_executor
from cudnn_moe.cache import reset_stats, stats
from cudnn_moe.weights.nvfp4 import Nvfp4Activations
config, weights, acts, ids, route = layer("sm90", tokens=3)
get_executor(config, weights, top_k=2, activation=SwiGLU(), local_expert_start=0).warmup(4)
torch.cuda.synchronize()
reset_stats()
routing = Routing.unpacked(ids, route)
eager = fused_moe(config, acts, routing, weights, use_cuda_graph=False)  # the call's own chain, T=3
one = Routing.unpacked(ids[:1], route[:1])
first = Nvfp4Activations(acts.packed[:1], acts.scales[:1])
single = fused_moe(config, first, one, weights, use_cuda_graph=False)  # T=1: the routed GEMM1
torch.cuda.synchronize()
torch.save((eager.cpu(), single.cpu()), {path!r})
print("STATS", sorted(stats().items()))
"""


def test_warmup_builds_the_call_chains_own_kernels(tmp_path: Path) -> None:
    # After warmup, eager calls (whose chain folds the stage into GEMM1 at T=1 and the finalize into GEMM2) build and
    # load nothing: a fresh process on an empty cache directory, so that no earlier call compiled those forms.
    env = {**os.environ, "CUDNN_MOE_CACHE_DIR": str(tmp_path / "cache"),
           "PYTHONPATH": os.pathsep.join([str(REPO), *sys.path])}
    path = tmp_path / "out.pt"
    result = subprocess.run([sys.executable, "-c", _WARM_CHILD.format(repo=str(REPO), path=str(path))], env=env,
                            capture_output=True, text=True, check=True)
    report = result.stdout
    assert "STATS" in report and "'built')" not in report and "'disk')" not in report, report
    eager, single = torch.load(path)
    config, weights, acts, ids, route = layer("sm90", tokens=3)
    graphed = fused_moe(config, acts, Routing.unpacked(ids, route), weights)  # the bucket graph's chain
    first = Nvfp4Activations(acts.packed[:1], acts.scales[:1])
    graphed_single = fused_moe(config, first, Routing.unpacked(ids[:1], route[:1]), weights)
    assert torch.equal(_bits(eager), _bits(graphed.cpu())) and torch.equal(_bits(single), _bits(graphed_single.cpu()))
