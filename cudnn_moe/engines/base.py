"""What every engine declares and does; the executor and the ops see engines only through this module
and the registry (cudnn_moe.engines.registry).

Every engine declares the ``Service``s it offers (an op, weight formats, architectures, a token limit)
and answers a ``Request`` (what one op needs on one GPU) with ``supports``: a ``Support`` that says
yes, or why not. Two kinds of engine exist: a ``GemmEngine`` runs the two grouped GEMMs of a layer
inside the pipeline's executor (which does the glue around them); a ``LayerEngine`` runs a whole
layer by itself (cudnn_moe.engines.cuda_cores).

A grouped GEMM multiplies R expert-sorted token rows by their expert's NVFP4 weights:

    out[r, :] = bf16( alpha[e] * sum_k x[r, k] * W_e[:, k] )   for every row r of expert e's segment

with exact decoded operands, FP32 accumulation, the expert's FP32 global ``alpha`` applied to the
FP32 accumulator and one rounding to BF16 (the rounding contract in ``cudnn_moe.fused.reference``).
Segments are given by ``offsets`` int32 [E + 1] (starts, rows used last), each start a multiple of
the engine's row alignment.

An engine declares, for a GPU architecture (``EngineSpec``): the layout it reads tokens in (so the
permute and activation kernels write that layout), the layout of its prepared weights, and the row
alignment of segments; and the chain of launches a layer call takes on it (``stages``: the five unfused
stages by default; an engine may fuse some, the executor launches whatever it declares).
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import torch

from ..arch import Arch, arch_name
from ..kernels.codes import IntermediateCode, TokenLayout
from ..kernels.l2_warm import L2Warm

PACK_CHUNK_BYTES = 1 << 28  # code bytes per chunk of GemmEngine.pack_weights_chunked


class WeightLayout(enum.Enum):
    """How an engine stores an expert's NVFP4 weight matrix [N, K] (N output rows, K reduction).

    LINEAR: codes uint8 [E, N, K/2] (element 2i in the low nibble) + E4M3 scales [E, N, K/16].
    SWIZZLED_128X4: the same codes; scales [E, Np * Kp], one 128x4 tile plane per expert.
    SM90_TILES: fragment tiles uint8 [E, N*K/2] + tile scales uint8 [E, N*K/16]
    (``cudnn_moe.engines.sm90.layout``).
    """

    LINEAR = "linear"
    SWIZZLED_128X4 = "128x4"
    SM90_TILES = "sm90-tiles"


class BlockCode(enum.Enum):
    """What a weight view's codes and block scales are. NVFP4: E2M1 codes, E4M3 scales per 16 k, the expert
    globals as alpha. MXINT4 (the low-latency op's MXINT4 weight-only layers on the SM90 engine): two's-complement
    INT4 codes, BF16 scales per 32 k applied to FP32 partial sums, no global; GEMM1's preactivation stays FP32, so
    GEMM1 runs with the activation in its epilogue. BF16 (the low-latency op's BF16 layers on the SM90 engine): the
    weights themselves, row-major bfloat16 [E, rows * K] read in place, no block scales, no global (alphas 1/256).
    NVFP4_ROWS (the aligned op's raw weights on the SM90 engine): NVFP4 as NVFP4, but in the canonical row-major
    layout (codes [E, rows * K/2], linear E4M3 scales [E, rows * K/16]) read in place instead of the engine's own.
    MXFP4 (the low-latency op's MXFP4 weight-only layers on the SM90 engine, in their exact shifted form): E2M1 codes,
    one scale byte per 32 k holding 2^(j - a) as a BF16 multiplier (cudnn_moe.engines.sm90.layout, MXFP4 tiles), the
    expert globals 2^a as alpha; the same products as NVFP4 tiles of that form.
    MXFP4_ROWS (the low-latency op's MXFP4 pair on the SM90 engine): MXFP4 in the canonical row-major layout (codes
    [E, rows * K/2], E8M0 scales [E, rows * K/32]) read in place, in the exact shifted form of MXFP4 (the expert globals
    2^a as alpha, each scale byte made into its multiplier 2^(j - a) in the kernel): the products of MXFP4 tiles."""

    NVFP4 = "nvfp4"
    MXINT4 = "mxint4"
    MXFP4 = "mxfp4"
    BF16 = "bf16"
    NVFP4_ROWS = "nvfp4-rows"
    MXFP4_ROWS = "mxfp4-rows"

    @property
    def row_major(self) -> bool:
        """The canonical row-major layout, read in place (the decode kernel's row-major forms)."""
        return self in (BlockCode.NVFP4_ROWS, BlockCode.MXFP4_ROWS)

    @property
    def e8m0(self) -> bool:
        """MXFP4 codes with one scale byte per 32 values (the tiles' form bytes, or E8M0 bytes in place)."""
        return self in (BlockCode.MXFP4, BlockCode.MXFP4_ROWS)


@dataclass(frozen=True)
class EngineSpec:
    """What one engine reads and writes on one architecture."""

    engine: str
    arch: Arch
    token_layout: TokenLayout
    weight_layout: WeightLayout
    row_alignment: int  # every expert segment starts on a multiple of this many rows

    def describe(self) -> str:
        return f"{self.engine} engine on {arch_name(self.arch)}"


OP_FUSED, OP_ALIGNED, OP_LOW_LATENCY = "fused", "aligned", "low_latency"
NVFP4 = "nvfp4"  # the weight format of the fused and aligned ops


class WeightFormat(str, enum.Enum):
    """The weight formats of the low-latency op, and for the pairs (``*_W_*_A``) the activation format too
    (records: cudnn_moe.weights.low_latency); engines declare them by value."""

    BF16 = "bf16"
    FP16 = "fp16"
    NVFP4_WEIGHT_ONLY = "nvfp4_weight_only"
    MXFP4_WEIGHT_ONLY = "mxfp4_weight_only"
    MXINT4_WEIGHT_ONLY = "mxint4_weight_only"
    NVFP4_W_NVFP4_A = "nvfp4_w_nvfp4_a"
    FP8_WEIGHT_ONLY = "fp8_weight_only"
    FP8_PER_TENSOR = "fp8_per_tensor"
    DEEPSEEK_FP8 = "deepseek_fp8"
    MXFP4_W_MXFP8_A = "mxfp4_w_mxfp8_a"
    MXFP8_W_MXFP8_A = "mxfp8_w_mxfp8_a"


# The MX weight + MXFP8 activation formats (MXFP8 tokens and intermediate, the unrouted-slot rule).
MX_PAIRS = (WeightFormat.MXFP4_W_MXFP8_A, WeightFormat.MXFP8_W_MXFP8_A)


@dataclass(frozen=True)
class Service:
    """One thing an engine offers: ``op``'s weights in ``formats`` on ``archs``, up to ``max_tokens`` per call."""

    op: str
    formats: frozenset[str]
    archs: frozenset[Arch]
    max_tokens: int | None = None

    def covers(self, request: Request) -> bool:
        return request.op == self.op and request.weight_format in self.formats and request.arch in self.archs


@dataclass(frozen=True)
class Request:
    """What one op asks of an engine; fields left None are not known yet (e.g. at preparation) and not checked.

    shapes: the layer's two grouped GEMMs. token_dtype: the 16-bit dtype of a low-latency call's tokens
    (None for NVFP4 tokens). tokens: the most tokens a call passes. nvfp4_problem: for MXFP4 weight-only
    weights, why they have no exact shifted form (None where they have one, or where nothing is known). tiled: the
    low-latency weights are stored as SM90 fragment tiles (cudnn_moe.weights.low_latency).
    """

    op: str
    arch: Arch
    weight_format: str = NVFP4
    shapes: tuple[GemmShape, ...] = ()
    num_experts: int | None = None
    token_dtype: torch.dtype | None = None
    out_dtype: torch.dtype | None = None
    finalize: bool | None = None
    tokens: int | None = None
    nvfp4_problem: str | None = None
    tiled: bool | None = None


@dataclass(frozen=True)
class GemmShape:
    """A grouped GEMM's shape: reduction K, output columns N, experts E (rows vary per call)."""

    k: int
    n: int
    num_experts: int


class Support(NamedTuple):
    """The answer to "can this engine run that?": ``ok``, and ``reason`` when not."""

    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok


@dataclass(frozen=True)
class TokenOperand:
    """Token rows in ``layout`` (the one the engine reads for this GEMM and bucket): ``data`` (uint8 codes or
    bfloat16 values) and, for the NVFP4 layouts, the E4M3 scale bytes."""

    data: torch.Tensor
    scales: torch.Tensor | None
    layout: TokenLayout


@dataclass(frozen=True)
class WeightOperand:
    """One GEMM's prepared weights: ``data`` and ``scales`` in the engine's weight layout, ``alpha``
    float32 [E] (the expert globals). With ``alpha_split`` (a multiple of 128 below N), alpha is
    [2E] and output features f >= alpha_split take alpha[E + e] (GEMM1 halves with their own scales).
    code: what the codes and scales are (BlockCode). halves_swapped: the rows are stored as [second half; first
    half] of N / 2 each (the aligned op's raw w1, [gate; up], read in place as [up; gate])."""

    data: torch.Tensor
    scales: torch.Tensor
    alpha: torch.Tensor
    alpha_split: int | None = None
    code: BlockCode = BlockCode.NVFP4
    halves_swapped: bool = False


def alpha_split(weights: WeightOperand, n: int) -> int:
    """The first output feature that takes the second alpha half: ``weights.alpha_split``, or N (none)."""
    return n if weights.alpha_split is None else weights.alpha_split


@dataclass(frozen=True)
class RowGather:
    """The permute folded into a GEMM's token load: row r of the GEMM's tokens is row
    ``row_to_slot[r] // top_k`` of ``source`` (bfloat16 [B, K], natural column order, one row per token),
    zeros where row_to_slot[r] < 0 (padding rows). row_to_slot: int32 [R], the sort's output."""

    source: torch.Tensor
    row_to_slot: torch.Tensor
    top_k: int


@dataclass(frozen=True)
class ActivationEpilogue:
    """The activation stage folded into GEMM1's epilogue: instead of GEMM1's BF16 output, ``out`` (GEMM2's
    token operand) receives what the activation kernel (cudnn_moe.kernels.activate_quantize) would write
    from it, bit for bit: the activation in FP32 of the BF16-rounded GEMM1 values, made into ``intermediate``
    (cudnn_moe.kernels.codes.IntermediateCode: NVFP4-requantized, or rounded to BF16), padding rows
    (row_to_slot < 0) zero."""

    activation: Any  # a cudnn_moe.activations.Activation
    row_to_slot: torch.Tensor
    out: TokenOperand
    intermediate: IntermediateCode = IntermediateCode.NVFP4


@dataclass(frozen=True)
class FinalizeEpilogue:
    """The finalize folded into GEMM2: besides GEMM2's rows, ``out`` (bfloat16 [T, N], the caller's output)
    receives what the finalize kernel (cudnn_moe.kernels.finalize, accumulate=False) would write from them, bit for
    bit: out[t] = bf16(sum over token t's slots s in order with r = slot_to_row[t k + s] >= 0 of
    weights[t k + s] * row r), a separate FP32 multiply and add per slot. slot_to_row int32 and weights float32
    [>= T top_k]; T = out.shape[0]."""

    slot_to_row: torch.Tensor
    weights: torch.Tensor
    top_k: int
    out: torch.Tensor


@dataclass(frozen=True)
class RoutePrologue:
    """The op's stage and the routing sort folded into GEMM1 (a one-token bucket): GEMM1 reads the caller's token and
    routing instead of the permuted rows, sorts the slots itself, and writes what the stage + sort + permute launch
    writes besides those rows, so the rest of the chain reads the same buffers bit for bit: the decoded routing into
    ``ids_out`` int32 / ``w_out`` float32 [1, top_k], the sort's outputs (local experts from ``local_start``, segments
    padded to ``align`` rows) into ``sorted``. tokens: bfloat16 [T, H] (``token_scales`` None), NVFP4 codes uint8
    [T, H/2] with E4M3 ``token_scales`` [T, H/16], or MXFP8 codes float8_e4m3fn [T, H] with E8M0 ``token_scales``
    [T, H/32] (the MXFP4 pair's, on its MXFP4 tiles), T <= 1, 16-byte aligned; ids / weights / routing_format as
    ``Routing.kernel_operands`` gives them."""

    tokens: torch.Tensor
    token_scales: torch.Tensor | None
    ids: torch.Tensor
    weights: torch.Tensor | None
    routing_format: int
    ids_out: torch.Tensor
    w_out: torch.Tensor
    local_start: int
    align: int
    sorted: Any  # a cudnn_moe.kernels.SortBuffers


@dataclass(frozen=True)
class EarlyRouting:
    """The routing a decode GEMM may read before its dependency wait, to find its expert and start streaming its
    weights while the launch before it runs (an engine may ignore it): GEMM1 behind the sort + permute launch, or
    GEMM2 behind a routed GEMM1 (which writes the offsets). ids: expert ids int32 or int64 [T, top_k] (slots of other
    ranks' experts or -1 unrouted), or with ``routing_format`` ROUTING_PACKED the packed int32 routing, as
    ``Routing.kernel_operands`` gives them; local experts from ``local_start``. Its writer must have finished before
    the launch before this GEMM passed its own wait: the caller's routing, or the bucket's ids where the op's stage is
    a launch of its own. ctas: the launch's first CTAs (in linear order) that guess, one wave of them (the engine sets
    it). Only the order of the weight loads depends on it, never a result."""

    ids: torch.Tensor
    routing_format: int
    local_start: int
    ctas: int = 0


@dataclass(frozen=True)
class TileHandoff:
    """GEMM1 (with the activation epilogue) handing each finished token tile to GEMM2, launched right behind it, so
    that GEMM2 computes the tiles GEMM1 has finished while GEMM1's last CTAs still run (an engine's choice,
    GemmEngine.tile_handoff). done / passed: int32 [tiles] counters in the engine's workspace, zero before the pair
    and after it; producers: GEMM1's CTAs per tile. The two launches only ever run together (LayerStages.gemm1_gemm2),
    right after the bucket's sort: GEMM2 reads what the sort wrote without waiting for GEMM1 to complete."""

    done: torch.Tensor
    passed: torch.Tensor
    producers: int


class Gemm1Fusion(NamedTuple):
    """How an engine's chain runs GEMM1 on one bucket: with the activation in its epilogue (GEMM1's BF16 output
    is never written), and gathering its rows through the routing (no permuted token rows). The executor
    allocates only the buffers the chain uses."""

    epilogue: bool = False
    gather: bool = False


@dataclass(frozen=True)
class GemmOperands:
    """Everything one grouped GEMM launch reads and writes (buffers of one token bucket).

    rows: the bucket's row capacity R; tokens: R rows of K; offsets int32 [E + 1];
    out bfloat16 [R, N]; workspace: uint8, ``GemmEngine.workspace_bytes`` bytes, or None. A bucket whose chain
    fuses GEMM1 (GemmEngine.gemm1_fusion) holds no rows in the buffers that chain never touches: GEMM1's
    ``out`` with the epilogue, its ``tokens`` with the gather. gemm: which GEMM of the layer this is, 1 or 2 (an
    engine may pick its kernel by it: ``GemmEngine.gemm`` sees both GEMMs' operands in every form).
    gather / epilogue: the fused forms, for an engine that declares ``LayerStages.gemm1_activation`` in its
    chain: the tokens read through the routing instead of ``tokens``; the activation written instead of ``out``.
    finalize: GEMM2 also finalizing its rows into the caller's output (``LayerStages.gemm2_finalize``).
    route: GEMM1 (with the epilogue) also staging and sorting the caller's call itself (``LayerStages.gemm1_routed``):
    its ``tokens`` and ``offsets`` are then not read (the sort in ``route`` writes the offsets).
    early: the routing GEMM1 (with the epilogue, after a sort launch), or GEMM2 behind a routed GEMM1, may read
    before its dependency wait.
    handoff: GEMM1 (with the epilogue) signals each finished tile, GEMM2 waits for its tile instead of for GEMM1.
    """

    rows: int
    shape: GemmShape
    tokens: TokenOperand
    weights: WeightOperand
    offsets: torch.Tensor
    out: torch.Tensor
    workspace: torch.Tensor | None
    gemm: int
    gather: RowGather | None = None
    epilogue: ActivationEpilogue | None = None
    finalize: FinalizeEpilogue | None = None
    route: RoutePrologue | None = None
    early: EarlyRouting | None = None
    handoff: TileHandoff | None = None


class Engine(abc.ABC):
    """What every engine declares: ``name`` and ``services``; class-level answers need no GPU."""

    name: ClassVar[str]
    services: ClassVar[tuple[Service, ...]]

    @classmethod
    def supports(cls, request: Request) -> Support:
        """Whether this engine can run ``request``, and why not: a declared service must cover it, then ``check``."""
        service = next((s for s in cls.services if s.covers(request)), None)
        if service is None:
            return Support(False, cls._uncovered(request))
        if service.max_tokens is not None and request.tokens is not None and request.tokens > service.max_tokens:
            return Support(False, f"the {cls.name} engine takes at most {service.max_tokens} tokens per {request.op} "
                                  f"call, not {request.tokens}")
        return cls.check(request)

    @classmethod
    def check(cls, request: Request) -> Support:
        """The engine's own conditions on a covered request (shapes, dtypes, ...); yes by default."""
        return Support(True)

    @classmethod
    def archs(cls, op: str, weight_format: str = NVFP4) -> frozenset[Arch]:
        """The architectures some service of this engine runs ``op``'s ``weight_format`` weights on."""
        return frozenset().union(*(s.archs for s in cls.services if s.op == op and weight_format in s.formats))

    @classmethod
    def environment_problem(cls) -> str | None:
        """Why this machine's software cannot run the engine (a missing or old library), or None."""
        return None

    @classmethod
    def _uncovered(cls, request: Request) -> str:
        archs = cls.archs(request.op, request.weight_format)
        if archs:
            names = ", ".join(sorted(arch_name(a) for a in archs))
            return f"the {cls.name} engine runs on {names}, not {arch_name(request.arch)} (the {request.op} op)"
        if any(s.op == request.op for s in cls.services):
            return f"the {cls.name} engine does not run {request.weight_format} weights for {request.op}"
        return f"the {cls.name} engine does not serve the {request.op} op"


class GemmEngine(Engine):
    """A grouped NVFP4 GEMM backend run inside the pipeline's executor. Subclasses set ``name`` and
    ``services`` and implement the rest.

    The class-level methods answer on any machine (no GPU needed); an instance is bound to a device
    and runs GEMMs on torch's current stream.
    """

    @classmethod
    @abc.abstractmethod
    def spec(cls, arch: Arch) -> EngineSpec:
        """Layouts and alignment on ``arch`` (one this engine serves)."""

    @classmethod
    @abc.abstractmethod
    def pack_weights(cls, arch: Arch, codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Canonical NVFP4 weights (codes uint8 [E, N, K/2], linear E4M3 scales [E, N, K/16]) -> the
        engine's weight layout on ``arch`` (done once, at preparation)."""

    @classmethod
    def pack_mxint4_weights(
        cls, arch: Arch, codes: torch.Tensor, scales: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """MXINT4 weights (two's-complement codes uint8 [E, N, K/2], linear BF16 scales [E, N, K/32]) -> the engine's
        MXINT4 layout on ``arch`` (BlockCode.MXINT4), for engines serving MXINT4 weight-only layers."""
        raise NotImplementedError(f"the {cls.name} engine runs no MXINT4 weights")

    @classmethod
    def pack_weights_chunked(
        cls,
        arch: Arch,
        codes: torch.Tensor,
        scales: torch.Tensor,
        rows: Callable[[torch.Tensor], torch.Tensor] | None = None,
        code: BlockCode = BlockCode.NVFP4,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``pack_weights`` (``pack_mxint4_weights`` for BlockCode.MXINT4) a few experts at a time (about
        PACK_CHUNK_BYTES of codes each), so the packing's temporaries stay small next to the weights; ``rows`` (e.g. a
        reorder of the rows) is applied to each chunk's codes and scales first."""
        pack = cls.pack_mxint4_weights if code is BlockCode.MXINT4 else cls.pack_weights
        step = max(1, PACK_CHUNK_BYTES // max(1, codes[0].numel()))
        parts = []
        for e in range(0, codes.shape[0], step):
            c, s = codes[e : e + step], scales[e : e + step]
            if rows is not None:
                c, s = rows(c), rows(s)
            parts.append(pack(arch, c.contiguous(), s.contiguous()))
        data, packed_scales = zip(*parts)
        return torch.cat(data), torch.cat(packed_scales)

    @classmethod
    @abc.abstractmethod
    def unpack_weights(
        cls, arch: Arch, data: torch.Tensor, scales: torch.Tensor, n: int, k: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Inverse of ``pack_weights``: -> (codes uint8 [E, N, K/2], scales float8_e4m3fn [E, N, K/16])."""

    def __init__(self, device: torch.device, arch: Arch) -> None:
        self.device = device
        self.layout = self.spec(arch)

    @property
    def row_alignment(self) -> int:
        return self.layout.row_alignment

    @property
    def token_layout(self) -> TokenLayout:
        return self.layout.token_layout

    def token_layout_for(self, rows: int, shape: GemmShape, *, gemm: int,
                         code: BlockCode = BlockCode.NVFP4) -> TokenLayout:
        """The token layout GEMM ``gemm`` (1: the permute writes its tokens; 2: the activation does) of ``shape`` on
        a bucket of ``rows`` rows with ``code`` weights reads: the engine's own by default; an engine whose kernels
        differ by size, by GEMM or by weights says so."""
        return self.token_layout

    def token_buffers(self, rows: int, k: int, num_experts: int) -> tuple[tuple[int, ...], torch.dtype, int]:
        """(data shape, data dtype, scale bytes) of a token operand of ``rows`` rows of K values."""
        if self.token_layout.is_bf16:
            return (rows, k), torch.bfloat16, 0
        return (rows, k // 2), torch.uint8, rows * (k // 16)

    def gemm1_fusion(self, rows: int, shape: GemmShape, activation: Any) -> Gemm1Fusion:
        """How this engine's chain (``stages``) runs GEMM1 of ``shape`` on a bucket of ``rows`` rows with
        ``activation``: unfused by default."""
        return Gemm1Fusion()

    def workspace_bytes(self, rows: int, shape: GemmShape) -> int:
        """Workspace a GEMM of ``rows`` rows needs (0 by default); an engine that builds plans per shape
        builds them here, before any capture."""
        return 0

    def can_finalize(self, operands: GemmOperands, tokens: int) -> bool:
        """Whether ``gemm`` runs GEMM2 of these operands with a FinalizeEpilogue of ``tokens`` tokens (never, by
        default)."""
        return False

    def can_route(self, operands: GemmOperands) -> bool:
        """Whether ``gemm`` runs GEMM1 of these operands (with its activation epilogue) with a RoutePrologue (never, by
        default)."""
        return False

    def l2_warm(self, gemm1: GemmOperands) -> L2Warm | None:
        """What the decode chain's staged sort + permute, which runs right before ``gemm1`` with DRAM idle, may warm
        L2 with: the first bytes of GEMM1's weight stream, where this engine knows them (None by default)."""
        return None

    def tile_handoff(self, gemm1: GemmOperands, gemm2: GemmOperands) -> TileHandoff | None:
        """The TileHandoff of a bucket's GEMM1 (with the activation epilogue) and GEMM2 where ``gemm`` runs them with
        one (in the bucket's workspace), else None (by default)."""
        return None

    @abc.abstractmethod
    def gemm(self, operands: GemmOperands) -> None:
        """Enqueue the grouped GEMM on the device's current torch stream."""

    def stages(self, layer: LayerStages) -> list[Stage]:
        """The bucket-static launches of one layer call, in order: the five unfused stages by default. An
        engine that fuses stages (GEMM1 with the activation, GEMM2 with the combine, the whole layer)
        returns its own launches in their place; the executor launches whatever this returns."""
        return [layer.sort(), layer.permute(), layer.gemm1(), layer.activation(), layer.gemm2()]


class Stage(NamedTuple):
    """One launch (or a few) of a layer call: a name for benchmarks and tests, and the launch."""

    name: str
    launch: Callable[[], None]


class LayerStages(abc.ABC):
    """The default stages of one layer call on one token bucket, as the executor builds them, and the fused
    ones an engine may declare instead (``gemm1_activation`` in place of GEMM1 and the activation, and of the
    permute too when it gathers)."""

    gemm1_fusion: Gemm1Fusion  # how the bucket's GEMM1 runs (GemmEngine.gemm1_fusion, asked once per bucket)

    @abc.abstractmethod
    def sort(self) -> Stage: ...

    @abc.abstractmethod
    def permute(self) -> Stage: ...

    @abc.abstractmethod
    def sort_permute(self) -> Stage | None:
        """sort() and permute() in one launch where this bucket allows it (BF16 token fragments and at most
        cudnn_moe.kernels.SORT_PERMUTE_MAX_SLOTS slots), else None."""

    @abc.abstractmethod
    def gemm1(self) -> Stage: ...

    @abc.abstractmethod
    def activation(self) -> Stage: ...

    @abc.abstractmethod
    def gemm1_activation(self, gather: bool) -> Stage:
        """GEMM1 with the activation stage in its epilogue (GEMM2's tokens written directly: GemmOperands.epilogue);
        with ``gather``, reading its rows through the routing from the token rows (the NVFP4 tokens the op's stage
        decoded into BF16 rows, or the BF16 tokens themselves: the permute folded into its token load,
        GemmOperands.gather), else from the permuted rows. Same GEMM2 tokens, bit for bit, as the unfused stages."""

    @abc.abstractmethod
    def gemm1_routed(self) -> Stage | None:
        """gemm1_activation(gather=False) also staging the caller's inputs and sorting the routing (GemmOperands.route:
        the stage + sort + permute launch folded into GEMM1): for a one-token bucket whose launches know the caller's
        inputs, where the engine can (GemmEngine.can_route), else None."""

    @abc.abstractmethod
    def gemm1_gemm2(self) -> Stage | None:
        """gemm1_activation(gather=False), then GEMM2 (finalizing where gemm2_finalize would) in one stage, the two
        sharing a TileHandoff where the engine gives one (GemmEngine.tile_handoff), else None. For chains whose
        sort runs in a launch before GEMM1."""

    @abc.abstractmethod
    def gemm2(self) -> Stage: ...

    @abc.abstractmethod
    def gemm2_finalize(self) -> Stage | None:
        """GEMM2 with the finalize in its epilogue (GemmOperands.finalize), writing the caller's output: where the
        call's launches know that output and the engine can (GemmEngine.can_finalize), else None. The executor then
        launches no finalize of its own."""


@dataclass(frozen=True)
class LowLatencyCall:
    """One checked call of the low-latency op (cudnn_moe.low_latency.checks), as an engine runs it.

    x: BF16/FP16 tokens [T, H], or NVFP4 codes uint8 [T, H/2] with E4M3 ``x_scales`` [T, H/16] (the NVFP4
    pair), or E4M3 codes [T, H] (per-tensor FP8; with FP32 ``x_scales`` [T, H/128] DeepSeek FP8, with E8M0
    ``x_scales`` [T, H/32] the MX pairs). ``out`` receives ``out_dtype`` [T, H] (finalize) or the raw rows [T, top_k, H].
    max_tokens: the config's limit (workspaces are sized by it).
    """

    weights: Any  # a cudnn_moe.weights.low_latency.LowLatencyWeights
    x: torch.Tensor
    x_scales: torch.Tensor | None
    routing: Any  # a cudnn_moe.routing.Routing
    activation: Any  # a cudnn_moe.activations.Activation
    out_dtype: torch.dtype
    finalize: bool
    out: torch.Tensor
    max_tokens: int
    scores: torch.Tensor | None = None  # raw calls asked for scores: float32 [T, top_k], every slot's route weight

    @property
    def tokens(self) -> int:
        return self.x.shape[0]

    @property
    def top_k(self) -> int:
        return self.routing.top_k

    @property
    def x_dtype(self) -> torch.dtype | None:
        """The 16-bit token dtype (E4M3 for per-tensor FP8), or None for tokens with scales (NVFP4, DeepSeek FP8
        codes, MXFP8)."""
        return None if self.x_scales is not None else self.x.dtype


WorkspaceSpec = dict[str, tuple[tuple[int, ...], torch.dtype]]


class LayerEngine(Engine):
    """An engine that runs a whole layer in its own launches (no executor, buckets or glue kernels). It
    declares the scratch a call needs (``workspace_spec``); the pipeline allocates it once per weights and
    key (cudnn_moe.pipeline.workspaces) and passes it to ``run``."""

    @classmethod
    @abc.abstractmethod
    def workspace_spec(cls, call: LowLatencyCall) -> tuple[Hashable, WorkspaceSpec]:
        """(key, {name: (shape, dtype)}): the zero-filled buffers calls of this key share."""

    @classmethod
    @abc.abstractmethod
    def run(cls, call: LowLatencyCall, workspace: Mapping[str, torch.Tensor]) -> None:
        """Enqueue the layer on torch's current stream (nothing allocated, nothing synchronized)."""
