"""GPU unit tests of the CUDA glue kernels, each against a plain Python or torch statement of its documented
semantics. Output buffers are poisoned before every launch so that missing and stray writes both show."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from cudnn_moe import kernels
from cudnn_moe.activations import GELU, Activation, GeGLU, GeGLUTanh, Identity, ReLU, ReLU2, SiLU, SwiGLU
from cudnn_moe.pipeline.executor import row_capacity
from cudnn_moe.engines.sm90.layout import from_token_layout, to_token_layout
from cudnn_moe.formats import dequantize_nvfp4, encode_e2m1, swizzled_offset, swizzled_shape, unpack_nibbles
from cudnn_moe.kernels import SORT_THREADS, IntermediateCode, TokenLayout
from cudnn_moe.kernels.l2_warm import L2Warm
from cudnn_moe.kernels.sort import sort_grid
from cudnn_moe.formats.blocks import to_e4m3
from cudnn_moe.routing import pack_routing
from tests.support.number_formats import check_format_helpers, format_inputs

pytestmark = pytest.mark.gpu

DEV = torch.device("cuda")
POISON_BYTE = 0xA5
POISON_INT = -7


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _full(shape: tuple[int, ...], value: float, dtype: torch.dtype) -> torch.Tensor:
    return torch.full(shape, value, dtype=dtype, device=DEV)


# ---------------------------------------------------------------------------------------------------------------
# Number-format helpers of common.cuh, through a small test kernel
# ---------------------------------------------------------------------------------------------------------------

_HELPERS_SOURCE = r"""
#include "common.cuh"
#include "activation_unit.cuh"
using namespace moe;

// The requantize's division (divide_rn with a block's shared reciprocal) next to IEEE division, and the E2M1
// grid values of both.
extern "C" __global__ void divide(const float* y, const float* d, int n, float* out) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float fast = divide_rn(y[i], d[i], refined_reciprocal(d[i]));
  const float ieee = y[i] / d[i];
  out[4 * i] = fast;
  out[4 * i + 1] = ieee;
  out[4 * i + 2] = round_to_e2m1(fast);
  out[4 * i + 3] = round_to_e2m1(ieee);
}

extern "C" __global__ void encode(const float* x, int n, u8* e4m3, u8* e2m1, u16* bf16) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  e4m3[i] = float_to_e4m3(x[i]);
  e2m1[i] = float_to_e2m1(x[i]);
  bf16[i] = float_to_bf16(x[i]);
}

// decoded [65536, 3]: for every 16-bit pattern i, BF16 i, E4M3 (i & 0xFF) and E2M1 (i & 0xF) widened to FP32.
extern "C" __global__ void decode(float* decoded) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= 65536) return;
  decoded[3 * i] = bf16_to_float(static_cast<u16>(i));
  decoded[3 * i + 1] = e4m3_to_float(static_cast<u8>(i & 0xFF));
  decoded[3 * i + 2] = e2m1_to_float(static_cast<u8>(i & 0xF));
}
"""


@pytest.fixture(scope="module")
def helpers() -> Callable[[str, int, tuple], None]:
    """Runs a kernel of _HELPERS_SOURCE over ``count`` threads and waits for it."""
    import cupy

    module = cupy.RawModule(code=_HELPERS_SOURCE, options=kernels.compile_options())

    def run(name: str, count: int, args: tuple) -> None:
        torch.cuda.synchronize()
        with cupy.cuda.Device(torch.cuda.current_device()):
            module.get_function(name)(((count + 255) // 256,), (256,), args)
            cupy.cuda.Device().synchronize()

    return run


def _ptr(t: torch.Tensor) -> np.uint64:
    return np.uint64(t.data_ptr())


def test_format_helpers_on_device(helpers: Callable[[str, int, tuple], None]) -> None:
    x = format_inputs()
    n = x.numel()
    x_dev = x.to(DEV)
    e4m3, e2m1 = _full((n,), POISON_BYTE, torch.uint8), _full((n,), POISON_BYTE, torch.uint8)
    bf16 = _full((n,), POISON_INT, torch.int16)
    decoded = _full((65536, 3), math.nan, torch.float32)
    helpers("encode", n, (_ptr(x_dev), np.int32(n), _ptr(e4m3), _ptr(e2m1), _ptr(bf16)))
    helpers("decode", 65536, (_ptr(decoded),))
    check_format_helpers(x, e4m3.cpu(), e2m1.cpu(), bf16.cpu(), decoded.cpu())


def _division_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """(y, d) float32: d every positive finite E4M3 value; y quotients log-uniform over [2^-14, 2^4], values a few
    ulps either side of every E2M1 rounding threshold times d, and zeros, infinities, NaN, subnormals, huge."""
    gen = _gen(21)
    scales = torch.arange(1, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    thresholds = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    ys, ds = [], []
    for d in scales.tolist():
        q = torch.exp2(torch.rand(2000, generator=gen) * 18 - 14) * torch.where(torch.rand(2000, generator=gen) < 0.5,
                                                                                 -1.0, 1.0)
        ys.append((q * d).float())
        near = (thresholds * d).float()
        for steps in range(-4, 5):
            moved = near.clone()
            for _ in range(abs(steps)):
                moved = torch.nextafter(moved, torch.full_like(moved, math.inf if steps > 0 else 0.0))
            ys += [moved, -moved]
        ys.append(torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 1e-45, -3e-39, 1e-30, 3e38, -1e30]))
        ds.append(torch.full((sum(t.numel() for t in ys) - sum(t.numel() for t in ds),), d))
    return torch.cat(ys), torch.cat(ds)


def test_requantize_division_is_ieee(helpers: Callable[[str, int, tuple], None]) -> None:
    """divide_rn, the requantize's division with one reciprocal per block, gives the IEEE quotient bit for bit
    wherever it is normal, and the same E2M1 grid value for every y (so the shared reciprocal changes nothing)."""
    y, d = _division_inputs()
    n = y.numel()
    out = _full((n, 4), math.nan, torch.float32)
    y_dev, d_dev = y.to(DEV), d.to(DEV)
    helpers("divide", n, (_ptr(y_dev), _ptr(d_dev), np.int32(n), _ptr(out)))
    fast, ieee, fast_grid, ieee_grid = out.cpu().unbind(1)
    normal = ieee.isfinite() & (ieee.abs() >= 2.0**-126)
    cpu = y / d  # IEEE on the CPU: the device's y / d must be it wherever the quotient is normal
    assert torch.equal(ieee[normal].view(torch.int32), cpu[normal].view(torch.int32)), \
        f"{int((ieee[normal] != cpu[normal]).sum())} device quotients differ from the CPU's"
    assert torch.equal(fast[normal].view(torch.int32), ieee[normal].view(torch.int32))
    assert torch.equal(fast_grid.view(torch.int32), ieee_grid.view(torch.int32))
    assert bool(normal.float().mean() > 0.95)


# ---------------------------------------------------------------------------------------------------------------
# stage
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("routing", ["packed", "fp32", "bf16", "fp32_int64_ids"])
def test_stage_inputs(routing: str) -> None:
    tokens, bucket, top_k, hidden = 5, 8, 4, 256
    x = torch.randint(0, 256, (tokens, hidden // 2), dtype=torch.uint8, generator=_gen(3))
    x_scales = torch.randint(0, 256, (tokens, hidden // 16), dtype=torch.uint8, generator=_gen(4))
    ids = torch.randint(-3, 600, (tokens, top_k), dtype=torch.int32, generator=_gen(5))
    weights = torch.rand(tokens, top_k, generator=_gen(6)) * 4 - 2
    want_ids, want_w = ids.clone(), weights.clone()
    if routing == "packed":
        ids_in, w_in, fmt = pack_routing(ids, weights), None, kernels.ROUTING_PACKED
        want_w = weights.to(torch.bfloat16).float()
    elif routing == "bf16":
        ids_in, w_in, fmt = ids, weights.to(torch.bfloat16), kernels.ROUTING_BF16
        want_w = w_in.float()
    else:
        ids_in, w_in, fmt = ids, weights, kernels.ROUTING_FP32
        if routing == "fp32_int64_ids":
            ids_in = ids.to(torch.int64)
            ids_in[0, 0], ids_in[1, 1] = 2**32 + 1, -(2**40)  # outside int32: masked
            want_ids[0, 0], want_ids[1, 1] = -1, -1
    xs = _full((bucket, hidden // 2), POISON_BYTE, torch.uint8)
    xss = _full((bucket, hidden // 16), POISON_BYTE, torch.uint8)
    ids_out = _full((bucket, top_k), POISON_INT, torch.int32)
    w_out = _full((bucket, top_k), math.nan, torch.float32)
    w_dev = None if w_in is None else w_in.to(DEV)
    kernels.stage_inputs(x.to(DEV), x_scales.to(DEV), ids_in.to(DEV), w_dev, fmt, xs, xss, ids_out, w_out)
    torch.cuda.synchronize()
    assert torch.equal(xs[:tokens].cpu(), x) and bool((xs[tokens:] == POISON_BYTE).all())
    assert torch.equal(xss[:tokens].cpu(), x_scales) and bool((xss[tokens:] == POISON_BYTE).all())
    assert torch.equal(ids_out[:tokens].cpu(), want_ids) and bool((ids_out[tokens:] == -1).all())
    assert torch.equal(w_out[:tokens].cpu(), want_w) and bool((w_out[tokens:] == 0).all())



@pytest.mark.parametrize("offset", [0, 1, 4], ids=["aligned", "byte-offset", "word-offset"])
def test_stage_inputs_decodes_token_rows(offset: int) -> None:
    """With x_rows, each staged token is its exact BF16 row (formats.dequantize_nvfp4, NaN scale bytes included) from
    codes at any alignment; rows >= T and the code buffers are left as they were."""
    tokens, bucket, top_k, hidden = 5, 8, 2, 320
    codes = torch.randint(0, 256, (tokens, hidden // 2), dtype=torch.uint8, generator=_gen(13))
    x_scales = torch.randint(0, 256, (tokens, hidden // 16), dtype=torch.uint8, generator=_gen(14))
    x_scales[1, 3] = 0x7F  # a NaN scale: its block decodes to NaN
    flat = torch.zeros(tokens * hidden // 2 + 16, dtype=torch.uint8, device=DEV)
    x = flat[offset:offset + codes.numel()].view(tokens, hidden // 2)
    x.copy_(codes.to(DEV))
    ids = torch.randint(0, 8, (tokens, top_k), dtype=torch.int32, generator=_gen(15))
    xs, xss = _full((0, hidden // 2), POISON_BYTE, torch.uint8), _full((0, hidden // 16), POISON_BYTE, torch.uint8)
    x_rows = _full((bucket, hidden), math.nan, torch.bfloat16)
    ids_out, w_out = _full((bucket, top_k), POISON_INT, torch.int32), _full((bucket, top_k), math.nan, torch.float32)
    kernels.stage_inputs(x, x_scales.to(DEV), pack_routing(ids, torch.rand(tokens, top_k)).to(DEV), None,
                         kernels.ROUTING_PACKED, xs, xss, ids_out, w_out, x_rows=x_rows)
    torch.cuda.synchronize()
    want = dequantize_nvfp4(codes, x_scales.view(torch.float8_e4m3fn), 1.0, torch.bfloat16)
    assert bool(want.isnan().any())
    _same_values(x_rows[:tokens], want, f"staged token rows, codes {offset} bytes past 16-byte alignment")
    assert bool(x_rows[tokens:].isnan().all())
    assert torch.equal(ids_out[:tokens].cpu(), ids) and bool((ids_out[tokens:] == -1).all())

# ---------------------------------------------------------------------------------------------------------------
# sort, and the routing the other tests use
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class SortResult:
    offsets: list[int]
    slot_to_row: list[int]
    row_to_slot: list[int]
    row_expert: list[int]
    counts: list[int]

    def tensors(self) -> dict[str, torch.Tensor]:
        return {name: torch.tensor(values, dtype=torch.int32) for name, values in vars(self).items()}


def sort_reference(ids: list[int], local_start: int, num_local: int, align: int, capacity: int) -> SortResult:
    """The documented semantics of moe_sort, slot by slot."""
    counts = [0] * num_local
    for expert in ids:
        if local_start <= expert < local_start + num_local:
            counts[expert - local_start] += 1
    offsets = [0]
    for count in counts:
        offsets.append(offsets[-1] + -(-count // align) * align)
    slot_to_row, row_to_slot, row_expert = [-1] * len(ids), [-1] * capacity, [-1] * capacity
    next_row = offsets[:-1]
    for slot, expert in enumerate(ids):
        if local_start <= expert < local_start + num_local:
            e = expert - local_start
            slot_to_row[slot], row_to_slot[next_row[e]] = next_row[e], slot
            next_row[e] += 1
    for e in range(num_local):
        row_expert[offsets[e] : offsets[e + 1]] = [e] * (offsets[e + 1] - offsets[e])
    return SortResult(offsets, slot_to_row, row_to_slot, row_expert, counts)


def _random_ids(count: int, low: int, high: int, seed: int, hot: int | None = None) -> list[int]:
    """count ids uniform in [low, high); with ``hot``, about 90% of them equal ``hot``."""
    ids = torch.randint(low, high, (count,), generator=_gen(seed))
    if hot is not None:
        ids = torch.where(torch.rand(count, generator=_gen(seed + 1)) < 0.9, torch.full_like(ids, hot), ids)
    return ids.tolist()


SORT_CASES = {
    # name: (tokens, top_k, local_start, num_local, align, id range low, high, hot expert id)
    "small": (64, 8, 0, 16, 8, -1, 20, None),
    "one_expert": (4, 1, 5, 1, 128, 3, 8, None),
    "all_masked": (32, 4, 0, 4, 8, -1, 0, None),
    "offset_range": (300, 6, 100, 64, 128, 0, 300, None),
    "hot_expert": (2048, 2, 0, 8, 128, -2, 10, 3),
    "max_size": (8192, 8, 0, 512, 128, 0, 512, None),
    "max_size_align8": (8192, 8, 0, 512, 8, -5, 520, None),
}


@pytest.mark.parametrize("case", list(SORT_CASES))
def test_sort_matches_reference(case: str) -> None:
    tokens, top_k, start, num_local, align, low, high, hot = SORT_CASES[case]
    ids = _random_ids(tokens * top_k, low, high, seed=len(case), hot=hot)
    capacity = row_capacity(tokens, top_k, num_local, align)
    want = sort_reference(ids, start, num_local, align, capacity).tensors()
    got = {name: torch.full_like(tensor, POISON_INT, device=DEV) for name, tensor in want.items()}
    ids_dev = torch.tensor(ids, dtype=torch.int32, device=DEV)
    for _ in range(2):  # a second run over the first's outputs gives the same result
        kernels.sort_routing(ids_dev, top_k, start, num_local, align, kernels.SortBuffers(**got))
        torch.cuda.synchronize()
        for name, tensor in want.items():
            assert torch.equal(got[name].cpu(), tensor), name


# The sort at sizes beyond one block (moe_sort_blocks), up to 512 experts, local ranges, capacity clamping,
# forced small blocks and unaligned ids, against the same semantics in torch (a stable argsort by expert).

SORT_OUTPUTS = ("offsets", "slot_to_row", "row_to_slot", "row_expert", "counts")


def sort_reference_torch(ids: torch.Tensor, local_start: int, num_local: int, align: int,
                         capacity: int) -> dict[str, torch.Tensor]:
    """sort_routing's documented outputs for ids int [N] (CPU), clamping included: segment starts are clamped to
    ``capacity`` and a slot whose row reaches its clamped segment's end is dropped (-1)."""
    n = ids.numel()
    e = ids.long() - local_start
    routed = (e >= 0) & (e < num_local)
    counts = torch.bincount(e[routed], minlength=num_local)
    padded = (counts + align - 1) // align * align
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), padded.cumsum(0)]).clamp(max=capacity)
    key = torch.where(routed, e, torch.full_like(e, num_local))  # unrouted slots sort last
    order = torch.argsort(key, stable=True)  # slots of each expert in slot order
    firsts = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])  # each expert's first sorted place
    rank = torch.empty(n, dtype=torch.int64)
    rank[order] = torch.arange(n) - firsts[key[order]]
    expert = e.clamp(0, num_local - 1)
    row = offsets[expert] + rank
    kept = routed & (row < offsets[expert + 1])
    slot_to_row = torch.where(kept, row, torch.full_like(row, -1))
    row_to_slot = torch.full((capacity,), -1, dtype=torch.int64)
    row_to_slot[row[kept]] = torch.arange(n)[kept]
    rows = torch.arange(capacity)
    segment = torch.searchsorted(offsets, rows, right=True) - 1
    row_expert = torch.where(rows < offsets[-1], segment, torch.full_like(rows, -1))
    outputs = {"offsets": offsets, "slot_to_row": slot_to_row, "row_to_slot": row_to_slot, "row_expert": row_expert,
               "counts": counts}
    return {name: t.to(torch.int32) for name, t in outputs.items()}


def _sort_ids(slots: int, local_start: int, experts: int, seed: int, hot: bool) -> torch.Tensor:
    ids = torch.randint(local_start - 3, local_start + experts + 3, (slots,), generator=_gen(seed))
    if hot:  # most slots on one expert: long segments, clamping bites there
        ids = torch.where(torch.rand(slots, generator=_gen(seed + 1)) < 0.8, torch.full_like(ids, local_start), ids)
    return ids.to(torch.int32).to(DEV)


def _sort_buffers(slots: int, experts: int, capacity: int) -> dict[str, torch.Tensor]:
    sizes = {"offsets": experts + 1, "slot_to_row": slots, "row_to_slot": capacity, "row_expert": capacity,
             "counts": experts}
    return {name: _full((n,), POISON_INT, torch.int32) for name, n in sizes.items()}


def _launch_sort(name: str, grid: int, ids: torch.Tensor, local_start: int, experts: int, align: int,
                 capacity: int, block_slots: int | None = None) -> dict[str, torch.Tensor]:
    """One entry point of sort.cu launched directly (moe_sort_blocks with a chosen ``block_slots``)."""
    out = _sort_buffers(ids.numel(), experts, capacity)
    extra = () if block_slots is None else (np.int32(block_slots),)
    kernels.launch("sort.cu", name, DEV, grid, SORT_THREADS, (
        kernels.ptr(ids), np.int32(ids.numel()), np.int32(local_start), np.int32(experts), np.int32(align),
        np.int32(capacity), *extra, *(kernels.ptr(out[n]) for n in SORT_OUTPUTS)))
    torch.cuda.synchronize()
    return out


def _assert_sort_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    for name in SORT_OUTPUTS:
        g = got[name].cpu()
        if not torch.equal(g, want[name]):
            bad = (g != want[name]).nonzero()
            raise AssertionError(f"{what} {name}: {bad.shape[0]} entries differ, first at {bad[0].tolist()}")


SORT_SIZES = [1, 7, 33, 63, 64, 65, 1023, 1024, 1025, 2051, 4096, 8191, 12288, 32768, 40000]
SORT_EXPERTS = [1, 2, 128, 256, 512]


def _sort_cases() -> list[tuple[int, int, int, int, str, bool]]:
    """(slots, experts, align, local_start, capacity kind, hot) over sizes x experts, varying the rest."""
    cases = []
    for i, slots in enumerate(SORT_SIZES):
        for j, experts in enumerate(SORT_EXPERTS):
            align = (8, 128)[(i + j) % 2]
            local_start = (0, 5, 100)[(i + 2 * j) % 3]
            capacity = ("full", "full", "half", "tiny")[(i + j) % 4]
            cases.append((slots, experts, align, local_start, capacity, (i * j) % 3 == 1))
    return cases


def _capacity(kind: str, slots: int, experts: int, align: int) -> int:
    full = row_capacity(slots, 1, experts, align)
    return {"full": full, "half": full // 2, "tiny": min(full, 24)}[kind]


@pytest.mark.parametrize("case", _sort_cases(), ids=lambda c: "-".join(map(str, c)))
def test_sort_sizes_match_reference(case) -> None:
    """sort_routing (one block or a grid of blocks) equals the torch statement, clamping included."""
    slots, experts, align, local_start, capacity_kind, hot = case
    capacity = _capacity(capacity_kind, slots, experts, align)
    ids = _sort_ids(slots, local_start, experts, seed=slots + experts, hot=hot)
    want = sort_reference_torch(ids.cpu(), local_start, experts, align, capacity)
    if capacity_kind == "full" and slots <= 4096:  # the torch statement is the slot-by-slot one where that applies
        _assert_sort_equal(want, sort_reference(ids.tolist(), local_start, experts, align, capacity).tensors(),
                           "torch statement vs the Python statement:")
    got = _sort_buffers(slots, experts, capacity)
    for _ in range(2):  # a second run over the first's outputs gives the same result
        kernels.sort_routing(ids, 1, local_start, experts, align, kernels.SortBuffers(**got))
        torch.cuda.synchronize()
        _assert_sort_equal(got, want, f"{sort_grid(slots)[0]} blocks:")


@pytest.mark.parametrize("slots", [1025, 5000, 40000])
@pytest.mark.parametrize("chunks_per_block", [1, 2, 7])
def test_sort_blocks_any_block_size(slots: int, chunks_per_block: int) -> None:
    """moe_sort_blocks with several chunks per block, and moe_sort (one block) on many slots, equal the reference."""
    experts, align, local_start = 64, 8, 3
    capacity = row_capacity(slots, 1, experts, align)
    ids = _sort_ids(slots, local_start, experts, seed=slots, hot=False)
    want = sort_reference_torch(ids.cpu(), local_start, experts, align, capacity)
    block_slots = chunks_per_block * SORT_THREADS
    grids = {
        "blocks": _launch_sort("moe_sort_blocks", -(-slots // block_slots), ids, local_start, experts, align,
                               capacity, block_slots),
        "single": _launch_sort("moe_sort", 1, ids, local_start, experts, align, capacity),
    }
    for label, got in grids.items():
        _assert_sort_equal(got, want, label)


def test_sort_unaligned_ids() -> None:
    """ids not 16-byte aligned (the kernel counts them one by one) give the same result."""
    slots, experts, align = 9001, 32, 128
    base = _sort_ids(slots + 1, 0, experts, seed=5, hot=False)
    ids = base[1:]  # 4-byte offset
    capacity = row_capacity(slots, 1, experts, align)
    want = sort_reference_torch(ids.cpu(), 0, experts, align, capacity)
    got = _sort_buffers(slots, experts, capacity)
    kernels.sort_routing(ids, 1, 0, experts, align, kernels.SortBuffers(**got))
    torch.cuda.synchronize()
    _assert_sort_equal(got, want, "unaligned ids:")


def _routing(tokens: int, top_k: int, num_local: int, align: int, seed: int) -> tuple[SortResult, int]:
    """Sorted routing of random ids (some masked) over experts [1, 1 + num_local); returns it and the capacity."""
    ids = _random_ids(tokens * top_k, -1, num_local + 3, seed)
    capacity = row_capacity(tokens, top_k, num_local, align)
    return sort_reference(ids, 1, num_local, align, capacity), capacity


def _scale_index(row: int, col: int, cols: int, swizzled: bool) -> int:
    return swizzled_offset(row, col, cols) if swizzled else row * cols + col


def _scale_buffer_bytes(rows: int, cols: int, swizzled: bool) -> int:
    padded_rows, padded_cols = swizzled_shape(rows, cols) if swizzled else (rows, cols)
    return padded_rows * padded_cols


# ---------------------------------------------------------------------------------------------------------------
# permute
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("swizzled", [False, True])
@pytest.mark.parametrize("hidden", [256, 96])
def test_permute(swizzled: bool, hidden: int) -> None:
    layout = TokenLayout.NVFP4_SWIZZLED_128X4 if swizzled else TokenLayout.NVFP4_LINEAR
    bucket, top_k, num_local, align = 16, 4, 6, 8
    routing, capacity = _routing(bucket, top_k, num_local, align, seed=7)
    cols = hidden // 16
    xs = torch.randint(0, 256, (bucket, hidden // 2), dtype=torch.uint8, generator=_gen(8))
    xss = torch.randint(0, 256, (bucket, cols), dtype=torch.uint8, generator=_gen(9))
    xp = _full((capacity, hidden // 2), POISON_BYTE, torch.uint8)
    xps = _full((_scale_buffer_bytes(capacity, cols, swizzled),), POISON_BYTE, torch.uint8)
    slot_to_row = routing.tensors()["slot_to_row"].to(DEV)
    kernels.permute_tokens(xs.to(DEV), xss.to(DEV), slot_to_row, bucket * top_k, top_k, layout, xp, xps)
    torch.cuda.synchronize()
    want_xp = torch.full_like(xp.cpu(), POISON_BYTE)
    want_xps = torch.full_like(xps.cpu(), POISON_BYTE)
    for slot, row in enumerate(routing.slot_to_row):
        if row >= 0:
            want_xp[row] = xs[slot // top_k]
            for col in range(cols):
                want_xps[_scale_index(row, col, cols, swizzled)] = xss[slot // top_k, col]
    assert torch.equal(xp.cpu(), want_xp)
    assert torch.equal(xps.cpu(), want_xps)


def _same_values(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """BF16 got == want bit for bit, except that a NaN may have any NaN bits (NaN exactly where want has NaN)."""
    g, w = got.cpu(), want.cpu()
    nan = w.isnan()
    assert torch.equal(g.isnan(), nan), f"{what}: NaN at other places ({int((g.isnan() != nan).sum())} differ)"
    same = (g.view(torch.int16) == w.view(torch.int16)) | nan
    if not bool(same.all()):
        bad = (~same).nonzero()
        raise AssertionError(f"{what}: {bad.shape[0]} values differ, first at {bad[0].tolist()}")


BF16_LAYOUTS = [TokenLayout.BF16_FRAGMENTS, TokenLayout.BF16_ROWS]  # what the permute writes
ACTIVATION_LAYOUTS = [*BF16_LAYOUTS, TokenLayout.BF16_TILED]  # the activation also writes the tiled planes (GEMM2's)


@pytest.mark.parametrize("layout", BF16_LAYOUTS, ids=lambda l: l.name)
@pytest.mark.parametrize("hidden", [64, 2048, 7168, 8256])
@pytest.mark.parametrize("top_k", [1, 3, 8])
def test_permute_bf16_sizes(hidden: int, top_k: int, layout: TokenLayout) -> None:
    """The BF16 permute (moe_permute_bf16) at widths up to 8256 and top_k 1 .. 8: each routed slot's row is its
    token decoded (formats.dequantize_nvfp4, NaN scale bytes included) in the layout's column order;
    masked slots, fully masked tokens and rows no slot maps to are not written, nor are slots >= num_slots."""
    tokens = 37
    slots = tokens * top_k
    gen = _gen(hidden + top_k)
    xs = torch.randint(0, 256, (tokens, hidden // 2), generator=gen, dtype=torch.uint8)
    xss = torch.randint(0, 256, (tokens, hidden // 16), generator=gen, dtype=torch.uint8)  # NaN bytes included
    xss[0, 0], xss[1, -1] = 0x7F, 0xFF
    capacity = slots + 5
    rows = torch.randperm(capacity, generator=gen)[:slots].to(torch.int32)
    rows[torch.rand(slots, generator=gen) < 0.2] = -1  # masked slots
    rows[2 * top_k : 4 * top_k] = -1  # tokens 2 and 3 fully masked
    decoded = to_token_layout(dequantize_nvfp4(xs, xss.view(torch.float8_e4m3fn), 1.0, torch.bfloat16), layout)
    blank = torch.full((capacity, hidden), POISON_INT, dtype=torch.int16).view(torch.bfloat16)
    # All slots, then fewer slots than the tokens hold (the last token partly): slots >= num_slots are left alone.
    for num_slots in (slots, slots - 1 if top_k > 1 else slots - 2):
        want = blank.clone()
        for slot, row in enumerate(rows[:num_slots].tolist()):
            if row >= 0:
                want[row] = decoded[slot // top_k]
        got = blank.to(DEV)
        kernels.permute_tokens(xs.to(DEV), xss.to(DEV), rows.to(DEV), num_slots, top_k, layout, got, None)
        torch.cuda.synchronize()
        _same_values(got, want, f"moe_permute_bf16 {layout.name}, {num_slots} of {slots} slots")
        if hidden == 2048:  # BF16 tokens (moe_permute_bf16_tokens): the same rows from the decoded values
            got = blank.to(DEV)
            natural = dequantize_nvfp4(xs, xss.view(torch.float8_e4m3fn), 1.0, torch.bfloat16)
            kernels.permute_bf16_tokens(natural.to(DEV), rows.to(DEV), num_slots, top_k, got, layout)
            torch.cuda.synchronize()
            _same_values(got, want, f"moe_permute_bf16_tokens {layout.name}, {num_slots} of {slots} slots")


# ---------------------------------------------------------------------------------------------------------------
# activation + NVFP4 requantization
# ---------------------------------------------------------------------------------------------------------------

ACTIVATIONS = {
    "identity": Identity(),
    "relu": ReLU(),
    "gelu": GELU(),
    "silu": SiLU(),
    "relu2": ReLU2(),
    "swiglu": SwiGLU(),
    "swiglu_clamped": SwiGLU(alpha=1.702, beta=1.0, limit=7.0),
    "geglu": GeGLU(),
    "geglu_tanh": GeGLUTanh(),
}

# Per-expert w1 alphas: ordinary, subnormal E4M3 scales, saturated scales, all-zero scales.
ALPHA1 = (1.0, 0.01, 3000.0, 1e-9)

# Relative slack on values and scales: a code or a scale may take either neighbour when the reference value
# lies within this of a rounding tie (torch's and CUDA's erf/exp/tanh differ in the last bits).
TIE_TOL = 1e-5


def _check_quantized(y: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> None:
    """y float32 [n, I] reference activations; codes uint8 [n, I] and scale bytes [n, I/16] from the kernel."""
    blocks = y.reshape(y.shape[0], -1, 16)
    amax = blocks.abs().amax(dim=-1)
    scale_options = [to_e4m3(amax / 6 * f).view(torch.uint8) for f in (1 - TIE_TOL, 1 + TIE_TOL)]
    assert bool(((scales == scale_options[0]) | (scales == scale_options[1])).all())
    sf = scales.view(torch.float8_e4m3fn).float().unsqueeze(-1)
    q = blocks / torch.where(sf == 0, torch.ones_like(sf), sf)
    codes = codes.reshape(blocks.shape)
    near = (codes == encode_e2m1(q * (1 - TIE_TOL))) | (codes == encode_e2m1(q * (1 + TIE_TOL)))
    assert bool(torch.where(sf == 0, codes == 0, near).all())


def _activation_case(act: Activation, seed: int = 10):
    """Routing, and GEMM1 rows g1 bfloat16 [R, N1] whose expert globals (ALPHA1) are already applied."""
    bucket, top_k, inter, align = 32, 4, 64, 8
    routing, capacity = _routing(bucket, top_k, len(ALPHA1), align, seed=seed)
    t = routing.tensors()
    alpha1 = torch.tensor(ALPHA1, dtype=torch.float32)[t["row_expert"].clamp(min=0)].unsqueeze(1)
    g1 = (torch.randn(capacity, act.gemm1_columns(inter), generator=_gen(seed + 1)) * 3 * alpha1).to(torch.bfloat16)
    used = torch.tensor([slot >= 0 for slot in routing.row_to_slot])
    g1[~used] = math.nan  # padding rows and rows past the end must not be read
    return routing, capacity, inter, g1, used


@pytest.mark.parametrize("swizzled", [False, True])
@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_activation_quantize(name: str, swizzled: bool) -> None:
    act: Activation = ACTIVATIONS[name]
    routing, capacity, inter, g1, used = _activation_case(act)
    total = routing.offsets[-1]
    t = routing.tensors()
    cols = inter // 16
    layout = TokenLayout.NVFP4_SWIZZLED_128X4 if swizzled else TokenLayout.NVFP4_LINEAR
    out = _full((capacity, inter // 2), POISON_BYTE, torch.uint8)
    out_scales = _full((_scale_buffer_bytes(capacity, cols, swizzled),), POISON_BYTE, torch.uint8)
    row_to_slot, offsets = t["row_to_slot"].to(DEV), t["offsets"].to(DEV)
    kernels.activate_quantize(g1.to(DEV), row_to_slot, offsets, act, layout, out, out_scales)
    torch.cuda.synchronize()
    out, out_scales = out.cpu(), out_scales.cpu()

    # Layout: rows >= total untouched, padding rows zero; gather the scales of the used rows.
    assert bool((out[total:] == POISON_BYTE).all())
    want_scales = torch.full_like(out_scales, POISON_BYTE)
    index = torch.tensor([[_scale_index(r, c, cols, swizzled) for c in range(cols)] for r in range(capacity)])
    want_scales[index[:total]] = 0
    written = out_scales.clone()
    written[index[:total]] = 0
    assert torch.equal(written, want_scales)  # nothing outside rows < total was written
    padding = ~used[:total]
    assert bool((out[:total][padding] == 0).all()) and bool((out_scales[index[:total][padding]] == 0).all())

    # Values of the used rows against the reference activation, in FP32 as the kernel computes.
    rows = used.nonzero().squeeze(1)
    y = act.apply_gemm1(g1[rows].float())
    _check_quantized(y, unpack_nibbles(out[rows]), out_scales[index[rows]])


def _requantize_blocks() -> torch.Tensor:
    """float32 [n, 16] blocks, every value exact in BF16: exact E2M1 ties (and their BF16 neighbours) under normal,
    subnormal and saturated scales; peaks at and either side of the requantize's fast-path bounds (6 * 2^-6,
    6 * 448); zeros, tiny and huge values, infinities, NaN."""
    gen = _gen(77)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1.0, 3.0, 6.0, 0.0, 2.0, 4.0, 1.5, 0.125])
    blocks = []
    for sf in (2.0**-6, 0.01953125, 1.125, 3.25, 26.0, 448.0, 2.0**-9, 3 * 2.0**-9):  # E4M3 values, normal and subnormal
        block = ties * sf  # amax 6 sf: the block's scale is sf itself
        blocks += [block, -block]
        up = (block.bfloat16().view(torch.int16) + 1).view(torch.bfloat16).float()  # one BF16 step either side
        down = (block.bfloat16().view(torch.int16) - 1).view(torch.bfloat16).float()
        blocks += [torch.where(block > 0, up, block), torch.where(block > 0, down, block)]
    for peak in (0.09375, 2688.0, 3000.0, 1e30, 1e-30):
        for step in (-1, 0, 1):
            p = (torch.tensor([peak]).bfloat16().view(torch.int16) + step).view(torch.bfloat16).float()
            blocks.append(torch.cat([p, torch.rand(15, generator=gen) * 2 - 1]) * torch.tensor([1.0] + [float(p)] * 15))
    blocks += [torch.zeros(16), torch.full((16,), 1e-40), torch.tensor([math.inf] + [1.0] * 15),
               torch.tensor([-math.inf] + [0.5] * 15), torch.tensor([math.nan] + [3.0] * 15),
               torch.tensor([math.nan] * 16), torch.tensor([math.inf, -math.inf] + [0.0] * 14)]
    return torch.stack(blocks).bfloat16().float()


def test_requantize_is_exact_at_ties_and_at_its_fast_paths_bounds() -> None:
    """With the identity activation the values are exact, so the NVFP4 requantize must equal the reference bit for
    bit (no tie tolerance): scale e4m3(amax / 6) of the NaN-blind amax, codes e2m1 of the IEEE quotient (0 where the
    scale is 0), on exact ties, on both sides of the bounds of requantize_16's normal-scale path, and on specials."""
    blocks = _requantize_blocks()
    inter = 64
    rows = -(-blocks.shape[0] // (inter // 16))
    fill = torch.randn(rows * inter // 16 - blocks.shape[0], 16, generator=_gen(78))
    y = torch.cat([blocks, fill.bfloat16().float()]).reshape(rows, inter)
    capacity = -(-rows // 8) * 8
    g1 = torch.zeros(capacity, inter, dtype=torch.bfloat16)
    g1[:rows] = y.bfloat16()
    row_to_slot = torch.arange(capacity, dtype=torch.int32)
    offsets = torch.tensor([0, capacity], dtype=torch.int32)
    codes = _full((capacity, inter // 2), POISON_BYTE, torch.uint8)
    scales = _full((capacity * inter // 16,), POISON_BYTE, torch.uint8)
    kernels.activate_quantize(g1.to(DEV), row_to_slot.to(DEV), offsets.to(DEV), Identity(), TokenLayout.NVFP4_LINEAR,
                              codes, scales)
    torch.cuda.synchronize()
    want_blocks = g1.float().reshape(-1, 16)
    amax = torch.where(want_blocks.isnan(), torch.zeros_like(want_blocks), want_blocks.abs()).amax(dim=1)
    want_scales = to_e4m3(amax / 6)
    sf = want_scales.float().unsqueeze(1)
    want_codes = torch.where(sf == 0, torch.zeros_like(want_blocks, dtype=torch.uint8),
                             encode_e2m1(want_blocks / torch.where(sf == 0, torch.ones_like(sf), sf)))
    assert torch.equal(scales.cpu(), want_scales.view(torch.uint8))
    assert torch.equal(unpack_nibbles(codes.cpu()).reshape(-1, 16), want_codes)


@pytest.mark.parametrize("layout", ACTIVATION_LAYOUTS, ids=lambda l: l.name)
@pytest.mark.parametrize("name", ["swiglu", "gelu"])
def test_activation_bf16_layouts_decode_the_nvfp4_values(name: str, layout: TokenLayout) -> None:
    """The BF16 outputs hold exactly the decoded NVFP4 values of the linear output, in the layout's order (the
    tiled planes read back with from_token_layout); without requantization, the BF16-rounded activation."""
    act: Activation = ACTIVATIONS[name]
    routing, capacity, inter, g1, used = _activation_case(act, seed=40)
    assert capacity % 8 == 0
    total = routing.offsets[-1]
    t = routing.tensors()
    row_to_slot, offsets, g1_dev = t["row_to_slot"].to(DEV), t["offsets"].to(DEV), g1.to(DEV)
    codes = torch.zeros(capacity, inter // 2, dtype=torch.uint8, device=DEV)
    scales = torch.zeros(capacity * inter // 16, dtype=torch.uint8, device=DEV)
    kernels.activate_quantize(g1_dev, row_to_slot, offsets, act, TokenLayout.NVFP4_LINEAR, codes, scales)
    frags = _full((capacity, inter), math.nan, torch.bfloat16)
    kernels.activate_quantize(g1_dev, row_to_slot, offsets, act, layout, frags, None)
    rounded = _full((capacity, inter), math.nan, torch.bfloat16)
    kernels.activate_quantize(g1_dev, row_to_slot, offsets, act, layout, rounded, None,
                              intermediate=IntermediateCode.BF16)
    torch.cuda.synchronize()
    want = dequantize_nvfp4(codes.cpu(), scales.cpu().view(torch.float8_e4m3fn).view(capacity, -1), dtype=torch.bfloat16)
    got = from_token_layout(frags.cpu(), layout)
    assert torch.equal(got[:total].view(torch.int16), want[:total].view(torch.int16))
    assert bool(got[:total][~used[:total]].eq(0).all()) and bool(got[total:].isnan().all())
    rows = used.nonzero().squeeze(1)
    # FP32 as the kernel computes: one BF16 rounding apart, plus the last bits of its exp / erf, which the
    # cancellation in GELU's 1 + erf(x) at negative x turns into an absolute error of about |x| 2^-24.
    want_y = act.apply_gemm1(g1[rows].float())
    got_y = from_token_layout(rounded.cpu(), layout)[rows].float()
    atol = g1[rows].float().abs().amax(dim=1, keepdim=True) * 2**-20
    assert not got_y.isnan().any() and bool(((got_y - want_y).abs() <= want_y.abs() * 2**-7 + atol).all())


# ---------------------------------------------------------------------------------------------------------------
# finalize and unfinalized rows
# ---------------------------------------------------------------------------------------------------------------


def _gemm2_case(seed: int) -> tuple[SortResult, torch.Tensor, int]:
    """Routing, g2 bfloat16 [R, H] (NaN on rows no slot uses), top_k."""
    bucket, top_k, hidden, num_local, align = 16, 4, 256, 5, 8
    routing, capacity = _routing(bucket, top_k, num_local, align, seed)
    g2 = torch.randn(capacity, hidden, generator=_gen(seed + 1)).to(torch.bfloat16)
    g2[torch.tensor(routing.row_to_slot) < 0] = math.nan
    return routing, g2, top_k


def test_finalize() -> None:
    routing, g2, top_k = _gemm2_case(seed=20)
    slot_to_row = torch.tensor(routing.slot_to_row)
    weights = torch.rand(slot_to_row.numel(), generator=_gen(23)) * 2 - 0.5
    weights[slot_to_row < 0] = math.nan  # masked slots must contribute nothing
    tokens = slot_to_row.numel() // top_k - 3  # fewer tokens than the bucket holds
    t = routing.tensors()
    out = _full((tokens, g2.shape[1]), math.nan, torch.bfloat16)
    slot_to_row_dev = t["slot_to_row"].to(DEV)
    kernels.finalize(g2.to(DEV), slot_to_row_dev, weights.to(DEV), top_k, out)
    torch.cuda.synchronize()
    want = torch.zeros(tokens, g2.shape[1], dtype=torch.float64)
    for slot in range(tokens * top_k):
        row = routing.slot_to_row[slot]
        if row >= 0:
            want[slot // top_k] += weights[slot].double() * g2[row].double()
    # One BF16 rounding (half an ulp, <= 2^-9 relative) plus FP32 accumulation error.
    torch.testing.assert_close(out.cpu().double(), want, rtol=2**-8, atol=1e-5)


@pytest.mark.parametrize("hidden", [8, 256, 7168])
@pytest.mark.parametrize("top_k", [1, 3, 4, 8, 10])
def test_finalize_sizes(hidden: int, top_k: int) -> None:
    """finalize at widths 8 .. 7168 and top_k 1 .. 10 (the kernel's groups of four slots and the rest), masked
    slots: bit for bit the documented FP32 statement (in slot order, a separate multiply and add per slot, one
    BF16 rounding), and within one BF16 rounding plus FP32 accumulation of the float64 sum."""
    tokens, capacity = 29, 29 * top_k + 7
    gen = _gen(hidden * top_k)
    g2 = (torch.randn(capacity, hidden, generator=gen) * 10).to(torch.bfloat16)
    rows = torch.randperm(capacity, generator=gen)[: tokens * top_k].to(torch.int32)
    rows[torch.rand(tokens * top_k, generator=gen) < 0.25] = -1
    weights = torch.rand(tokens * top_k, generator=gen) * 2 - 0.5
    out = torch.full((tokens, hidden), POISON_INT, dtype=torch.int16, device=DEV).view(torch.bfloat16)
    kernels.finalize(g2.to(DEV), rows.to(DEV), weights.to(DEV), top_k, out)
    torch.cuda.synchronize()
    acc = torch.zeros(tokens, hidden, dtype=torch.float32)
    want64 = torch.zeros(tokens, hidden, dtype=torch.float64)
    slot_rows, slot_weights = rows.view(tokens, top_k), weights.view(tokens, top_k)
    for s in range(top_k):
        routed = (slot_rows[:, s] >= 0).unsqueeze(1)
        picked = g2[slot_rows[:, s].clamp(min=0).long()]
        product = slot_weights[:, s : s + 1] * picked.float()  # FP32 multiply, then FP32 add
        acc = torch.where(routed, acc + product, acc)
        want64 += torch.where(routed, slot_weights[:, s : s + 1].double() * picked.double(), torch.zeros(()))
    got = out.cpu()
    assert torch.equal(got.view(torch.int16), acc.to(torch.bfloat16).view(torch.int16))
    torch.testing.assert_close(got.double(), want64, rtol=2**-8, atol=1e-5)


def test_unfinalized_rows() -> None:
    routing, g2, _ = _gemm2_case(seed=30)
    t = routing.tensors()
    rows_out = g2.shape[0] - 5
    out = _full((rows_out, g2.shape[1]), math.nan, torch.bfloat16)
    kernels.unfinalized_rows(g2.to(DEV), t["row_to_slot"].to(DEV), out)
    torch.cuda.synchronize()
    used = (t["row_to_slot"][:rows_out] >= 0).unsqueeze(1)
    want = torch.where(used, g2[:rows_out].float(), torch.zeros(())).to(torch.bfloat16)
    assert torch.equal(out.cpu().view(torch.int16), want.view(torch.int16))


# ---------------------------------------------------------------------------------------------------------------
# sort + permute in one launch (decode buckets of the sm90 engine)
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", BF16_LAYOUTS, ids=lambda l: l.name)
@pytest.mark.parametrize("tokens_kind", ["nvfp4", "bf16"])
@pytest.mark.parametrize("case", [(1, 8, 2048, 128, 0), (5, 8, 7168, 256, 0), (64, 8, 2048, 128, 32),
                                  (128, 8, 7168, 64, 100), (37, 3, 64, 1, 0), (200, 5, 8256, 512, 7)],
                         ids=lambda c: "T{}-k{}-H{}-E{}-start{}".format(*c))
def test_sort_permute_in_one_launch_equals_the_two_launches(case: tuple[int, int, int, int, int],
                                                            tokens_kind: str, layout: TokenLayout) -> None:
    """moe_sort_permute_bf16(_tokens): every output of the sort equals the float-free reference sort (and the
    separate moe_sort), and the rows equal moe_sort followed by the permute, bit for bit, from buffers poisoned
    first; ids outside the local range (masked slots) and rows no slot takes stay as the two launches leave them."""
    tokens, top_k, hidden, experts, local_start = case
    slots, align = tokens * top_k, 8
    capacity = row_capacity(slots, 1, experts, align)
    gen = _gen(sum(case))
    ids = _sort_ids(slots, local_start, experts, seed=sum(case), hot=tokens == 128)
    if tokens_kind == "bf16":
        x = torch.randn(tokens, hidden, generator=gen).to(DEV, torch.bfloat16)
        scales = None
    else:
        x = torch.randint(0, 256, (tokens, hidden // 2), generator=gen, dtype=torch.uint8).to(DEV)
        scales = torch.randint(0, 0x7F, (tokens, hidden // 16), generator=gen, dtype=torch.uint8).to(DEV)
    want_sort = _launch_sort("moe_sort", 1, ids, local_start, experts, align, capacity)
    _assert_sort_equal(want_sort, sort_reference_torch(ids.cpu(), local_start, experts, align, capacity), "moe_sort")
    want_rows = torch.full((capacity, hidden), POISON_INT, dtype=torch.int16, device=DEV).view(torch.bfloat16)
    if scales is None:
        kernels.permute_bf16_tokens(x, want_sort["slot_to_row"], slots, top_k, want_rows, layout)
    else:
        kernels.permute_tokens(x, scales, want_sort["slot_to_row"], slots, top_k, layout, want_rows, None)
    got_sort = _sort_buffers(slots, experts, capacity)
    got_rows = torch.full((capacity, hidden), POISON_INT, dtype=torch.int16, device=DEV).view(torch.bfloat16)
    kernels.sort_permute_bf16(ids, top_k, local_start, experts, align, kernels.SortBuffers(**got_sort), x, scales,
                              got_rows, layout)
    torch.cuda.synchronize()
    _assert_sort_equal(got_sort, {n: t.cpu() for n, t in want_sort.items()}, "moe_sort_permute")
    assert torch.equal(got_rows.view(torch.int16), want_rows.view(torch.int16))
    assert (want_sort["slot_to_row"] >= 0).sum() > 0


@pytest.mark.parametrize("warm", [False, True], ids=["", "warm"])
@pytest.mark.parametrize("token_kind", ["nvfp4", "bf16"])
@pytest.mark.parametrize("routing", ["packed", "fp32", "bf16", "int64"])
@pytest.mark.parametrize("case", [(1, 1, 8, 2048, 128, 0), (3, 4, 8, 7168, 256, 0), (5, 8, 8, 2048, 64, 32),
                                  (64, 64, 8, 2048, 128, 0), (100, 128, 8, 4096, 256, 17), (7, 8, 3, 64, 1, 0)],
                         ids=lambda c: "T{}-B{}-k{}-H{}-E{}-start{}".format(*c))
def test_stage_sort_permute_in_one_launch_equals_stage_then_sort_permute(case: tuple[int, ...], routing: str,
                                                                         token_kind: str, warm: bool) -> None:
    """moe_stage_sort_permute_bf16* from the caller's T tokens (NVFP4, or BF16 as the low-latency op stages them: as
    bytes) and routing: the bucket's routing copies (ids -1 and weight 0 past T), every sort output and the BF16
    fragment rows equal moe_stage_inputs followed by moe_sort_permute_bf16* over the bucket's B * top_k slots, bit
    for bit, from buffers poisoned first; with ``warm`` the same, with blocks warming L2 with weights of the local
    experts (cudnn_moe.kernels.l2_warm), which are left as they were."""
    tokens, bucket, top_k, hidden, experts, local_start = case
    slots, align, layout = bucket * top_k, 8, TokenLayout.BF16_FRAGMENTS
    capacity = row_capacity(slots, 1, experts, align)
    gen = _gen(sum(case) + len(routing))
    bf16 = token_kind == "bf16"
    if bf16:  # random finite BF16 values of every exponent
        x = (torch.randn(tokens, hidden, generator=gen) * torch.exp2(torch.randint(-60, 60, (tokens, hidden),
                                                                                   generator=gen))).to(torch.bfloat16).to(DEV)
        scales = None
    else:
        x = torch.randint(0, 256, (tokens, hidden // 2), generator=gen, dtype=torch.uint8).to(DEV)
        scales = torch.randint(0, 0x7F, (tokens, hidden // 16), generator=gen, dtype=torch.uint8).to(DEV)
    ids = _sort_ids(tokens * top_k, local_start, experts, seed=sum(case), hot=False).view(tokens, top_k).cpu()
    weights = torch.rand(tokens, top_k, generator=gen) * 4 - 2
    if routing == "packed":
        ids_in, w_in, fmt = pack_routing(ids, weights), None, kernels.ROUTING_PACKED
    elif routing == "bf16":
        ids_in, w_in, fmt = ids, weights.to(torch.bfloat16), kernels.ROUTING_BF16
    else:
        ids_in, w_in, fmt = ids, weights, kernels.ROUTING_FP32
        if routing == "int64":
            ids_in = ids.to(torch.int64)
            ids_in[0, 0] = 2**32 + local_start  # outside int32: masked, not wrapped onto a local expert
    ids_in, w_in = ids_in.to(DEV), None if w_in is None else w_in.to(DEV)

    def bucket_buffers() -> tuple[torch.Tensor, ...]:
        return (_full((bucket, top_k), POISON_INT, torch.int32), _full((bucket, top_k), math.nan, torch.float32),
                torch.full((capacity, hidden), POISON_INT, dtype=torch.int16, device=DEV).view(torch.bfloat16))

    want_ids, want_w, want_rows = bucket_buffers()
    want_sort = _sort_buffers(slots, experts, capacity)
    if bf16:  # staged as bytes with an empty scale row (cudnn_moe.low_latency.grouped)
        xs, xss = _full((bucket, 2 * hidden), POISON_BYTE, torch.uint8), _full((bucket, 0), 0, torch.uint8)
        kernels.stage_inputs(x.view(torch.uint8), xss[:tokens], ids_in, w_in, fmt, xs, xss, want_ids, want_w)
        kernels.sort_permute_bf16(want_ids.view(-1), top_k, local_start, experts, align,
                                  kernels.SortBuffers(**want_sort), xs.view(torch.bfloat16), None, want_rows, layout)
    else:
        xs, xss = _full((bucket, hidden // 2), POISON_BYTE, torch.uint8), _full((bucket, hidden // 16), 0, torch.uint8)
        kernels.stage_inputs(x, scales, ids_in, w_in, fmt, xs, xss, want_ids, want_w)
        kernels.sort_permute_bf16(want_ids.view(-1), top_k, local_start, experts, align,
                                  kernels.SortBuffers(**want_sort), xs, xss, want_rows, layout)
    got_ids, got_w, got_rows = bucket_buffers()
    got_sort = _sort_buffers(slots, experts, capacity)
    l2 = None
    if warm:  # 3 row blocks an expert, 4 tiles of codes (and of 64-byte scales) each; the first 2 (1) warmed
        codes = torch.randint(0, 256, (experts, 3 * 4 * 512), generator=gen, dtype=torch.uint8).to(DEV)
        tile_scales = torch.randint(0, 256, (experts, 3 * 4 * 64), generator=gen, dtype=torch.uint8).to(DEV)
        l2 = L2Warm(codes, tile_scales, row_blocks=3, code_row=4 * 512, scale_row=4 * 64, code_bytes=1024,
                    scale_bytes=128, experts=min(experts, 5), blocks=3)
        before = codes.clone(), tile_scales.clone()
    kernels.stage_sort_permute_bf16(x, scales, ids_in, w_in, fmt, got_ids, got_w, local_start, experts, align,
                                    kernels.SortBuffers(**got_sort), got_rows, layout, l2)
    torch.cuda.synchronize()
    if warm:
        assert torch.equal(codes, before[0]) and torch.equal(tile_scales, before[1])
    assert bool((want_ids[tokens:] == -1).all()) and bool((want_w[tokens:] == 0).all())
    assert torch.equal(got_ids, want_ids) and torch.equal(got_w.view(torch.int32), want_w.view(torch.int32))
    _assert_sort_equal(got_sort, {n: t.cpu() for n, t in want_sort.items()}, "moe_stage_sort_permute")
    assert torch.equal(got_rows.view(torch.int16), want_rows.view(torch.int16))
    assert (want_sort["slot_to_row"] >= 0).sum() > 0


def test_peak_dram_bandwidth_of_this_gpu() -> None:
    """The driver's memory clock and bus width give the GPU's peak DRAM bandwidth: 3.35 TB/s for an H100 SXM
    (HBM3), 4.9 for an H200, which the SM90 variant rules tell apart by it (_SLOW_DRAM_TBS)."""
    from cudnn_moe.arch import peak_dram_tbs

    name, tbs = torch.cuda.get_device_name(), peak_dram_tbs()
    assert 0.2 < tbs < 20, (name, tbs)
    if "H200" in name:
        assert 4.5 < tbs < 5.2, (name, tbs)
    if "H100 80GB HBM3" in name:
        assert 3.2 < tbs < 3.5, (name, tbs)
