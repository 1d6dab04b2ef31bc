"""GPU test: two threads on two streams calling the same prepared weights of each op get the single-stream
results, bit for bit (the executor's buckets and the layer engines' workspaces are shared scratch, ordered
across streams by cudnn_moe.pipeline.order)."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch

from cudnn_moe import LowLatencyMoeConfig, Nvfp4MoeConfig, Routing, align_routing, aligned_moe, fused_moe
from cudnn_moe import low_latency_moe, prepare_aligned_weights
from cudnn_moe.formats import quantize_nvfp4

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")
E, H, I, TOP_K = 16, 1024, 512, 4
ROUNDS = 12


def _routing(gen: torch.Generator, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.rand(tokens, E, device=DEV, generator=gen).argsort(dim=1)[:, :TOP_K].to(torch.int32)
    return ids, torch.rand(tokens, TOP_K, device=DEV, generator=gen) + 0.1


def _fused(gen: torch.Generator) -> Callable[[int], Callable[[torch.Tensor], None]]:
    config = Nvfp4MoeConfig(max_num_tokens=256)
    weights = config.prepare_weights(torch.randn(E, 2 * I, H, device=DEV, generator=gen) * H**-0.5,
                                     torch.randn(E, H, I, device=DEV, generator=gen) * I**-0.5)

    def batch(tokens: int) -> Callable[[torch.Tensor], None]:
        acts = config.prepare_activations(torch.randn(tokens, H, device=DEV, generator=gen))
        routing = Routing.unpacked(*_routing(gen, tokens))
        return lambda out: fused_moe(config, acts, routing, weights, out=out)

    return batch


def _aligned(gen: torch.Generator) -> Callable[[int], Callable[[torch.Tensor], None]]:
    w1, w1s = quantize_nvfp4(torch.randn(E, 2 * I, H, device=DEV, generator=gen) * H**-0.5)
    w2, w2s = quantize_nvfp4(torch.randn(E, H, I, device=DEV, generator=gen) * I**-0.5)
    prepared = prepare_aligned_weights(w1, w1s, w2, w2s)

    def batch(tokens: int) -> Callable[[torch.Tensor], None]:
        x, xs = quantize_nvfp4(torch.randn(tokens, H, device=DEV, generator=gen))
        ids, topk_weights = _routing(gen, tokens)
        plan = align_routing(ids, 16, E)
        scales = [0.5 + torch.rand(E, device=DEV, generator=gen) for _ in range(3)]  # per call: staged per bucket
        out0 = torch.randn(tokens, H, device=DEV, generator=gen).to(torch.bfloat16)

        def call(out: torch.Tensor) -> None:
            out.copy_(out0)
            aligned_moe(x, xs, w1, w1s, w2, w2s, *scales, *plan, topk_weights, out, TOP_K, 16, 1.0, prepared=prepared)

        return call

    return batch


def _low_latency(fmt: str) -> Callable[[torch.Generator], Callable[[int], Callable[[torch.Tensor], None]]]:
    def make(gen: torch.Generator) -> Callable[[int], Callable[[torch.Tensor], None]]:
        config = LowLatencyMoeConfig(max_num_tokens=8)
        w1 = (torch.randn(E, 2 * I, H, device=DEV, generator=gen) * H**-0.5).to(torch.bfloat16)
        w2 = (torch.randn(E, H, I, device=DEV, generator=gen) * I**-0.5).to(torch.bfloat16)
        if fmt == "bf16":  # the CUDA-core engine and its workspace
            weights = config.prepare_bf16_weights(w1, w2)
        else:  # NVFP4 weight-only: the SM90 engine's pipeline on SM90
            (c1, s1), (c2, s2) = quantize_nvfp4(w1.float()), quantize_nvfp4(w2.float())
            weights = config.prepare_nvfp4_weight_only_weights(c1, s1, torch.ones(E, device=DEV), c2, s2,
                                                       torch.ones(E, device=DEV))

        def batch(tokens: int) -> Callable[[torch.Tensor], None]:
            x = torch.randn(tokens, H, device=DEV, generator=gen).to(torch.bfloat16)
            routing = Routing.unpacked(*_routing(gen, tokens))
            return lambda out: low_latency_moe(config, x, weights, routing, out=out)

        return batch

    return make


# Both threads use one token bucket (the same T, different inputs), so they share its buffers.
OPS = {"fused": (_fused, 64), "aligned": (_aligned, 64), "low_latency-bf16": (_low_latency("bf16"), 8),
       "low_latency-nvfp4": (_low_latency("nvfp4"), 8)}


@pytest.mark.parametrize("op", list(OPS))
def test_two_threads_on_two_streams_give_the_single_stream_results(op: str) -> None:
    make, tokens = OPS[op]
    batch = make(torch.Generator(device=DEV).manual_seed(7))
    calls = [batch(tokens), batch(tokens)]
    outs = [torch.full((tokens, H), float("nan"), dtype=torch.bfloat16, device=DEV) for _ in calls]
    expected = []
    for call, out in zip(calls, outs):  # one stream, one call at a time; three times: graphs captured here
        for _ in range(3):
            call(out)
        torch.cuda.synchronize()
        assert not torch.isnan(out).any() and out.abs().max() > 0
        expected.append(out.clone())
    assert not torch.equal(expected[0], expected[1]), "the two threads' inputs must differ"
    mismatches: list[str] = []
    start = threading.Barrier(len(calls))

    def worker(index: int) -> None:
        stream = torch.cuda.Stream()
        start.wait()
        with torch.cuda.stream(stream):
            for round_index in range(ROUNDS):
                outs[index].fill_(float("nan"))
                calls[index](outs[index])
                if round_index % 4 == 3:
                    stream.synchronize()
                    if not torch.equal(outs[index], expected[index]):
                        mismatches.append(f"thread {index} round {round_index}")
        stream.synchronize()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not mismatches, mismatches
    for got, want in zip(outs, expected):
        assert torch.equal(got, want)
