"""Prepared weights of the low-latency MoE config: the caller's payloads, bit for bit, plus zero padding.

Every prepared form stores the bytes it was given (copied, never requantized or cast) with the
intermediate size I padded up to a multiple of 128:

- GEMM1 (w1, rows along N1): non-gated rows [0, I) hold the caller's rows and [I, Ip) are zero;
  gated weights keep two halves of Ip rows each, [up rows, zeros, gate rows, zeros], so the kernels
  split the GEMM1 output at Ip.
- GEMM2 (w2, [E, H, I] along K = I): columns (and their block scales) beyond I are zero.

Padding is all-zero bytes in every tensor: a zero code (E2M1 +0, INT4 0, E4M3 +0) or a zero BF16/FP16 value,
so padded rows and columns contribute exactly nothing (every activation maps 0 to 0, and the padded
w2 columns are zero anyway); a zero E8M0 scale byte means 2^-127, harmless under zero codes.

Layout. The tensors are row-major (scales [E, rows, K / block]), which the CUDA-core kernels
(kernels_cuda/low_latency/ll_moe.cu) stream as they are, except where one layout serves every engine of the
arch better: a layer of NVFP4 (weight-only or the pair) or MXINT4 weight-only prepared for SM90 is stored
``tiled``, in the SM90 engine's fragment tiles (cudnn_moe.engines.sm90.layout), which its tensor-core decode
kernels read and the CUDA-core kernels read too (their tile mode, -DLL_TILES=1). That is the layer's only
copy: no engine repacks it. The tiled tensors keep the shapes and dtypes of the row-major ones (the same bytes,
in tile order), and ``canonical()`` unpacks them (a new tensor), so it gives the caller's logical tensors
either way. MXFP4 layers (weight-only, or the pair with MXFP8 tokens) with an exact shifted form
(cudnn_moe.formats.mxfp4_as_nvfp4) are tiled in that form, as the engine's MXFP4 tiles: the codes in tiles, and
beside the caller's E8M0 scales (row-major, kept because the form drops the scale bytes of all-zero blocks, which
``canonical()`` gives back) the form's scales in tile order, one byte per 32 values, and its globals
(``tile_form``): 1/32 of a byte a weight more than the row-major layer, where a repacked copy took 9/16. Layers
without that form stay row-major. The ll_mma engine reads row-major weights only: it runs no tiled MXFP4 pair.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, ClassVar

import torch

from ..engines.base import PACK_CHUNK_BYTES, WeightFormat
from ..engines.sm90.layout import (
    pack_int4_weight_tiles,
    pack_mxfp4_weight_tiles,
    pack_weight_tiles,
    unpack_int4_weight_tiles,
    unpack_mxfp4_weight_tiles,
    unpack_weight_tiles,
)
from ..formats.mxfp4_as_nvfp4 import form_scales, nvfp4_globals

if TYPE_CHECKING:
    from ..low_latency.fallback import LowLatencyFallback

PAD_MULTIPLE = 128
_BIT_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
# The formats whose payloads may be stored as SM90 fragment tiles (``tiled``), and how: NVFP4 tiles (E2M1 codes,
# E4M3 scales per 16), MXFP4 tiles (E2M1 codes, a scale byte per 32: MXFP4 weights, weight-only or the pair, in their
# exact shifted form, Mxfp4WeightOnlyWeights.to_tiles) or MXINT4 tiles (INT4 codes, BF16 scales per 32): each one's
# (pack, unpack) of cudnn_moe.engines.sm90.layout.
_PACKERS = {WeightFormat.NVFP4_WEIGHT_ONLY: (pack_weight_tiles, unpack_weight_tiles),
            WeightFormat.NVFP4_W_NVFP4_A: (pack_weight_tiles, unpack_weight_tiles),
            WeightFormat.MXINT4_WEIGHT_ONLY: (pack_int4_weight_tiles, unpack_int4_weight_tiles),
            WeightFormat.MXFP4_WEIGHT_ONLY: (pack_mxfp4_weight_tiles, unpack_mxfp4_weight_tiles),
            WeightFormat.MXFP4_W_MXFP8_A: (pack_mxfp4_weight_tiles, unpack_mxfp4_weight_tiles)}
TILED_FORMATS = frozenset(_PACKERS)
_MXFP4_TILED = frozenset({WeightFormat.MXFP4_WEIGHT_ONLY, WeightFormat.MXFP4_W_MXFP8_A})  # uint8 scale tiles


def padded_intermediate(intermediate: int) -> int:
    """I rounded up to a multiple of 128."""
    return -(-intermediate // PAD_MULTIPLE) * PAD_MULTIPLE


def _zeros_like_bits(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor of ``t``'s dtype and device whose bytes are all zero (built as integers, then viewed)."""
    return torch.zeros(shape, dtype=_BIT_DTYPES[t.element_size()], device=t.device).view(t.dtype)


def pad_gemm1_rows(t: torch.Tensor, intermediate: int, padded: int, gated: bool) -> torch.Tensor:
    """[E, N1, X] -> [E, N1p, X] (N1 = 2I or I, N1p = 2Ip or Ip); each half's rows first, zeros after."""
    halves = t.chunk(2, dim=1) if gated else (t,)
    out = _zeros_like_bits(t, (t.shape[0], len(halves) * padded, t.shape[2]))
    for index, half in enumerate(halves):
        out[:, index * padded : index * padded + intermediate] = half
    return out


def unpad_gemm1_rows(t: torch.Tensor, intermediate: int, padded: int, gated: bool) -> torch.Tensor:
    """Inverse of pad_gemm1_rows: [E, N1p, X] -> [E, N1, X] (a view when not gated)."""
    if not gated:
        return t[:, :intermediate]
    bits = t.view(_BIT_DTYPES[t.element_size()])  # torch.cat has no CUDA kernel for some 1-byte floats (E8M0)
    return torch.cat((bits[:, :intermediate], bits[:, padded : padded + intermediate]), dim=1).view(t.dtype)


def pad_columns(t: torch.Tensor, columns: int) -> torch.Tensor:
    """[E, H, C] -> [E, H, columns] with zero bytes after the caller's C columns."""
    out = _zeros_like_bits(t, (*t.shape[:-1], columns))
    out[..., : t.shape[-1]] = t
    return out


def _tile_payload(fmt: WeightFormat, codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-major codes uint8 [E, N, K/2] and scales ([E, N, K/16] E4M3; [E, N, K/32] BF16 for MXINT4, the exact
    shifted form's E8M0 for MXFP4) -> the codes' shape and dtype holding the SM90 fragment tiles, and the scales'
    shape holding the scale tiles (their dtype; uint8 for MXFP4, whose tile bytes are no E8M0 values), a few experts
    at a time."""
    pack = _PACKERS[fmt][0]
    step = max(1, PACK_CHUNK_BYTES // max(1, codes[0].numel()))
    parts = [pack(codes[e : e + step].contiguous(), scales[e : e + step].contiguous())
             for e in range(0, codes.shape[0], step)]
    tiles, tile_scales = (torch.cat(p) for p in zip(*parts))
    dtype = torch.uint8 if fmt in _MXFP4_TILED else scales.dtype
    return tiles.view(codes.shape), tile_scales.view(dtype).view(scales.shape)


def _untile_payload(fmt: WeightFormat, tiles: torch.Tensor, tile_scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of _tile_payload (new tensors; MXFP4: the form's E8M0 scales)."""
    experts, n, k = tiles.shape[0], tiles.shape[1], 2 * tiles.shape[2]
    flat, flat_scales = tiles.reshape(experts, -1), tile_scales.view(torch.uint8).reshape(experts, -1)
    return _PACKERS[fmt][1](flat, flat_scales, n, k)


@dataclass(frozen=True, eq=False)
class LowLatencyWeights:
    """What every prepared form records: the format, H, logical I, padded I (multiple of 128), gated.

    tiled: the 4-bit payloads of a TILED_FORMATS layer (the codes, and the block scales but MXFP4's, whose tiles are
    ``tile_form``) hold the SM90 fragment tiles, in the row-major tensors' shapes and dtypes (module docstring);
    False for every other layer.
    """

    format: WeightFormat
    hidden_size: int
    intermediate_size: int
    padded_intermediate: int
    gated: bool
    tiled: bool = field(default=False, kw_only=True)

    def __post_init__(self) -> None:
        if self.tiled and self.format not in TILED_FORMATS:
            raise ValueError(f"{self.format.value} weights are never stored as SM90 tiles")

    @property
    def gemm1_rows(self) -> int:
        """Logical N1: 2I gated, I otherwise."""
        return 2 * self.intermediate_size if self.gated else self.intermediate_size

    @property
    def num_experts(self) -> int:
        raise NotImplementedError

    def canonical(self) -> tuple[torch.Tensor, ...]:
        """The caller's logical tensors, without padding (see each subclass)."""
        raise NotImplementedError


@dataclass(frozen=True, eq=False)
class DenseWeights(LowLatencyWeights):
    """BF16 or FP16 weights (``format`` says which).

    w1: [E, N1p, H] (N1p = 2Ip gated, halves [up; gate], else Ip); w2: [E, H, Ip]; dtype of the format.
    """

    w1: torch.Tensor
    w2: torch.Tensor

    @property
    def num_experts(self) -> int:
        return self.w1.shape[0]

    def canonical(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w1 [E, N1, H], w2 [E, H, I]) as the caller passed them."""
        w1 = unpad_gemm1_rows(self.w1, self.intermediate_size, self.padded_intermediate, self.gated)
        return w1, self.w2[..., : self.intermediate_size]


@dataclass(frozen=True, eq=False)
class BlockScaledWeights(LowLatencyWeights):
    """Codes with linear block scales along K: 4-bit codes two per byte (element 2i in the low nibble), or
    (``codes_per_byte`` 1) E4M3 codes one per byte.

    4-bit: w1_codes uint8 [E, N1p, H/2], w2_codes uint8 [E, H, Ip/2]; E4M3: float8_e4m3fn [E, N1p, H] and
    [E, H, Ip]. w1_scales [E, N1p, H/block], w2_scales [E, H, Ip/block] of the format's scale dtype.
    """

    block: ClassVar[int]
    codes_per_byte: ClassVar[int] = 2
    w1_codes: torch.Tensor
    w1_scales: torch.Tensor
    w2_codes: torch.Tensor
    w2_scales: torch.Tensor

    @property
    def num_experts(self) -> int:
        return self.w1_codes.shape[0]

    def row_payloads(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(w1_codes, w1_scales, w2_codes, w2_scales) row-major and padded as stored: these tensors, or unpacked from
        the tiles (new tensors) when ``tiled``."""
        if not self.tiled:
            return self.w1_codes, self.w1_scales, self.w2_codes, self.w2_scales
        return (*_untile_payload(self.format, self.w1_codes, self.w1_scales),
                *_untile_payload(self.format, self.w2_codes, self.w2_scales))

    def to_tiles(self) -> BlockScaledWeights:
        """These weights stored as SM90 fragment tiles (new payload tensors; self if already tiled). ValueError for a
        format outside TILED_FORMATS."""
        if self.tiled:
            return self
        if self.format not in TILED_FORMATS:
            raise ValueError(f"{self.format.value} weights are never stored as SM90 tiles")
        w1_codes, w1_scales = _tile_payload(self.format, self.w1_codes, self.w1_scales)
        w2_codes, w2_scales = _tile_payload(self.format, self.w2_codes, self.w2_scales)
        return replace(self, w1_codes=w1_codes, w1_scales=w1_scales, w2_codes=w2_codes, w2_scales=w2_scales,
                       tiled=True)

    def _canonical_payloads(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        i, ip, gated = self.intermediate_size, self.padded_intermediate, self.gated
        w1_codes, w1_scales, w2_codes, w2_scales = self.row_payloads()
        return (
            unpad_gemm1_rows(w1_codes, i, ip, gated),
            unpad_gemm1_rows(w1_scales, i, ip, gated),
            w2_codes[..., : i // self.codes_per_byte],
            w2_scales[..., : i // self.block],
        )

    def canonical(self) -> tuple[torch.Tensor, ...]:
        """(w1_codes [E, N1, H/2], w1_scales [E, N1, H/block], w2_codes [E, H, I/2], w2_scales [E, H, I/block]);
        E4M3 codes [E, N1, H] and [E, H, I]. Views of the stored tensors, or new tensors when ``tiled``."""
        return self._canonical_payloads()


@dataclass(frozen=True, eq=False)
class Mxfp4WeightOnlyWeights(BlockScaledWeights):
    """MXFP4 weight-only: E2M1 codes, float8_e8m0fnu scales per 32 K values (value = e2m1 * 2^(byte - 127)).

    nvfp4_shifts: decided at preparation (``prepare_mxfp4_weight_only_weights``, and ``prepare_weights`` for the
        MXFP4 pair): the shifts (w1, w2), int32 [E] each, of the exact shifted form these weights take on the SM90
        kernels (cudnn_moe.formats.mxfp4_as_nvfp4), or why they have none (a str); None where nobody asked (weights
        built by hand).
    tile_form: None, or where ``tiled`` the rest of that form, which both engines run the tiled codes with: (w1 scale
        tiles uint8 [E, N1p, H/32] (cudnn_moe.engines.sm90.layout, MXFP4 tiles), w1 global float32 [E], w2 scale tiles
        [E, H, Ip/32], w2 global [E]). The E8M0 scales stay row-major: ``canonical()`` gives them as the caller passed
        them (the form drops the scale bytes of all-zero blocks).
    """

    block: ClassVar[int] = 32
    nvfp4_shifts: tuple[torch.Tensor, torch.Tensor] | str | None = None
    tile_form: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tiled != (self.tile_form is not None):
            raise ValueError("tiled MXFP4 weights hold their form's scale tiles and globals (tile_form), others none")

    def row_payloads(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(w1_codes, w1_scales, w2_codes, w2_scales) row-major and padded as stored, with the E8M0 scales: the codes
        unpacked from the tiles (new tensors) when ``tiled``."""
        if not self.tiled:
            return self.w1_codes, self.w1_scales, self.w2_codes, self.w2_scales
        w1_tile_scales, _, w2_tile_scales, _ = self.tile_form
        w1_codes, _ = _untile_payload(self.format, self.w1_codes, w1_tile_scales)
        w2_codes, _ = _untile_payload(self.format, self.w2_codes, w2_tile_scales)
        return w1_codes, self.w1_scales, w2_codes, self.w2_scales

    def to_tiles(self) -> Mxfp4WeightOnlyWeights:
        """These weights with their codes stored as SM90 MXFP4 tiles and their exact shifted form's scale tiles and
        globals beside the E8M0 scales (``tile_form``); self if already tiled. ValueError when they have no such form
        (``nvfp4_problem``)."""
        if self.tiled:
            return self
        if self.format not in TILED_FORMATS:
            raise ValueError(f"{self.format.value} weights are never stored as SM90 tiles")
        problem = self.nvfp4_problem
        if problem is not None:
            raise ValueError(f"these MXFP4 weights have no exact shifted form: {problem}")
        shifts1, shifts2 = self.nvfp4_shifts
        w1_tiles, w1_tile_scales = _tile_payload(self.format, self.w1_codes,
                                                 form_scales(self.w1_codes, self.w1_scales, shifts1))
        w2_tiles, w2_tile_scales = _tile_payload(self.format, self.w2_codes,
                                                 form_scales(self.w2_codes, self.w2_scales, shifts2))
        return replace(self, w1_codes=w1_tiles, w2_codes=w2_tiles, tiled=True,
                       tile_form=(w1_tile_scales, nvfp4_globals(shifts1), w2_tile_scales, nvfp4_globals(shifts2)))

    @property
    def nvfp4_problem(self) -> str | None:
        """Why these weights have no exact shifted form, or None."""
        if self.nvfp4_shifts is None:
            return "their shifted form was not decided (weights not made by prepare_mxfp4_weight_only_weights)"
        return self.nvfp4_shifts if isinstance(self.nvfp4_shifts, str) else None


@dataclass(frozen=True, eq=False)
class Mxfp4PairWeights(Mxfp4WeightOnlyWeights):
    """MXFP4 weights for MXFP8 activations (``LowLatencyMoeConfig.prepare_weights``): the tensors of
    Mxfp4WeightOnlyWeights (E2M1 codes, float8_e8m0fnu scales per 32 K values, I padded to 128), with the shifts of
    their exact shifted form decided at preparation (``nvfp4_shifts``). Prepared for SM90 with that form they are
    stored ``tiled`` in it (the module docstring), which the SM90 decode kernels and the CUDA-core kernels read;
    otherwise row-major, which the CUDA-core and ll_mma kernels read, and the SM90 decode kernel's row-major MXFP4
    form too where the form exists (weights prepared for another arch)."""


@dataclass(frozen=True, eq=False)
class Mxfp8PairWeights(BlockScaledWeights):
    """MXFP8 weights for MXFP8 activations (``LowLatencyMoeConfig.prepare_weights``): E4M3 codes one per byte,
    w1_codes float8_e4m3fn [E, N1p, H], w2_codes [E, H, Ip], and float8_e8m0fnu scales per 32 K values,
    w1_scales [E, N1p, H/32], w2_scales [E, H, Ip/32]; weight = e4m3 * 2^(byte - 127)."""

    block: ClassVar[int] = 32
    codes_per_byte: ClassVar[int] = 1


@dataclass(frozen=True, eq=False)
class Mxint4WeightOnlyWeights(BlockScaledWeights):
    """MXINT4 weight-only: two's-complement INT4 codes (-8..7), bfloat16 scales per 32 K values."""

    block: ClassVar[int] = 32


@dataclass(frozen=True, eq=False)
class Nvfp4WeightOnlyWeights(BlockScaledWeights):
    """NVFP4 weight-only: E2M1 codes, float8_e4m3fn scales per 16 K values, float32 global [E] per GEMM.

    Dequantized weight = e2m1 * block scale * global (the global multiplies, like ``w1_alpha`` of
    the NVFP4 config).
    fallback: None, or the shared pipeline's view of these same payloads that runs calls above the
    config's max_num_tokens (``LowLatencyMoeConfig.prepare_fallback``; cudnn_moe.low_latency.fallback).
    """

    block: ClassVar[int] = 16
    w1_global: torch.Tensor
    w2_global: torch.Tensor
    fallback: LowLatencyFallback | None = None

    def nvfp4_payloads(self) -> tuple[torch.Tensor, ...]:
        """(w1_codes, w1_scales, w1_global, w2_codes, w2_scales, w2_global), row-major and padded (``row_payloads``)."""
        w1_codes, w1_scales, w2_codes, w2_scales = self.row_payloads()
        return w1_codes, w1_scales, self.w1_global, w2_codes, w2_scales, self.w2_global

    def canonical(self) -> tuple[torch.Tensor, ...]:
        """(w1_codes, w1_scales, w1_global, w2_codes, w2_scales, w2_global): the prepare method's argument order."""
        w1_codes, w1_scales, w2_codes, w2_scales = self._canonical_payloads()
        return w1_codes, w1_scales, self.w1_global, w2_codes, w2_scales, self.w2_global


@dataclass(frozen=True, eq=False)
class Nvfp4PairWeights(Nvfp4WeightOnlyWeights):
    """NVFP4 weights for NVFP4 activations, quantized from a float source by ``prepare_nvfp4_weights``.

    Same tensors as ``Nvfp4WeightOnlyWeights``; H % 512 == 0 and I % 128 == 0, so there is no padding.
    """


@dataclass(frozen=True, eq=False)
class E4m3Weights(LowLatencyWeights):
    """E4M3 codes (float8_e4m3fn, one byte a value) and one FP32 scale per expert and GEMM, shared by the FP8
    formats: w1_codes [E, N1p, H], w2_codes [E, H, Ip] (layout of DenseWeights); w1_scale, w2_scale float32 [E];
    dequantized weight = e4m3 * scale."""

    w1_codes: torch.Tensor
    w1_scale: torch.Tensor
    w2_codes: torch.Tensor
    w2_scale: torch.Tensor

    @property
    def num_experts(self) -> int:
        return self.w1_codes.shape[0]

    def canonical(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(w1 codes [E, N1, H], w1_scale [E], w2 codes [E, H, I], w2_scale [E]): the prepare method's argument
        order for FP8 weight-only, the quantized weights for per-tensor FP8."""
        w1 = unpad_gemm1_rows(self.w1_codes, self.intermediate_size, self.padded_intermediate, self.gated)
        return w1, self.w1_scale, self.w2_codes[..., : self.intermediate_size], self.w2_scale


@dataclass(frozen=True, eq=False)
class Fp8WeightOnlyWeights(E4m3Weights):
    """FP8 weight-only: the E4M3 codes and per-expert scales of E4m3Weights, nothing else (the kernels multiply
    the FP32 sum by the scale, as the NVFP4 global)."""


@dataclass(frozen=True, eq=False)
class Fp8PerTensorWeights(E4m3Weights):
    """Per-tensor FP8: E4M3 weights and tokens with static calibration scales (``prepare_fp8_per_tensor_weights``).

    The codes and scales of E4m3Weights (each expert's dequantization scale per GEMM, weight = e4m3 * scale).
    input_scale, intermediate_scale: the static calibration scales (float32 values, as Python floats) of FC1's
    tokens and of FC2's input: x = e4m3 * input_scale, intermediate = e4m3 * intermediate_scale.
    Device tensors the kernels read at every call (so the scales stay live), all float32, each rounded once
    from the float32 operands above:
    - fc1_factor [E] = input_scale * w1_scale[e], the factor on GEMM1's FP32 sum of code products;
    - fc2_factor [E] = intermediate_scale * w2_scale[e], the factor on GEMM2's sum;
    - inter_multiplier [1] = 1 / intermediate_scale, the intermediate's quantization multiplier.
    input_multiplier (a Python float) = float32(1 / input_scale), the tokens' multiplier
    (``prepare_fp8_per_tensor_activations``).
    """

    input_scale: float
    intermediate_scale: float
    input_multiplier: float
    fc1_factor: torch.Tensor
    fc2_factor: torch.Tensor
    inter_multiplier: torch.Tensor


@dataclass(frozen=True, eq=False)
class DeepSeekFp8Weights(LowLatencyWeights):
    """DeepSeek FP8: E4M3 weights with FP32 dequantization scales per 128 x 128 block, copied bit for bit.

    w1_codes float8_e4m3fn [E, N1, H] (N1 = 2I rows [up; gate] gated, else I), w1_scales float32
    [E, N1 / 128, H / 128]; w2_codes [E, H, I], w2_scales float32 [E, H / 128, I / 128]. Weight [e, n, k] =
    e4m3 * scales[e, n // 128, k // 128]. H and I are multiples of 128, so nothing is padded (Ip = I) and a
    128-row block never straddles the up and gate halves.
    """

    w1_codes: torch.Tensor
    w1_scales: torch.Tensor
    w2_codes: torch.Tensor
    w2_scales: torch.Tensor

    @property
    def num_experts(self) -> int:
        return self.w1_codes.shape[0]

    def canonical(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(w1 [E, N1, H], w1_scales, w2 [E, H, I], w2_scales): the prepare method's arguments, as stored."""
        return self.w1_codes, self.w1_scales, self.w2_codes, self.w2_scales


@dataclass(frozen=True, eq=False)
class E4m3Tokens:
    """What the prepared E4M3 token records share: codes float8_e4m3fn [T, H]."""

    codes: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.codes.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.codes.shape[1]


@dataclass(frozen=True, eq=False)
class DeepSeekFp8Activations(E4m3Tokens):
    """Prequantized tokens of the DeepSeek FP8 format: codes float8_e4m3fn [T, H] and FP32 scales [T, H / 128]
    (x[t, k] = e4m3 * scales[t, k // 128]), kept as given (``prepare_deepseek_fp8_activations`` checks them)."""

    scales: torch.Tensor


@dataclass(frozen=True, eq=False)
class Fp8PerTensorActivations(E4m3Tokens):
    """Tokens of the per-tensor FP8 format: codes float8_e4m3fn [T, H], x = e4m3 * input_scale (the weights'
    static input scale, kept here so the call can refuse tokens quantized for other weights)."""

    input_scale: float


@dataclass(frozen=True, eq=False)
class Mxfp8Activations(E4m3Tokens):
    """MXFP8 tokens of the MX pairs (``LowLatencyMoeConfig.prepare_mxfp8_activations``): codes float8_e4m3fn
    [T, H] and scales float8_e8m0fnu [T, H / 32], x[t, k] = e4m3 * 2^(scales[t, k // 32] - 127)."""

    scales: torch.Tensor
