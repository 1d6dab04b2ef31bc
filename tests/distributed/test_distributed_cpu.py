"""CPU tests of cudnn_moe.distributed: expert sharding, argument checks, and the padding / gather /
reduce-scatter bookkeeping of ExpertParallelMoe over gloo, with fused_moe replaced by an exact fake
(the real op needs a GPU; tests/distributed/ep_check.py runs it on two)."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import pytest

import cudnn_moe.distributed as ep
from cudnn_moe import ExpertParallelMoe, GELU, Nvfp4MoeConfig, Routing, SwiGLU, expert_shard, pack_routing, shard_weights
from tests.support import REPO

HIDDEN, INTER = 128, 128

needs_gloo = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo is not available"
)


# ---- sharding helpers ----

@pytest.mark.parametrize("experts, world", [(8, 1), (8, 2), (10, 3), (256, 3), (7, 7), (257, 8), (5, 4)])
def test_expert_shard_covers_every_expert_once(experts, world):
    shards = [expert_shard(experts, world_size=world, rank=r) for r in range(world)]
    base, extra = divmod(experts, world)
    assert [count for _, count in shards] == [base + 1] * extra + [base] * (world - extra)
    start = 0
    for shard_start, count in shards:
        assert shard_start == start and count >= 1
        start += count
    assert start == experts


def test_expert_shard_examples():
    assert [expert_shard(10, world_size=3, rank=r) for r in range(3)] == [(0, 4), (4, 3), (7, 3)]
    assert expert_shard(256, world_size=2, rank=1) == (128, 128)


@pytest.mark.parametrize("args, error", [
    ((3, 4, 0), ValueError),      # fewer experts than ranks
    ((0, 1, 0), ValueError),
    ((8, 0, 0), ValueError),
    ((8, 2, 2), ValueError),      # rank outside the world
    ((8, 2, -1), ValueError),
    ((8.0, 2, 0), TypeError),
    ((8, 2, True), TypeError),
])
def test_expert_shard_rejects(args, error):
    experts, world, rank = args
    with pytest.raises(error):
        expert_shard(experts, world_size=world, rank=rank)


def test_rank_and_world_size_are_keyword_only():
    """The two ints cannot be swapped silently: positional calls are refused (they used to take
    opposite orders in expert_shard and shard_weights)."""
    w = torch.zeros(8, 1)
    with pytest.raises(TypeError, match="positional"):
        expert_shard(8, 2, 1)
    with pytest.raises(TypeError, match="positional"):
        shard_weights(w, w, 1, 2)
    assert shard_weights(w, w, rank=1, world_size=2)[0].shape[0] == expert_shard(8, rank=1, world_size=2)[1] == 4


def test_shard_weights_slices_views():
    w1 = torch.arange(10 * 2 * 3).view(10, 2, 3)
    w2 = torch.arange(10 * 3 * 2).view(10, 3, 2) + 1000
    for rank in range(3):
        start, count = expert_shard(10, world_size=3, rank=rank)
        s1, s2 = shard_weights(w1, w2, world_size=3, rank=rank)
        assert torch.equal(s1, w1[start : start + count]) and torch.equal(s2, w2[start : start + count])
        assert s1.data_ptr() == w1[start].data_ptr()  # a view, no copy
    with pytest.raises(ValueError, match="w1 has 10 experts but w2 has 9"):
        shard_weights(w1, w2[:9], world_size=3, rank=0)
    with pytest.raises(TypeError, match="w2 must be a torch.Tensor"):
        shard_weights(w1, None, world_size=3, rank=0)
    with pytest.raises(ValueError, match="cannot be sharded"):
        shard_weights(w1[:2], w2[:2], world_size=3, rank=0)


# ---- the layer, with an exact fake fused_moe ----

def _weights(experts: int, activation=SwiGLU(), max_tokens: int = 64):
    config = Nvfp4MoeConfig(arch="sm90", max_num_tokens=max_tokens)
    gen = torch.Generator().manual_seed(experts)
    w1 = torch.randn(experts, activation.gemm1_columns(INTER), HIDDEN, generator=gen)
    w2 = torch.randn(experts, HIDDEN, INTER, generator=gen)
    return config, config.prepare_weights(w1, w2, activation=activation)


def fake_fused_moe(config, activations, routing, weights, *, activation, local_expert_start, out):
    """out[n, :] = sum over the slots of token n whose expert is local of weight * (id + 1) * (1 + packed[n, 0] % 4);
    with route weights in {0.5, 1} and few small experts every value is exact in BF16. Records its inputs."""
    ids, route_weights = routing.ids, routing.weights
    local = (ids >= local_expert_start) & (ids < local_expert_start + weights.num_experts)
    token_factor = 1 + (activations.packed[:, :1].to(torch.int32) % 4).float()
    contrib = torch.where(local, route_weights * (ids + 1).float(), torch.zeros_like(route_weights)).sum(1, keepdim=True)
    out.copy_((contrib * token_factor).expand_as(out))
    fake_fused_moe.calls.append((activations.packed.clone(), activations.scales.clone(), ids.clone(),
                                 route_weights.clone(), local_expert_start, out.data_ptr()))
    return out


def expected_output(packed: torch.Tensor, ids: torch.Tensor, route_weights: torch.Tensor, experts: int) -> torch.Tensor:
    """What fake_fused_moe gives on the full weights, [T, HIDDEN] bf16."""
    live = (ids >= 0) & (ids < experts)
    contrib = torch.where(live, route_weights.float() * (ids + 1).float(), torch.zeros(())).sum(1, keepdim=True)
    return (contrib * (1 + (packed[:, :1].to(torch.int32) % 4).float())).expand(-1, HIDDEN).to(torch.bfloat16)


def make_batch(tokens: int, experts: int, top_k: int, seed: int):
    """x-derived NVFP4 pack (from a random bf16 x) plus distinct ids and weights in {0.5, 1}."""
    gen = torch.Generator().manual_seed(seed)
    acts = Nvfp4MoeConfig(arch="sm90").prepare_activations(torch.randn(tokens, HIDDEN, generator=gen))
    ids = torch.rand(tokens, experts, generator=gen).argsort(1)[:, :top_k].to(torch.int32)
    route_weights = torch.randint(1, 3, (tokens, top_k), generator=gen).float() / 2
    return acts, ids, route_weights


@pytest.fixture
def fake_op(monkeypatch):
    fake_fused_moe.calls = []
    monkeypatch.setattr(ep, "fused_moe", fake_fused_moe)
    return fake_fused_moe


@pytest.mark.parametrize("reduce_dtype", [torch.float32, torch.bfloat16])
def test_single_rank_padding_and_slicing(group, fake_op, reduce_dtype):
    experts, top_k, tmax = 8, 2, 16
    config, weights = _weights(experts)
    layer = ExpertParallelMoe(config, weights, num_experts=experts, top_k=top_k, max_tokens_per_rank=tmax,
                              group=group, reduce_dtype=reduce_dtype)
    assert (layer.rank, layer.world_size, layer.expert_start, layer.rows) == (0, 1, 0, tmax)
    for tokens in (5, tmax, 0, 3):  # a shorter call after longer ones must re-pad the rows it no longer fills
        acts, ids, route_weights = make_batch(tokens, experts, top_k, seed=tokens)
        got = layer(acts, Routing.unpacked(ids, route_weights))
        assert got.shape == (tokens, HIDDEN) and got.dtype == torch.bfloat16
        assert torch.equal(got, expected_output(acts.packed, ids, route_weights, experts))
        packed, scales, batch_ids, batch_weights, start, out_ptr = fake_op.calls[-1]
        assert packed.shape == (tmax, HIDDEN // 2) and scales.shape == (tmax, HIDDEN // 16)
        assert batch_ids.shape == (tmax, top_k) and batch_ids.dtype == torch.int32 and batch_weights.dtype == torch.float32
        assert torch.equal(packed[:tokens], acts.packed) and torch.equal(scales[:tokens].view(torch.uint8),
                                                                          acts.scales.view(torch.uint8))
        assert torch.equal(batch_ids[:tokens], ids) and torch.equal(batch_weights[:tokens], route_weights)
        assert torch.all(batch_ids[tokens:] == -1), "padding rows must be unrouted"
        assert start == 0 and out_ptr == layer._partial.data_ptr()


def test_out_argument_and_routing_formats(group, fake_op):
    experts, top_k, tmax = 8, 4, 8
    config, weights = _weights(experts)
    layer = ExpertParallelMoe(config, weights, num_experts=experts, top_k=top_k, max_tokens_per_rank=tmax, group=group)
    acts, ids, route_weights = make_batch(6, experts, top_k, seed=1)
    want = expected_output(acts.packed, ids, route_weights, experts)
    out = torch.full((6, HIDDEN), float("nan"), dtype=torch.bfloat16)
    assert layer(acts, Routing.unpacked(ids, route_weights), out=out) is out
    assert torch.equal(out, want)
    assert torch.equal(layer(acts, Routing.packed(pack_routing(ids, route_weights))), want)
    assert torch.equal(layer(acts, Routing.unpacked(ids.long(), route_weights.bfloat16())), want)
    # int64 ids beyond int32 must stay unrouted, not wrap onto an expert (2^32 + 3 would wrap to 3).
    wide = ids.long()
    wide[:, 0] = (1 << 32) + 3
    masked = ids.clone()
    masked[:, 0] = -1
    assert torch.equal(layer(acts, Routing.unpacked(wide, route_weights)),
                       expected_output(acts.packed, masked, route_weights, experts))
    assert torch.equal(fake_op.calls[-1][2][:6, 0], torch.full((6,), experts, dtype=torch.int32))


def test_call_argument_checks(group, fake_op):
    experts, top_k, tmax = 8, 2, 4
    config, weights = _weights(experts)
    layer = ExpertParallelMoe(config, weights, num_experts=experts, top_k=top_k, max_tokens_per_rank=tmax, group=group)
    acts, ids, route_weights = make_batch(5, experts, top_k, seed=2)
    with pytest.raises(ValueError, match="5 tokens exceed max_tokens_per_rank=4"):
        layer(acts, Routing.unpacked(ids, route_weights))
    acts, ids, route_weights = make_batch(3, experts, top_k, seed=3)
    routing = Routing.unpacked(ids, route_weights)
    with pytest.raises(ValueError, match="routing covers 2 tokens"):
        layer(acts, Routing.unpacked(ids[:2], route_weights[:2]))
    with pytest.raises(ValueError, match="top_k=1 but the layer was built for top_k=2"):
        layer(acts, Routing.unpacked(ids[:, :1].contiguous(), route_weights[:, :1].contiguous()))
    with pytest.raises(TypeError, match="activations must be"):
        layer(acts.packed, routing)
    with pytest.raises(TypeError, match="routing must be"):
        layer(acts, ids)
    with pytest.raises(ValueError, match="out must have shape"):
        layer(acts, routing, out=torch.empty(4, HIDDEN, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="out must have dtype bfloat16"):
        layer(acts, routing, out=torch.empty(3, HIDDEN))
    with pytest.raises(ValueError, match="out must be contiguous"):
        layer(acts, routing, out=torch.empty(HIDDEN, 3, dtype=torch.bfloat16).t())
    assert fake_op.calls == [], "a rejected call must not communicate or compute"


def test_constructor_checks(group):
    config, weights = _weights(8)
    kwargs = dict(num_experts=8, top_k=2, max_tokens_per_rank=16, group=group)
    with pytest.raises(ValueError, match="holds experts 0..15 .16. of 16, but its weights hold 8"):
        ExpertParallelMoe(config, weights, **{**kwargs, "num_experts": 16})
    with pytest.raises(ValueError, match="max_num_tokens is 64; raise it to at least 65"):
        ExpertParallelMoe(config, weights, **{**kwargs, "max_tokens_per_rank": 65})
    with pytest.raises(ValueError, match="top_k must be <= 8"):
        ExpertParallelMoe(config, weights, **{**kwargs, "top_k": 9})
    with pytest.raises(ValueError, match="max_tokens_per_rank must be >= 1"):
        ExpertParallelMoe(config, weights, **{**kwargs, "max_tokens_per_rank": 0})
    with pytest.raises(ValueError, match="reduce_dtype"):
        ExpertParallelMoe(config, weights, **kwargs, reduce_dtype=torch.float16)
    with pytest.raises(ValueError, match="GELU is non-gated"):
        ExpertParallelMoe(config, weights, **kwargs, activation=GELU())
    with pytest.raises(TypeError, match="group must be"):
        ExpertParallelMoe(config, weights, **{**kwargs, "group": "world"})
    with pytest.raises(TypeError, match="config must be"):
        ExpertParallelMoe(None, weights, **kwargs)
    with pytest.raises(TypeError, match="weights must be"):
        ExpertParallelMoe(config, None, **kwargs)
    layer = ExpertParallelMoe(config, weights, **{**kwargs, "group": None})  # None: the default group
    assert layer.world_size == 1 and layer.buffer_bytes > 0


def test_needs_an_initialized_process_group(monkeypatch):
    config, weights = _weights(8)
    kwargs = dict(num_experts=8, top_k=2, max_tokens_per_rank=4)
    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    with pytest.raises(RuntimeError, match="not initialized"):
        ExpertParallelMoe(config, weights, **kwargs)
    monkeypatch.setattr(dist, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="not available in this torch build"):
        ExpertParallelMoe(config, weights, **kwargs)


# ---- two gloo ranks in two processes: uneven T (one rank 0), uneven expert shards ----

def _two_rank_worker(rank: int, world: int, store_path: str, experts: int, top_k: int, tokens: list[int],
                     reduce_dtype: torch.dtype) -> None:
    ep.fused_moe = fake_fused_moe
    fake_fused_moe.calls = []
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        tmax = 8
        config = Nvfp4MoeConfig(arch="sm90", max_num_tokens=world * tmax)
        start, count = expert_shard(experts, world_size=world, rank=rank)
        gen = torch.Generator().manual_seed(0)  # every rank draws the full weights from one seed
        w1, w2 = torch.randn(experts, 2 * INTER, HIDDEN, generator=gen), torch.randn(experts, HIDDEN, INTER, generator=gen)
        weights = config.prepare_weights(*shard_weights(w1, w2, world_size=world, rank=rank))
        layer = ExpertParallelMoe(config, weights, num_experts=experts, top_k=top_k, max_tokens_per_rank=tmax,
                                  reduce_dtype=reduce_dtype)
        assert layer.expert_start == start
        batches = [make_batch(t, experts, top_k, seed=10 + r) for r, t in enumerate(tokens)]
        acts, ids, route_weights = batches[rank]
        got = layer(acts, Routing.unpacked(ids, route_weights))
        assert torch.equal(got, expected_output(acts.packed, ids, route_weights, experts)), f"rank {rank} output"
        packed, _, batch_ids, _, local_start, _ = fake_fused_moe.calls[-1]
        assert local_start == start
        for r, (r_acts, r_ids, _) in enumerate(batches):  # rank r's tokens at rows r * tmax ..
            rows = slice(r * tmax, r * tmax + tokens[r])
            assert torch.equal(packed[rows], r_acts.packed) and torch.equal(batch_ids[rows], r_ids)
            assert torch.all(batch_ids[r * tmax + tokens[r] : (r + 1) * tmax] == -1)
    finally:
        dist.destroy_process_group()


@needs_gloo
@pytest.mark.parametrize("tokens, reduce_dtype", [([7, 0], torch.float32), ([3, 8], torch.bfloat16)])
def test_two_ranks_match_the_full_layer(tmp_path, tokens, reduce_dtype):
    # 5 experts over 2 ranks: shards (0, 3) and (3, 2); T differs per rank (0 on one, Tmax on another).
    mp.spawn(_two_rank_worker, args=(2, str(tmp_path / "store"), 5, 2, tokens, reduce_dtype), nprocs=2)


# ---- benchmarks/bench_ep.py helpers (its timings need two GPUs) ----

def test_bench_ep_helpers():
    sys.path.insert(0, str(REPO / "benchmarks"))
    import bench_ep

    args = bench_ep.parse_args([])
    assert args.tokens == [1, 64, 4096] and args.model == "deepseek-v3" and args.reduce_dtype == torch.float32
    assert bench_ep.parse_args(["--reduce-dtype", "bfloat16"]).reduce_dtype == torch.bfloat16
    _, weights = _weights(8)
    # per expert: w1 codes 2I x H/2, scales 2I x H/16, w2 codes H x I/2, scales H x I/16, two fp32 globals
    per_expert = 2 * INTER * (HIDDEN // 2 + HIDDEN // 16) + HIDDEN * (INTER // 2 + INTER // 16) + 8
    assert bench_ep.weight_bytes(weights) == 8 * per_expert
    model = bench_ep.MODELS["deepseek-v3"]
    assert [bench_ep.shard_range(model, r, 2) for r in range(2)] == ["0..127", "128..255"]
    assert bench_ep.rel_errors(torch.ones(2, 4), torch.ones(2, 4)) == "0.0e+00 / 0.0e+00"
    traffic = bench_ep.parse_args(["--traffic", "--worlds", "2", "8"])
    assert traffic.traffic and traffic.worlds == [2, 8] and not args.traffic and args.worlds == [2, 4, 8]
    # W=8, T=64: 7 x 64 records of 4096 B out in both; back 7 x 64 rows of 7168 x 4 B (FP32 reduce) or x 2 B (BF16).
    row = bench_ep.traffic_table(model, [8], [64])[2].split(" | ")
    assert row[2:5] == [f"{7 * 64 * (4096 + 7168 * 4) / 1e6:,.3f}", f"{7 * 64 * (4096 + 7168 * 2) / 1e6:,.3f}", "0.56"]


def test_readme_traffic_table_is_the_model():
    """The README's bytes-moved table is what benchmarks/bench_ep.py --traffic prints for its defaults."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import bench_ep

    readme = (REPO / "README.md").read_text()
    assert "\n".join(bench_ep.traffic_table(bench_ep.MODELS["deepseek-v3"], [2, 4, 8], [1, 64, 4096])) in readme
