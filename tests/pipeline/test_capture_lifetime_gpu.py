"""GPU stress test: a caller's CUDA-graph capture survives the library's objects dying during it.

In one process the three ops run on several layers in turn; layers are dropped between rounds, some
plainly and some held in reference cycles of the caller's own objects, and ``gc.collect()`` is forced
inside the caller's ``torch.cuda.graph`` capture of each op, so the cycles (warmed executors and CUDA
graphs among them) die mid-capture. Every capture must succeed and replay bitwise equal to the eager
call; the dropped layers' GPU objects wait (cudnn_moe.pipeline.lifetime) and are released by the next
call outside a capture.
"""

from __future__ import annotations

import gc
from collections.abc import Callable

import pytest
import torch

from cudnn_moe import LowLatencyMoeConfig, Nvfp4MoeConfig, Routing, SwiGLU, align_routing, aligned_moe, fused_moe
from cudnn_moe import low_latency_moe, prepare_aligned_weights
from cudnn_moe.formats import quantize_nvfp4
from cudnn_moe.pipeline.lifetime import pending_count

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")
E, H, I, TOP_K, T = 8, 512, 256, 4, 8


class Cycle:
    """One of the caller's objects, in a reference cycle with itself, holding a layer."""

    def __init__(self, payload: object) -> None:
        self.payload = payload
        self.me = self


class Case:
    """One op on one layer: ``call(out)`` runs it into ``out``; ``fresh_out()`` gives the out to start from."""

    def __init__(self, name: str, call: Callable[[torch.Tensor], None], fresh_out: Callable[[], torch.Tensor]) -> None:
        self.name, self.call, self.fresh_out = name, call, fresh_out


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEV).manual_seed(seed)


def _routing(gen: torch.Generator, unrouted_nan: bool = False) -> Routing:
    ids = torch.rand(T, E, device=DEV, generator=gen).argsort(dim=1)[:, :TOP_K].to(torch.int32)
    weights = torch.rand(T, TOP_K, device=DEV, generator=gen) + 0.1
    if unrouted_nan:  # the NVFP4 pair's unrouted slots: ids outside [0, E) with NaN scores
        ids[0, 1], ids[-1, 2] = -1, E
        weights[0, 1] = weights[-1, 2] = float("nan")
    return Routing.unpacked(ids, weights)


def _nan_out() -> torch.Tensor:
    return torch.full((T, H), float("nan"), dtype=torch.bfloat16, device=DEV)


def fused_case(seed: int) -> Case:
    gen = _gen(seed)
    config = Nvfp4MoeConfig(max_num_tokens=T)
    weights = config.prepare_weights(torch.randn(E, 2 * I, H, device=DEV, generator=gen) * H**-0.5,
                                     torch.randn(E, H, I, device=DEV, generator=gen) * I**-0.5)
    acts = config.prepare_activations(torch.randn(T, H, device=DEV, generator=gen))
    routing = _routing(gen)
    return Case(f"fused_moe#{seed}", lambda out: fused_moe(config, acts, routing, weights, out=out), _nan_out)


def aligned_case(seed: int, prepared: bool) -> Case:
    gen = _gen(seed)
    x, x_scale = quantize_nvfp4(torch.randn(T, H, device=DEV, generator=gen))
    w1, w1s = quantize_nvfp4(torch.randn(E, 2 * I, H, device=DEV, generator=gen) * H**-0.5)
    w2, w2s = quantize_nvfp4(torch.randn(E, H, I, device=DEV, generator=gen) * I**-0.5)
    scales = [(0.5 + torch.rand(E, device=DEV, generator=gen)) for _ in range(3)]
    topk_weights = torch.rand(T, TOP_K, device=DEV, generator=gen) + 0.1
    ids = torch.rand(T, E, device=DEV, generator=gen).argsort(dim=1)[:, :TOP_K].to(torch.int32)
    plan = align_routing(ids, 16, E)
    out0 = torch.randn(T, H, device=DEV, generator=gen).to(torch.bfloat16)
    ready = prepare_aligned_weights(w1, w1s, w2, w2s) if prepared else None

    def call(out: torch.Tensor) -> None:
        aligned_moe(x, x_scale, w1, w1s, w2, w2s, *scales, *plan, topk_weights, out, TOP_K, 16, 1.5, prepared=ready)

    return Case(f"aligned_moe#{seed}{'' if prepared else '-unprepared'}", call, out0.clone)


def low_latency_case(seed: int, fmt: str) -> Case:
    gen = _gen(seed)
    config = LowLatencyMoeConfig(max_num_tokens=T)
    w1 = (torch.randn(E, 2 * I, H, device=DEV, generator=gen) * H**-0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, device=DEV, generator=gen) * I**-0.5).to(torch.bfloat16)
    x = torch.randn(T, H, device=DEV, generator=gen).to(torch.bfloat16)
    if fmt == "bf16":  # the CUDA-core kernels
        weights, inputs, routing = config.prepare_bf16_weights(w1, w2), x, _routing(gen)
    elif fmt == "nvfp4-pair":  # the tensor-core path, with unrouted NaN-scored slots
        weights, inputs = config.prepare_nvfp4_weights(w1, w2), config.prepare_nvfp4_activations(x)
        routing = _routing(gen, unrouted_nan=True)
    else:  # NVFP4 weight-only with BF16 tokens: the tensor-core path
        c1, s1 = quantize_nvfp4(w1.float())
        c2, s2 = quantize_nvfp4(w2.float())
        g1, g2 = (0.5 + torch.rand(E, device=DEV, generator=gen) for _ in range(2))
        weights, inputs, routing = config.prepare_nvfp4_weight_only_weights(c1, s1, g1, c2, s2, g2), x, _routing(gen)

    def call(out: torch.Tensor) -> None:
        low_latency_moe(config, inputs, weights, routing, activation=SwiGLU(), out=out)

    return Case(f"low_latency_moe#{seed}-{fmt}", call, _nan_out)


def make_round(seed: int) -> list[Case]:
    return [
        fused_case(seed), aligned_case(seed + 1, prepared=True), aligned_case(seed + 2, prepared=False),
        aligned_case(seed + 3, prepared=False), low_latency_case(seed + 4, "nvfp4-weight-only"),
        low_latency_case(seed + 5, "nvfp4-pair"), low_latency_case(seed + 6, "bf16"),
    ]


def warm(case: Case) -> torch.Tensor:
    """Three eager calls (checks, cached signature, full-call graph); returns the result, checked real."""
    results = []
    for _ in range(3):
        out = case.fresh_out()
        case.call(out)
        results.append(out)
    torch.cuda.synchronize()
    assert all(torch.equal(results[0], r) for r in results[1:]), f"{case.name}: repeated eager calls differ"
    assert not torch.isnan(results[0]).any() and results[0].abs().max() > 0, f"{case.name}: NaN or all-zero output"
    return results[0]


def test_captures_survive_layers_dying_inside_them() -> None:
    was_enabled = gc.isenabled()
    gc.disable()  # the cycles below must die inside the captures, not earlier
    try:
        previous: list[Case] = []
        deferred_seen = 0
        for round_index in range(3):
            cases = make_round(100 * round_index)
            eager = {case.name: warm(case) for case in cases}
            # the last round's layers (warmed: executors, buckets, CUDA graphs) become garbage: every
            # other one is only in a cycle of the caller's objects, the rest is dropped plainly
            cycles = [Cycle(c) for c in previous[::2]]
            del cycles
            previous = cases
            for case in cases:
                out = case.fresh_out()
                start = out.clone()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    case.call(out)
                    gc.collect()  # frees the cycles mid-capture
                deferred_seen = max(deferred_seen, pending_count())
                for _ in range(2):
                    out.copy_(start)
                    graph.replay()
                    torch.cuda.synchronize()
                    assert torch.equal(out, eager[case.name]), f"{case.name}: replay differs from eager"
                del graph
            assert deferred_seen > 0 or round_index == 0, "no GPU object died inside a capture: the test tests nothing"
        cases[0].call(cases[0].fresh_out())  # a call outside any capture releases what waited
        assert pending_count() == 0
    finally:
        if was_enabled:
            gc.enable()
