"""Expert parallelism over torch.distributed: each rank holds a contiguous range of the experts.

Sharding (``expert_shard``): E experts over W ranks in contiguous ranges; the first ``E % W``
ranks hold ``E // W + 1`` experts, the others ``E // W``. Every rank holds at least one expert.
``expert_shard`` and ``shard_weights`` take ``world_size`` and ``rank`` as keyword-only arguments
(``expert_shard(E, world_size=W, rank=r)``), so that the two ints cannot be swapped silently.

One ``ExpertParallelMoe`` call (collective: every rank of the group calls it, in the same order):

1. this rank's T tokens (NVFP4 pack) and routing (GLOBAL expert ids) are copied into static send
   buffers of ``max_tokens_per_rank`` (Tmax) rows; padding rows get expert id -1 (unrouted);
2. one all-gather gives every rank the [W * Tmax] token batch of all ranks (rank r's tokens at rows
   r * Tmax ..);
3. ``fused_moe`` runs this rank's experts on that batch (slots naming other experts are skipped):
   the BF16 partial output [W * Tmax, H] of this rank's experts;
4. a reduce-scatter sums the partials over ranks and hands each rank its own Tmax rows; the first T
   are its output, bfloat16 [T, H].

Rounding: each rank's partial is ``fused_moe``'s finalize of its slots (FP32 sum in slot order,
rounded once to BF16); the cross-rank sum runs in ``reduce_dtype``: float32 (default: the BF16
partials are widened exactly, summed in FP32 by NCCL, then rounded once to BF16) or bfloat16 (half
the bytes; NCCL rounds to BF16 after each addition). So the output equals single-GPU ``fused_moe``
on the full weights to BF16 noise, not bitwise (single-GPU rounds the whole slot sum once).

Static shapes throughout (no host sync, no data-dependent size): the whole call can be captured in a
CUDA graph after ``warmup()`` (NCCL collectives are capturable with NCCL >= 2.9.6 once the process
group's communicator exists; warmup creates it).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from .activations import Activation, SwiGLU, parse_activation
from .fused import Nvfp4MoeConfig, fused_moe
from .routing import Routing, unpack_routing
from .validate import require_int_arg, require_same_device, require_shape, require_tensor
from .weights.nvfp4 import Nvfp4Activations, Nvfp4Weights

REDUCE_DTYPES = (torch.float32, torch.bfloat16)


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
    ``world_size * max_tokens_per_rank`` (the gathered batch). weights: this rank's shard
    (``shard_weights`` + ``prepare_weights``), on this rank's current CUDA device. group: the process
    group (None: the default group); the shard is ``expert_shard(num_experts, world_size=W, rank=r)``.
    reduce_dtype: float32 or bfloat16, the dtype of the cross-rank sum (module docstring).

    All arguments are checked here, before any communication; nothing is communicated until the first
    call, so what other ranks were given (shapes, top_k, Tmax) is not compared: build every rank's layer
    with the same arguments. Device buffers (``buffer_bytes``) are allocated once, for Tmax tokens per
    rank, and shared by all calls: order calls on one stream.

    Size Tmax to the batch: every call gathers, sorts and reduce-scatters W * Tmax rows whatever T is
    (padding rows are masked out of the GEMMs). To serve several batch sizes, build one layer per size
    (each with a config of that ``max_num_tokens``) over the same prepared weights.
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
    ) -> None:
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
                f"the gathered batch has world_size * max_tokens_per_rank = {self.rows} tokens but the config's "
                f"max_num_tokens is {config.max_num_tokens}; raise it to at least {self.rows}"
            )
        if reduce_dtype not in REDUCE_DTYPES:
            raise ValueError(f"reduce_dtype must be torch.float32 or torch.bfloat16, got {reduce_dtype}")
        self.device = weights.device
        if self.device.type == "cuda" and self.device.index != torch.cuda.current_device():
            raise ValueError(f"the weights are on {self.device} but the current CUDA device is "
                             f"{torch.cuda.current_device()}; call torch.cuda.set_device({self.device.index}) first")
        self.config, self.weights, self.reduce_dtype = config, weights, reduce_dtype
        self.hidden_size = weights.hidden_size
        self._all_gather, self._reduce_scatter = _collectives()
        self._allocate()

    def _allocate(self) -> None:
        """Static buffers. Per rank and token the send buffer holds [ids int32 k | weights fp32 k |
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

    @property
    def buffer_bytes(self) -> int:
        """Device bytes of this layer's static buffers (weights and fused_moe's workspaces excluded)."""
        buffers = {self._send, self._gathered, self._recv, self._partial, self._reduce_in, self._reduced}
        return sum(b.nbytes for b in buffers)

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
        self._send_ids[:tokens].copy_(ids)
        self._send_ids[tokens:].fill_(-1)
        self._send_weights[:tokens].copy_(route_weights)
        self._send_packed[:tokens].copy_(activations.packed)
        self._send_scales[:tokens].copy_(activations.scales.view(torch.uint8))
        self._all_gather(self._gathered, self._send, group=self.group)
        for gathered, received in self._unpack:
            received.copy_(gathered)
        fused_moe(self.config, self._batch, self._batch_routing, self.weights, activation=self.activation,
                  local_expert_start=self.expert_start, out=self._partial)
        if self._reduce_in is not self._partial:
            self._reduce_in.copy_(self._partial)
        self._reduce_scatter(self._reduced, self._reduce_in, group=self.group)
        result = out if out is not None else torch.empty(tokens, self.hidden_size, dtype=torch.bfloat16, device=self.device)
        return result.copy_(self._reduced[:tokens])

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
                       routing=routing.device_tensor(), layer_buffers=self._send)
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
        NCCL communicator, fused_moe's workspace, plans and graphs for the gathered batch, so that the
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
