"""GPU tests of the aligned-plan op (contract 002) against its float64 reference.

``out`` is an input here too (the op adds into it), so instead of a NaN-filled ``out`` every case
runs with ``out`` pre-filled with random values inside a NaN-filled buffer: the guard rows around it
must keep their NaN bits (nothing outside ``out`` is written) and no NaN may reach ``out``.
Tolerance: tests.support.moe_checks (the reference rounds where the GPU does; what remains is FP32 accumulation
order).
"""

from __future__ import annotations

import pytest
import torch

from cudnn_moe import align_routing, aligned_moe, prepare_aligned_weights
from cudnn_moe.aligned import aligned_weights_handle, clear_aligned_caches, plan_capacity, reference_aligned_moe
from cudnn_moe.formats import quantize_nvfp4
from tests.support.moe_checks import check_close

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")
I32 = torch.int32


class Layer:
    """Random NVFP4 tokens and weights of the contract's layouts, on the GPU; ``prepared`` as prepare_aligned_weights
    makes them by default (in_place=None: read in place on the sm90 engine) unless ``in_place`` says otherwise."""

    def __init__(self, m: int, k: int, n: int, e: int, top_k: int, seed: int, engine: str = "auto",
                 in_place: bool | None = None) -> None:
        assert top_k <= e, "a token routes to top_k distinct experts"
        gen = torch.Generator(device=DEV).manual_seed(seed)
        self.m, self.k, self.n, self.e, self.top_k = m, k, n, e, top_k
        self.hidden_states, self.hidden_states_scale = quantize_nvfp4(torch.randn(m, k, device=DEV, generator=gen))
        self.w1, self.w1s = quantize_nvfp4(torch.randn(e, n, k, device=DEV, generator=gen) * k**-0.5)
        self.w2, self.w2s = quantize_nvfp4(torch.randn(e, k, n // 2, device=DEV, generator=gen) * (n // 2) ** -0.5)
        self.gate_scale, self.up_scale, self.down_scale = (0.5 + torch.rand(3, e, device=DEV, generator=gen)).unbind(0)
        self.gate_scale, self.up_scale, self.down_scale = (s.contiguous() for s in (self.gate_scale, self.up_scale,
                                                                                    self.down_scale))
        self.topk_weights = torch.rand(m, top_k, device=DEV, generator=gen) + 0.1
        self.ids = torch.rand(m, e, device=DEV, generator=gen).argsort(dim=1)[:, :top_k].to(I32)
        self.out0 = torch.randn(m, k, device=DEV, generator=gen).to(torch.bfloat16)
        self.prepared = prepare_aligned_weights(self.w1, self.w1s, self.w2, self.w2s, engine=engine, in_place=in_place)

    def args(self, plan, out, hidden_states=None):
        return (
            self.hidden_states if hidden_states is None else hidden_states, self.hidden_states_scale,
            self.w1, self.w1s, self.w2, self.w2s, self.gate_scale, self.up_scale, self.down_scale, *plan,
            self.topk_weights, out,
        )

    def reference(self, plan, block_m, rsf, out0=None):
        out0 = self.out0 if out0 is None else out0
        return reference_aligned_moe(*self.args(plan, out0), self.top_k, block_m, rsf)


def guarded_out(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(buffer, out): out = buffer[1:-1] holds ``values``; the guard rows around it are NaN."""
    buffer = torch.full((values.shape[0] + 2, values.shape[1]), float("nan"), dtype=torch.bfloat16, device=DEV)
    out = buffer[1:-1]
    out.copy_(values)
    return buffer, out


def check_guards(buffer: torch.Tensor) -> None:
    assert torch.isnan(buffer[0]).all() and torch.isnan(buffer[-1]).all(), "a write landed outside out"


# (M, K, N, E, top_k, block_m, rsf): K and N from 256 to 7168 / 4096, E up to 256, top_k 1..8
CASES = [
    (1, 256, 512, 16, 1, 8, 1.0),
    (5, 256, 256, 3, 2, 8, 2.5),
    (33, 512, 768, 64, 8, 16, 1.0),
    (64, 1024, 512, 256, 6, 64, -0.75),
    (200, 2048, 1536, 128, 8, 128, 2.5),
    (17, 7168, 4096, 8, 4, 64, 1.0),
    (300, 768, 256, 32, 3, 16, 0.5),
    (9, 4096, 2048, 40, 7, 128, 1.5),
    (1500, 256, 256, 8, 5, 8, 1.0),
]


@pytest.mark.parametrize("in_place", [None, False], ids=["default", "copy"])
@pytest.mark.parametrize("m,k,n,e,top_k,block_m,rsf", CASES)
def test_matches_reference(m, k, n, e, top_k, block_m, rsf, in_place: bool | None) -> None:
    """The op against the float64 reference, on the weights as prepared by default (read in place on the sm90
    engine) and as the engine's layout (in_place=False)."""
    layer = Layer(m, k, n, e, top_k, seed=m + k + n + e, in_place=in_place)
    plan = align_routing(layer.ids, block_m, e)
    buffer, out = guarded_out(layer.out0)
    aligned_moe(*layer.args(plan, out), top_k, block_m, rsf, prepared=layer.prepared)
    check_guards(buffer)
    check_close(out, layer.reference(plan, block_m, rsf))
    # the contributions alone (out zero): another view of the same numbers
    zero_buffer, zero_out = guarded_out(torch.zeros_like(layer.out0))
    aligned_moe(*layer.args(plan, zero_out), top_k, block_m, rsf, prepared=layer.prepared)
    check_guards(zero_buffer)
    check_close(zero_out, layer.reference(plan, block_m, rsf, out0=torch.zeros_like(layer.out0)))


@pytest.mark.parametrize("m,k,n,e,top_k,block_m,rsf", [CASES[i] for i in (0, 2, 4, 5, 8)])
def test_in_place_weights_match_reference_and_hold_no_copy(m, k, n, e, top_k, block_m, rsf) -> None:
    """Weights prepared in place (the sm90 engine reading the raw tensors: decode buckets on the decode kernel's
    row-major form, long segments on wgmma's) allocate nothing, match the reference and the output of the engine's
    tiled layout (in_place=False, a copy)."""
    layer = Layer(m, k, n, e, top_k, seed=m + k + n + e)
    before = torch.cuda.memory_allocated()
    in_place = prepare_aligned_weights(layer.w1, layer.w1s, layer.w2, layer.w2s, in_place=True)
    assert torch.cuda.memory_allocated() == before and in_place.in_place
    assert in_place.layer.w1.data_ptr() == layer.w1.data_ptr()
    plan = align_routing(layer.ids, block_m, e)
    buffer, out = guarded_out(layer.out0)
    aligned_moe(*layer.args(plan, out), top_k, block_m, rsf, prepared=in_place)
    check_guards(buffer)
    want = layer.reference(plan, block_m, rsf)
    check_close(out, want)
    tiled = prepare_aligned_weights(layer.w1, layer.w1s, layer.w2, layer.w2s, in_place=False)
    assert not tiled.in_place and tiled.layer.w1.data_ptr() != layer.w1.data_ptr()
    _, tiled_out = guarded_out(layer.out0)
    aligned_moe(*layer.args(plan, tiled_out), top_k, block_m, rsf, prepared=tiled)
    check_close(tiled_out, want)
    gap = (out.double() - tiled_out.double()).norm() / (tiled_out.double() - layer.out0.double()).norm()
    assert gap <= 2e-2, f"in place and tiled differ by {gap:.3g} of the contributions"


def test_padding_and_garbage_past_the_extent_are_skipped() -> None:
    layer = Layer(40, 512, 512, 24, 4, seed=1)
    sorted_ids, expert_ids, post = align_routing(layer.ids, 16, 24)
    # make room past the extent and fill it (and the padding entries) with garbage
    extra = 64
    capacity = sorted_ids.numel() + extra
    padded_ids = torch.full((capacity,), 40 * 4, dtype=I32, device=DEV)
    padded_ids[: sorted_ids.numel()] = sorted_ids
    extent = int(post.item())
    padded_ids[extent:] = torch.randint(-(1 << 30), 1 << 30, (capacity - extent,), dtype=I32, device=DEV)
    pad_entries = padded_ids[:extent] >= 40 * 4
    padded_ids[:extent][pad_entries] = torch.randint(40 * 4, 1 << 30, (int(pad_entries.sum()),), dtype=I32, device=DEV)
    garbage_experts = torch.randint(-1000, 1000, (capacity // 16,), dtype=I32, device=DEV)
    garbage_experts[: extent // 16] = expert_ids[: extent // 16]
    plan = (padded_ids, garbage_experts, post)
    want = layer.reference(align_routing(layer.ids, 16, 24), 16, 1.0)
    buffer, out = guarded_out(layer.out0)
    aligned_moe(*layer.args(plan, out), 4, 16, prepared=layer.prepared)
    check_guards(buffer)
    check_close(out, want)


def test_hand_built_plan() -> None:
    """Blocks in any expert order, one expert in two separate blocks, a partial last block, a slot
    never named (slot 5: it adds nothing), padding values of every size."""
    layer = Layer(3, 256, 256, 5, 2, seed=2)
    pad = 6
    sorted_ids = torch.tensor([3, 0, pad, 9999, pad, pad, pad, pad,  # expert 2
                               1, 4, pad, pad, pad, pad, pad, pad,  # expert 0
                               2, pad, pad, pad, pad, pad, pad, pad,  # expert 2 again
                               pad, 7, 1 << 30, pad], dtype=I32, device=DEV)  # partial last block: padding only
    expert_ids = torch.tensor([2, 0, 2, 4], dtype=I32, device=DEV)
    post = torch.tensor([32], dtype=I32, device=DEV)
    plan = (sorted_ids, expert_ids, post)
    buffer, out = guarded_out(layer.out0)
    aligned_moe(*layer.args(plan, out), 2, 8, 1.25, prepared=layer.prepared)
    check_guards(buffer)
    want = layer.reference(plan, 8, 1.25)
    check_close(out, want)
    # a plan naming nothing leaves out's values bitwise
    before = out.clone()
    empty = (sorted_ids, expert_ids, torch.zeros(1, dtype=I32, device=DEV))
    aligned_moe(*layer.args(empty, out), 2, 8, 1.25, prepared=layer.prepared)
    assert torch.equal(out, before)
    check_guards(buffer)


def test_row_strided_hidden_states() -> None:
    layer = Layer(20, 512, 512, 8, 3, seed=3)
    plan = align_routing(layer.ids, 8, 8)
    storage = torch.zeros(20, 512 // 2 + 48, dtype=torch.uint8, device=DEV)
    view = storage[:, : 512 // 2]
    view.copy_(layer.hidden_states)
    assert not view.is_contiguous()
    _, strided = guarded_out(layer.out0)
    aligned_moe(*layer.args(plan, strided, hidden_states=view), 3, 8, prepared=layer.prepared)
    _, plain = guarded_out(layer.out0)
    aligned_moe(*layer.args(plan, plain), 3, 8, prepared=layer.prepared)
    assert torch.equal(strided, plain)
    check_close(plain, layer.reference(plan, 8, 1.0))


def test_repeated_calls_are_bitwise_equal() -> None:
    """Eager first call, then the cached signature, then its full-call graph replays."""
    layer = Layer(64, 1024, 768, 32, 8, seed=4)
    plan = align_routing(layer.ids, 64, 32)
    _, out = guarded_out(layer.out0)
    results = []
    for _ in range(4):
        out.copy_(layer.out0)
        aligned_moe(*layer.args(plan, out), 8, 64, 2.0, prepared=layer.prepared)
        results.append(out.clone())
    assert all(torch.equal(results[0], r) for r in results[1:])
    check_close(results[0], layer.reference(plan, 64, 2.0))


def test_graph_replay_follows_the_device_extent() -> None:
    layer = Layer(48, 512, 512, 16, 4, seed=5)
    sorted_ids, expert_ids, post = align_routing(layer.ids, 16, 16)
    full_extent = int(post.item())
    out = torch.empty_like(layer.out0)
    out.copy_(layer.out0)
    aligned_moe(*layer.args((sorted_ids, expert_ids, post), out), 4, 16, prepared=layer.prepared)  # warm-up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        aligned_moe(*layer.args((sorted_ids, expert_ids, post), out), 4, 16, prepared=layer.prepared)
    for extent in (full_extent, 16 * ((full_extent // 16) // 2), 0, full_extent):
        post.fill_(extent)
        out.copy_(layer.out0)
        graph.replay()
        torch.cuda.synchronize()
        if extent:
            check_close(out, layer.reference((sorted_ids, expert_ids, post), 16, 1.0))
        else:
            assert torch.equal(out, layer.out0)


def test_unprepared_weights_match_and_follow_in_place_writes() -> None:
    clear_aligned_caches()
    layer = Layer(24, 512, 512, 8, 2, seed=6)
    plan = align_routing(layer.ids, 8, 8)
    _, prepared_out = guarded_out(layer.out0)
    aligned_moe(*layer.args(plan, prepared_out), 2, 8, prepared=layer.prepared)
    _, raw_out = guarded_out(layer.out0)
    aligned_moe(*layer.args(plan, raw_out), 2, 8)
    assert torch.equal(prepared_out, raw_out)
    layer.w2s.copy_((layer.w2s.float() * 2).to(torch.float8_e4m3fn))  # an in-place torch write: re-laid out
    raw_out.copy_(layer.out0)
    aligned_moe(*layer.args(plan, raw_out), 2, 8)
    check_close(raw_out, layer.reference(plan, 8, 1.0))
    with pytest.raises(ValueError, match="prepared was built from other weight tensors"):
        aligned_moe(*layer.args(plan, raw_out), 2, 8, prepared=layer.prepared)


def test_cudnn_engine_matches_reference() -> None:
    layer = Layer(12, 512, 512, 6, 3, seed=7, engine="cudnn")
    assert layer.prepared.layer.spec.engine == "cudnn"
    plan = align_routing(layer.ids, 16, 6)
    buffer, out = guarded_out(layer.out0)
    aligned_moe(*layer.args(plan, out), 3, 16, 1.5, prepared=layer.prepared)
    check_guards(buffer)
    check_close(out, layer.reference(plan, 16, 1.5))


def test_align_routing_on_the_gpu_matches_the_cpu() -> None:
    gen = torch.Generator().manual_seed(8)
    ids = torch.randint(-1, 66, (257, 8), generator=gen, dtype=I32)
    for block_m in (8, 16, 64, 128):
        cpu = align_routing(ids, block_m, 64)
        gpu = align_routing(ids.to(DEV), block_m, 64)
        assert all(torch.equal(a, b.cpu()) for a, b in zip(cpu, gpu))
        assert gpu[0].numel() == plan_capacity(ids.numel(), 64, block_m)
    graph = torch.cuda.CUDAGraph()
    dev_ids = ids.to(DEV)
    align_routing(dev_ids, 16, 64)
    with torch.cuda.graph(graph):
        captured = align_routing(dev_ids, 16, 64)
    dev_ids.copy_(torch.randint(0, 64, ids.shape, generator=gen, dtype=I32))
    graph.replay()
    want = align_routing(dev_ids.cpu(), 16, 64)
    assert all(torch.equal(a.cpu(), b) for a, b in zip(captured, want))


def test_bad_inputs_raise_before_any_launch() -> None:
    layer = Layer(4, 256, 256, 4, 2, seed=9)
    plan = align_routing(layer.ids, 8, 4)
    out = layer.out0.clone()
    with pytest.raises(ValueError, match="w1_scale_prepared must be None"):
        aligned_moe(*layer.args(plan, out), 2, 8, w1_scale_prepared=torch.zeros(4, dtype=torch.uint8, device=DEV))
    with pytest.raises(ValueError, match="out"):
        aligned_moe(*layer.args(plan, layer.out0[:, :128]), 2, 8, prepared=layer.prepared)
    with pytest.raises(ValueError, match="routed_scaling_factor"):
        aligned_moe(*layer.args(plan, out), 2, 8, float("nan"), prepared=layer.prepared)
    with pytest.raises(TypeError, match="prepared"):
        aligned_moe(*layer.args(plan, out), 2, 8, prepared=object())
    assert torch.equal(out, layer.out0)


def test_custom_op_compiles_and_matches_eager() -> None:
    layer = Layer(16, 512, 512, 8, 2, seed=10)
    plan = align_routing(layer.ids, 16, 8)
    handle = aligned_weights_handle(layer.prepared)

    def model(out: torch.Tensor) -> torch.Tensor:
        torch.ops.cudnn_moe.aligned_moe_(*layer.args(plan, out), 2, 16, 1.5, handle)
        return out * 1.0

    eager_out = layer.out0.clone()
    aligned_moe(*layer.args(plan, eager_out), 2, 16, 1.5, prepared=layer.prepared)
    compiled = torch.compile(model, fullgraph=True)
    got = compiled(layer.out0.clone())
    assert torch.equal(got, eager_out)
    check_close(got, layer.reference(plan, 16, 1.5))
