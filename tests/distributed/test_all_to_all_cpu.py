"""CPU tests of ExpertParallelMoe(dispatch="all_to_all") over gloo in 1-4 processes: the device-side packing
(dispatch_rows), what each rank's experts receive, the per-peer counts and capacities, and the FP32 combine
against a float reference of the documented rounding; plus the bytes-moved model (ep_traffic,
expected_remote_ranks) and the argument checks.

fused_moe needs a GPU, so the layer's local-expert step (cudnn_moe.distributed.fused_moe) is replaced by a
stand-in with fused_moe's rounding (the FP32 slot-order sum of a token's local slots, rounded once to BF16)
over a float function of the expert id and the token's codes; rows without a local slot, which only padding
rows are, get NaN, so a padding row that reached an output would show. tests/distributed/ep_check.py runs
the real op on two GPUs.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import cudnn_moe.distributed as ep
from cudnn_moe import ExpertParallelMoe, Nvfp4MoeConfig, Routing, SwiGLU, expert_shard, pack_routing
from cudnn_moe.distributed import dispatch_rows, ep_traffic, expected_remote_ranks, token_record_bytes
from cudnn_moe.weights.nvfp4 import Nvfp4Activations, Nvfp4Weights

HIDDEN, INTER = 128, 128


# ---- the stand-in experts and the float reference ----

def expert_rows(experts: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """float32 [N, H]: the stand-in output of expert experts[n] (int [N]) for token n (NVFP4 codes uint8 [N, H/2]);
    a smooth function of both, not exact in BF16, different for every expert and token."""
    codes = torch.cat([packed, packed.flip(1)], dim=1).float()
    expert = experts.float().unsqueeze(1)
    column = torch.arange(HIDDEN, dtype=torch.float32)
    return torch.sin(codes * 0.013 + expert * 0.37 + column * 0.05) * (1 + expert.remainder(3))


def slot_sum(packed: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """float32 [N, H]: the sum over the slots in ``mask`` (bool [N, k]) of weight x expert row, in slot order
    in FP32, one multiply and one add per slot (fused_moe's finalize before its rounding)."""
    total = torch.zeros(packed.shape[0], HIDDEN)
    for j in range(ids.shape[1]):
        total = total + torch.where(mask[:, j : j + 1], weights[:, j : j + 1] * expert_rows(ids[:, j], packed), 0.0)
    return total


class StandInExperts:
    """Replaces fused_moe in cudnn_moe.distributed: out = bf16(slot_sum of the local slots); NaN on rows with no
    local slot. Records each call's batch (copies)."""

    def __init__(self) -> None:
        self.calls: list[dict[str, torch.Tensor]] = []

    def __call__(self, config, activations, routing, weights, *, activation, local_expert_start, out):
        ids, route_weights = routing.ids, routing.weights
        local = (ids >= local_expert_start) & (ids < local_expert_start + weights.num_experts)
        out.copy_(slot_sum(activations.packed, ids, route_weights, local))
        out[~local.any(dim=1)] = float("nan")
        self.calls.append(dict(packed=activations.packed.clone(), scales=activations.scales.view(torch.uint8).clone(),
                               ids=ids.clone(), weights=route_weights.clone(), out_ptr=out.data_ptr()))
        return out


def shard_bounds(experts: int, world: int) -> list[int]:
    """[W + 1]: rank p holds experts bounds[p] .. bounds[p + 1] - 1."""
    return [expert_shard(experts, world_size=world, rank=r)[0] for r in range(world)] + [experts]


def on_rank(ids: torch.Tensor, bounds: list[int], rank: int) -> torch.Tensor:
    """bool [T, k]: the slots naming an expert of rank."""
    return (ids >= bounds[rank]) & (ids < bounds[rank + 1])


def reference_output(packed: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, bounds: list[int]) -> torch.Tensor:
    """bfloat16 [T, H], the documented rounding: each rank's slots summed in FP32 in slot order and rounded to
    BF16 (its partial), the partials widened and summed in FP32 in rank order, rounded once."""
    total = torch.zeros(packed.shape[0], HIDDEN)
    for rank in range(len(bounds) - 1):
        total = total + slot_sum(packed, ids, weights, on_rank(ids, bounds, rank)).bfloat16().float()
    return total.bfloat16()


def check_within_rounding(got: torch.Tensor, packed: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                          experts: int) -> None:
    """|got - exact float64 sum| <= 2^-7 x the sum of |weight x row| over the routed slots: one BF16 rounding
    (unit roundoff 2^-8) of each partial plus the final one, with room for the FP32 sums (2^-24 each)."""
    exact = torch.zeros(packed.shape[0], HIDDEN, dtype=torch.float64)
    magnitude = torch.zeros_like(exact)
    for j in range(ids.shape[1]):
        routed = ((ids[:, j] >= 0) & (ids[:, j] < experts)).unsqueeze(1)
        term = torch.where(routed, weights[:, j : j + 1].double() * expert_rows(ids[:, j], packed).double(), 0.0)
        exact += term
        magnitude += term.abs()
    assert torch.all((got.double() - exact).abs() <= magnitude * 2.0**-7 * 1.001), "output beyond BF16 rounding of the exact sum"


# ---- one case: every rank's tokens, drawn from one seed so that every rank can check every other's ----

@dataclass(frozen=True)
class Case:
    experts: int
    top_k: int
    tokens: tuple[int, ...]  # per rank
    max_tokens_per_rank: int
    routing: str = "fp32"  # fp32 | bf16 | packed | int64
    seed: int = 0


def rank_batch(case: Case, rank: int, version: int = 0) -> tuple[Nvfp4Activations, torch.Tensor, torch.Tensor]:
    """(activations, ids int32 [T, k], BF16-exact weights float32 [T, k]) of rank's tokens. The first rows are
    special where T and the shards allow: all experts on this rank, all on other ranks, two slots unrouted
    (-1 and E, out of range), every slot unrouted."""
    gen = torch.Generator().manual_seed(case.seed * 1000 + 10 * rank + version)
    tokens = case.max_tokens_per_rank if version else case.tokens[rank]
    experts, k = case.experts, case.top_k
    acts = Nvfp4MoeConfig(arch="sm90").prepare_activations(torch.randn(tokens, HIDDEN, generator=gen))
    ids = torch.rand(tokens, experts, generator=gen).argsort(1)[:, :k].to(torch.int32)
    weights = (torch.rand(tokens, k, generator=gen) + 0.1).bfloat16().float()
    start, count = expert_shard(experts, world_size=len(case.tokens), rank=rank)
    own = torch.arange(start, start + count, dtype=torch.int32)
    others = torch.cat([torch.arange(0, start), torch.arange(start + count, experts)]).to(torch.int32)
    specials = []
    if count >= k:
        specials.append(own[torch.randperm(count, generator=gen)[:k]])
    if others.numel() >= k:
        specials.append(others[torch.randperm(others.numel(), generator=gen)[:k]])
    if k >= 2 and tokens:
        specials.append(torch.cat([torch.tensor([-1]), ids[0, 1:-1], torch.tensor([experts])]).to(torch.int32))
    specials.append(torch.full((k,), -1, dtype=torch.int32))
    for row, special in enumerate(specials[:tokens]):
        ids[row] = special
    return acts, ids, weights


def make_routing(kind: str, ids: torch.Tensor, weights: torch.Tensor) -> Routing:
    if kind == "packed":
        return Routing.packed(pack_routing(ids, weights))
    if kind == "bf16":
        return Routing.unpacked(ids, weights.bfloat16())
    if kind == "int64":
        return Routing.unpacked(ids.long(), weights)
    return Routing.unpacked(ids, weights)


@functools.cache
def one_expert() -> Nvfp4Weights:
    """One random SwiGLU expert, prepared once per process (preparing runs ~0.1 s per expert on a CPU)."""
    gen = torch.Generator().manual_seed(0)
    return Nvfp4MoeConfig(arch="sm90").prepare_weights(torch.randn(1, 2 * INTER, HIDDEN, generator=gen),
                                                       torch.randn(1, HIDDEN, INTER, generator=gen))


def shard_weights_of(count: int) -> Nvfp4Weights:
    """Weights of ``count`` experts: one prepared expert repeated (views; the stand-in reads no weights)."""
    w = one_expert()
    return dataclasses.replace(w, **{name: getattr(w, name).expand(count, *getattr(w, name).shape[1:])
                                     for name in ("w1", "w1_scales", "w1_alpha", "w2", "w2_scales", "w2_alpha")})


def shard_layer(case: Case, world: int, rank: int, group: dist.ProcessGroup | None = None) -> ExpertParallelMoe:
    """This rank's all-to-all layer."""
    config = Nvfp4MoeConfig(arch="sm90", max_num_tokens=world * case.max_tokens_per_rank)
    weights = shard_weights_of(expert_shard(case.experts, world_size=world, rank=rank)[1])
    return ExpertParallelMoe(config, weights, num_experts=case.experts, top_k=case.top_k,
                             max_tokens_per_rank=case.max_tokens_per_rank, group=group, dispatch="all_to_all")


def check_call(layer: ExpertParallelMoe, stand_in: StandInExperts, case: Case, rank: int, version: int) -> None:
    """One layer call on every rank's batch of this version; checks this rank's output, counts and received rows."""
    world, tmax, experts = layer.world_size, case.max_tokens_per_rank, case.experts
    bounds = shard_bounds(experts, world)
    batches = [rank_batch(case, r, version) for r in range(world)]
    acts, ids, weights = batches[rank]
    out = torch.full((ids.shape[0], HIDDEN), float("nan"), dtype=torch.bfloat16)
    assert layer(acts, make_routing(case.routing, ids, weights), out=out) is out
    where = f"rank {rank}, {case}, version {version}"
    assert torch.equal(out, reference_output(acts.packed, ids, weights, bounds)), f"output differs: {where}"
    check_within_rounding(out, acts.packed, ids, weights, experts)
    # The counts: tokens of this rank that name at least one expert of each peer; none beyond the capacity.
    counts = [int(on_rank(ids, bounds, p).any(dim=1).sum()) for p in range(world)]
    assert layer.sent_counts.tolist() == counts and max(counts, default=0) <= tmax, where
    # What this rank's experts got: from each source s, its tokens that need this rank, in token order, at rows
    # s * Tmax .., other ranks' slots unrouted; the rest of the block padding (every slot -1).
    call = stand_in.calls[-1]
    assert call["out_ptr"] == layer._partial.data_ptr() and call["ids"].shape == (world * tmax, case.top_k)
    for source, (s_acts, s_ids, s_weights) in enumerate(batches):
        local = on_rank(s_ids, bounds, rank)
        sent = local.any(dim=1).nonzero().flatten()
        rows = slice(source * tmax, source * tmax + sent.numel())
        assert torch.equal(call["packed"][rows], s_acts.packed[sent]), f"{where}: codes from rank {source}"
        assert torch.equal(call["scales"][rows], s_acts.scales.view(torch.uint8)[sent]), f"{where}: scales from {source}"
        assert torch.equal(call["weights"][rows], s_weights[sent]), f"{where}: weights from rank {source}"
        assert torch.equal(call["ids"][rows], torch.where(local, s_ids, -1)[sent]), f"{where}: ids from rank {source}"
        assert torch.all(call["ids"][source * tmax + sent.numel() : (source + 1) * tmax] == -1), f"{where}: padding"


# Process groups of 2, 3 and 4 ranks within one run of 4 processes (each start imports torch: seconds): the global
# ranks of each group; the 2-rank group's ranks 0 and 1 are global ranks 2 and 3.
GROUPS = {2: [2, 3], 3: [0, 1, 2], 4: [0, 1, 2, 3]}

CASES = {
    2: [Case(5, 2, (7, 0), 8, seed=1),  # E not divisible by W; T = 0 on one rank
        Case(8, 8, (8, 3), 8, "bf16", seed=2),  # top-8 of 8: every token needs both ranks, full capacity
        Case(16, 4, (0, 0), 4, seed=3)]  # no tokens anywhere
       + [Case(16, k, (k + 2, (3 * k) % 10), 10, ("fp32", "packed", "int64", "bf16")[k % 4], seed=10 + k)
          for k in range(1, 9)],  # top-k 1..8
    3: [Case(10, 3, (5, 0, 9), 9, "int64", seed=4),  # shards 4, 3, 3
        Case(7, 3, (4, 6, 1), 6, seed=5),
        Case(256, 8, (16, 3, 0), 16, "packed", seed=6)],
    4: [Case(5, 2, (3, 0, 6, 1), 6, seed=7),  # shards 2, 1, 1, 1
        Case(9, 4, (0, 5, 2, 8), 8, "bf16", seed=8),
        Case(32, 8, (8, 8, 8, 8), 8, "int64", seed=9)],
}


def _worker(rank: int, store_path: str) -> None:
    stand_in = StandInExperts()
    ep.fused_moe = stand_in
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 4), rank=rank, world_size=4)
    try:
        groups = {size: dist.new_group(members) for size, members in GROUPS.items()}  # every rank creates every group
        for size, members in GROUPS.items():  # one order on every rank
            if rank not in members:
                continue
            group_rank = members.index(rank)
            for case in CASES[size]:
                layer = shard_layer(case, size, group_rank, groups[size])
                assert (layer.rank, layer.world_size) == (group_rank, size)
                for version in (1, 0):  # a full batch first: the case's (smaller) call must not see its rows
                    check_call(layer, stand_in, case, group_rank, version)
    finally:
        dist.destroy_process_group()


def test_ranks_match_the_reference(gloo, tmp_path):
    mp.spawn(_worker, args=(str(tmp_path / "store"),), nprocs=4)


# ---- one rank in this process ----

@pytest.fixture
def stand_in(monkeypatch) -> StandInExperts:
    experts = StandInExperts()
    monkeypatch.setattr(ep, "fused_moe", experts)
    return experts


def test_single_rank_calls(group, stand_in):
    case = Case(8, 3, (6,), 16, seed=11)
    layer = shard_layer(case, 1, 0, group)
    assert (layer.world_size, layer.rows, layer.dispatch) == (1, 16, "all_to_all") and layer.buffer_bytes > 0
    for tokens in (16, 5, 0, 3):  # shorter calls after longer ones
        for kind in ("fp32", "bf16", "packed", "int64"):
            check_call(layer, stand_in, Case(8, 3, (tokens,), 16, kind, seed=tokens), 0, 0)
    # int64 ids beyond int32 stay unrouted (2^32 + 3 would wrap to 3); so does E.
    acts, ids, weights = rank_batch(case, 0)
    wide = ids.long()
    wide[:, 0] = (1 << 32) + 3
    masked = ids.clone()
    masked[:, 0] = -1
    got = layer(acts, Routing.unpacked(wide, weights))
    assert torch.equal(got, reference_output(acts.packed, masked, weights, [0, 8]))
    assert torch.all(stand_in.calls[-1]["ids"][:, 0] == -1)


def test_argument_checks(group, stand_in):
    case = Case(8, 2, (3,), 4)
    layer = shard_layer(case, 1, 0, group)
    acts, ids, weights = rank_batch(Case(8, 2, (5,), 5), 0)
    with pytest.raises(ValueError, match="5 tokens exceed max_tokens_per_rank=4"):
        layer(acts, Routing.unpacked(ids, weights))
    acts, ids, weights = rank_batch(case, 0)
    with pytest.raises(ValueError, match="top_k=1 but the layer was built for top_k=2"):
        layer(acts, Routing.unpacked(ids[:, :1].contiguous(), weights[:, :1].contiguous()))
    with pytest.raises(ValueError, match="out must have shape"):
        layer(acts, Routing.unpacked(ids, weights), out=torch.empty(4, HIDDEN, dtype=torch.bfloat16))
    assert stand_in.calls == [], "a rejected call must not communicate or compute"


@pytest.mark.parametrize("dispatch, error, message", [
    ("alltoall", ValueError, "dispatch must be one of 'all_gather', 'all_to_all', got 'alltoall'"),
    ("All_To_All", ValueError, "dispatch must be one of"),
    ("", ValueError, "dispatch must be one of"),
    (None, TypeError, "dispatch must be a str"),
    (2, TypeError, "dispatch must be a str"),
])
def test_bad_dispatch(group, dispatch, error, message):
    config, weights = Nvfp4MoeConfig(arch="sm90", max_num_tokens=8), shard_weights_of(4)
    with pytest.raises(error, match=message):
        ExpertParallelMoe(config, weights, num_experts=4, top_k=2, max_tokens_per_rank=8, dispatch=dispatch)
    with pytest.raises(error, match=message):
        ep_traffic(dispatch, world_size=2, max_tokens_per_rank=1, hidden_size=128, top_k=2)


def test_dispatch_is_checked_first(monkeypatch):
    """A bad dispatch is reported as such even before torch.distributed is initialized."""
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    with pytest.raises(ValueError, match="dispatch must be one of"):
        ExpertParallelMoe(None, None, num_experts=4, top_k=2, max_tokens_per_rank=8, dispatch="ring")


def test_dispatch_specific_arguments(group):
    config, weights = Nvfp4MoeConfig(arch="sm90", max_num_tokens=8), shard_weights_of(4)
    kwargs = dict(num_experts=4, top_k=2, max_tokens_per_rank=8)
    with pytest.raises(ValueError, match="reduce_dtype=torch.bfloat16 applies to dispatch='all_gather' only"):
        ExpertParallelMoe(config, weights, **kwargs, dispatch="all_to_all", reduce_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="max_num_tokens is 8; raise it to at least 9"):
        ExpertParallelMoe(config, weights, **{**kwargs, "max_tokens_per_rank": 9}, dispatch="all_to_all")
    gathered = ExpertParallelMoe(config, weights, **kwargs)
    assert gathered.dispatch == "all_gather"  # the default
    with pytest.raises(ValueError, match="sent_counts exists for dispatch='all_to_all' only"):
        gathered.sent_counts
    routed = ExpertParallelMoe(config, weights, **kwargs, dispatch="all_to_all", activation=SwiGLU())
    assert routed.sent_counts.tolist() == [0]


# ---- the packing on its own ----

def packing_reference(ids: torch.Tensor, bounds: list[int], tmax: int) -> tuple[list[list[int]], list[int]]:
    """dispatch_rows by a plain loop: the n-th token (in token order) going to peer p takes row p * Tmax + n."""
    world = len(bounds) - 1
    rows, counts = [], [0] * world
    for t in range(ids.shape[0]):
        row = []
        for p in range(world):
            if any(bounds[p] <= int(e) < bounds[p + 1] for e in ids[t]):
                row.append(p * tmax + counts[p])
                counts[p] += 1
            else:
                row.append(world * tmax)
        rows.append(row)
    return rows, counts


@pytest.mark.parametrize("experts, world, top_k, tokens, tmax", [
    (10, 3, 3, 9, 12), (5, 4, 2, 7, 7), (256, 8, 8, 64, 64), (8, 2, 1, 5, 5), (3, 3, 3, 0, 4), (6, 1, 2, 4, 4),
])
def test_dispatch_rows_match_a_loop(experts, world, top_k, tokens, tmax):
    gen = torch.Generator().manual_seed(experts + world)
    ids = torch.rand(tokens, experts, generator=gen).argsort(1)[:, :top_k].to(torch.int32)
    if tokens:
        ids[0] = -1  # unrouted: goes nowhere
        ids[-1, 0] = experts  # out of range: unrouted
    bounds = shard_bounds(experts, world)
    rows, counts = dispatch_rows(ids, torch.tensor(bounds), tmax)
    want_rows, want_counts = packing_reference(ids, bounds, tmax)
    assert rows.dtype == counts.dtype == torch.int64 and rows.shape == (tokens, world)
    assert rows.tolist() == want_rows and counts.tolist() == want_counts
    sent = rows[rows < world * tmax]
    assert sent.unique().numel() == sent.numel(), "two pairs share a send row"


def test_dispatch_rows_at_full_capacity():
    """Top-k = E: every token needs every peer; at T = Tmax each peer's Tmax rows are all taken, in token order."""
    world, tmax = 4, 6
    ids = torch.stack([torch.randperm(8) for _ in range(tmax)]).to(torch.int64)
    rows, counts = dispatch_rows(ids, torch.tensor(shard_bounds(8, world)), tmax)
    assert counts.tolist() == [tmax] * world
    assert torch.equal(rows, torch.arange(world) * tmax + torch.arange(tmax).unsqueeze(1))


# ---- the rounding the reference models, and the bytes-moved model ----

def test_reference_rounding_is_not_single_gpu_rounding():
    """The EP combine rounds each rank's partial before the cross-rank sum: within the BF16 bound of the exact sum,
    yet not bitwise single-GPU fused_moe (one rounding of the whole slot sum), so the reference above checks the
    documented rounding points."""
    acts, ids, weights = rank_batch(Case(16, 8, (32, 0), 32, seed=12), 0)
    ep_rounding = reference_output(acts.packed, ids, weights, shard_bounds(16, 2))
    single = slot_sum(acts.packed, ids, weights, (ids >= 0) & (ids < 16)).bfloat16()
    check_within_rounding(ep_rounding, acts.packed, ids, weights, 16)
    assert not torch.equal(ep_rounding, single)


def test_token_record_and_traffic_model():
    assert token_record_bytes(7168, 8) == 32 + 32 + 3584 + 448 == 4096  # DeepSeek-V3
    shape = dict(max_tokens_per_rank=64, hidden_size=7168, top_k=8)
    assert ep_traffic("all_gather", world_size=8, **shape) == (7 * 64 * 4096, 7 * 64 * 7168 * 4)
    assert ep_traffic("all_gather", world_size=8, **shape, reduce_dtype=torch.bfloat16) == (7 * 64 * 4096,
                                                                                           7 * 64 * 7168 * 2)
    routed = ep_traffic("all_to_all", world_size=8, **shape)
    assert routed == (7 * 64 * 4096, 7 * 64 * 7168 * 2) and routed.total == 7 * 64 * (4096 + 2 * 7168)
    assert ep_traffic("all_to_all", world_size=1, **shape).total == 0
    with pytest.raises(ValueError, match="hidden_size must be a positive multiple of 16"):
        token_record_bytes(100, 2)
    with pytest.raises(ValueError, match="reduce_dtype"):
        ep_traffic("all_gather", world_size=2, **shape, reduce_dtype=torch.float16)
    with pytest.raises(ValueError, match="max_tokens_per_rank must be >= 1"):
        ep_traffic("all_to_all", world_size=2, max_tokens_per_rank=0, hidden_size=128, top_k=1)


@pytest.mark.parametrize("experts, top_k, world", [(6, 3, 3), (5, 2, 4), (7, 3, 2), (9, 9, 3), (8, 1, 8), (4, 2, 1)])
def test_expected_remote_ranks_by_enumeration(experts, top_k, world):
    """Every top-k subset of the experts equally likely: the mean number of other ranks a token needs."""
    bounds = shard_bounds(experts, world)
    for rank in range(world):
        needs = [sum(1 for p in range(world) if p != rank and any(bounds[p] <= e < bounds[p + 1] for e in subset))
                 for subset in itertools.combinations(range(experts), top_k)]
        want = sum(needs) / len(needs)
        assert math.isclose(expected_remote_ranks(experts, top_k, world_size=world, rank=rank), want, rel_tol=1e-12)
    assert expected_remote_ranks(experts, experts, world_size=world, rank=0) == world - 1  # every expert: every rank
