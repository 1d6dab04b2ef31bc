"""Executor: per-bucket workspaces and CUDA-graph replay of one MoE layer's GPU pipeline.

One executor serves one prepared weight view with one (top_k, activation, local expert range).
A call with T tokens runs in the smallest power-of-two bucket B >= T. Per call:

1. stage (the op's launch, caller pointers): tokens and routing into the bucket's static buffers (NVFP4 tokens
   decoded straight into BF16 rows where GEMM1 gathers them); slots of tokens T..B-1 get expert id -1, so they
   are masked and never computed. Per-call values
   (the aligned op's output scales) are staged into the bucket too, never into the prepared weights.
2. the stage chain the engine declares (``GemmEngine.stages``; by default sort, permute, GEMM1,
   activation + NVFP4 requantize, GEMM2): captured once per bucket in a CUDA graph and replayed (or
   launched eagerly in debug mode, or recorded straight into the caller's graph when the caller's
   stream is capturing). Where the launches are recorded for the call itself (eager, the caller's graph, a
   full-call graph), a chain whose first launch can read the caller's inputs does step 1 in it (the sm90
   decode chain's sort + permute: _BucketStages.sort_permute; for one token its GEMM1, which then also sorts and
   permutes: _BucketStages.gemm1_routed), one launch less (two). The executor's ``tokens``
   (cudnn_moe.pipeline.tokens.TokenCode: NVFP4 by default) and ``intermediate``
   (cudnn_moe.kernels.codes.IntermediateCode: what the activation makes for GEMM2, NVFP4 by default) other than
   NVFP4 need an engine reading BF16 token rows (the SM90 engine).
3. finish (the op's launch): finalize, or the unfinalized rows; writes the caller's output for the T
   live tokens.

Full-call graphs: when a finalized call with a caller ``out`` repeats a signature (the same caller
tensors: pointers, shapes, strides, dtypes, and T) on two consecutive calls of a bucket, stage +
pipeline + finalize are captured into one CUDA graph for that signature, and later calls with it
replay only that graph (it reads the caller's current tensor contents, so results equal the eager
path bitwise). Each bucket keeps the FULL_GRAPHS_PER_BUCKET most recently used ones. Nothing is
captured while the caller's stream is capturing (the launches are recorded into the caller's graph).

Nothing on the call path allocates device memory (outputs aside), syncs, or copies host<->device.
Calls that share an executor share its buckets; calls on different streams (threads) are ordered on the
GPU by cudnn_moe.pipeline.order, so they give the single-stream results.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, replace

import torch

from .. import kernels
from ..activations import Activation
from ..capture import gc_paused, refuse_during_capture
from ..engines.base import (
    ActivationEpilogue,
    BlockCode,
    EarlyRouting,
    FinalizeEpilogue,
    GemmEngine,
    GemmOperands,
    GemmShape,
    LayerStages,
    RoutePrologue,
    RowGather,
    Stage,
    TileHandoff,
    TokenOperand,
    WeightOperand,
)
from ..kernels.codes import IntermediateCode
from ..routing import Routing
from ..weights.low_latency import Mxfp8Activations
from ..weights.nvfp4 import Nvfp4Activations, Nvfp4Weights
from .lifetime import defer, release_deferred
from .order import StreamOrder
from .tokens import TokenCode, Tokens, token_code, token_operands


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

    rows: bfloat16 [R, H], GEMM2 rows in expert-sorted order (bf16 of the w2 global times the FP32
    accumulator; route weight not applied); rows no slot points at are zero.
    expert_weights: float32 [T, k] route weights. token_to_row: int32 [T, k], the row of slot
    (t, s) in ``rows`` or -1 where the slot's expert is not local. The finalized output is
    ``sum_s expert_weights[t, s] * rows[token_to_row[t, s]]`` over slots with a row.
    """

    rows: torch.Tensor
    expert_weights: torch.Tensor
    token_to_row: torch.Tensor


class Bucket:
    """Static device buffers for up to ``tokens`` tokens (see the module docstring), and the operand
    bundles of its two grouped GEMMs."""

    def __init__(self, tokens: int, rows: int, executor: MoeExecutor) -> None:
        w, engine = executor.weights, executor.engine
        dev, k, hidden, inter = w.device, executor.top_k, w.hidden_size, w.intermediate_size
        experts, n1 = w.num_experts, w.gemm1_rows

        def empty(*shape: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
            # Zero-filled so rows the pipeline never writes always hold finite values.
            return torch.zeros(*shape, dtype=dtype, device=dev)

        def token_operand(gemm: GemmShape, index: int, buffer_rows: int) -> TokenOperand:
            shape, dtype, scale_bytes = engine.token_buffers(buffer_rows, gemm.k, experts)
            return TokenOperand(empty(*shape, dtype=dtype), empty(scale_bytes) if scale_bytes else None,
                                engine.token_layout_for(rows, gemm, gemm=index, code=w.code))

        self.tokens, self.rows = tokens, rows
        shape1, shape2 = GemmShape(hidden, n1, experts), GemmShape(inter, hidden, experts)
        # Only the buffers the engine's chain uses hold rows (cudnn_moe.engines.base.Gemm1Fusion): a gathering GEMM1
        # reads no permuted rows (the op's stage decodes NVFP4 tokens straight into x_rows, so x and x_scales hold
        # none; BF16 tokens are read from x), one with the activation epilogue writes no BF16 output.
        self.fusion = engine.gemm1_fusion(rows, shape1, executor.activation)
        if w.code is BlockCode.MXINT4 and not self.fusion.epilogue:  # its FP32 preactivation lives in the epilogue
            self.fusion = self.fusion._replace(epilogue=True)
        if self.fusion.gather and executor.tokens is TokenCode.MXFP8:
            raise ValueError(f"MXFP8 tokens are decoded by the sort + permute launch, which this bucket of {tokens} "
                             f"tokens does not run ({engine.name} gathers its GEMM1 rows)")
        decoded = self.fusion.gather and executor.tokens is TokenCode.NVFP4
        staged = 0 if decoded else tokens
        if executor.tokens is TokenCode.BF16:  # BF16 tokens [B, H]; no scales
            self.x, self.x_scales = empty(tokens, hidden, dtype=torch.bfloat16), empty(tokens, 0)
        elif executor.tokens is TokenCode.MXFP8:  # E4M3 codes [B, H], E8M0 scales [B, H/32]
            self.x, self.x_scales = empty(tokens, hidden, dtype=torch.float8_e4m3fn), empty(tokens, hidden // 32)
        else:  # NVFP4 tokens: codes [B, H/2], E4M3 scales [B, H/16]
            self.x, self.x_scales = empty(staged, hidden // 2), empty(staged, hidden // 16)
        # bfloat16 [B, H]: the NVFP4 tokens decoded by the stage (None: the stage writes x and x_scales)
        self.x_rows = empty(tokens, hidden, dtype=torch.bfloat16) if decoded else None
        self.ids = empty(tokens, k, dtype=torch.int32)
        self.route_weights = empty(tokens, k, dtype=torch.float32)
        self.offsets = empty(experts + 1, dtype=torch.int32)
        self.expert_counts = empty(experts, dtype=torch.int32)  # slots per local expert of the last call
        self.slot_to_row = empty(tokens * k, dtype=torch.int32)
        self.row_to_slot = empty(rows, dtype=torch.int32)
        self.row_expert = empty(rows, dtype=torch.int32)
        self.sorted = kernels.SortBuffers(self.offsets, self.slot_to_row, self.row_to_slot, self.row_expert,
                                          self.expert_counts)  # the five above, as the sort writes them
        workspace_bytes = max(engine.workspace_bytes(rows, shape1), engine.workspace_bytes(rows, shape2))
        workspace = empty(workspace_bytes) if workspace_bytes else None
        # The expert globals: the weights', or per-call ones the op's stage writes here (weights without alpha).
        self.alpha1 = w.w1_alpha if w.w1_alpha is not None else empty(2 * experts if w.w1_alpha_split else experts,
                                                                      dtype=torch.float32)
        self.alpha2 = w.w2_alpha if w.w2_alpha is not None else empty(experts, dtype=torch.float32)
        self.gemm1 = GemmOperands(
            rows, shape1, token_operand(shape1, 1, 0 if self.fusion.gather else rows),
            WeightOperand(w.w1, w.w1_scales, self.alpha1, w.w1_alpha_split, w.code, w.w1_halves_swapped), self.offsets,
            empty(0 if self.fusion.epilogue else rows, n1, dtype=torch.bfloat16), workspace, gemm=1,
        )
        self.gemm2 = GemmOperands(
            rows, shape2, token_operand(shape2, 2, rows), WeightOperand(w.w2, w.w2_scales, self.alpha2, code=w.code),
            self.offsets, empty(rows, hidden, dtype=torch.bfloat16), workspace, gemm=2,
        )
        self.graph: torch.cuda.CUDAGraph | None = None
        self.call_chain_warm = False  # MoeExecutor._warm_call_chain ran on this bucket
        self.full_graphs: OrderedDict[Hashable, torch.cuda.CUDAGraph] = OrderedDict()  # LRU, by signature
        self.last_signature: Hashable | None = None


FULL_GRAPHS_PER_BUCKET = 4


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
        tokens: TokenCode = TokenCode.NVFP4,
        intermediate: IntermediateCode = IntermediateCode.NVFP4,
    ) -> None:
        if weights.spec != engine.layout:
            raise ValueError(
                f"the weights were prepared for the {weights.spec.describe()} but the executor got the "
                f"{engine.layout.describe()}; prepare them with a config for this GPU"
            )
        # A copy of the record (same tensors), never the caller's object: the executor cache
        # (cudnn_moe.pipeline.lifetime) releases this executor when the caller's weights die.
        self.weights, self.engine = replace(weights), engine
        self.top_k, self.activation = top_k, activation
        self.local_expert_start, self.max_num_tokens = local_expert_start, max_num_tokens
        if not isinstance(tokens, TokenCode) or not isinstance(intermediate, IntermediateCode):
            raise ValueError(f"tokens must be a TokenCode and intermediate an IntermediateCode, got {tokens!r} and "
                             f"{intermediate!r}")
        if (tokens is not TokenCode.NVFP4 or intermediate is not IntermediateCode.NVFP4) and (
                not engine.token_layout.is_bf16):
            raise ValueError(f"{tokens.name} tokens with a {intermediate.name} intermediate need an engine reading BF16 "
                             f"token rows, not the {engine.name} engine")
        if tokens is TokenCode.MXFP8 and max_num_tokens * top_k > kernels.SORT_PERMUTE_MAX_SLOTS:
            raise ValueError(f"MXFP8 tokens are decoded by the sort + permute launch, of at most "
                             f"{kernels.SORT_PERMUTE_MAX_SLOTS} slots; max_num_tokens={max_num_tokens} x top_k={top_k} "
                             f"is more")
        if weights.code is BlockCode.MXINT4 and intermediate is not IntermediateCode.BF16:
            raise ValueError("MXINT4 weights need a BF16 intermediate: their GEMM1 epilogue writes BF16 rows only")
        self.tokens, self.intermediate = tokens, intermediate
        self._buckets: dict[int, Bucket] = {}
        self._lock = threading.Lock()
        self.order = StreamOrder(weights.device)

    def bucket(self, num_tokens: int) -> Bucket:
        """The bucket for ``num_tokens`` tokens, allocating it on first use."""
        size = bucket_size(num_tokens)
        found = self._buckets.get(size)
        if found is not None:
            return found
        refuse_during_capture(f"there is no workspace for {num_tokens} tokens yet",
                              f"call warmup({self.max_num_tokens}) (or run one call of this size) before capture")
        with self._lock:
            if size not in self._buckets:
                rows = row_capacity(size, self.top_k, self.weights.num_experts, self.engine.row_alignment)
                self._buckets[size] = Bucket(size, rows, self)
            return self._buckets[size]

    def warmup(self, max_tokens: int | None = None, use_cuda_graph: bool = True) -> None:
        """Allocate every bucket up to ``max_tokens``, build its GEMM plans and capture its graph, and launch once
        the chain of a call that hands over its inputs and output (_warm_call_chain); also load the stage and
        finalize kernels, so the first call builds nothing."""
        limit = self.max_num_tokens if max_tokens is None else max_tokens
        release_deferred()
        kernels.load_call_kernels(self.weights.device.index)
        size = 1
        with self.order.use():
            while True:
                bucket = self.bucket(size)
                if use_cuda_graph:
                    self._ensure_graph(bucket)
                else:
                    self._pipeline(bucket)
                self._warm_call_chain(bucket)
                if size >= limit:
                    break
                size *= 2

    def _warm_call_chain(self, bucket: Bucket) -> None:
        """Once per bucket: where the chain of a finalized call of ``bucket.tokens`` tokens that hands over its inputs
        and output (eager, recorded into the caller's graph, a full-call graph) folds the stage into its first launch
        or the finalize into GEMM2, that chain's launches, on zero tokens whose every slot is unrouted (expert id -1)
        into a scratch output. Nothing is computed, but the kernel forms only such a call launches are compiled and
        loaded. A chain without a fold launches nothing the bucket's graph does not."""
        if bucket.call_chain_warm:
            return
        w, t = self.weights, bucket.tokens
        dev, hidden = w.device, w.hidden_size
        if self.tokens is TokenCode.BF16:
            tokens: Tokens = torch.zeros(t, hidden, dtype=torch.bfloat16, device=dev)
        elif self.tokens is TokenCode.MXFP8:
            tokens = Mxfp8Activations(torch.zeros(t, hidden, dtype=torch.uint8, device=dev).view(torch.float8_e4m3fn),
                                      torch.zeros(t, hidden // 32, dtype=torch.uint8, device=dev).view(
                                          torch.float8_e8m0fnu))
        else:
            tokens = Nvfp4Activations(torch.zeros(t, hidden // 2, dtype=torch.uint8, device=dev),
                                      torch.zeros(t, hidden // 16, dtype=torch.float8_e4m3fn, device=dev))
        routing = Routing.unpacked(torch.full((t, self.top_k), -1, dtype=torch.int32, device=dev),
                                   torch.zeros(t, self.top_k, dtype=torch.float32, device=dev))
        out = torch.empty(t, hidden, dtype=torch.bfloat16, device=dev)
        caller = CallerInputs(tokens, routing, out)
        chain = self._call_chain(bucket, caller)
        _, staged, finished = chain
        if staged or finished:
            for _, launch in self._finalized_launches(bucket, chain, caller):
                launch()
        bucket.call_chain_warm = True

    def run(
        self,
        activations: Tokens,
        routing: Routing,
        *,
        finalize: bool,
        out: torch.Tensor | None,
        use_cuda_graph: bool,
        signature: Hashable | None = None,
    ) -> torch.Tensor | UnfinalizedOutput:
        """Run the layer for the T tokens of ``activations`` (validated by the caller) of the executor's kind
        (cudnn_moe.pipeline.tokens).

        signature: a hashable identity of the caller's tensors (pointers, shapes, strides, dtypes) and
        T; given with finalize=True, an ``out`` and use_cuda_graph, repeated calls replay one full-call
        graph (module docstring). None: never.
        """
        with self.order.use():
            tokens = token_operands(activations)[0].shape[0]
            w = self.weights

            def stage(bucket: Bucket) -> None:
                self.stage(bucket, activations, routing)

            if finalize:
                result = out if out is not None else torch.empty(
                    tokens, w.hidden_size, dtype=torch.bfloat16, device=w.device
                )
                self.run_call(tokens, stage, lambda bucket: self._finalize(bucket, result),
                              use_cuda_graph=use_cuda_graph, signature=signature if out is not None else None,
                              caller=CallerInputs(activations, routing, result))
                return result
            caller = CallerInputs(activations, routing)
            rows = row_capacity(tokens, self.top_k, w.num_experts, self.engine.row_alignment)
            rows_out = out if out is not None else torch.empty(
                rows, w.hidden_size, dtype=torch.bfloat16, device=w.device
            )

            def unfinalized(bucket: Bucket) -> None:
                kernels.unfinalized_rows(bucket.gemm2.out, bucket.row_to_slot, rows_out)

            self.run_call(tokens, stage, unfinalized, use_cuda_graph=use_cuda_graph, caller=caller)
            bucket = self.bucket(tokens)
            token_to_row = bucket.slot_to_row[: tokens * self.top_k].view(tokens, self.top_k).clone()
            route_weights = bucket.route_weights[:tokens].clone()  # as decoded by the stage kernel
            return UnfinalizedOutput(rows_out, route_weights, token_to_row)

    def run_call(
        self,
        tokens: int,
        stage: Callable[[Bucket], None],
        finish: Callable[[Bucket], None],
        *,
        use_cuda_graph: bool,
        signature: Hashable | None = None,
        caller: CallerInputs | None = None,
    ) -> None:
        """One call of T = ``tokens`` tokens: ``stage(bucket)`` (caller's inputs -> the bucket's static
        buffers), the bucket pipeline, ``finish(bucket)`` (bucket -> the caller's output).

        signature: a hashable identity of everything stage and finish read and write (tensor pointers,
        shapes, strides, dtypes, scalars baked into launches) and T; with use_cuda_graph, repeated calls
        replay one full-call graph of stage + pipeline + finish (module docstring). None: never.
        caller: the op's inputs, which ``stage`` stages, and the output ``finish`` finalizes into; where the launches
        are recorded for this call (eager, the caller's graph, a full-call graph) the chain's first launch may stage
        them itself and its last finalize (_launch_call). Its tokens must be of the executor's kind (ValueError).
        """
        if caller is not None and token_code(caller.tokens) is not self.tokens:
            raise ValueError(f"caller.tokens must be {self.tokens.name} tokens for this executor, got "
                             f"{token_code(caller.tokens).name} ones")
        with self.order.use():
            bucket = self.bucket(tokens)
            graphed = use_cuda_graph and not torch.cuda.is_current_stream_capturing()
            if signature is not None and graphed:
                full = self._full_graph(bucket, signature, stage, finish, caller)
                if full is not None:
                    full.replay()
                    return
            if graphed:
                stage(bucket)
                self._ensure_graph(bucket).replay()
                finish(bucket)
            else:
                self._launch_call(bucket, stage, finish, caller)

    def _launch_call(self, bucket: Bucket, stage: Callable[[Bucket], None], finish: Callable[[Bucket], None],
                     caller: CallerInputs | None) -> None:
        """``stage(bucket)``, the bucket's chain and ``finish(bucket)``, launched now; the stage folded into the
        chain's first launch where that launch can read the caller's inputs, the finish (a finalize) into its last
        where that launch can write the caller's output."""
        ends = Stage("stage", lambda: stage(bucket)), Stage("finish", lambda: finish(bucket))
        for _, launch in _with_ends(self._call_chain(bucket, caller), *ends):
            launch()

    def call_launches(self, b: Bucket, caller: CallerInputs) -> list[Stage]:
        """Every launch of a finalized call on bucket ``b`` with the caller's inputs and output (``caller.out``, not
        None), in order, as an eager call, one recorded into the caller's graph and a full-call graph launch them: the
        op's stage ("stage") unless the chain's first launch does it, the chain (stages(b, caller)), and the finalize
        into caller.out ("finalize") unless the chain's last launch does it."""
        if caller.out is None:
            raise ValueError("caller.out must be the output a finalized call writes, got None")
        return self._finalized_launches(b, self._call_chain(b, caller), caller)

    def _finalized_launches(self, b: Bucket, chain: tuple[list[Stage], bool, bool],
                            caller: CallerInputs) -> list[Stage]:
        """call_launches(b, caller) with its _call_chain given."""
        return _with_ends(chain, Stage("stage", lambda: self.stage(b, caller.tokens, caller.routing)),
                          Stage("finalize", lambda: self._finalize(b, caller.out)))

    def stage(self, bucket: Bucket, activations: Tokens, routing: Routing) -> None:
        """The op's stage launch: the caller's tokens and routing into ``bucket``. NVFP4 tokens are copied, or decoded
        into its x_rows where its GEMM1 gathers them (Bucket.x_rows); MXFP8 tokens are copied; BF16 tokens [T, H] are
        copied as bytes, with an empty scale row."""
        ids, route_weights, routing_format = routing.kernel_operands()
        codes, scales = token_operands(activations)
        if scales is None:
            codes, scales = codes.view(torch.uint8), bucket.x_scales[: codes.shape[0]]
        kernels.stage_inputs(
            codes, scales, ids, route_weights, routing_format,
            bucket.x.view(torch.uint8), bucket.x_scales, bucket.ids, bucket.route_weights, x_rows=bucket.x_rows,
        )

    def _finalize(self, bucket: Bucket, out: torch.Tensor) -> None:
        kernels.finalize(bucket.gemm2.out, bucket.slot_to_row, bucket.route_weights, self.top_k, out)

    def _full_graph(
        self,
        bucket: Bucket,
        signature: Hashable,
        stage: Callable[[Bucket], None],
        finish: Callable[[Bucket], None],
        caller: CallerInputs | None,
    ) -> torch.cuda.CUDAGraph | None:
        """The full-call graph of ``signature``: found, captured now (second consecutive call with it),
        or None (first call: run the usual path)."""
        graph = bucket.full_graphs.get(signature)
        if graph is not None:
            bucket.full_graphs.move_to_end(signature)
            bucket.last_signature = signature
            return graph
        repeated = bucket.last_signature == signature
        bucket.last_signature = signature
        if not repeated:
            return None
        self._ensure_graph(bucket)  # kernels compiled and GEMM plans built outside the capture
        with self._lock:
            graph = torch.cuda.CUDAGraph()
            with gc_paused(), torch.cuda.graph(graph):
                self._launch_call(bucket, stage, finish, caller)
            bucket.full_graphs[signature] = graph
            while len(bucket.full_graphs) > FULL_GRAPHS_PER_BUCKET:
                defer(bucket.full_graphs.popitem(last=False)[1])  # destroyed outside any capture
        return graph

    def _ensure_graph(self, bucket: Bucket) -> torch.cuda.CUDAGraph:
        if bucket.graph is None:
            with self._lock:
                if bucket.graph is None:
                    self._pipeline(bucket)  # compiles kernels and builds GEMM plans outside capture
                    graph = torch.cuda.CUDAGraph()
                    with gc_paused(), torch.cuda.graph(graph):
                        self._pipeline(bucket)
                    bucket.graph = graph
        return bucket.graph

    def _pipeline(self, bucket: Bucket) -> None:
        """Launch the bucket-static part of the layer on the current stream."""
        for _, launch in self.stages(bucket):
            launch()

    def stages(self, b: Bucket, caller: CallerInputs | None = None) -> list[Stage]:
        """The launches of a call on bucket ``b``, in order: the chain the engine declares (bucket-static; given the
        caller's inputs, its first launch may read them and do the op's stage too)."""
        return self._call_chain(b, caller)[0]

    def _call_chain(self, b: Bucket, caller: CallerInputs | None) -> tuple[list[Stage], bool, bool]:
        """stages(b, caller), whether a launch of it stages the caller's inputs, and whether one finalizes into the
        caller's output."""
        layer = _BucketStages(self, b, caller)
        chain = self.engine.stages(layer)
        return chain, any(s is layer.staging for s in chain), any(s is layer.finishing for s in chain)


def _with_ends(chain: tuple[list[Stage], bool, bool], stage: Stage, finish: Stage) -> list[Stage]:
    """A call's launches from its _call_chain (launches, whether one stages, whether one finishes): ``stage`` before
    them unless one stages, ``finish`` after them unless one finishes."""
    launches, staged, finished = chain
    return [*([] if staged else [stage]), *launches, *([] if finished else [finish])]


@dataclass(frozen=True)
class CallerInputs:
    """An op's inputs of one call as the caller passed them: the tokens (of the executor's kind,
    cudnn_moe.pipeline.tokens) and the routing, and the bfloat16 [T, H] output a finalized call writes (None: the
    call returns unfinalized rows)."""

    tokens: Tokens
    routing: Routing
    out: torch.Tensor | None = None

    def token_operands(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """token_operands of the call's tokens."""
        return token_operands(self.tokens)


def _clear_handoff(handoff: TileHandoff) -> None:
    """After GEMM1 of a tile handoff was enqueued and GEMM2 failed to launch: wait for GEMM1 and zero the counters it
    set, so that the next call's GEMM2 waits for its own GEMM1 (nothing ran while a graph captures)."""
    if not torch.cuda.is_current_stream_capturing():
        torch.cuda.current_stream().synchronize()
        handoff.done.zero_()
        handoff.passed.zero_()


class _BucketStages(LayerStages):
    """The stages of one executor's call on one bucket (cudnn_moe.engines.base.LayerStages); with the caller's
    inputs, the decode chain's sort + permute also stages them, and with the caller's output its GEMM2 may also
    finalize (a launch less each)."""

    def __init__(self, executor: MoeExecutor, bucket: Bucket, caller: CallerInputs | None = None) -> None:
        self.x, self.b, self.caller = executor, bucket, caller
        self.gemm1_fusion = bucket.fusion
        self.staging: Stage | None = None  # the stage handed out that also stages the caller's inputs
        self.finishing: Stage | None = None  # the stage handed out that also finalizes into the caller's output
        self.gemm2_early: EarlyRouting | None = None  # behind a routed GEMM1: the routing GEMM2 may read early

    def sort(self) -> Stage:
        x, b = self.x, self.b
        return Stage("sort", lambda: kernels.sort_routing(
            b.ids.view(-1), x.top_k, x.local_expert_start, x.weights.num_experts, x.engine.row_alignment, b.sorted,
        ))

    def permute(self) -> Stage:
        """The bucket's tokens into GEMM1's rows, in the engine's token layout."""
        x, b = self.x, self.b
        slots, g1 = b.tokens * x.top_k, b.gemm1
        if x.tokens is TokenCode.MXFP8:  # MoeExecutor.__init__ keeps their buckets to the sort + permute launch
            raise ValueError("MXFP8 tokens are decoded by the sort + permute launch only")
        if x.tokens is TokenCode.BF16:
            return Stage("permute", lambda: kernels.permute_bf16_tokens(b.x, b.slot_to_row, slots, x.top_k,
                                                                        g1.tokens.data, g1.tokens.layout))
        return Stage("permute", lambda: kernels.permute_tokens(
            b.x, b.x_scales, b.slot_to_row, slots, x.top_k, g1.tokens.layout, g1.tokens.data, g1.tokens.scales,
        ))

    def sort_permute(self) -> Stage | None:
        x, b = self.x, self.b
        slots, g1 = b.tokens * x.top_k, b.gemm1
        if not g1.tokens.layout.is_bf16 or slots > kernels.SORT_PERMUTE_MAX_SLOTS:
            return None
        tokens, token_scales = (None, None) if self.caller is None else self.caller.token_operands()
        if tokens is not None and tokens.data_ptr() % 16 == 0:
            ids, route_weights, routing_format = self.caller.routing.kernel_operands()
            warm = x.engine.l2_warm(g1)
            self.staging = Stage("stage+sort+permute", lambda: kernels.stage_sort_permute_bf16(
                tokens, token_scales, ids, route_weights, routing_format, b.ids, b.route_weights,
                x.local_expert_start, x.weights.num_experts, x.engine.row_alignment, b.sorted, g1.tokens.data,
                g1.tokens.layout, warm,
            ))
            return self.staging
        scales = None if x.tokens is TokenCode.BF16 else b.x_scales
        return Stage("sort+permute", lambda: kernels.sort_permute_bf16(
            b.ids.view(-1), x.top_k, x.local_expert_start, x.weights.num_experts, x.engine.row_alignment, b.sorted,
            b.x, scales, g1.tokens.data, g1.tokens.layout,
        ))

    def gemm1(self) -> Stage:
        return Stage("gemm1", lambda: self.x.engine.gemm(self.b.gemm1))

    def activation(self) -> Stage:
        x, b = self.x, self.b
        g1, g2 = b.gemm1, b.gemm2
        return Stage("activation", lambda: kernels.activate_quantize(
            g1.out, b.row_to_slot, b.offsets, x.activation, g2.tokens.layout, g2.tokens.data, g2.tokens.scales,
            intermediate=x.intermediate,
        ))

    def gemm1_routed(self) -> Stage | None:
        x, b, caller = self.x, self.b, self.caller
        if caller is None or b.tokens != 1 or x.top_k > kernels.SORT_WARP_SLOTS:
            return None
        tokens, token_scales = caller.token_operands()
        if tokens.data_ptr() % 16:
            return None
        ids, route_weights, routing_format = caller.routing.kernel_operands()
        operands = replace(b.gemm1, epilogue=self._activation_epilogue(), route=RoutePrologue(
            tokens, token_scales, ids, route_weights, routing_format, b.ids, b.route_weights, x.local_expert_start,
            x.engine.row_alignment, b.sorted,
        ))
        if not x.engine.can_route(operands):
            return None
        self.staging = Stage("stage+sort+permute+gemm1+activation", lambda: x.engine.gemm(operands))
        self.gemm2_early = EarlyRouting(ids, routing_format, x.local_expert_start)
        return self.staging

    def gemm2(self) -> Stage:
        return self._gemm2(None)

    def gemm2_finalize(self) -> Stage | None:
        return self._gemm2_finalize(None)

    def gemm1_gemm2(self) -> Stage | None:
        x, b = self.x, self.b
        handoff = x.engine.tile_handoff(b.gemm1, b.gemm2)
        if handoff is None:
            return None
        first = self._gemm1_activation(gather=False, handoff=handoff)
        second = self._gemm2_finalize(handoff) or self._gemm2(handoff)

        def launch() -> None:
            first.launch()
            try:
                second.launch()
            except BaseException:
                _clear_handoff(handoff)
                raise

        pair = Stage(f"{first.name}+{second.name}", launch)
        if second is self.finishing:
            self.finishing = pair
        return pair

    # The stages below take a TileHandoff only as the two halves of gemm1_gemm2's one stage: launched alone, a GEMM2
    # that waits for it would never start, and a GEMM1 that signals it would leave its counters set.

    def _gemm2(self, handoff: TileHandoff | None) -> Stage:
        operands = replace(self.b.gemm2, handoff=handoff, early=self.gemm2_early)
        return Stage("gemm2", lambda: self.x.engine.gemm(operands))

    def _gemm2_finalize(self, handoff: TileHandoff | None) -> Stage | None:
        x, b = self.x, self.b
        out = None if self.caller is None else self.caller.out
        if out is None:
            return None
        operands = replace(b.gemm2, finalize=FinalizeEpilogue(b.slot_to_row, b.route_weights.view(-1), x.top_k, out),
                           handoff=handoff, early=self.gemm2_early)
        if not x.engine.can_finalize(operands, out.shape[0]):
            return None
        self.finishing = Stage("gemm2+finalize", lambda: x.engine.gemm(operands))
        return self.finishing

    def _token_rows(self) -> torch.Tensor:
        """The natural BF16 token rows gemm1_activation gathers from: the bucket's BF16 tokens, or the x_rows its
        stage decoded the NVFP4 tokens into."""
        b = self.b
        return b.x if self.x.tokens is TokenCode.BF16 else b.x_rows

    def _activation_epilogue(self) -> ActivationEpilogue:
        x, b = self.x, self.b
        return ActivationEpilogue(x.activation, b.row_to_slot, b.gemm2.tokens, x.intermediate)

    def _early_routing(self) -> EarlyRouting:
        """The routing GEMM1 may read before its dependency wait: the caller's where the launch before it stages the
        call (and writes the bucket's ids), else the bucket's ids, which the op's stage launch wrote."""
        if self.staging is not None:
            ids, _, routing_format = self.caller.routing.kernel_operands()
            return EarlyRouting(ids, routing_format, self.x.local_expert_start)
        return EarlyRouting(self.b.ids, kernels.ROUTING_FP32, self.x.local_expert_start)

    def gemm1_activation(self, gather: bool) -> Stage:
        return self._gemm1_activation(gather, None)

    def _gemm1_activation(self, gather: bool, handoff: TileHandoff | None) -> Stage:
        x, b = self.x, self.b
        operands = replace(
            b.gemm1,
            gather=RowGather(self._token_rows(), b.row_to_slot, x.top_k) if gather else None,
            epilogue=self._activation_epilogue(),
            early=self._early_routing(),
            handoff=handoff,
        )
        return Stage("gemm1+activation", lambda: x.engine.gemm(operands))
