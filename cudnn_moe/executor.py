"""Executor: per-bucket workspaces and CUDA-graph replay of one MoE layer's GPU pipeline.

One executor serves one prepared weight view with one (top_k, activation, local expert range).
A call with T tokens runs in the smallest power-of-two bucket B >= T. Per call:

1. stage (eager launch, caller pointers): tokens and routing into the bucket's static buffers;
   slots of tokens T..B-1 get expert id -1, so they are masked and never computed.
2. sort, permute, GEMM1, activation + NVFP4 requantize, GEMM2: captured once per bucket in a
   CUDA graph and replayed (or launched eagerly in debug mode, or recorded straight into the
   caller's graph when the caller's stream is capturing).
3. finalize or scale_rows (eager launch): writes the caller's output for the T live tokens.

Nothing on the call path allocates device memory (outputs aside), syncs, or copies host<->device.
Calls that share an executor share its workspace: order them on one stream.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import torch

from . import kernels
from .activations import Activation
from .config import Nvfp4Activations, Nvfp4Weights
from .engines import GemmEngine
from .formats import ScaleLayout
from .routing import Routing


def bucket_size(num_tokens: int) -> int:
    """Smallest power of two >= num_tokens (1 for 0 or 1)."""
    return 1 << max(0, (num_tokens - 1).bit_length())


def row_capacity(num_tokens: int, top_k: int, num_experts: int, align: int) -> int:
    """Most expert-sorted rows ``num_tokens`` tokens can need: every slot, plus each non-empty
    expert's padding up to ``align`` rows, rounded up to ``align``."""
    slots = num_tokens * top_k
    rows = slots + min(num_experts, slots) * (align - 1)
    return -(-rows // align) * align


@dataclass
class UnfinalizedOutput:
    """Per-slot expert outputs before the weighted sum over slots.

    rows: bfloat16 [R, H], GEMM2 rows in expert-sorted order times their expert's w2 global
    scale (route weight not applied); rows no slot points at are zero.
    expert_weights: float32 [T, k] route weights. token_to_row: int32 [T, k], the row of slot
    (t, s) in ``rows`` or -1 where the slot's expert is not local. The finalized output is
    ``sum_s expert_weights[t, s] * rows[token_to_row[t, s]]`` over slots with a row.
    """

    rows: torch.Tensor
    expert_weights: torch.Tensor
    token_to_row: torch.Tensor


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Keep Python's cyclic GC from running inside a capture: freeing another object's CUDA
    memory or graph there would invalidate the capture."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class _Bucket:
    """Static device buffers for up to ``tokens`` tokens (see the module docstring)."""

    def __init__(self, tokens: int, rows: int, executor: MoeExecutor) -> None:
        w = executor.weights
        dev, k, hidden, inter = w.device, executor.top_k, w.hidden_size, w.intermediate_size
        experts, n1 = w.num_experts, w.w1.shape[1]

        def empty(*shape: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
            # Zero-filled so rows the pipeline never writes always hold finite values.
            return torch.zeros(*shape, dtype=dtype, device=dev)

        engine = executor.engine
        self.tokens, self.rows = tokens, rows
        self.x = empty(tokens, hidden // 2)
        self.x_scales = empty(tokens, hidden // 16)
        self.ids = empty(tokens, k, dtype=torch.int32)
        self.route_weights = empty(tokens, k, dtype=torch.float32)
        self.offsets = empty(experts + 1, dtype=torch.int32)
        self.expert_counts = empty(experts, dtype=torch.int32)  # slots per local expert of the last call
        self.slot_to_row = empty(tokens * k, dtype=torch.int32)
        self.row_to_slot = empty(rows, dtype=torch.int32)
        self.row_expert = empty(rows, dtype=torch.int32)
        self.x_sorted = empty(rows, hidden // 2)
        self.x_sorted_scales = empty(engine.token_scale_bytes(rows, hidden, experts))
        self.gemm1_out = empty(rows, n1, dtype=torch.bfloat16)
        self.act = empty(rows, inter // 2)
        self.act_scales = empty(engine.token_scale_bytes(rows, inter, experts))
        self.gemm2_out = empty(rows, hidden, dtype=torch.bfloat16)
        self.gemm_workspace = empty(
            max(
                engine.workspace_bytes(rows, hidden, n1, experts),
                engine.workspace_bytes(rows, inter, hidden, experts),
                1,
            )
        )
        self.graph: torch.cuda.CUDAGraph | None = None


class MoeExecutor:
    """Runs the NVFP4 MoE pipeline for one weight view on its device (see the module docstring)."""

    def __init__(
        self,
        weights: Nvfp4Weights,
        engine: GemmEngine,
        *,
        top_k: int,
        activation: Activation,
        local_expert_start: int,
        max_num_tokens: int,
    ) -> None:
        if weights.scale_layout is not engine.scale_layout:
            raise ValueError(
                f"the weights were prepared with {weights.scale_layout.value} scales but the "
                f"{engine.name} engine on this GPU reads {engine.scale_layout.value} scales; "
                "prepare them with a config for this GPU's architecture"
            )
        # A view without the executor cache: no reference cycle weights -> executor -> weights, so the
        # buckets and CUDA graphs are freed by reference counting, never by a GC pass during a capture.
        self.weights, self.engine = replace(weights, executors={}), engine
        self.top_k, self.activation = top_k, activation
        self.local_expert_start, self.max_num_tokens = local_expert_start, max_num_tokens
        self._buckets: dict[int, _Bucket] = {}
        self._lock = threading.Lock()

    @property
    def swizzled(self) -> bool:
        return self.engine.scale_layout is ScaleLayout.SWIZZLED_128X4

    def bucket(self, num_tokens: int) -> _Bucket:
        """The bucket for ``num_tokens`` tokens, allocating it on first use."""
        size = bucket_size(num_tokens)
        found = self._buckets.get(size)
        if found is not None:
            return found
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"no workspace for {num_tokens} tokens yet and the stream is capturing a CUDA graph; "
                f"call warmup({self.max_num_tokens}) (or run one call of this size) before capture"
            )
        with self._lock:
            if size not in self._buckets:
                rows = row_capacity(size, self.top_k, self.weights.num_experts, self.engine.row_alignment)
                self._buckets[size] = _Bucket(size, rows, self)
            return self._buckets[size]

    def warmup(self, max_tokens: int | None = None, use_cuda_graph: bool = True) -> None:
        """Allocate every bucket up to ``max_tokens``, build its GEMM plans and capture its graph."""
        limit = self.max_num_tokens if max_tokens is None else max_tokens
        size = 1
        while True:
            bucket = self.bucket(size)
            if use_cuda_graph:
                self._ensure_graph(bucket)
            else:
                self._pipeline(bucket)
            if size >= limit:
                break
            size *= 2

    def run(
        self,
        activations: Nvfp4Activations,
        routing: Routing,
        *,
        finalize: bool,
        out: torch.Tensor | None,
        use_cuda_graph: bool,
    ) -> torch.Tensor | UnfinalizedOutput:
        """Run the layer for T = activations.num_tokens (validated by the caller) tokens."""
        tokens = activations.num_tokens
        bucket = self.bucket(tokens)
        ids, route_weights, routing_format = routing.kernel_operands()
        kernels.stage_inputs(
            activations.packed, activations.scales, ids, route_weights, routing_format,
            bucket.x, bucket.x_scales, bucket.ids, bucket.route_weights,
        )
        if use_cuda_graph and not torch.cuda.is_current_stream_capturing():
            self._ensure_graph(bucket).replay()
        else:
            self._pipeline(bucket)
        w = self.weights
        if finalize:
            result = out if out is not None else torch.empty(
                tokens, w.hidden_size, dtype=torch.bfloat16, device=w.device
            )
            kernels.finalize(
                bucket.gemm2_out, bucket.slot_to_row, bucket.row_expert, bucket.route_weights,
                w.w2_alpha, self.top_k, result,
            )
            return result
        rows = row_capacity(tokens, self.top_k, w.num_experts, self.engine.row_alignment)
        rows_out = out if out is not None else torch.empty(
            rows, w.hidden_size, dtype=torch.bfloat16, device=w.device
        )
        kernels.scale_rows(bucket.gemm2_out, bucket.row_to_slot, bucket.row_expert, w.w2_alpha, rows_out)
        token_to_row = bucket.slot_to_row[: tokens * self.top_k].view(tokens, self.top_k).clone()
        route_weights = bucket.route_weights[:tokens].clone()  # as decoded by the stage kernel
        return UnfinalizedOutput(rows_out, route_weights, token_to_row)

    def _ensure_graph(self, bucket: _Bucket) -> torch.cuda.CUDAGraph:
        if bucket.graph is None:
            with self._lock:
                if bucket.graph is None:
                    self._pipeline(bucket)  # compiles kernels and builds GEMM plans outside capture
                    graph = torch.cuda.CUDAGraph()
                    with _gc_paused(), torch.cuda.graph(graph):
                        self._pipeline(bucket)
                    bucket.graph = graph
        return bucket.graph

    def _pipeline(self, bucket: _Bucket) -> None:
        """Launch the bucket-static part of the layer on the current stream."""
        for _, launch in self.stages(bucket):
            launch()

    def stages(self, b: _Bucket) -> list[tuple[str, Callable[[], None]]]:
        """The five bucket-static launches, in order: sort, permute, GEMM1, activation, GEMM2."""
        w, k, act = self.weights, self.top_k, self.activation
        experts, hidden, inter, n1 = w.num_experts, w.hidden_size, w.intermediate_size, w.w1.shape[1]
        a, beta, limit = act.params()
        return [
            ("sort", lambda: kernels.sort_routing(
                b.ids.view(-1), k, self.local_expert_start, experts, self.engine.row_alignment,
                b.offsets, b.slot_to_row, b.row_to_slot, b.row_expert, b.expert_counts,
            )),
            ("permute", lambda: kernels.permute_tokens(
                b.x, b.x_scales, b.slot_to_row, b.tokens * k, k, b.x_sorted, b.x_sorted_scales, self.swizzled,
            )),
            ("gemm1", lambda: self.engine.gemm(
                b.rows, hidden, n1, experts, b.x_sorted, b.x_sorted_scales,
                w.w1, w.w1_scales, b.offsets, b.gemm1_out, b.gemm_workspace,
            )),
            ("activation", lambda: kernels.activate_quantize(
                b.gemm1_out, w.w1_alpha, b.row_to_slot, b.row_expert, b.offsets, int(act.kind), a, beta, limit,
                act.gated, b.act, b.act_scales, self.swizzled,
            )),
            ("gemm2", lambda: self.engine.gemm(
                b.rows, inter, hidden, experts, b.act, b.act_scales,
                w.w2, w.w2_scales, b.offsets, b.gemm2_out, b.gemm_workspace,
            )),
        ]
