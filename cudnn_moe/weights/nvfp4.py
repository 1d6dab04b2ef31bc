"""The NVFP4 records every op's GPU pipeline reads: activation packs, per-expert weights in an engine's layout,
and the one helper that quantizes float weights per expert and packs them for an engine."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..engines.base import BlockCode, EngineSpec
from ..engines.registry import engine_class_of
from ..formats import NVFP4_MAX, quantize_nvfp4
from ..kernels.codes import SORT_MAX_EXPERTS


@dataclass(frozen=True, eq=False)
class Nvfp4Activations:
    """NVFP4 activation pack with global scale one.

    packed: uint8 [M, H/2], element 2i in the low nibble. scales: float8_e4m3fn [M, H/16], linear
    (token-major). Dequantized value = e2m1 * scale.
    """

    packed: torch.Tensor
    scales: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.packed.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.packed.shape[1] * 2


@dataclass(frozen=True, eq=False)
class Nvfp4Weights:
    """Per-expert NVFP4 weights of one MoE layer (E experts held by this rank), in the layout of the
    GEMM engine they were prepared for (``spec``).

    Canonical form (``canonical()``): w1 codes uint8 [E, N1, H/2] with N1 = 2I rows [up; gate] for
    gated activations, else I; w2 codes uint8 [E, H, I/2]; float8_e4m3fn scales per 16 values along
    the reduction dim, linear [E, rows, K/16]. ``w1``/``w1_scales``/``w2``/``w2_scales`` hold them in
    ``spec.weight_layout`` (see ``cudnn_moe.engines.base.WeightLayout``).
    w1_alpha / w2_alpha: float32 [E]; dequantized weight = e2m1 * block scale * alpha. None when the
    op brings the globals with every call (the aligned op's output scales): its stage writes them into
    the token bucket (cudnn_moe.pipeline.executor), so prepared weights are never written.
    w1_alpha_split: None, or (the aligned-plan op's weights) I: w1's alphas are then [2E] and GEMM1
    output features f >= I (the gate half) take alpha[E + e].
    code: BlockCode.NVFP4, or for the SM90 engine's view of MXINT4 low-latency weights BlockCode.MXINT4 (INT4 codes
    and BF16 scales per 32 in the SM90 MXINT4 tiles, alphas 1/256; cudnn_moe.low_latency.grouped), or for the aligned
    op's raw tensors read in place on the SM90 engine BlockCode.NVFP4_ROWS (the canonical layout, each expert's
    matrix flattened: w1 [E, N1 * H/2], scales [E, N1 * H/16] float8_e4m3fn, likewise w2), or for the SM90 engine's
    view of the MXFP4 pair BlockCode.MXFP4_ROWS (its canonical codes and E8M0 scale bytes [E, N1 * H/32] in place, the
    globals of their exact shifted form as alphas; cudnn_moe.low_latency.fallback.mxfp4_rows_view).
    w1_halves_swapped: w1's two halves are stored as [gate; up] (BlockCode.NVFP4_ROWS views of the aligned op's raw
    w1); the kernels read them as [up; gate], and canonical() gives [up; gate].
    The GPU executors built for these weights live in cudnn_moe.pipeline.lifetime's cache and are
    released (outside any CUDA-graph capture) after the weights object is dropped.
    """

    w1: torch.Tensor
    w1_scales: torch.Tensor
    w1_alpha: torch.Tensor | None
    w2: torch.Tensor
    w2_scales: torch.Tensor
    w2_alpha: torch.Tensor | None
    spec: EngineSpec
    gated: bool
    hidden_size: int
    intermediate_size: int
    w1_alpha_split: int | None = None
    code: BlockCode = BlockCode.NVFP4
    w1_halves_swapped: bool = False

    @property
    def num_experts(self) -> int:
        return self.w1.shape[0]

    @property
    def gemm1_rows(self) -> int:
        """N1: rows of w1 per expert (2I gated, I otherwise)."""
        return 2 * self.intermediate_size if self.gated else self.intermediate_size

    @property
    def device(self) -> torch.device:
        return self.w1.device

    def canonical(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(w1 codes [E, N1, H/2], w1 scales [E, N1, H/16], w2 codes [E, H, I/2], w2 scales [E, H, I/16]),
        scales linear float8_e4m3fn (derived from the engine layout; a copy for repacked layouts and swapped halves,
        views of the weights' own tensors otherwise). NVFP4 views only (an MXINT4 view's canonical tensors are its
        low-latency weights')."""
        if self.code is BlockCode.NVFP4_ROWS:
            n1, h, i = self.gemm1_rows, self.hidden_size, self.intermediate_size
            w1 = self.w1.view(-1, n1, h // 2)
            w1_scales = self.w1_scales.view(torch.float8_e4m3fn).view(-1, n1, h // 16)
            if self.w1_halves_swapped:
                w1, w1_scales = swap_row_halves(w1), swap_row_halves(w1_scales)
            return (w1, w1_scales, self.w2.view(-1, h, i // 2),
                    self.w2_scales.view(torch.float8_e4m3fn).view(-1, h, i // 16))
        if self.code is not BlockCode.NVFP4:
            raise ValueError(f"canonical() gives NVFP4 tensors; this is a {self.code.value} view")
        engine = engine_class_of(self.spec)
        w1, w1_scales = engine.unpack_weights(self.spec.arch, self.w1, self.w1_scales, self.gemm1_rows, self.hidden_size)
        w2, w2_scales = engine.unpack_weights(
            self.spec.arch, self.w2, self.w2_scales, self.hidden_size, self.intermediate_size
        )
        return w1, w1_scales, w2, w2_scales


def swap_row_halves(t: torch.Tensor) -> torch.Tensor:
    """[E, N, X]: rows [a; b] -> [b; a] (the aligned op's [gate; up] w1 and the pipeline's [up; gate]), a new tensor."""
    a, b = t.chunk(2, dim=1)
    return torch.cat((b, a), dim=1)


def require_expert_count(name: str, experts: int) -> None:
    """One layer (or rank) holds 1 .. SORT_MAX_EXPERTS experts: the sort kernel groups slots by expert in one
    block's shared memory."""
    if not 1 <= experts <= SORT_MAX_EXPERTS:
        raise ValueError(f"{name} holds {experts} experts; a layer (or a rank's shard) holds 1 to {SORT_MAX_EXPERTS}")


_CHUNK_ELEMENTS = 1 << 26  # experts are quantized in chunks of about this many values to bound temporaries
Pack = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def quantize_experts(name: str, w: torch.Tensor, pack: Pack | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-expert NVFP4 of float weights ``w`` [E, rows, K] (checked finite by the caller), then ``pack``ed.

    Each expert's global scale is amax / 2688 (one for an all-zero expert), so its largest block uses the
    full E4M3 range: codes e2m1(w / global / scale) with block scales e4m3(amax16 / 6 / global) per 16 K
    values. ``pack(codes, scales)`` lays a chunk of experts out for an engine (default: the canonical
    layout, codes uint8 [E, rows, K/2] and linear scales [E, rows, K/16]); experts go a few at a time to
    bound the temporaries. Returns (data, scales, global float32 [E]). An expert whose amax is too small
    for a float32 global (below about 3e-35) raises ValueError naming ``name``.
    """
    amax = w.abs().amax(dim=tuple(range(1, w.dim()))).float()
    global_scale = torch.where(amax > 0, amax / NVFP4_MAX, torch.ones_like(amax))
    inverse = 1.0 / global_scale
    if not bool(torch.isfinite(inverse).all()):  # reads the amax: preparation only
        tiny = int(torch.nonzero(~torch.isfinite(inverse))[0])
        raise ValueError(f"{name}: expert {tiny} has amax {amax[tiny].item():.3g}, too small for an NVFP4 global "
                         "scale in float32; scale the weights up or zero the expert")
    step = max(1, _CHUNK_ELEMENTS // max(1, w[0].numel()))
    parts = []
    for e in range(0, w.shape[0], step):
        codes, scales = quantize_nvfp4(w[e : e + step], inverse[e : e + step], check_finite=False)
        parts.append(pack(codes, scales) if pack is not None else (codes, scales))
    data, packed_scales = zip(*parts)
    return torch.cat(data), torch.cat(packed_scales), global_scale
