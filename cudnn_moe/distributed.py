"""Expert parallelism over torch.distributed: each rank holds a contiguous range of the experts.

Sharding (``expert_shard``): E experts over W ranks in contiguous ranges; the first ``E % W``
ranks hold ``E // W + 1`` experts, the others ``E // W``. Every rank holds at least one expert.
``expert_shard`` and ``shard_weights`` take ``world_size`` and ``rank`` as keyword-only arguments
(``expert_shard(E, world_size=W, rank=r)``), so that the two ints cannot be swapped silently.

One ``ExpertParallelMoe`` call (collective: every rank of the group calls it, in the same order) moves
tokens one of two ways, ``dispatch="all_gather"`` (the default) or ``dispatch="all_to_all"``.

all_gather:

1. this rank's T tokens (NVFP4 pack) and routing (GLOBAL expert ids) are copied into static send
   buffers of ``max_tokens_per_rank`` (Tmax) rows; padding rows get expert id -1 (unrouted);
2. one all-gather gives every rank the [W * Tmax] token batch of all ranks (rank r's tokens at rows
   r * Tmax ..);
3. ``fused_moe`` runs this rank's experts on that batch (slots naming other experts are skipped):
   the BF16 partial output [W * Tmax, H] of this rank's experts;
4. a reduce-scatter sums the partials over ranks and hands each rank its own Tmax rows; the first T
   are its output, bfloat16 [T, H].

all_to_all (each token travels only to the ranks that hold at least one of its experts):

1. packing, on the device (``dispatch_rows``): a [T, W] mask says which ranks each token needs; a
   cumulative sum over it gives token t the row p * Tmax + (its place among the tokens going to p) of
   the send rows, Tmax per peer (a token goes to a peer at most once, so Tmax rows always suffice);
   the tokens' records (``token_record_bytes``) are gathered into those rows, the other rows get the
   padding record (expert ids -1);
2. one ``all_to_all_single`` with fixed equal splits (Tmax rows per peer, padding included) hands
   every rank the [W * Tmax] rows the others packed for it;
3. the receiving rank rewrites slots naming other ranks' experts to -1 (unrouted) and runs its
   experts on the rows (``fused_moe``): the BF16 partial [W * Tmax, H], zero on padding rows;
4. a second ``all_to_all_single`` sends the partial rows back to the ranks they came from, in the
   same places; the source gathers, for each token and each rank, the row it sent there (a token that
   was not sent to a rank reads a zero row: padding rows are never read), sums them and writes [T, H].
   The source keeps each token's send rows from step 1, so no token index travels with the rows.

Rounding: each rank's partial is ``fused_moe``'s finalize of its own slots of a token (FP32 sum in
slot order, rounded once to BF16). all_gather: the cross-rank sum runs in ``reduce_dtype``: float32
(default: the BF16 partials are widened exactly, summed in FP32 by NCCL in its order, then rounded
once to BF16) or bfloat16 (half the bytes; NCCL rounds to BF16 after each addition). all_to_all: the
source widens the BF16 partials of the ranks a token went to, sums them in FP32 in rank order
(0, 1, .., W - 1; a rank it did not go to adds an exact zero) and rounds once to BF16. Either way the
output equals single-GPU ``fused_moe`` on the full weights to BF16 noise, not bitwise (single-GPU
rounds the whole slot sum once).

Static shapes throughout (no host sync, no data-dependent size): the whole call can be captured in a
CUDA graph after ``warmup()`` (NCCL collectives are capturable with NCCL >= 2.9.6 once the process
group's communicator exists; warmup creates it). Bytes moved per call: ``ep_traffic``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist

from .activations import Activation, SwiGLU, parse_activation
from .fused import Nvfp4MoeConfig, fused_moe
from .routing import Routing, unpack_routing
from .validate import (
    require_choice, require_int_arg, require_multiple, require_same_device, require_shape, require_tensor,
)
from .weights.nvfp4 import Nvfp4Activations, Nvfp4Weights

REDUCE_DTYPES = (torch.float32, torch.bfloat16)
DISPATCHES = ("all_gather", "all_to_all")


def expert_shard(num_experts: int, *, world_size: int, rank: int) -> tuple[int, int]:
    """(start, count): the contiguous global expert range ``start .. start + count - 1`` of ``rank``
    (0 .. world_size - 1; keyword-only, like torch.distributed.init_process_group's world_size and rank).

    The first ``num_experts % world_size`` ranks get one expert more than the rest. Raises
    ValueError when there are fewer experts than ranks (a rank would hold none).
    """
    require_int_arg("num_experts", num_experts, 1)
    require_int_arg("world_size", world_size, 1)
    require_int_arg("rank", rank, 0, world_size - 1)
    if num_experts < world_size:
        raise ValueError(f"{num_experts} experts cannot be sharded over {world_size} ranks: each rank needs at least one")
    base, extra = divmod(num_experts, world_size)
    return rank * base + min(rank, extra), base + (rank < extra)


def shard_weights(
    w1: torch.Tensor, w2: torch.Tensor, *, world_size: int, rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Views ``w1[start : start + count]``, ``w2[start : start + count]`` of the [E, ...] weights for
    ``rank``'s experts (``expert_shard``; world_size and rank keyword-only); feed them to
    ``Nvfp4MoeConfig.prepare_weights``."""
    for name, value in (("w1", w1), ("w2", w2)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
        if value.dim() < 1:
            raise ValueError(f"{name} must have a leading expert dimension, got a scalar")
    if w1.shape[0] != w2.shape[0]:
        raise ValueError(f"w1 has {w1.shape[0]} experts but w2 has {w2.shape[0]}")
    start, count = expert_shard(w1.shape[0], world_size=world_size, rank=rank)
    return w1[start : start + count], w2[start : start + count]


def token_record_bytes(hidden_size: int, top_k: int) -> int:
    """Bytes one token takes on the wire in either dispatch: expert ids int32 [k], route weights float32 [k]
    and its NVFP4 pack (codes H/2 bytes, E4M3 block scales H/16 bytes); H a multiple of 16."""
    require_int_arg("top_k", top_k, 1)
    require_multiple("hidden_size", require_int_arg("hidden_size", hidden_size, 1), 16)
    return 8 * top_k + hidden_size // 2 + hidden_size // 16


def _record_columns(records: torch.Tensor, top_k: int, hidden: int) -> tuple[torch.Tensor, ...]:
    """Column views of token records uint8 [N, token_record_bytes]: ids int32 [N, k], weights float32 [N, k],
    packed uint8 [N, H/2], scales uint8 [N, H/16] (the record size is a multiple of 4: H is of 128)."""
    k = top_k
    return (records.view(torch.int32)[:, :k], records.view(torch.float32)[:, k : 2 * k],
            records[:, 8 * k : 8 * k + hidden // 2], records[:, 8 * k + hidden // 2 :])


def dispatch_rows(
    ids: torch.Tensor, shard_bounds: torch.Tensor, max_tokens_per_rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows int64 [T, W], counts int64 [W]): the all-to-all send row of each (token, peer) pair, and how
    many tokens go to each peer.

    ids: [T, k] GLOBAL expert ids (int32 or int64; ids outside the shards are unrouted). shard_bounds:
    int64 [W + 1], rank p holds experts ``shard_bounds[p] .. shard_bounds[p + 1] - 1``. Token t goes to
    peer p when at least one of its slots names an expert of p (once, however many); the tokens going to
    p take rows ``p * Tmax, p * Tmax + 1, ..`` in token order (a cumulative sum over the [T, W]
    membership mask), so ``counts[p] <= T <= Tmax`` and no two pairs share a row. A pair whose token does
    not go to p gets row ``W * Tmax``, one past the send rows: the packing's discard slot and the
    combine's zero row. Device ops only (no host sync, no data-dependent shape).
    """
    world = shard_bounds.numel() - 1
    slots = ids.unsqueeze(-1)
    member = ((slots >= shard_bounds[:-1]) & (slots < shard_bounds[1:])).any(dim=1)  # bool [T, W]
    first_row = torch.arange(world, device=ids.device) * max_tokens_per_rank
    rows = torch.where(member, first_row + member.cumsum(0) - 1, world * max_tokens_per_rank)
    return rows, member.sum(0)


class EpTraffic(NamedTuple):
    """Bytes one rank sends to the other ranks in one ``ExpertParallelMoe`` call, by step; it receives as
    many (the splits are fixed and equal). The copy of its own chunk to itself is not counted."""

    dispatch: int  # tokens and routing out
    combine: int  # expert outputs back

    @property
    def total(self) -> int:
        return self.dispatch + self.combine


def ep_traffic(
    dispatch: str,
    *,
    world_size: int,
    max_tokens_per_rank: int,
    hidden_size: int,
    top_k: int,
    reduce_dtype: torch.dtype = torch.float32,
) -> EpTraffic:
    """The bytes-moved model of one call per rank (W ranks, Tmax = max_tokens_per_rank, record =
    ``token_record_bytes(H, k)``); the same for every T <= Tmax and every routing, the splits being fixed.

    all_gather: dispatch (W - 1) * Tmax * record (every rank's padded chunk reaches every other rank);
    combine (W - 1) * Tmax * H * size(reduce_dtype) (the reduce-scatter of the [W * Tmax, H] partials, a
    ring's volume per rank: NCCL's bus-bytes convention). all_to_all: dispatch (W - 1) * Tmax * record
    (Tmax rows per peer, padding included); combine (W - 1) * Tmax * H * 2 (BF16 partials back).
    """
    require_choice("dispatch", dispatch, DISPATCHES)
    world = require_int_arg("world_size", world_size, 1)
    tmax = require_int_arg("max_tokens_per_rank", max_tokens_per_rank, 1)
    record = token_record_bytes(hidden_size, top_k)
    if reduce_dtype not in REDUCE_DTYPES:
        raise ValueError(f"reduce_dtype must be torch.float32 or torch.bfloat16, got {reduce_dtype}")
    out_bytes = 2 if dispatch == "all_to_all" else reduce_dtype.itemsize
    return EpTraffic((world - 1) * tmax * record, (world - 1) * tmax * hidden_size * out_bytes)


def expected_remote_ranks(num_experts: int, top_k: int, *, world_size: int, rank: int) -> float:
    """How many OTHER ranks a token of ``rank`` needs, on average, when its top_k distinct experts are drawn
    uniformly: the sum over ranks p != rank of 1 - C(E - n_p, k) / C(E, k), n_p = p's expert count
    (``expert_shard``). At most min(k, W - 1); what a token-routed exchange without padding would move."""
    shards = [expert_shard(num_experts, world_size=world_size, rank=p)[1] for p in range(world_size)]
    require_int_arg("top_k", top_k, 1, num_experts)
    require_int_arg("rank", rank, 0, world_size - 1)
    total = math.comb(num_experts, top_k)
    return sum(1 - math.comb(num_experts - n, top_k) / total for p, n in enumerate(shards) if p != rank)


def _process_group(group: object) -> tuple[object, int, int]:
    """(group, rank, world size) of a usable process group (None: the default one); raises otherwise."""
    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this torch build; expert parallelism needs it")
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized; call torch.distributed.init_process_group first")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed.ProcessGroup or None, got {type(group).__name__}")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("this process is not a member of the given process group")
    return group, rank, dist.get_world_size(group)


class ExpertParallelMoe:
    """One expert-parallel NVFP4 MoE layer; this rank holds experts ``expert_start ..`` of ``num_experts``.

    config: the config ``weights`` were prepared with; its ``max_num_tokens`` must be at least
    ``world_size * max_tokens_per_rank`` (the batch this rank's experts run on: the gathered tokens, or
    the all-to-all's receive rows). weights: this rank's shard (``shard_weights`` + ``prepare_weights``),
    on this rank's current CUDA device. group: the process group (None: the default group); the shard is
    ``expert_shard(num_experts, world_size=W, rank=r)``. dispatch: "all_gather" (default) or
    "all_to_all" (module docstring). reduce_dtype: float32 or bfloat16, the dtype of the all-gather's
    cross-rank sum; all_to_all always combines in float32 on the source rank and accepts float32 only.

    All arguments are checked here, before any communication; nothing is communicated until the first
    call, so what other ranks were given (shapes, top_k, Tmax, dispatch) is not compared: build every
    rank's layer with the same arguments. Device buffers (``buffer_bytes``) are allocated once, for Tmax
    tokens per rank, and shared by all calls: order calls on one stream.

    Size Tmax to the batch: every call moves, sorts and combines W * Tmax rows whatever T is (padding
    rows are masked out of the GEMMs). To serve several batch sizes, build one layer per size (each with
    a config of that ``max_num_tokens``) over the same prepared weights.
    """

    def __init__(
        self,
        config: Nvfp4MoeConfig,
        weights: Nvfp4Weights,
        *,
        num_experts: int,
        top_k: int,
        max_tokens_per_rank: int,
        activation: Activation | str = SwiGLU(),
        group: dist.ProcessGroup | None = None,
        reduce_dtype: torch.dtype = torch.float32,
        dispatch: str = "all_gather",
    ) -> None:
        self.dispatch = require_choice("dispatch", dispatch, DISPATCHES)
        self.group, self.rank, self.world_size = _process_group(group)
        if not isinstance(config, Nvfp4MoeConfig):
            raise TypeError(f"config must be an Nvfp4MoeConfig, got {type(config).__name__}")
        if not isinstance(weights, Nvfp4Weights):
            raise TypeError("weights must be the Nvfp4Weights of this rank's shard, from config.prepare_weights()")
        self.num_experts = require_int_arg("num_experts", num_experts, 1)
        self.top_k = require_int_arg("top_k", top_k, 1, num_experts)
        self.max_tokens_per_rank = require_int_arg("max_tokens_per_rank", max_tokens_per_rank, 1)
        self.expert_start, count = expert_shard(num_experts, world_size=self.world_size, rank=self.rank)
        if weights.num_experts != count:
            raise ValueError(
                f"rank {self.rank} of {self.world_size} holds experts {self.expert_start}..{self.expert_start + count - 1} "
                f"({count}) of {num_experts}, but its weights hold {weights.num_experts}; prepare them from shard_weights()"
            )
        self.activation = parse_activation(activation)
        if self.activation.gated != weights.gated:
            raise ValueError(f"{type(self.activation).__name__} is {'' if self.activation.gated else 'non-'}gated but the "
                             f"weights were prepared for a {'' if weights.gated else 'non-'}gated activation")
        self.rows = self.world_size * self.max_tokens_per_rank
        if self.rows > config.max_num_tokens:
            raise ValueError(
                f"this rank's experts run on world_size * max_tokens_per_rank = {self.rows} tokens but the config's "
                f"max_num_tokens is {config.max_num_tokens}; raise it to at least {self.rows}"
            )
        if reduce_dtype not in REDUCE_DTYPES:
            raise ValueError(f"reduce_dtype must be torch.float32 or torch.bfloat16, got {reduce_dtype}")
        if dispatch == "all_to_all" and reduce_dtype != torch.float32:
            raise ValueError(f"reduce_dtype={reduce_dtype} applies to dispatch='all_gather' only; dispatch='all_to_all' "
                             "always combines in float32 on the source rank (leave reduce_dtype at torch.float32)")
        self.device = weights.device
        if self.device.type == "cuda" and self.device.index != torch.cuda.current_device():
            raise ValueError(f"the weights are on {self.device} but the current CUDA device is "
                             f"{torch.cuda.current_device()}; call torch.cuda.set_device({self.device.index}) first")
        self.config, self.weights, self.reduce_dtype = config, weights, reduce_dtype
        self.hidden_size = weights.hidden_size
        if dispatch == "all_gather":
            self._all_gather, self._reduce_scatter = _collectives()
            self._allocate_all_gather()
        else:
            self._allocate_all_to_all()

    def _allocate_all_gather(self) -> None:
        """Static buffers of the all-gather. Per rank and token the send buffer holds [ids int32 k | weights fp32 k |
        packed H/2 | scales H/16] bytes, section by section (Tmax rows each); the all-gather output is
        [W, chunk]; the receive buffer holds each section of all ranks contiguously ([W * Tmax, ...]),
        which is what fused_moe reads."""
        tmax, world, k, hidden, dev = self.max_tokens_per_rank, self.world_size, self.top_k, self.hidden_size, self.device
        widths = (("ids", 4 * k), ("weights", 4 * k), ("packed", hidden // 2), ("scales", hidden // 16))
        chunk = tmax * sum(width for _, width in widths)
        self._send = torch.zeros(chunk, dtype=torch.uint8, device=dev)
        self._gathered = torch.zeros(world * chunk, dtype=torch.uint8, device=dev)
        self._recv = torch.zeros(world * chunk, dtype=torch.uint8, device=dev)
        send, recv, self._unpack = {}, {}, []
        offset = 0
        for name, width in widths:
            size = tmax * width
            send[name] = self._send[offset : offset + size]
            recv[name] = self._recv[world * offset : world * (offset + size)]
            self._unpack.append((self._gathered.view(world, chunk)[:, offset : offset + size], recv[name].view(world, size)))
            offset += size
        self._send_ids = send["ids"].view(torch.int32).view(tmax, k)
        self._send_weights = send["weights"].view(torch.float32).view(tmax, k)
        self._send_packed = send["packed"].view(tmax, hidden // 2)
        self._send_scales = send["scales"].view(tmax, hidden // 16)
        self._send_ids.fill_(-1)
        self._batch = Nvfp4Activations(
            recv["packed"].view(self.rows, hidden // 2), recv["scales"].view(torch.float8_e4m3fn).view(self.rows, hidden // 16)
        )
        self._batch_routing = Routing.unpacked(
            recv["ids"].view(torch.int32).view(self.rows, k), recv["weights"].view(torch.float32).view(self.rows, k)
        )
        self._partial = torch.zeros(self.rows, hidden, dtype=torch.bfloat16, device=dev)
        self._reduce_in = self._partial if self.reduce_dtype == torch.bfloat16 else torch.zeros(
            self.rows, hidden, dtype=torch.float32, device=dev
        )
        self._reduced = torch.zeros(tmax, hidden, dtype=self.reduce_dtype, device=dev)
        self._buffers = [self._send, self._gathered, self._recv, self._partial, self._reduce_in, self._reduced]

    def _allocate_all_to_all(self) -> None:
        """Static buffers of the all-to-all. A token travels as one record of ``token_record_bytes`` bytes
        ([ids int32 k | weights fp32 k | packed H/2 | scales H/16], ``_record_columns``). staging uint8
        [Tmax + 1, record]: this rank's T tokens, row Tmax the padding record (ids -1; no call writes it);
        send / receive uint8 [W * Tmax, record]: Tmax rows per peer; the receive rows unpacked into the
        contiguous batch fused_moe reads ([W * Tmax, ...] per column); the partial [W * Tmax, H] bf16; the
        returned partials [W * Tmax + 1, H] bf16 (the last row is never written: the zero row of pairs not
        sent); one peer's gathered rows [Tmax, H] bf16 and the FP32 sum [Tmax, H]."""
        tmax, world, k, hidden, dev = self.max_tokens_per_rank, self.world_size, self.top_k, self.hidden_size, self.device
        rows, record = self.rows, token_record_bytes(hidden, k)
        self._staging = torch.zeros(tmax + 1, record, dtype=torch.uint8, device=dev)
        self._staging_columns = _record_columns(self._staging, k, hidden)
        self._staging_columns[0][tmax].fill_(-1)
        self._send = torch.zeros(rows, record, dtype=torch.uint8, device=dev)
        self._recv = torch.zeros(rows, record, dtype=torch.uint8, device=dev)
        self._send_token = torch.zeros(rows + 1, dtype=torch.int64, device=dev)  # staging row of each send row
        self._pair_token = torch.arange(tmax, device=dev).repeat_interleave(world)  # token of pair (t, p) = t * W + p
        bounds = [expert_shard(self.num_experts, world_size=world, rank=r)[0] for r in range(world)] + [self.num_experts]
        self._shard_bounds = torch.tensor(bounds, dtype=torch.int64, device=dev)
        self._sent_counts = torch.zeros(world, dtype=torch.int64, device=dev)
        batch_ids = torch.full((rows, k), -1, dtype=torch.int32, device=dev)
        batch_weights = torch.zeros(rows, k, dtype=torch.float32, device=dev)
        batch_packed = torch.zeros(rows, hidden // 2, dtype=torch.uint8, device=dev)
        batch_scales = torch.zeros(rows, hidden // 16, dtype=torch.uint8, device=dev)
        self._unpack = list(zip(_record_columns(self._recv, k, hidden), (batch_ids, batch_weights, batch_packed, batch_scales)))
        self._batch = Nvfp4Activations(batch_packed, batch_scales.view(torch.float8_e4m3fn))
        self._batch_routing = Routing.unpacked(batch_ids, batch_weights)
        self._partial = torch.zeros(rows, hidden, dtype=torch.bfloat16, device=dev)
        self._returned = torch.zeros(rows + 1, hidden, dtype=torch.bfloat16, device=dev)
        self._peer_rows = torch.zeros(tmax, hidden, dtype=torch.bfloat16, device=dev)
        self._sum = torch.zeros(tmax, hidden, dtype=torch.float32, device=dev)
        self._buffers = [self._staging, self._send, self._recv, self._send_token, self._pair_token, self._shard_bounds,
                         self._sent_counts, batch_ids, batch_weights, batch_packed, batch_scales, self._partial,
                         self._returned, self._peer_rows, self._sum]

    @property
    def buffer_bytes(self) -> int:
        """Device bytes of this layer's static buffers (weights and fused_moe's workspaces excluded)."""
        return sum(b.nbytes for b in self._buffers)

    @property
    def sent_counts(self) -> torch.Tensor:
        """int64 [W] on the layer's device (dispatch="all_to_all" only): how many of its tokens the last call
        sent to each rank (itself included), each <= max_tokens_per_rank. The layer's own buffer, rewritten
        by every call; reading its values is a device sync."""
        if self.dispatch != "all_to_all":
            raise ValueError(f"sent_counts exists for dispatch='all_to_all' only; this layer has dispatch={self.dispatch!r}")
        return self._sent_counts

    def __call__(
        self, activations: Nvfp4Activations, routing: Routing, *, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """This rank's output bfloat16 [T, H]: for each of its T tokens the sum over ALL ranks' experts.

        activations: this rank's T tokens (``config.prepare_activations``), T in 0..max_tokens_per_rank
        (T may differ per rank). routing: [T, top_k] with GLOBAL expert ids (packed or unpacked; ids
        outside 0..num_experts-1 are unrouted). out: optional contiguous bfloat16 [T, H] to write.
        Collective: every rank of the group must call it. No host sync; launches on the current stream.
        """
        tokens = self._check_call(activations, routing, out)
        ids, route_weights = _routing_operands(routing, self.num_experts)
        result = out if out is not None else torch.empty(tokens, self.hidden_size, dtype=torch.bfloat16, device=self.device)
        if self.dispatch == "all_gather":
            self._call_all_gather(tokens, activations, ids, route_weights, result)
        else:
            self._call_all_to_all(tokens, activations, ids, route_weights, result)
        return result

    def _local_experts(self) -> None:
        """This rank's experts on the batch (``self._batch``, ``self._batch_routing``) into ``self._partial``."""
        fused_moe(self.config, self._batch, self._batch_routing, self.weights, activation=self.activation,
                  local_expert_start=self.expert_start, out=self._partial)

    def _call_all_gather(self, tokens: int, activations: Nvfp4Activations, ids: torch.Tensor,
                         route_weights: torch.Tensor, result: torch.Tensor) -> None:
        """All-gather, local experts, reduce-scatter; result bfloat16 [T, H] receives this rank's rows."""
        self._send_ids[:tokens].copy_(ids)
        self._send_ids[tokens:].fill_(-1)
        self._send_weights[:tokens].copy_(route_weights)
        self._send_packed[:tokens].copy_(activations.packed)
        self._send_scales[:tokens].copy_(activations.scales.view(torch.uint8))
        self._all_gather(self._gathered, self._send, group=self.group)
        for gathered, received in self._unpack:
            received.copy_(gathered)
        self._local_experts()
        if self._reduce_in is not self._partial:
            self._reduce_in.copy_(self._partial)
        self._reduce_scatter(self._reduced, self._reduce_in, group=self.group)
        result.copy_(self._reduced[:tokens])

    def _call_all_to_all(self, tokens: int, activations: Nvfp4Activations, ids: torch.Tensor,
                         route_weights: torch.Tensor, result: torch.Tensor) -> None:
        """Pack, all-to-all, local experts, all-to-all back, FP32 combine; result bfloat16 [T, H]."""
        tmax, rows = self.max_tokens_per_rank, self.rows
        for column, value in zip(self._staging_columns, (ids, route_weights, activations.packed,
                                                         activations.scales.view(torch.uint8))):
            column[:tokens].copy_(value)
        pair_rows, counts = dispatch_rows(ids, self._shard_bounds, tmax)
        self._sent_counts.copy_(counts)
        self._send_token.fill_(tmax)  # the padding record, except where a token is scattered below
        self._send_token.scatter_(0, pair_rows.reshape(-1), self._pair_token[: pair_rows.numel()])
        torch.index_select(self._staging, 0, self._send_token[:rows], out=self._send)
        dist.all_to_all_single(self._recv, self._send, group=self.group)
        for received, batch in self._unpack:
            batch.copy_(received)
        batch_ids = self._batch_routing.ids
        batch_ids.masked_fill_((batch_ids < self.expert_start) | (batch_ids >= self.expert_start + self.weights.num_experts), -1)
        self._local_experts()
        dist.all_to_all_single(self._returned[:rows], self._partial, group=self.group)
        total, peer_rows = self._sum[:tokens], self._peer_rows[:tokens]
        total.zero_()
        for peer in range(self.world_size):  # rank order; a pair not sent reads the zero row
            torch.index_select(self._returned, 0, pair_rows[:, peer], out=peer_rows)
            total.add_(peer_rows)
        result.copy_(total)

    def _check_call(self, activations: Nvfp4Activations, routing: Routing, out: torch.Tensor | None) -> int:
        """T after the host-side checks of a call's arguments (no data read)."""
        if not isinstance(activations, Nvfp4Activations):
            raise TypeError("activations must be the Nvfp4Activations from config.prepare_activations()")
        if not isinstance(routing, Routing):
            raise TypeError("routing must be a cudnn_moe.Routing (Routing.packed(...) or Routing.unpacked(...))")
        tokens, hidden = activations.num_tokens, self.hidden_size
        if tokens > self.max_tokens_per_rank:
            raise ValueError(f"{tokens} tokens exceed max_tokens_per_rank={self.max_tokens_per_rank}; "
                             "split the batch or build the layer with a larger max_tokens_per_rank")
        require_tensor("activations.packed", activations.packed, torch.uint8, rank=2)
        require_tensor("activations.scales", activations.scales, torch.float8_e4m3fn, rank=2)
        require_shape("activations.packed", activations.packed, (tokens, hidden // 2))
        require_shape("activations.scales", activations.scales, (tokens, hidden // 16))
        if routing.num_tokens != tokens:
            raise ValueError(f"routing covers {routing.num_tokens} tokens but activations hold {tokens}")
        if routing.top_k != self.top_k:
            raise ValueError(f"routing has top_k={routing.top_k} but the layer was built for top_k={self.top_k}")
        tensors = dict(activations=activations.packed, activation_scales=activations.scales,
                       routing=routing.device_tensor(), layer_buffers=self._partial)
        if out is not None:
            require_tensor("out", out, torch.bfloat16, rank=2)
            require_shape("out", out, (tokens, hidden))
            if not out.is_contiguous():
                raise ValueError("out must be contiguous (row-major)")
            tensors["out"] = out
        require_same_device(**tensors)
        return tokens

    def warmup(self) -> None:
        """Two collective calls with T = 0 on this rank (call on every rank together): creates the
        NCCL communicator, fused_moe's workspace, plans and graphs for the batch of W * Tmax rows, so that the
        next call can be captured in a CUDA graph and eager calls replay fused_moe's full-call graph."""
        hidden = self.hidden_size
        acts = Nvfp4Activations(
            torch.empty(0, hidden // 2, dtype=torch.uint8, device=self.device),
            torch.empty(0, hidden // 16, dtype=torch.float8_e4m3fn, device=self.device),
        )
        routing = Routing.unpacked(
            torch.empty(0, self.top_k, dtype=torch.int32, device=self.device),
            torch.empty(0, self.top_k, dtype=torch.float32, device=self.device),
        )
        for _ in range(2):
            self(acts, routing)


def _routing_operands(routing: Routing, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, weights) for the int32 / float32 send buffers, without a data read: packed routing is
    unpacked; int64 ids are clamped to [-1, num_experts] first so that the int32 cast cannot wrap an
    out-of-range id onto an expert (both ends stay unrouted)."""
    if routing.is_packed:
        return unpack_routing(routing.packed_tensor)
    ids = routing.ids.clamp(-1, num_experts) if routing.ids.dtype == torch.int64 else routing.ids
    return ids, routing.weights


def _collectives() -> tuple[Callable[..., object], Callable[..., object]]:
    """(all-gather into one tensor, reduce-scatter from one tensor): torch >= 2.13 names them
    ``all_gather_single`` / ``reduce_scatter_single`` (the ``*_tensor`` names warn there)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return gather, scatter
