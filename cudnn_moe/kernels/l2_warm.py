"""L2 warming by the decode chain's staged sort + permute launch (kernels_cuda/l2_warm.cuh): while that launch sorts
with DRAM idle, extra blocks of it ask L2 for the first bytes of GEMM1's weight stream, the part GEMM1's first wave of
CTAs loads first. Only where GEMM1's loads are served from changes, never a result."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .codes import SORT_MAX_EXPERTS

CODE_CHUNK = 512  # bytes of codes warmed at a time per row block (one weight tile of the SM90 layout)
LINE = 128  # bytes of one L2 prefetch


@dataclass(frozen=True)
class L2Warm:
    """What to warm: weights stored as ``row_blocks`` row blocks per expert, expert after expert, each row block's
    stream ``code_row`` bytes of ``codes`` (uint8) and ``scale_row`` bytes of ``scales`` (uint8) long; the first
    ``code_bytes`` (a multiple of CODE_CHUNK, at most code_row) and ``scale_bytes`` (a multiple of LINE, at most
    scale_row) of every row block of the first ``experts`` used local experts (ascending ids, the order of the GEMM's
    tiles), by ``blocks`` extra blocks of the launch."""

    codes: torch.Tensor
    scales: torch.Tensor
    row_blocks: int
    code_row: int
    scale_row: int
    code_bytes: int
    scale_bytes: int
    experts: int
    blocks: int

    def __post_init__(self) -> None:
        if not (self.code_row % CODE_CHUNK == 0 and self.scale_row % LINE == 0 and 0 < self.row_blocks
                and 0 <= self.code_bytes <= self.code_row and self.code_bytes % CODE_CHUNK == 0
                and 0 <= self.scale_bytes <= self.scale_row and self.scale_bytes % LINE == 0
                and 0 < self.experts <= SORT_MAX_EXPERTS and 0 < self.blocks):
            raise ValueError(f"L2Warm: inconsistent geometry {self}")
        for name, t, row in (("codes", self.codes, self.code_row), ("scales", self.scales, self.scale_row)):
            if t.dtype != torch.uint8 or not t.is_contiguous() or t.numel() % (self.row_blocks * row):
                raise ValueError(f"L2Warm.{name} must be contiguous uint8 of whole experts ({self.row_blocks} row "
                                 f"blocks of {row} bytes), got {t.dtype} {tuple(t.shape)}")
