"""What every grouped-GEMM engine declares and does; the executor and the configs see engines only
through this module.

A grouped GEMM multiplies R expert-sorted token rows by their expert's NVFP4 weights:

    out[r, :] = bf16( alpha[e] * sum_k x[r, k] * W_e[:, k] )   for every row r of expert e's segment

with exact decoded operands, FP32 accumulation, the expert's FP32 global ``alpha`` applied to the
FP32 accumulator and one rounding to BF16 (the rounding contract in ``cudnn_moe.reference``).
Segments are given by ``offsets`` int32 [E + 1] (starts, rows used last), each start a multiple of
the engine's row alignment.

An engine declares, for a GPU architecture (``EngineSpec``): the layout it reads tokens in (so the
permute and activation kernels write that layout), the layout of its prepared weights, and the row
alignment of segments. ``supports(arch, shape)`` answers whether it can run a GEMM and why not.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch

from ..arch import Arch, arch_name
from ..kernels.codes import TokenLayout

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
    """Token rows in the engine's token layout: ``data`` (uint8 codes or bfloat16 values) and, for the
    NVFP4 layouts, the E4M3 scale bytes."""

    data: torch.Tensor
    scales: torch.Tensor | None


@dataclass(frozen=True)
class WeightOperand:
    """One GEMM's prepared weights: ``data`` and ``scales`` in the engine's weight layout, ``alpha``
    float32 [E] (the expert globals). With ``alpha_split`` (a multiple of 128 below N), alpha is
    [2E] and output features f >= alpha_split take alpha[E + e] (GEMM1 halves with their own scales)."""

    data: torch.Tensor
    scales: torch.Tensor
    alpha: torch.Tensor
    alpha_split: int | None = None


def alpha_split(weights: WeightOperand, n: int) -> int:
    """The first output feature that takes the second alpha half: ``weights.alpha_split``, or N (none)."""
    return n if weights.alpha_split is None else weights.alpha_split


@dataclass(frozen=True)
class GemmOperands:
    """Everything one grouped GEMM launch reads and writes (buffers of one token bucket).

    rows: the bucket's row capacity R; tokens: R rows of K; offsets int32 [E + 1];
    out bfloat16 [R, N]; workspace: uint8, ``GemmEngine.workspace_bytes`` bytes, or None.
    """

    rows: int
    shape: GemmShape
    tokens: TokenOperand
    weights: WeightOperand
    offsets: torch.Tensor
    out: torch.Tensor
    workspace: torch.Tensor | None


class GemmEngine(abc.ABC):
    """A grouped NVFP4 GEMM backend. Subclasses set ``name`` and ``archs`` and implement the rest.

    The class-level methods answer on any machine (no GPU needed); an instance is bound to a device
    and runs GEMMs on torch's current stream.
    """

    name: ClassVar[str]
    archs: ClassVar[frozenset[Arch]]

    @classmethod
    @abc.abstractmethod
    def spec(cls, arch: Arch) -> EngineSpec:
        """Layouts and alignment on ``arch`` (one of ``archs``)."""

    @classmethod
    def supports(cls, arch: Arch, shape: GemmShape | None = None) -> Support:
        """Whether this engine can run on ``arch`` (and the GEMM ``shape``, when given), and why not."""
        if arch not in cls.archs:
            names = ", ".join(sorted(arch_name(a) for a in cls.archs))
            return Support(False, f"the {cls.name} engine runs on {names}, not {arch_name(arch)}")
        return Support(True)

    @classmethod
    @abc.abstractmethod
    def pack_weights(cls, arch: Arch, codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Canonical NVFP4 weights (codes uint8 [E, N, K/2], linear E4M3 scales [E, N, K/16]) -> the
        engine's weight layout on ``arch`` (done once, at preparation)."""

    @classmethod
    def pack_weights_chunked(
        cls,
        arch: Arch,
        codes: torch.Tensor,
        scales: torch.Tensor,
        rows: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``pack_weights`` a few experts at a time (about PACK_CHUNK_BYTES of codes each), so the packing's
        temporaries stay small next to the weights; ``rows`` (e.g. a reorder of the rows) is applied to each
        chunk's codes and scales first."""
        step = max(1, PACK_CHUNK_BYTES // max(1, codes[0].numel()))
        parts = []
        for e in range(0, codes.shape[0], step):
            c, s = codes[e : e + step], scales[e : e + step]
            if rows is not None:
                c, s = rows(c), rows(s)
            parts.append(cls.pack_weights(arch, c.contiguous(), s.contiguous()))
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

    def token_buffers(self, rows: int, k: int, num_experts: int) -> tuple[tuple[int, ...], torch.dtype, int]:
        """(data shape, data dtype, scale bytes) of a token operand of ``rows`` rows of K values."""
        if self.token_layout is TokenLayout.BF16_FRAGMENTS:
            return (rows, k), torch.bfloat16, 0
        return (rows, k // 2), torch.uint8, rows * (k // 16)

    def workspace_bytes(self, rows: int, shape: GemmShape) -> int:
        """Workspace a GEMM of ``rows`` rows needs (0 by default); an engine that builds plans per shape
        builds them here, before any capture."""
        return 0

    @abc.abstractmethod
    def gemm(self, operands: GemmOperands) -> None:
        """Enqueue the grouped GEMM on the device's current torch stream."""
