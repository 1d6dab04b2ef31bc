"""CPU tests of the aligned-plan groundwork (contract 002): the plan builder against a plain
Python loop, the float64 reference against an independent per-slot loop, and every argument check.

The plain oracles share no code with cudnn_moe: they decode E2M1 from their own table and
requantize with their own block loop (float32 division, ties to the even code, as the kernel does).
"""

from __future__ import annotations

import math

import pytest
import torch

from cudnn_moe.aligned import (
    align_routing, aligned_moe, check_aligned_args, plan_capacity, prepare_aligned_weights, reference_aligned_moe,
)
from cudnn_moe.formats import quantize_nvfp4

GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
M, TOP_K, E, K, N = 5, 2, 3, 256, 256
I32 = torch.int32


# ----------------------------------------------------------------------------- plan builder
def plain_plan(ids: torch.Tensor, block_m: int, num_experts: int) -> tuple[list[int], list[int], int]:
    """(sorted_token_ids, expert_ids, extent) by a loop over experts; ids outside [0, E) are skipped."""
    flat = ids.reshape(-1).tolist()
    n = len(flat)
    capacity = math.ceil((n + min(n, num_experts) * (block_m - 1)) / block_m) * block_m
    entries: list[int] = []
    experts: list[int] = []
    for expert in range(num_experts):
        slots = [i for i, e in enumerate(flat) if e == expert]
        if slots:
            slots += [n] * (-len(slots) % block_m)
            entries += slots
            experts += [expert] * (len(slots) // block_m)
    extent = len(entries)
    return entries + [n] * (capacity - extent), experts + [0] * (capacity // block_m - len(experts)), extent


@pytest.mark.parametrize("block_m", [8, 16, 64])
@pytest.mark.parametrize("num_tokens,top_k,num_experts", [(1, 1, 1), (7, 2, 4), (33, 8, 64), (64, 4, 3), (3, 6, 256)])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_align_routing_matches_plain_loop(block_m: int, num_tokens: int, top_k: int, num_experts: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(num_tokens * 1000 + top_k * 10 + block_m)
    # a few ids outside [0, E): -1 and E + 1 are routed nowhere
    ids = torch.randint(-1, num_experts + 2, (num_tokens, top_k), generator=gen, dtype=dtype)
    sorted_ids, expert_ids, post = align_routing(ids, block_m, num_experts)
    want_sorted, want_experts, extent = plain_plan(ids, block_m, num_experts)
    assert sorted_ids.dtype == expert_ids.dtype == post.dtype == I32
    assert sorted_ids.is_contiguous() and expert_ids.is_contiguous() and post.shape == (1,)
    assert sorted_ids.tolist() == want_sorted
    assert expert_ids.tolist() == want_experts
    assert post.item() == extent and extent % block_m == 0


def test_align_routing_experts_without_slots_and_skipped_ids() -> None:
    ids = torch.tensor([[5, 5], [-1, 7], [5, 9]], dtype=I32)  # experts 0..4, 6, 8 get nothing; 9 >= E
    sorted_ids, expert_ids, post = align_routing(ids, 8, 9)
    assert post.item() == 16
    assert sorted_ids[:16].tolist() == [0, 1, 4] + [6] * 5 + [3] + [6] * 7
    assert expert_ids.tolist()[:2] == [5, 7] and set(expert_ids.tolist()[2:]) == {0}
    assert set(sorted_ids[16:].tolist()) == {6}


def test_align_routing_hand_built() -> None:
    ids = torch.tensor([[2, 0], [0, 2], [2, 2]], dtype=torch.int64)
    sorted_ids, expert_ids, post = align_routing(ids, 8, 3)
    # 6 slots, 3 experts: capacity = 6 + 3 * 7 = 27 -> 32
    assert sorted_ids.tolist() == [1, 2] + [6] * 6 + [0, 3, 4, 5] + [6] * 4 + [6] * 16
    assert expert_ids.tolist() == [0, 2, 0, 0]
    assert post.tolist() == [16]


def test_align_routing_vllm_docstring_example() -> None:
    """vLLM's moe_align_block_size docstring example (ids 1..4 there, 0..3 here), block_m 8."""
    ids = torch.tensor([[1, 2, 3], [0, 1, 3], [0, 2, 3], [0, 1, 2]])
    sorted_ids, expert_ids, post = align_routing(ids, 8, 4)
    pad = [12] * 5
    assert sorted_ids[:32].tolist() == [3, 6, 9] + pad + [0, 4, 10] + pad + [1, 7, 11] + pad + [2, 5, 8] + pad
    assert expert_ids[:4].tolist() == [0, 1, 2, 3] and post.item() == 32


@pytest.mark.parametrize(
    "num_slots,num_experts,block_m,want",
    [(12, 4, 4, 24), (12, 4, 8, 40), (3, 256, 8, 24), (0, 8, 8, 0), (1, 1, 8, 8), (4096 * 8, 256, 64, 4096 * 8 + 256 * 63), (10, 3, 16, 64)],
)
def test_plan_capacity(num_slots: int, num_experts: int, block_m: int, want: int) -> None:
    assert plan_capacity(num_slots, num_experts, block_m) == want


@pytest.mark.parametrize("block_m", [8, 32])
def test_align_routing_capacity_holds_the_worst_case(block_m: int) -> None:
    """One slot per expert pads every group to a whole block: the extent reaches the capacity."""
    ids = torch.arange(12, dtype=I32).reshape(6, 2)
    sorted_ids, expert_ids, post = align_routing(ids, block_m, 12)
    assert post.item() == sorted_ids.numel() == 12 * block_m
    assert expert_ids.tolist() == list(range(12))
    ids = torch.arange(3, dtype=I32).reshape(3, 1)  # fewer slots than experts
    sorted_ids, _, post = align_routing(ids, block_m, 256)
    assert post.item() == sorted_ids.numel() == 3 * block_m


def test_align_routing_empty() -> None:
    sorted_ids, expert_ids, post = align_routing(torch.zeros(0, 4, dtype=I32), 8, 16)
    assert sorted_ids.numel() == expert_ids.numel() == 0 and post.tolist() == [0]


HUGE_IDS = torch.zeros(1, 1, dtype=I32).expand(1 << 31, 1)  # a view: no memory behind it

PLAN_ROWS = [
    ("ids list", lambda: align_routing([[0, 1]], 8, 2), TypeError, "topk_ids must be a torch.Tensor"),
    ("ids float", lambda: align_routing(torch.zeros(2, 2), 8, 2), TypeError, "topk_ids must be an integer"),
    ("ids bool", lambda: align_routing(torch.zeros(2, 2, dtype=torch.bool), 8, 2), TypeError, "topk_ids must be an integer"),
    ("ids 1-D", lambda: align_routing(torch.zeros(4, dtype=I32), 8, 2), ValueError, "topk_ids must be 2-D"),
    ("ids 3-D", lambda: align_routing(torch.zeros(2, 2, 1, dtype=I32), 8, 2), ValueError, "topk_ids must be 2-D"),
    ("ids no slots", lambda: align_routing(torch.zeros(2, 0, dtype=I32), 8, 2), ValueError, "top_k >= 1"),
    ("block_m 4", lambda: align_routing(torch.zeros(2, 2, dtype=I32), 4, 2), ValueError, "block_m must be >= 8"),
    ("block_m 12", lambda: align_routing(torch.zeros(2, 2, dtype=I32), 12, 2), ValueError, "block_m must be a multiple of 8"),
    ("block_m float", lambda: align_routing(torch.zeros(2, 2, dtype=I32), 8.0, 2), TypeError, "block_m must be an int"),
    ("block_m bool", lambda: align_routing(torch.zeros(2, 2, dtype=I32), True, 2), TypeError, "block_m must be an int"),
    ("num_experts 0", lambda: align_routing(torch.zeros(2, 2, dtype=I32), 8, 0), ValueError, "num_experts must be >= 1"),
    ("num_experts float", lambda: align_routing(torch.zeros(2, 2, dtype=I32), 8, 2.0), TypeError, "num_experts must be an int"),
    ("too many slots", lambda: align_routing(HUGE_IDS, 8, 2), ValueError, "int32"),
]


@pytest.mark.parametrize("call,exc,text", [row[1:] for row in PLAN_ROWS], ids=[row[0] for row in PLAN_ROWS])
def test_align_routing_bad_arguments(call, exc: type[Exception], text: str) -> None:
    with pytest.raises(exc, match=text):
        call()


# ----------------------------------------------------------------------------- plain oracle of the op
def plain_decode(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] + e4m3 [..., K/16] -> float64 [..., K]; element 2i is the low nibble."""
    nibbles = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2).long()
    values = GRID[nibbles & 7] * torch.where(nibbles >= 8, -1.0, 1.0).double()
    return values * scales.float().double().repeat_interleave(16, dim=-1)


def plain_requantize(y: torch.Tensor) -> torch.Tensor:
    """float64 [I] -> the NVFP4 values (global scale one) of y rounded to float32, block by block."""
    out = torch.zeros_like(y)
    y32 = y.float()
    index = torch.arange(8)
    for start in range(0, y.numel(), 16):
        block = y32[start : start + 16]
        scale = (block.abs().max() / 6.0).clamp(max=448.0).to(torch.float8_e4m3fn).float()
        if scale.item() == 0.0:
            continue
        q = (block / scale).double()  # float32 division
        distance = (q.abs().clamp(max=6.0)[:, None] - GRID[None, :]).abs()
        nearest = distance == distance.min(dim=1, keepdim=True).values
        pick = (nearest.double() * torch.where(index % 2 == 0, 2.0, 1.0)).argmax(dim=1)  # ties: even code
        out[start : start + 16] = torch.copysign(GRID[pick], q) * scale.item()
    return out


class Layer:
    """Random NVFP4 data of the contract's layouts, quantized with cudnn_moe.formats."""

    def __init__(self, seed: int, num_tokens: int = M, top_k: int = TOP_K) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.num_tokens, self.top_k = num_tokens, top_k
        self.hidden_states, self.hidden_states_scale = quantize_nvfp4(torch.randn(num_tokens, K, generator=gen))
        self.gemm1_weights, self.gemm1_weights_scale = quantize_nvfp4(0.1 * torch.randn(E, N, K, generator=gen))
        self.gemm2_weights, self.gemm2_weights_scale = quantize_nvfp4(0.1 * torch.randn(E, K, N // 2, generator=gen))
        self.gate_scale, self.up_scale, self.down_scale = (0.5 + torch.rand(3, E, generator=gen)).unbind(0)
        self.topk_weights = torch.rand(num_tokens, top_k, generator=gen)
        self.ids = torch.stack([torch.randperm(E, generator=gen)[:top_k] for _ in range(num_tokens)]).to(I32)
        self.out = (4 * torch.randn(num_tokens, K, generator=gen)).to(torch.bfloat16)

    def reference(self, plan: tuple[torch.Tensor, ...], *, out: torch.Tensor | None = None, block_m: int = 8,
                  rsf: float = 1.0, hidden_states: torch.Tensor | None = None) -> torch.Tensor:
        return reference_aligned_moe(
            self.hidden_states if hidden_states is None else hidden_states, self.hidden_states_scale,
            self.gemm1_weights, self.gemm1_weights_scale, self.gemm2_weights, self.gemm2_weights_scale,
            self.gate_scale, self.up_scale, self.down_scale, *plan, self.topk_weights,
            self.out if out is None else out, self.top_k, block_m, rsf,
        )

    def plain(self, walk: list[tuple[int, int, int]], out: torch.Tensor, rsf: float) -> torch.Tensor:
        """Add one contribution per (token, slot, expert) of ``walk``, in its order, into out's values."""
        x = plain_decode(self.hidden_states, self.hidden_states_scale)
        w1 = plain_decode(self.gemm1_weights, self.gemm1_weights_scale)
        w2 = plain_decode(self.gemm2_weights, self.gemm2_weights_scale)
        def bf16(v: torch.Tensor) -> torch.Tensor:
            return v.to(torch.bfloat16).double()

        acc = out.double()
        for token, slot, expert in walk:
            h = w1[expert] @ x[token]
            gate = bf16(h[: N // 2] * self.gate_scale[expert].item())
            up = bf16(h[N // 2 :] * self.up_scale[expert].item())
            y = plain_requantize(gate / (1.0 + torch.exp(-gate)) * up)
            down = bf16((w2[expert] @ y) * self.down_scale[expert].item())
            weight = (self.topk_weights[token, slot] * torch.tensor(rsf, dtype=torch.float32)).item()  # FP32 product
            acc[token] += down * weight
        return acc.to(torch.bfloat16)


def plan_walk(plan: tuple[torch.Tensor, ...], block_m: int, num_slots: int, top_k: int) -> list[tuple[int, int, int]]:
    """(token, slot, expert) of every non-padding entry of the active blocks, in plan order."""
    sorted_ids, expert_ids, post = (p.tolist() for p in plan)
    walk = []
    for block in range(math.ceil(post[0] / block_m)):
        for entry in sorted_ids[block * block_m : (block + 1) * block_m]:
            if entry < num_slots:
                walk.append((entry // top_k, entry % top_k, expert_ids[block]))
    return walk


def assert_bf16_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal up to float64 summation-order noise: one BF16 unit where a sum sits on a rounding tie."""
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=2.0**-7, atol=1e-6)


# ----------------------------------------------------------------------------- reference tests
@pytest.mark.parametrize("block_m", [8, 16])
@pytest.mark.parametrize("rsf", [1.0, 2.5])
def test_reference_matches_plain_loop(block_m: int, rsf: float) -> None:
    layer = Layer(seed=block_m + int(rsf))
    plan = align_routing(layer.ids, block_m, E)
    out_before = layer.out.clone()
    got = layer.reference(plan, block_m=block_m, rsf=rsf)
    assert torch.equal(layer.out, out_before)  # the reference returns a new tensor
    assert got.shape == (M, K) and got.dtype == torch.bfloat16
    walk = plan_walk(plan, block_m, M * TOP_K, TOP_K)
    assert sorted((t, s) for t, s, _ in walk) == [(t, s) for t in range(M) for s in range(TOP_K)]
    assert_bf16_close(got, layer.plain(walk, layer.out, rsf))
    # and against the routing itself, token-major (another summation order)
    token_major = [(t, s, int(layer.ids[t, s])) for t in range(M) for s in range(TOP_K)]
    assert_bf16_close(got, layer.plain(token_major, layer.out, rsf))


def test_reference_accumulates_into_out() -> None:
    layer = Layer(seed=3)
    plan = align_routing(layer.ids, 8, E)
    zero = torch.zeros_like(layer.out)
    fresh = layer.reference(plan, out=zero)
    added = layer.reference(plan)
    assert not torch.equal(added, fresh)
    # added rounds out + sum once; out + fresh adds a second rounding: half a BF16 unit of each
    torch.testing.assert_close(added.double(), layer.out.double() + fresh.double(),
                               rtol=2.0**-8, atol=2.0**-8 * fresh.abs().max().item())
    empty_plan = (plan[0], plan[1], torch.zeros(1, dtype=I32))
    assert torch.equal(layer.reference(empty_plan), layer.out)  # nothing active: out's values back


def test_reference_skips_blocks_past_the_extent() -> None:
    layer = Layer(seed=4)
    sorted_ids, expert_ids, post = align_routing(layer.ids, 8, E)
    want = layer.reference((sorted_ids, expert_ids, post))
    active = post.item() // 8
    garbage_ids = sorted_ids.clone()
    garbage_ids[active * 8 :] = torch.randint(-(1 << 30), 1 << 30, (garbage_ids.numel() - active * 8,), dtype=I32)
    garbage_experts = expert_ids.clone()
    garbage_experts[active:] = torch.tensor([-7, 12345, E] * expert_ids.numel(), dtype=I32)[: expert_ids.numel() - active]
    assert torch.equal(layer.reference((garbage_ids, garbage_experts, post)), want)


def test_reference_hand_built_plan() -> None:
    """Blocks in any expert order, a repeated expert, padding of every size, a partial last block
    (a vLLM plan without pad_sorted_ids), one slot never named."""
    layer = Layer(seed=5, num_tokens=3, top_k=2)
    pad = 6
    sorted_ids = torch.tensor([3, 0, pad, 7, pad, pad, pad, pad,  # expert 2 (7 and up: padding too)
                               1, 4, pad, pad, pad, pad, pad, pad,  # expert 0
                               2, pad, pad, pad, pad, pad, pad, pad,  # expert 2 again
                               pad, pad, pad, pad], dtype=I32)  # partial last block, past the extent
    expert_ids = torch.tensor([2, 0, 2, 1], dtype=I32)
    post = torch.tensor([24], dtype=I32)
    plan = (sorted_ids, expert_ids, post)
    walk = plan_walk(plan, 8, 6, 2)
    assert walk == [(1, 1, 2), (0, 0, 2), (0, 1, 0), (2, 0, 0), (1, 0, 2)]  # slot (2, 1) never
    assert_bf16_close(layer.reference(plan), layer.plain(walk, layer.out, 1.0))
    assert_bf16_close(layer.reference(plan, rsf=-0.75), layer.plain(walk, layer.out, -0.75))


def test_reference_rejects_a_slot_named_twice() -> None:
    layer = Layer(seed=5, num_tokens=3, top_k=2)
    pad = 6
    sorted_ids = torch.tensor([3, 0, pad, pad, pad, pad, pad, pad, 1, 3, pad, pad, pad, pad, pad, pad], dtype=I32)
    plan = (sorted_ids, torch.tensor([2, 0], dtype=I32), torch.tensor([16], dtype=I32))
    with pytest.raises(ValueError, match="names a slot twice"):
        layer.reference(plan)
    past_extent = (sorted_ids, plan[1], torch.tensor([8], dtype=I32))  # the repeat lies past the extent: fine
    assert layer.reference(past_extent).shape == (3, K)


def test_reference_ignores_slots_routed_nowhere() -> None:
    layer = Layer(seed=6)
    layer.ids[1, 0] = -1
    layer.ids[3, 1] = E + 2
    plan = align_routing(layer.ids, 16, E)
    routed = [(t, s, int(layer.ids[t, s])) for t in range(M) for s in range(TOP_K) if 0 <= layer.ids[t, s] < E]
    assert_bf16_close(layer.reference(plan, block_m=16), layer.plain(routed, layer.out, 1.0))


def test_reference_row_strided_hidden_states() -> None:
    layer = Layer(seed=7)
    plan = align_routing(layer.ids, 8, E)
    buffer = torch.zeros(M, K // 2 + 48, dtype=torch.uint8)
    view = buffer[:, : K // 2]
    view.copy_(layer.hidden_states)
    assert not view.is_contiguous() and view.stride() == (K // 2 + 48, 1)
    assert torch.equal(layer.reference(plan, hidden_states=view), layer.reference(plan))


PLAN_VALUE_ROWS = [
    ("extent past capacity", lambda p: p[2].fill_(p[1].numel() * 8 + 8), "num_tokens_post_padded"),
    ("negative extent", lambda p: p[2].fill_(-8), "num_tokens_post_padded"),
    ("expert -1 in an active block", lambda p: p[1].__setitem__(0, -1), "expert_ids must lie in"),
    ("expert E in an active block", lambda p: p[1].__setitem__(0, E), "expert_ids must lie in"),
    ("negative entry in an active block", lambda p: p[0].__setitem__(0, -1), "sorted_token_ids must be non-negative"),
]


@pytest.mark.parametrize("mutate,text", [row[1:] for row in PLAN_VALUE_ROWS], ids=[row[0] for row in PLAN_VALUE_ROWS])
def test_reference_refuses_plans_breaking_the_contract(mutate, text: str) -> None:
    layer = Layer(seed=8)
    plan = tuple(p.clone() for p in align_routing(layer.ids, 8, E))
    mutate(plan)
    with pytest.raises(ValueError, match=text):
        layer.reference(plan)


# ----------------------------------------------------------------------------- argument checks
def valid_args() -> dict[str, object]:
    layer = Layer(seed=9)
    sorted_ids, expert_ids, post = align_routing(layer.ids, 8, E)
    return dict(
        hidden_states=layer.hidden_states, hidden_states_scale=layer.hidden_states_scale,
        gemm1_weights=layer.gemm1_weights, gemm1_weights_scale=layer.gemm1_weights_scale,
        gemm2_weights=layer.gemm2_weights, gemm2_weights_scale=layer.gemm2_weights_scale,
        output1_scale_gate_scalar=layer.gate_scale, output1_scale_scalar=layer.up_scale,
        output2_scale_scalar=layer.down_scale, sorted_token_ids=sorted_ids, expert_ids=expert_ids,
        num_tokens_post_padded=post, topk_weights=layer.topk_weights, out=layer.out,
        top_k=TOP_K, block_m=8, routed_scaling_factor=1.0,
    )


def test_check_aligned_args_accepts_valid_arguments() -> None:
    dims = check_aligned_args(**valid_args())
    assert (dims.num_tokens, dims.hidden, dims.n, dims.num_experts, dims.top_k, dims.block_m) == (M, K, N, E, TOP_K, 8)
    assert dims.routed_scaling_factor == 1.0


def strided_rows(row_stride: int, offset: int = 0) -> torch.Tensor:
    """A [M, K/2] uint8 view with the given row stride, ``offset`` bytes into a 16-byte aligned buffer."""
    buffer = torch.zeros(M * max(row_stride, K // 2) + 64, dtype=torch.uint8)
    start = (-buffer.data_ptr()) % 16 + offset
    return buffer.as_strided((M, K // 2), (row_stride, 1), start)


def shared_buffer(args: dict[str, object], name: str) -> None:
    """Make ``out`` share its bytes with args[name] (same dtype and shape as before)."""
    value = args[name]
    out = args["out"]
    assert isinstance(value, torch.Tensor) and isinstance(out, torch.Tensor)
    raw = torch.zeros(max(out.numel() * 2, value.numel() * value.element_size()), dtype=torch.uint8)
    args["out"] = raw[: out.numel() * 2].view(torch.bfloat16).view(out.shape)
    args[name] = raw[: value.numel() * value.element_size()].view(value.dtype).view(value.shape)


def misaligned(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of t whose data pointer is one element past a 16-byte boundary."""
    flat = torch.zeros(t.numel() + 16, dtype=t.dtype)
    start = (-flat.data_ptr() // t.element_size()) % (16 // t.element_size()) + 1
    return flat[start : start + t.numel()].view(t.shape)


def put(**changes: object):
    return lambda args: args.update(changes)


def change(name: str, fn):
    return lambda args: args.update({name: fn(args[name])})


U8, E4M3, F32 = torch.uint8, torch.float8_e4m3fn, torch.float32
CHECK_ROWS = [
    # types and ranks
    ("hidden_states list", put(hidden_states=[[0]]), TypeError, "hidden_states must be a torch.Tensor"),
    ("hidden_states int8", change("hidden_states", lambda t: t.to(torch.int8)), TypeError, "hidden_states must have dtype uint8"),
    ("hidden_states 3-D", change("hidden_states", lambda t: t[None]), ValueError, "hidden_states must have 2 dimensions"),
    ("hidden_states_scale float32", change("hidden_states_scale", lambda t: t.float()), TypeError, "hidden_states_scale must have dtype float8_e4m3fn"),
    ("gemm1_weights 2-D", change("gemm1_weights", lambda t: t[0]), ValueError, "gemm1_weights must have 3 dimensions"),
    ("gemm1_weights_scale uint8", change("gemm1_weights_scale", lambda t: t.view(U8)), TypeError, "gemm1_weights_scale must have dtype"),
    ("gemm2_weights float", change("gemm2_weights", lambda t: t.float()), TypeError, "gemm2_weights must have dtype uint8"),
    ("gemm2_weights_scale bf16", change("gemm2_weights_scale", lambda t: t.bfloat16()), TypeError, "gemm2_weights_scale must have dtype"),
    ("gate scale float64", change("output1_scale_gate_scalar", lambda t: t.double()), TypeError, "output1_scale_gate_scalar must have dtype float32"),
    ("up scale bf16", change("output1_scale_scalar", lambda t: t.bfloat16()), TypeError, "output1_scale_scalar must have dtype float32"),
    ("down scale 2-D", change("output2_scale_scalar", lambda t: t[:, None]), ValueError, "output2_scale_scalar must have 1 dimensions"),
    ("sorted_token_ids int64", change("sorted_token_ids", lambda t: t.long()), TypeError, "sorted_token_ids must have dtype int32"),
    ("expert_ids int64", change("expert_ids", lambda t: t.long()), TypeError, "expert_ids must have dtype int32"),
    ("num_tokens_post_padded int64", change("num_tokens_post_padded", lambda t: t.long()), TypeError, "num_tokens_post_padded must have dtype int32"),
    ("num_tokens_post_padded 0-d", change("num_tokens_post_padded", lambda t: t[0]), ValueError, "num_tokens_post_padded must have 1 dimensions"),
    ("num_tokens_post_padded list", put(num_tokens_post_padded=[8]), TypeError, "num_tokens_post_padded must be a torch.Tensor"),
    ("topk_weights bf16", change("topk_weights", lambda t: t.bfloat16()), TypeError, "topk_weights must have dtype float32"),
    ("out float32", change("out", lambda t: t.float()), TypeError, "out must have dtype bfloat16"),
    # scalars
    ("top_k float", put(top_k=2.0), TypeError, "top_k must be an int"),
    ("top_k bool", put(top_k=True), TypeError, "top_k must be an int"),
    ("top_k 0", put(top_k=0), ValueError, "top_k must be >= 1"),
    ("block_m 4", put(block_m=4), ValueError, "block_m must be >= 8"),
    ("block_m 12", put(block_m=12), ValueError, "block_m must be a multiple of 8"),
    ("block_m str", put(block_m="8"), TypeError, "block_m must be an int"),
    ("rsf nan", put(routed_scaling_factor=math.nan), ValueError, "routed_scaling_factor must be finite"),
    ("rsf inf", put(routed_scaling_factor=-math.inf), ValueError, "routed_scaling_factor must be finite"),
    ("rsf tensor", put(routed_scaling_factor=torch.tensor(1.0)), TypeError, "routed_scaling_factor must be a Python number"),
    ("rsf str", put(routed_scaling_factor="1"), TypeError, "routed_scaling_factor must be a number"),
    # sizes
    ("K 128", change("hidden_states", lambda t: t[:, :64].contiguous()), ValueError, r"K = 2 \* hidden_states.shape\[1\]"),
    ("K 384", put(hidden_states=torch.zeros(M, 192, dtype=U8)), ValueError, r"K = 2 \* hidden_states.shape\[1\]"),
    ("N 128", change("gemm1_weights", lambda t: t[:, :128].contiguous()), ValueError, r"N = gemm1_weights.shape\[1\]"),
    ("N 320", put(gemm1_weights=torch.zeros(E, 320, K // 2, dtype=U8)), ValueError, r"N = gemm1_weights.shape\[1\]"),
    ("no experts", change("gemm1_weights", lambda t: t[:0]), ValueError, "gemm1_weights must hold at least one expert"),
    ("M * top_k past int32", put(hidden_states=torch.zeros(1, K // 2, dtype=U8).expand(1 << 30, K // 2)), ValueError, r"M \* top_k"),
    # shapes
    ("hidden_states_scale rows", change("hidden_states_scale", lambda t: t[:-1]), ValueError, "hidden_states_scale must have shape"),
    ("gemm1_weights K", put(gemm1_weights=torch.zeros(E, N, K // 4, dtype=U8)), ValueError, "gemm1_weights must have shape"),
    ("gemm1_weights_scale experts", change("gemm1_weights_scale", lambda t: t[:-1]), ValueError, "gemm1_weights_scale must have shape"),
    ("gemm2_weights N/2", put(gemm2_weights=torch.zeros(E, K, N // 2, dtype=U8)), ValueError, "gemm2_weights must have shape"),
    ("gemm2_weights_scale N/16", put(gemm2_weights_scale=torch.zeros(E, K, N // 16, dtype=E4M3)), ValueError, "gemm2_weights_scale must have shape"),
    ("gate scale E+1", put(output1_scale_gate_scalar=torch.ones(E + 1)), ValueError, "output1_scale_gate_scalar must have shape"),
    ("up scale E-1", put(output1_scale_scalar=torch.ones(E - 1)), ValueError, "output1_scale_scalar must have shape"),
    ("down scale E+1", put(output2_scale_scalar=torch.ones(E + 1)), ValueError, "output2_scale_scalar must have shape"),
    ("expert_ids short", change("expert_ids", lambda t: t[:-1]), ValueError, r"expert_ids must have ceil\(sorted_token_ids.numel\(\) / block_m\)"),
    ("sorted_token_ids long", change("sorted_token_ids", lambda t: torch.cat((t, t[:8]))), ValueError, "expert_ids must have ceil"),
    ("block_m vs plan", put(block_m=16), ValueError, "expert_ids must have ceil"),
    ("num_tokens_post_padded [2]", put(num_tokens_post_padded=torch.zeros(2, dtype=I32)), ValueError, "num_tokens_post_padded must have shape"),
    ("topk_weights top_k", change("topk_weights", lambda t: torch.cat((t, t), 1)), ValueError, "topk_weights must have shape"),
    ("top_k vs topk_weights", put(top_k=3), ValueError, "topk_weights must have shape"),
    ("out K", put(out=torch.zeros(M, 2 * K, dtype=torch.bfloat16)), ValueError, "out must have shape"),
    # devices, strides, alignment
    ("out on meta", change("out", lambda t: t.to("meta")), ValueError, "out is on meta"),
    ("expert_ids on meta", change("expert_ids", lambda t: t.to("meta")), ValueError, "expert_ids is on meta"),
    ("hidden_states inner stride", put(hidden_states=torch.zeros(M, K, dtype=U8)[:, ::2]), ValueError, "hidden_states must have inner stride 1"),
    ("hidden_states row stride 136", put(hidden_states=strided_rows(K // 2 + 8)), ValueError, "hidden_states' row stride"),
    ("hidden_states row stride 16", put(hidden_states=strided_rows(16)), ValueError, "hidden_states' row stride"),
    ("hidden_states misaligned", put(hidden_states=strided_rows(K // 2 + 16, offset=8)), ValueError, "hidden_states' data pointer"),
    ("hidden_states_scale strided", change("hidden_states_scale", lambda t: torch.cat((t, t), 1)[:, : K // 16]), ValueError, "hidden_states_scale must be contiguous"),
    ("gemm1_weights transposed", change("gemm1_weights", lambda t: t.transpose(1, 2).contiguous().transpose(1, 2)), ValueError, "gemm1_weights must be contiguous"),
    ("gemm2_weights_scale strided", change("gemm2_weights_scale", lambda t: torch.cat((t, t), 2)[..., ::2]), ValueError, "gemm2_weights_scale must be contiguous"),
    ("down scale strided", change("output2_scale_scalar", lambda t: t.repeat(2)[::2]), ValueError, "output2_scale_scalar must be contiguous"),
    ("sorted_token_ids strided", change("sorted_token_ids", lambda t: t.repeat_interleave(2)[::2]), ValueError, "sorted_token_ids must be contiguous"),
    ("topk_weights transposed", change("topk_weights", lambda t: t.T.contiguous().T), ValueError, "topk_weights must be contiguous"),
    ("out transposed", change("out", lambda t: t.T.contiguous().T), ValueError, "out must be contiguous"),
    ("out misaligned", change("out", misaligned), ValueError, "out's data pointer"),
    # overlap
    ("out overlaps hidden_states", lambda a: shared_buffer(a, "hidden_states"), ValueError, "out overlaps the memory of hidden_states"),
    ("out overlaps topk_weights", lambda a: shared_buffer(a, "topk_weights"), ValueError, "out overlaps the memory of topk_weights"),
    ("out overlaps gemm2_weights", lambda a: shared_buffer(a, "gemm2_weights"), ValueError, "out overlaps the memory of gemm2_weights"),
    ("out overlaps expert_ids", lambda a: shared_buffer(a, "expert_ids"), ValueError, "out overlaps the memory of expert_ids"),
]


@pytest.mark.parametrize("mutate,exc,text", [row[1:] for row in CHECK_ROWS], ids=[row[0] for row in CHECK_ROWS])
def test_check_aligned_args_refuses(mutate, exc: type[Exception], text: str) -> None:
    args = valid_args()
    mutate(args)
    with pytest.raises(exc, match=text):
        check_aligned_args(**args)
    with pytest.raises(exc, match=text):  # the reference checks the same way, before any work
        reference_aligned_moe(**args)


# ----------------------------------------------------------------------------- weight preparation, the op on CPU
@pytest.mark.parametrize("arch,engine,in_place,held_in_place", [
    ("sm90", "sm90", None, True), ("sm90", "sm90", False, False), ("sm100", "cudnn", None, False),
    ("sm90", "cudnn", None, False),
])
def test_prepare_aligned_weights_keeps_the_bits(arch: str, engine: str, in_place: bool | None,
                                                held_in_place: bool) -> None:
    """By default the sm90 engine reads the caller's tensors in place and the cudnn engine lays them out in its own
    layout; in_place=False lays them out on the sm90 engine too. Either way the caller's values come back bit for bit
    and the caller's tensors are not written."""
    layer = Layer(seed=11)
    raw = (layer.gemm1_weights, layer.gemm1_weights_scale, layer.gemm2_weights, layer.gemm2_weights_scale)
    before = [t.clone() for t in raw]
    prepared = prepare_aligned_weights(*raw, arch=arch, engine=engine, in_place=in_place)
    assert prepared.layer.spec.engine == engine and prepared.num_experts == E
    assert prepared.in_place is held_in_place
    # no alphas: each call's output scales go into the token bucket, never into the prepared weights
    assert prepared.layer.w1_alpha is None and prepared.layer.w2_alpha is None and prepared.layer.w1_alpha_split == N // 2
    back = prepared.canonical()
    for got, want, name in zip(back, raw, ("w1", "w1 scales", "w2", "w2 scales")):
        assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8)), name
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(raw, before))  # inputs untouched
    # the pipeline's [up; gate] order: the first half of the packed GEMM1 rows is the caller's up half
    w1_internal = prepared.layer.canonical()[0]
    assert torch.equal(w1_internal[:, : N // 2], layer.gemm1_weights[:, N // 2 :])


PREPARE_ROWS = [
    ("codes not uint8", lambda a: a.__setitem__(0, a[0].view(torch.int8)), TypeError, "gemm1_weights"),
    ("scales not e4m3", lambda a: a.__setitem__(1, a[1].view(torch.uint8)), TypeError, "gemm1_weights_scale"),
    ("N not a multiple of 256", lambda a: a.__setitem__(0, a[0][:, :128]), ValueError, "N = gemm1_weights"),
    ("no experts", lambda a: a.__setitem__(0, a[0][:0]), ValueError, "holds 0 experts"),
    ("w2 of another K", lambda a: a.__setitem__(2, a[2][:, :128]), ValueError, "gemm2_weights"),
    ("w2 scales of another N", lambda a: a.__setitem__(3, a[3][..., :4]), ValueError, "gemm2_weights_scale"),
    ("a NaN w1 scale", lambda a: _set_scale_byte(a, 1, 0xFF), ValueError, "gemm1_weights_scale holds E4M3 NaN"),
    ("a negative w2 scale", lambda a: _set_scale_byte(a, 3, 0x81), ValueError, "gemm2_weights_scale holds negative"),
]


def _set_scale_byte(raw: list, index: int, code: int) -> None:
    """One block scale of raw[index] set to E4M3 ``code`` (on a copy: the layer's tensors stay as they are)."""
    scales = raw[index].clone()
    scales.view(torch.uint8)[1, 2, 0] = code
    raw[index] = scales


@pytest.mark.parametrize("mutate,error,text", [r[1:] for r in PREPARE_ROWS], ids=[r[0] for r in PREPARE_ROWS])
def test_prepare_aligned_weights_refuses_bad_tensors(mutate, error, text: str) -> None:
    layer = Layer(seed=12)
    raw = [layer.gemm1_weights, layer.gemm1_weights_scale, layer.gemm2_weights, layer.gemm2_weights_scale]
    mutate(raw)
    with pytest.raises(error, match=text):
        prepare_aligned_weights(*raw, arch="sm90")


def test_prepare_aligned_weights_refuses_an_in_place_that_is_no_bool() -> None:
    layer = Layer(seed=12)
    raw = [layer.gemm1_weights, layer.gemm1_weights_scale, layer.gemm2_weights, layer.gemm2_weights_scale]
    with pytest.raises(TypeError, match="in_place must be None, True or False"):
        prepare_aligned_weights(*raw, arch="sm90", in_place="yes")


def test_prepare_aligned_weights_needs_an_arch_on_the_cpu() -> None:
    layer = Layer(seed=13)
    with pytest.raises(ValueError, match="arch is required"):
        prepare_aligned_weights(layer.gemm1_weights, layer.gemm1_weights_scale, layer.gemm2_weights,
                                layer.gemm2_weights_scale)


def test_aligned_moe_checks_then_refuses_the_cpu() -> None:
    layer = Layer(seed=14)
    plan = align_routing(layer.ids, 8, E)
    args = (layer.hidden_states, layer.hidden_states_scale, layer.gemm1_weights, layer.gemm1_weights_scale,
            layer.gemm2_weights, layer.gemm2_weights_scale, layer.gate_scale, layer.up_scale, layer.down_scale,
            *plan, layer.topk_weights)
    out = layer.out.clone()
    with pytest.raises(ValueError, match="block_m must be a multiple of 8"):
        aligned_moe(*args, out, TOP_K, 12)
    with pytest.raises(ValueError, match="runs on a CUDA device"):
        aligned_moe(*args, out, TOP_K, 8)
    with pytest.raises(ValueError, match="w2_scale_prepared must be None"):
        aligned_moe(*args, out, TOP_K, 8, w2_scale_prepared=torch.zeros(1, dtype=torch.uint8))
    assert torch.equal(out, layer.out)


def test_aligned_weights_handle_is_stable_and_dies_with_the_weights() -> None:
    import gc

    from cudnn_moe.aligned import aligned_weights_handle
    from cudnn_moe.aligned.torch_op import _registered

    layer = Layer(seed=15)
    prepared = prepare_aligned_weights(layer.gemm1_weights, layer.gemm1_weights_scale, layer.gemm2_weights,
                                       layer.gemm2_weights_scale, arch="sm90")
    handle = aligned_weights_handle(prepared)
    assert handle > 0 and aligned_weights_handle(prepared) == handle and _registered.resolve(handle) is prepared
    del prepared
    gc.collect()
    with pytest.raises(ValueError, match=f"handle {handle} names no live"):
        _registered.resolve(handle)
    with pytest.raises(TypeError, match="prepare_aligned_weights"):
        aligned_weights_handle(object())  # type: ignore[arg-type]


def test_prepared_weights_know_their_tensors() -> None:
    """Identity, not only address: a copy (or new tensors at freed addresses) is not what was prepared;
    another view of the same tensor is; an in-place write is not."""
    layer = Layer(seed=16)
    raw = [layer.gemm1_weights, layer.gemm1_weights_scale, layer.gemm2_weights, layer.gemm2_weights_scale]
    prepared = prepare_aligned_weights(*raw, arch="sm90")
    assert prepared.same_tensors(raw)
    assert prepared.same_tensors([raw[0].view(raw[0].shape), *raw[1:]])
    assert not prepared.same_tensors([raw[0].clone(), *raw[1:]])
    raw[2].add_(0)  # an in-place write bumps the version counter
    assert not prepared.same_tensors(raw)

