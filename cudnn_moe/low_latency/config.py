"""The low-latency MoE config (1-8 tokens per call): where each weight format runs, and weight preparation.

Preparation keeps the caller's payloads bit-exact (copies, never requantized or cast) wherever the
format is given already quantized, and pads I to a multiple of 128 with zero bytes (see
``cudnn_moe.weights.low_latency``). Only ``prepare_nvfp4_weights`` and ``prepare_fp8_per_tensor_weights``
quantize, from a float source; ``prepare_deepseek_fp8_weights`` keeps its E4M3 payloads and FP32 block scales,
``prepare_weights`` its MXFP4 or MXFP8 payloads and E8M0 scales (for MXFP8 tokens, ``prepare_mxfp8_activations``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace

import torch

from ..activations import Activation, SwiGLU, parse_activation, require_gemm1_rows
from ..arch import SM90, Arch, arch_name, parse_arch, target_arch
from ..engines.base import OP_LOW_LATENCY, Request
from ..engines.registry import AUTO, engine_class, engine_names, served_archs
from ..formats import quantize_mxfp8, quantize_nvfp4
from ..formats.blocks import to_e4m3
from ..formats.fp8 import scale_from_amax
from ..formats.mxfp4_as_nvfp4 import nvfp4_shifts
from ..formats.nvfp4 import require_unsigned_scales
from ..fused.config import Nvfp4MoeConfig
from ..validate import (
    require_finite,
    require_float32_scalar,
    require_multiple,
    require_positive_finite,
    require_same_device,
    require_tensor,
)
from ..weights.low_latency import (
    TILED_FORMATS,
    BlockScaledWeights,
    DeepSeekFp8Activations,
    DeepSeekFp8Weights,
    DenseWeights,
    Fp8PerTensorActivations,
    Fp8PerTensorWeights,
    Fp8WeightOnlyWeights,
    LowLatencyWeights,
    Mxfp4PairWeights,
    Mxfp4WeightOnlyWeights,
    Mxfp8Activations,
    Mxfp8PairWeights,
    Mxint4WeightOnlyWeights,
    Nvfp4PairWeights,
    Nvfp4WeightOnlyWeights,
    WeightFormat,
    pad_columns,
    pad_gemm1_rows,
    padded_intermediate,
)
from ..weights.nvfp4 import Nvfp4Activations, Nvfp4Weights, quantize_experts
from .fallback import prepare_fallback
from .tactics import TuningResult

MAX_NUM_TOKENS = 8
MAX_TOP_K = 32
WEIGHT_ONLY_HIDDEN_MULTIPLE = 128
WEIGHT_ONLY_INTERMEDIATE_MULTIPLE = 32
PAIR_HIDDEN_MULTIPLE = 512
PAIR_INTERMEDIATE_MULTIPLE = 128
DEEPSEEK_BLOCK = 128  # DeepSeek FP8: weight scales per 128 x 128 block, token and intermediate scales per 128

_FLOAT_SOURCE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check_weight_pair(
    names: tuple[str, str], w1: object, w2: object, dtypes: torch.dtype | tuple[torch.dtype, ...], act: Activation,
    multiples: tuple[int, int], per_element: int = 1,
) -> tuple[int, int, int]:
    """Check a layer's two weights w1 [E, N1, H / v] and w2 [E, H, I / v], v = ``per_element`` values along K per
    element (2 for packed 4-bit codes), under the caller's ``names``: both 3-D of ``dtypes`` on one device with the
    same E >= 1, H and I positive multiples of ``multiples``, w1's K matching H, N1 the rows ``act`` needs for I.
    Returns (E, H, I)."""
    name1, name2 = names
    w1 = require_tensor(name1, w1, dtypes, rank=3)
    w2 = require_tensor(name2, w2, dtypes, rank=3)
    require_same_device(**{name1: w1, name2: w2})
    if w2.shape[0] != w1.shape[0]:
        raise ValueError(f"{name1} has {w1.shape[0]} experts but {name2} has {w2.shape[0]}")
    if w1.shape[0] < 1:
        raise ValueError(f"{name1} must hold at least one expert, got shape {tuple(w1.shape)}")
    experts, hidden, intermediate = w1.shape[0], w2.shape[1], per_element * w2.shape[2]
    packed = f"{per_element} * " if per_element > 1 else ""
    require_multiple(f"hidden size ({name2}.shape[1])", hidden, multiples[0])
    require_multiple(f"intermediate size ({packed}{name2}.shape[2])", intermediate, multiples[1])
    if per_element * w1.shape[2] != hidden:
        k = f"H/{per_element}" if per_element > 1 else "H"
        raise ValueError(f"{name1} must be [E, N1, {k}] with H = {hidden} (from {name2} [E, H, I]), "
                         f"got {tuple(w1.shape)}")
    require_gemm1_rows(name1, w1.shape[1], act, intermediate)
    return experts, hidden, intermediate


def _check_scales(name: str, scales: object, dtype: torch.dtype | tuple[torch.dtype, ...], shape: tuple[int, ...],
                  device: torch.device) -> torch.Tensor:
    scales = require_tensor(name, scales, dtype, rank=3)
    if tuple(scales.shape) != shape:
        raise ValueError(f"{name} must have shape {shape} to match the codes, got {tuple(scales.shape)}")
    if scales.device != device:
        raise ValueError(f"{name} is on {scales.device} but the codes are on {device}")
    return scales


def _require_no_e4m3_nan(name: str, codes: torch.Tensor) -> None:
    """E4M3 codes 0x7F / 0xFF are NaN: refused (reads the payload; preparation only)."""
    if bool(((codes.view(torch.uint8) & 0x7F) == 0x7F).any()):
        raise ValueError(f"{name} holds E4M3 NaN codes (0x7F / 0xFF); weights must be finite")


def _require_no_e8m0_nan(name: str, scales: torch.Tensor) -> None:
    """E8M0 scale byte 255 is NaN: refused (reads the scales; preparation only)."""
    if bool((scales.view(torch.uint8) == 255).any()):
        raise ValueError(f"{name} holds E8M0 NaN scale bytes (255); scales must be finite")


def _quantize_fp8_experts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [E, R, K] float -> (float8_e4m3fn [E, R, K], float32 [E]): per expert scale = fp32(amax / 448) (1.0 for
    an all-zero expert) and codes e4m3(fp32(w / scale)), as quantize_fp8_per_tensor does for one expert."""
    w = w.float()
    amax = w.abs().amax(dim=(1, 2))
    scale = scale_from_amax(amax)
    return to_e4m3(w / scale[:, None, None]), scale


def _check_global(name: str, value: object, experts: int, device: torch.device) -> torch.Tensor:
    value = require_tensor(name, value, torch.float32, rank=1)
    if value.shape[0] != experts:
        raise ValueError(f"{name} must have shape ({experts},), one global per expert, got {tuple(value.shape)}")
    if value.device != device:
        raise ValueError(f"{name} is on {value.device} but the codes are on {device}")
    require_positive_finite(name, value)
    return value


class LowLatencyMoeConfig:
    """Routed MoE for decode: 1..8 tokens per call, FMA/tensor-core kernels streaming the weights.

    max_num_tokens: the most tokens one call may pass, 1..8 (default 2).
    arch: the GPU the weights are prepared for ('sm90', (10, 0), ...); by default the current CUDA
    device, or SM90 when there is none. An arch this config does not run on is refused.
    engine: 'auto' (the engine ``tune`` measured fastest for a call's layer and token count, else the
    registry's first engine that runs it: on SM90 the tensor cores for the finalized BF16 calls of the NVFP4
    formats, of MXINT4 weight-only layers and of MXFP4 weight-only layers with an exact shifted form, the CUDA
    cores otherwise) or the name of a low-latency engine of the registry ('sm90',
    'cuda_cores', 'll_mma': the FP8 formats on tensor cores, ...).
    """

    def __init__(
        self, max_num_tokens: int = 2, arch: str | int | tuple[int, int] | None = None, engine: str = "auto"
    ) -> None:
        if isinstance(max_num_tokens, bool) or not isinstance(max_num_tokens, int):
            raise ValueError(f"max_num_tokens must be an int in 1..{MAX_NUM_TOKENS}, got {max_num_tokens!r}")
        if not 1 <= max_num_tokens <= MAX_NUM_TOKENS:
            raise ValueError(
                f"max_num_tokens must be in 1..{MAX_NUM_TOKENS} (the low-latency config serves decode steps; "
                f"use Nvfp4MoeConfig for larger batches), got {max_num_tokens}"
            )
        if engine not in engine_names(OP_LOW_LATENCY):
            raise ValueError(f"engine must be one of {', '.join(engine_names(OP_LOW_LATENCY))}, got {engine!r}")
        self.engine = engine
        self.max_num_tokens = max_num_tokens
        self.arch: Arch | None = None if arch is None else parse_arch(arch)
        if self.arch is not None and not self.supported(self.arch):
            raise ValueError(f"arch {arch!r} ({arch_name(self.arch)}) is not supported; the low-latency config runs on "
                             + ", ".join(sorted(arch_name(a) for a in _served_archs())))

    @staticmethod
    def supported_formats(arch: str | int | tuple[int, int]) -> tuple[WeightFormat, ...]:
        """The formats some engine runs on ``arch`` (cudnn_moe.engines.registry): SM80 BF16/FP16; SM90, SM100,
        SM103, SM107, SM120 all; else ()."""
        parsed = parse_arch(arch)
        return tuple(fmt for fmt in WeightFormat if parsed in served_archs(OP_LOW_LATENCY, fmt.value))

    @staticmethod
    def supported(arch: str | int | tuple[int, int]) -> bool:
        """True where some engine runs a low-latency format: SM80, SM90, SM100, SM103, SM107 and SM120."""
        return parse_arch(arch) in _served_archs()

    @staticmethod
    def require_format(arch: str | int | tuple[int, int], fmt: WeightFormat) -> None:
        """Raise ValueError naming both when ``fmt`` does not run on ``arch``."""
        parsed = parse_arch(arch)
        if fmt not in LowLatencyMoeConfig.supported_formats(parsed):
            runs = ", ".join(f.value for f in LowLatencyMoeConfig.supported_formats(parsed)) or "nothing"
            raise ValueError(f"weight format {fmt.value} does not run on arch {arch_name(parsed)} (it runs {runs})")

    def target_arch(self) -> Arch:
        """``arch``, else the current GPU's, else SM90."""
        return target_arch(self.arch)

    # ------------------------------------------------------------------ tactics
    def tune(
        self,
        weights: LowLatencyWeights,
        *,
        top_k: int,
        activation: Activation | str = SwiGLU(),
        out_dtype: torch.dtype = torch.bfloat16,
        finalize: bool = True,
        tokens: int | Iterable[int] | None = None,
        x_dtype: torch.dtype | None = None,
        iters: int = 20,
        progress: Callable[[str], None] | None = None,
    ) -> dict[int, TuningResult]:
        """Measure, on the weights' GPU, which engine runs these weights' calls fastest at each token count, and
        keep the choice (cudnn_moe.low_latency.tactics: the persistent cache and this process): later calls with
        engine="auto" of that layer, token count, ``top_k``, token and output dtypes and ``finalize`` run on it,
        whatever their activation of the same gatedness (a dict lookup per call; calls naming an engine keep
        theirs). Every engine supporting the call is timed
        (cudnn_moe.low_latency.tuning: its own CUDA graph, a few warm-up replays, the median of ``iters``
        L2-flushed replays, random tokens and routing); all compute the same numbers (the same rounding points).
        Run it once at warm-up, outside any CUDA-graph capture (it synchronizes the device).

        weights: from this config's prepare methods, on a CUDA device. top_k: slots per token, 1..min(32, E).
        activation, out_dtype, finalize: as the calls will pass them (gatedness and dtypes as the call checks).
        tokens: the token counts to measure, 1..max_num_tokens (default: all of them). x_dtype: the dtype of the
        token values the calls pass (hidden_states, or the codes of prepared activations): BF16 or FP16 where
        both are taken, torch.float8_e4m3fn for prequantized DeepSeek FP8 tokens; default: the format's usual
        one (BF16; FP16 for FP16 weights; the codes' dtype for the NVFP4 pair and per-tensor FP8). iters:
        timed replays per engine. progress: called with one line per token count (e.g. ``print``).

        Returns {T: TuningResult(engine, times_us)}: the chosen engine's name and each candidate's median time
        in microseconds. Bad arguments raise before anything runs, naming the argument (TypeError for a wrong
        type, ValueError for a wrong value)."""
        from .tuning import tune  # the tuner runs the op, which imports this module

        return tune(self, weights, top_k=top_k, activation=activation, out_dtype=out_dtype, finalize=finalize,
                    tokens=tokens, x_dtype=x_dtype, iters=iters, progress=progress)

    # ------------------------------------------------------------------ 16-bit
    def _prepare_dense(
        self, fmt: WeightFormat, dtype: torch.dtype, w1: object, w2: object, activation: Activation | str
    ) -> DenseWeights:
        self.require_format(self.target_arch(), fmt)
        act = parse_activation(activation)
        _, hidden, intermediate = _check_weight_pair(("w1", "w2"), w1, w2, dtype, act, (1, 1))
        require_finite("w1", w1)  # reads the weights (a device sync on CUDA): preparation, not the serving path
        require_finite("w2", w2)
        ip = padded_intermediate(intermediate)
        return DenseWeights(
            format=fmt, hidden_size=hidden, intermediate_size=intermediate, padded_intermediate=ip, gated=act.gated,
            w1=pad_gemm1_rows(w1, intermediate, ip, act.gated), w2=pad_columns(w2, ip),
        )

    def prepare_bf16_weights(
        self, w1: torch.Tensor, w2: torch.Tensor, *, activation: Activation | str = SwiGLU()
    ) -> DenseWeights:
        """BF16 w1 [E, N1, H] (N1 = 2I rows [up; gate] for gated activations, else I) and w2 [E, H, I].

        Any positive H and I; I is padded to a multiple of 128 with zero rows (w1) and columns (w2).
        The values are copied bit for bit; they must be finite (NaN / Inf raise ValueError naming
        w1 or w2; the check reads them).
        """
        return self._prepare_dense(WeightFormat.BF16, torch.bfloat16, w1, w2, activation)

    def prepare_fp16_weights(
        self, w1: torch.Tensor, w2: torch.Tensor, *, activation: Activation | str = SwiGLU()
    ) -> DenseWeights:
        """FP16 twin of ``prepare_bf16_weights`` (finite values, checked the same way)."""
        return self._prepare_dense(WeightFormat.FP16, torch.float16, w1, w2, activation)

    # ------------------------------------------------------------------ block-scaled codes (4-bit weight-only, MX pairs)
    def _prepare_block_scaled(
        self,
        fmt: WeightFormat,
        cls: type,
        scale_dtypes: torch.dtype | tuple[torch.dtype, ...],
        w1_codes: object,
        w1_scales: object,
        w2_codes: object,
        w2_scales: object,
        activation: Activation | str,
        names: tuple[str, str, str, str] = ("w1_codes", "w1_scales", "w2_codes", "w2_scales"),
        refuse_nan: bool = False,
        **globals_: object,
    ) -> LowLatencyWeights:
        """The record ``cls`` of codes (``cls.codes_per_byte``: 2 for uint8 4-bit codes, 1 for E4M3) and block scales
        of ``scale_dtypes`` (kept as the first; the others are views of the same bytes), checked under the caller's
        argument ``names``; E4M3 block scales (NVFP4) are read and must be unsigned (require_unsigned_scales);
        refuse_nan also reads the data for E4M3 NaN codes and E8M0 NaN scale bytes (255)."""
        self.require_format(self.target_arch(), fmt)
        act = parse_activation(activation)
        n1c, n1s, n2c, n2s = names
        per_byte = cls.codes_per_byte
        code_dtype = torch.uint8 if per_byte == 2 else torch.float8_e4m3fn
        experts, hidden, intermediate = _check_weight_pair(
            (n1c, n2c), w1_codes, w2_codes, code_dtype, act,
            (WEIGHT_ONLY_HIDDEN_MULTIPLE, WEIGHT_ONLY_INTERMEDIATE_MULTIPLE), per_byte)
        device, block = w1_codes.device, cls.block
        n1 = w1_codes.shape[1]
        stored = scale_dtypes if isinstance(scale_dtypes, torch.dtype) else scale_dtypes[0]
        w1_scales = _check_scales(n1s, w1_scales, scale_dtypes, (experts, n1, hidden // block), device)
        w2_scales = _check_scales(n2s, w2_scales, scale_dtypes, (experts, hidden, intermediate // block), device)
        w1_scales, w2_scales = w1_scales.view(stored), w2_scales.view(stored)
        checked = {name: _check_global(name, value, experts, device) for name, value in globals_.items()}
        if stored is torch.float8_e4m3fn:  # NVFP4 block scales; reads them (preparation, not the serving path)
            require_unsigned_scales(n1s, w1_scales)
            require_unsigned_scales(n2s, w2_scales)
        if refuse_nan:  # reads the payloads: preparation, not the serving path
            if code_dtype is torch.float8_e4m3fn:
                _require_no_e4m3_nan(n1c, w1_codes)
                _require_no_e4m3_nan(n2c, w2_codes)
            _require_no_e8m0_nan(n1s, w1_scales)
            _require_no_e8m0_nan(n2s, w2_scales)
        ip = padded_intermediate(intermediate)
        return self.stored(cls(
            format=fmt, hidden_size=hidden, intermediate_size=intermediate, padded_intermediate=ip, gated=act.gated,
            w1_codes=pad_gemm1_rows(w1_codes, intermediate, ip, act.gated),
            w1_scales=pad_gemm1_rows(w1_scales, intermediate, ip, act.gated),
            w2_codes=pad_columns(w2_codes, ip // per_byte),
            w2_scales=pad_columns(w2_scales, ip // block),
            **{name: value.clone() for name, value in checked.items()},
        ))

    def stored(self, weights: BlockScaledWeights) -> BlockScaledWeights:
        """``weights`` (row-major) in the layout this config's arch keeps them in: SM90 fragment tiles for the
        TILED_FORMATS on SM90, the one copy that the tensor-core and the CUDA-core engines both read there
        (cudnn_moe.weights.low_latency); as they are otherwise, and where the engine this config names reads no tiles
        (ll_mma, which a config names for the MXFP4 pair)."""
        tiles = self.target_arch() == SM90 and weights.format in TILED_FORMATS
        if isinstance(weights, Mxfp4WeightOnlyWeights) and weights.nvfp4_problem is not None:
            tiles = False  # no exact shifted form (or not decided yet): these run on the CUDA cores, row-major
        if tiles and self.engine != AUTO:  # the named engine, where it runs the format, must read tiles
            named, request = engine_class(self.engine), Request(OP_LOW_LATENCY, SM90, weights.format.value, tiled=True)
            tiles = not any(s.covers(request) for s in named.services) or bool(named.check(request))
        return weights.to_tiles() if tiles else weights

    def prepare_nvfp4_weight_only_weights(
        self,
        w1_codes: torch.Tensor,
        w1_scales: torch.Tensor,
        w1_global: torch.Tensor,
        w2_codes: torch.Tensor,
        w2_scales: torch.Tensor,
        w2_global: torch.Tensor,
        *,
        activation: Activation | str = SwiGLU(),
    ) -> Nvfp4WeightOnlyWeights:
        """NVFP4 weights for BF16/FP16 activations, preserved bit for bit.

        w1_codes uint8 [E, N1, H/2] (canonical E2M1, element 2i in the low nibble; N1 = 2I [up; gate]
        gated, else I), w1_scales float8_e4m3fn [E, N1, H/16] linear, w1_global float32 [E];
        w2_codes uint8 [E, H, I/2], w2_scales float8_e4m3fn [E, H, I/16], w2_global float32 [E].
        Weight = e2m1 * scale * global (globals finite and positive; block scales unsigned, E4M3 codes 0x00-0x7E or
        0x80 as zero, read here: a NaN or negative scale is refused). H % 128 == 0, I % 32 == 0, I padded to a
        multiple of 128.
        """
        return self._prepare_block_scaled(
            WeightFormat.NVFP4_WEIGHT_ONLY, Nvfp4WeightOnlyWeights, torch.float8_e4m3fn,
            w1_codes, w1_scales, w2_codes, w2_scales, activation, w1_global=w1_global, w2_global=w2_global,
        )

    def prepare_mxfp4_weight_only_weights(
        self,
        w1_codes: torch.Tensor,
        w1_scales: torch.Tensor,
        w2_codes: torch.Tensor,
        w2_scales: torch.Tensor,
        *,
        activation: Activation | str = SwiGLU(),
    ) -> Mxfp4WeightOnlyWeights:
        """MXFP4 weights for BF16/FP16 activations, preserved bit for bit.

        Codes as in ``prepare_nvfp4_weight_only_weights``; scales float8_e8m0fnu [E, N1, H/32] and [E, H, I/32],
        linear (value = e2m1 * 2^(byte - 127), decoded through FP32). H % 128 == 0, I % 32 == 0, I
        padded to a multiple of 128.

        Preparation also decides whether the layer runs on the NVFP4 tensor-core kernels (SM90): it does when
        every expert's block scales re-encode exactly as NVFP4 (cudnn_moe.formats.mxfp4_as_nvfp4: the exponents of
        its nonzero blocks span at most 17 binades, none is NaN or above 2^125); ``weights.nvfp4_problem`` says why
        not, and such layers run on the CUDA cores. On SM90 a layer with that form is stored in it, as the engine's
        tiles (``stored``; the E8M0 scales kept beside them for ``canonical()``). This reads the scales and codes (a
        device sync).
        """
        weights = self._prepare_block_scaled(
            WeightFormat.MXFP4_WEIGHT_ONLY, Mxfp4WeightOnlyWeights, torch.float8_e8m0fnu,
            w1_codes, w1_scales, w2_codes, w2_scales, activation,
        )
        return self.stored(replace(weights, nvfp4_shifts=self._mxfp4_shifts(weights)))

    @staticmethod
    def _mxfp4_shifts(weights: Mxfp4WeightOnlyWeights) -> tuple[torch.Tensor, torch.Tensor] | str:
        """The shifts (w1, w2) of the exact shifted form of row-major MXFP4 weights (cudnn_moe.formats.mxfp4_as_nvfp4),
        or why they have none. Reads the scales and codes (a device sync)."""
        shifts1 = nvfp4_shifts(weights.w1_codes, weights.w1_scales, "w1")
        shifts2 = nvfp4_shifts(weights.w2_codes, weights.w2_scales, "w2")
        return next((s for s in (shifts1, shifts2) if isinstance(s, str)), None) or (shifts1, shifts2)

    def prepare_mxint4_weight_only_weights(
        self,
        w1_codes: torch.Tensor,
        w1_scales: torch.Tensor,
        w2_codes: torch.Tensor,
        w2_scales: torch.Tensor,
        *,
        activation: Activation | str = SwiGLU(),
    ) -> Mxint4WeightOnlyWeights:
        """MXINT4 weights for BF16/FP16 activations, preserved bit for bit.

        Codes uint8, two's-complement INT4 nibbles (element 2i low); scales bfloat16 [E, N1, H/32] and
        [E, H, I/32], linear (value = int4 * scale). H % 128 == 0, I % 32 == 0, I padded to 128.
        """
        return self._prepare_block_scaled(
            WeightFormat.MXINT4_WEIGHT_ONLY, Mxint4WeightOnlyWeights, torch.bfloat16,
            w1_codes, w1_scales, w2_codes, w2_scales, activation,
        )

    # ------------------------------------------------------------------ FP8 weight-only
    def prepare_fp8_weight_only_weights(
        self,
        w1: torch.Tensor,
        w1_scale: torch.Tensor,
        w2: torch.Tensor,
        w2_scale: torch.Tensor,
        *,
        activation: Activation | str = SwiGLU(),
    ) -> Fp8WeightOnlyWeights:
        """E4M3 weights for BF16/FP16 activations, copied bit for bit (never requantized).

        w1 float8_e4m3fn [E, N1, H] (N1 = 2I rows [up; gate] gated, else I), w1_scale float32 [E];
        w2 float8_e4m3fn [E, H, I], w2_scale float32 [E]. Weight = e4m3 * scale (scales finite and
        positive; NaN codes 0x7F / 0xFF are refused, the check reads the codes). H % 128 == 0,
        I % 32 == 0, I padded to a multiple of 128 with +0 codes.
        """
        self.require_format(self.target_arch(), WeightFormat.FP8_WEIGHT_ONLY)
        act = parse_activation(activation)
        experts, hidden, intermediate = _check_weight_pair(
            ("w1", "w2"), w1, w2, torch.float8_e4m3fn, act,
            (WEIGHT_ONLY_HIDDEN_MULTIPLE, WEIGHT_ONLY_INTERMEDIATE_MULTIPLE))
        device = w1.device
        w1_scale = _check_global("w1_scale", w1_scale, experts, device)
        w2_scale = _check_global("w2_scale", w2_scale, experts, device)
        _require_no_e4m3_nan("w1", w1)
        _require_no_e4m3_nan("w2", w2)
        ip = padded_intermediate(intermediate)
        return Fp8WeightOnlyWeights(
            format=WeightFormat.FP8_WEIGHT_ONLY, hidden_size=hidden, intermediate_size=intermediate,
            padded_intermediate=ip, gated=act.gated,
            w1_codes=pad_gemm1_rows(w1, intermediate, ip, act.gated), w1_scale=w1_scale.clone(),
            w2_codes=pad_columns(w2, ip), w2_scale=w2_scale.clone(),
        )

    # Short names of the three methods above, from before the contract's names were adopted: thin aliases,
    # kept only so that older call sites keep working; new code uses the *_weights names.
    def prepare_nvfp4_weight_only(self, *args: object, **kwargs: object) -> Nvfp4WeightOnlyWeights:
        """Alias of ``prepare_nvfp4_weight_only_weights`` (the earlier, shorter name)."""
        return self.prepare_nvfp4_weight_only_weights(*args, **kwargs)

    def prepare_mxfp4_weight_only(self, *args: object, **kwargs: object) -> Mxfp4WeightOnlyWeights:
        """Alias of ``prepare_mxfp4_weight_only_weights`` (the earlier, shorter name)."""
        return self.prepare_mxfp4_weight_only_weights(*args, **kwargs)

    def prepare_mxint4_weight_only(self, *args: object, **kwargs: object) -> Mxint4WeightOnlyWeights:
        """Alias of ``prepare_mxint4_weight_only_weights`` (the earlier, shorter name)."""
        return self.prepare_mxint4_weight_only_weights(*args, **kwargs)

    # ------------------------------------------------------------------ NVFP4 weights + NVFP4 activations
    def prepare_nvfp4_weights(
        self, w1_bf16: torch.Tensor, w2_bf16: torch.Tensor, *, activation: Activation | str = SwiGLU()
    ) -> Nvfp4PairWeights:
        """Quantize float weights (BF16, FP16 or FP32, finite) to NVFP4 for use with NVFP4 activations.

        w1_bf16 [E, N1, H], w2_bf16 [E, H, I]; H % 512 == 0, I % 128 == 0 (so nothing is padded).
        Per expert and GEMM: global = amax / 2688 (one for an all-zero expert), block scales
        e4m3(amax16 / 6 / global) per 16 K values, codes e2m1(w / global / scale), the plain
        6-max recipe (the 4over6 recipe is not supported). Weight = e2m1 * scale * global.
        """
        self.require_format(self.target_arch(), WeightFormat.NVFP4_W_NVFP4_A)
        act = parse_activation(activation)
        _, hidden, intermediate = _check_weight_pair(
            ("w1_bf16", "w2_bf16"), w1_bf16, w2_bf16, _FLOAT_SOURCE_DTYPES, act,
            (PAIR_HIDDEN_MULTIPLE, PAIR_INTERMEDIATE_MULTIPLE))
        require_finite("w1_bf16", w1_bf16)
        require_finite("w2_bf16", w2_bf16)
        w1_codes, w1_scales, w1_global = quantize_experts("w1_bf16", w1_bf16)
        w2_codes, w2_scales, w2_global = quantize_experts("w2_bf16", w2_bf16)
        return self.stored(Nvfp4PairWeights(
            format=WeightFormat.NVFP4_W_NVFP4_A, hidden_size=hidden, intermediate_size=intermediate,
            padded_intermediate=intermediate, gated=act.gated,
            w1_codes=w1_codes, w1_scales=w1_scales, w2_codes=w2_codes, w2_scales=w2_scales,
            w1_global=w1_global, w2_global=w2_global,
        ))

    # ------------------------------------------------------------------ MX weights + MXFP8 activations
    def prepare_weights(
        self,
        w1: torch.Tensor,
        w1_scale: torch.Tensor,
        w2: torch.Tensor,
        w2_scale: torch.Tensor,
        *,
        activation: Activation | str = SwiGLU(),
    ) -> Mxfp4PairWeights | Mxfp8PairWeights:
        """Keep canonical MX weights, bit for bit (copies, never requantized), for MXFP8 activations
        (``prepare_mxfp8_activations``). The kind follows from the code dtype, the same for w1 and w2:

        - MXFP4 (``WeightFormat.MXFP4_W_MXFP8_A``, an Mxfp4PairWeights): w1 uint8 [E, N1, H/2], w2 uint8 [E, H, I/2],
          packed E2M1 codes (element 2i in the low nibble, cudnn_moe.formats.e2m1);
        - MXFP8 (``WeightFormat.MXFP8_W_MXFP8_A``, an Mxfp8PairWeights): w1 float8_e4m3fn [E, N1, H], w2 [E, H, I].

        N1 = 2I rows [up; gate] for gated activations, I rows for non-gated ones (no gate rows). w1_scale
        [E, N1, H/32], w2_scale [E, H, I/32]: E8M0 scale bytes, one per 32 K values, as float8_e8m0fnu or as uint8
        holding those bytes (kept as float8_e8m0fnu either way); weight = code * 2^(byte - 127). H % 128 == 0,
        I % 32 == 0; I is padded to a multiple of 128 with zero bytes (codes +0, scale bytes 0). E4M3 NaN codes
        (0x7F / 0xFF) and E8M0 NaN scales (byte 255) are refused; the checks read the data (preparation, not the
        serving path). Errors name the argument: TypeError for a non-tensor or a wrong dtype (w2 of the other
        kind included), ValueError for a wrong shape, size, device or value. MXFP4 weights also get their exact shifted
        form decided here (as ``prepare_mxfp4_weight_only_weights``'s), which the SM90 engine runs them in; on SM90 a
        layer with that form is stored in it, as the engine's tiles (``stored``: the one copy, which the CUDA-core
        kernels read too; the E8M0 scales kept beside them for ``canonical()``). ``weights.nvfp4_problem`` says why a
        layer has none (it then stays row-major and runs on the CUDA cores or ll_mma).

        What the call does with them (``reference_mx_pair`` states every rounding point): FC1 as FP32 sums of exact
        code products scaled per 32-K block by the two E8M0 scales, preactivation rounded to BF16, the activation
        in FP32 quantized to MXFP8 per 32 values inside the GEMM1 kernel, FC2 likewise, expert rows rounded to the
        output dtype (BF16 or FP16), ordered FP32 combine; expert ids outside [0, E) mark unrouted slots.
        """
        w1 = require_tensor("w1", w1, (torch.uint8, torch.float8_e4m3fn), rank=3)
        if isinstance(w2, torch.Tensor) and w2.dtype in (torch.uint8, torch.float8_e4m3fn) and w2.dtype != w1.dtype:
            raise TypeError(f"w2 must have dtype {str(w1.dtype).replace('torch.', '')} like w1 (both MXFP4 or both "
                            f"MXFP8), got {str(w2.dtype).replace('torch.', '')}")
        fp4 = w1.dtype is torch.uint8
        weights = self._prepare_block_scaled(
            WeightFormat.MXFP4_W_MXFP8_A if fp4 else WeightFormat.MXFP8_W_MXFP8_A,
            Mxfp4PairWeights if fp4 else Mxfp8PairWeights, (torch.float8_e8m0fnu, torch.uint8),
            w1, w1_scale, w2, w2_scale, activation, names=("w1", "w1_scale", "w2", "w2_scale"), refuse_nan=True,
        )
        return self.stored(replace(weights, nvfp4_shifts=self._mxfp4_shifts(weights))) if fp4 else weights

    def prepare_mxfp8_activations(self, hidden_states: torch.Tensor) -> Mxfp8Activations:
        """Quantize tokens x [T, H] (BF16; FP16 or FP32 also taken; T <= max_num_tokens, H % 128 == 0) to MXFP8 for
        the MX pairs (``prepare_weights``): ``cudnn_moe.formats.quantize_mxfp8``, per 32 values amax = max |x| in
        FP32, scale = 2^clamp(floor(log2 amax) - 8, -127, 127) (2^-127 for an all-zero block), codes
        e4m3(fp32(x / scale)), nearest even, saturating at +-448 (the division by a power of two is exact
        unless the quotient is below E4M3's range anyway). Returns an Mxfp8Activations: codes float8_e4m3fn
        [T, H], scales float8_e8m0fnu [T, H/32]. Torch operations on x's device that read nothing to the host:
        capturable in a CUDA graph with the call (a block holding NaN or Inf gets unspecified codes and scale)."""
        x = require_tensor("hidden_states", hidden_states, _FLOAT_SOURCE_DTYPES, rank=2)
        if x.shape[0] > self.max_num_tokens:
            raise ValueError(f"hidden_states has {x.shape[0]} tokens, more than max_num_tokens={self.max_num_tokens}")
        require_multiple("hidden size (hidden_states.shape[1])", x.shape[1], WEIGHT_ONLY_HIDDEN_MULTIPLE)
        codes, scales = quantize_mxfp8(x, check_finite=False)
        return Mxfp8Activations(codes, scales)

    # ------------------------------------------------------------------ fallback for larger calls
    def prepare_fallback(
        self, weights: Nvfp4WeightOnlyWeights, fused_config: Nvfp4MoeConfig, *, fused_weights: Nvfp4Weights | None = None
    ) -> Nvfp4WeightOnlyWeights:
        """NVFP4 weights (weight-only or the pair, from this config) that also run calls of max_num_tokens + 1 ..
        fused_config.max_num_tokens tokens: a new record with the same tensors and ``fallback`` set (a
        LowLatencyFallback: these payloads, bit for bit, laid out for fused_config's engine). Such calls run on
        the shared pipeline with the low-latency rounding points (cudnn_moe.low_latency.fallback): finalized,
        BF16 tokens (or the pair's NVFP4 tokens: quantize more than max_num_tokens of them with
        ``fused_config.prepare_activations``, the same quantizer) and BF16 output. fused_config: an Nvfp4MoeConfig
        of this config's arch whose engine reads BF16 token fragments (the SM90 engine) and with max_num_tokens
        above this config's; fused_weights: optionally the caller's fused view of the same layer (checked bit
        for bit, then used instead of a repacked copy). Other formats, and Blackwell, raise ValueError saying why.
        Weights prepared for SM90 are stored as that engine's tiles, so without fused_weights the view holds their
        own tensors (no copy), the view calls of up to 8 tokens use too."""
        return prepare_fallback(self.max_num_tokens, self.target_arch(), weights, fused_config, fused_weights)

    # ------------------------------------------------------------------ per-tensor FP8
    def prepare_fp8_per_tensor_weights(
        self,
        w1_bf16: torch.Tensor,
        w2_bf16: torch.Tensor,
        input_scale: float | torch.Tensor,
        intermediate_scale: float | torch.Tensor,
        *,
        activation: Activation | str = SwiGLU(),
    ) -> Fp8PerTensorWeights:
        """Quantize float weights to E4M3 with one FP32 scale per expert and GEMM, beside two static calibration
        scales, for E4M3 tokens (``prepare_fp8_per_tensor_activations``).

        w1_bf16 [E, N1, H] (N1 = 2I rows [up; gate] gated, else I), w2_bf16 [E, H, I]: BF16 (FP16 or FP32 also
        taken), finite (NaN / Inf raise ValueError naming the tensor; the check reads them). H % 128 == 0,
        I % 32 == 0, I padded to a multiple of 128 with +0 codes.
        input_scale: the dequantization scale of FC1's tokens (x ~ e4m3 * input_scale); intermediate_scale: that
        of FC2's input (the activation's output ~ e4m3 * intermediate_scale). Static calibration values: a
        number or a one-element floating tensor (read once, here), finite and positive in float32 with a
        finite float32 reciprocal; anything else raises (TypeError for a non-number, ValueError naming the
        argument for NaN, Inf, zero, negative or out-of-range values).

        Rounding points of the preparation (each FP32 operation rounds to nearest even):
        1. per expert and GEMM, scale = amax(|w|) / 448 in FP32 (1.0 for an all-zero expert), exactly
           ``cudnn_moe.formats.quantize_fp8_per_tensor`` of that expert;
        2. codes = e4m3(fp32(w / scale)): nearest even, saturating at +-448;
        3. the calibration scales rounded to FP32; the tokens' and intermediate's multipliers
           fp32(1 / input_scale) and fp32(1 / intermediate_scale); the GEMM factors
           fc1_factor[e] = fp32(input_scale * w1_scale[e]) and fc2_factor[e] = fp32(intermediate_scale *
           w2_scale[e]) (each must be finite and nonzero in FP32, else ValueError naming the scale).
        What the call then does with them: ``reference_fp8_per_tensor`` (the same rounding points).
        """
        self.require_format(self.target_arch(), WeightFormat.FP8_PER_TENSOR)
        act = parse_activation(activation)
        experts, hidden, intermediate = _check_weight_pair(
            ("w1_bf16", "w2_bf16"), w1_bf16, w2_bf16, _FLOAT_SOURCE_DTYPES, act,
            (WEIGHT_ONLY_HIDDEN_MULTIPLE, WEIGHT_ONLY_INTERMEDIATE_MULTIPLE))
        in_scale = require_float32_scalar("input_scale", input_scale, reciprocal=True)
        mid_scale = require_float32_scalar("intermediate_scale", intermediate_scale, reciprocal=True)
        require_finite("w1_bf16", w1_bf16)  # reads the weights: preparation, not the serving path
        require_finite("w2_bf16", w2_bf16)
        device = w1_bf16.device
        w1_codes, w1_scale = _quantize_fp8_experts(w1_bf16)
        w2_codes, w2_scale = _quantize_fp8_experts(w2_bf16)
        f32 = {"dtype": torch.float32, "device": device}
        fc1_factor = w1_scale * torch.tensor(in_scale, **f32)
        fc2_factor = w2_scale * torch.tensor(mid_scale, **f32)
        for name, factor in (("input_scale", fc1_factor), ("intermediate_scale", fc2_factor)):
            if not bool((torch.isfinite(factor) & (factor > 0)).all()):
                raise ValueError(f"{name} times the weights' per-expert scales leaves the float32 range "
                                 f"(a product is 0 or Inf): {name} is out of range for these weights")
        one = torch.ones((), dtype=torch.float32)
        input_multiplier = float(one / torch.tensor(in_scale, dtype=torch.float32))
        inter_multiplier = (one / torch.tensor(mid_scale, dtype=torch.float32)).reshape(1).to(device)
        ip = padded_intermediate(intermediate)
        return Fp8PerTensorWeights(
            format=WeightFormat.FP8_PER_TENSOR, hidden_size=hidden, intermediate_size=intermediate,
            padded_intermediate=ip, gated=act.gated,
            w1_codes=pad_gemm1_rows(w1_codes, intermediate, ip, act.gated), w1_scale=w1_scale,
            w2_codes=pad_columns(w2_codes, ip), w2_scale=w2_scale,
            input_scale=in_scale, intermediate_scale=mid_scale, input_multiplier=input_multiplier,
            fc1_factor=fc1_factor.contiguous(), fc2_factor=fc2_factor.contiguous(), inter_multiplier=inter_multiplier,
        )

    # ------------------------------------------------------------------ DeepSeek FP8
    def prepare_deepseek_fp8_weights(
        self,
        w1: torch.Tensor,
        w1_scale: torch.Tensor,
        w2: torch.Tensor,
        w2_scale: torch.Tensor,
        *,
        activation: Activation | str = SwiGLU(),
    ) -> DeepSeekFp8Weights:
        """Keep DeepSeek-style FP8 weights as given: E4M3 codes and their FP32 scales per 128 x 128 block, copied
        bit for bit (never requantized, rescaled or cast).

        w1 float8_e4m3fn [E, N1, H] (N1 = 2I rows [up; gate] gated, else I), w1_scale float32 [E, ceil(N1/128),
        ceil(H/128)]; w2 float8_e4m3fn [E, H, I], w2_scale float32 [E, ceil(H/128), ceil(I/128)]. Weight
        [e, n, k] = e4m3 * scale[e, n // 128, k // 128]. H and I must be multiples of 128 (so the ceilings are
        exact and nothing is padded). Scales must be finite and positive; E4M3 NaN codes (0x7F / 0xFF) are
        refused (both checks read the data: preparation, not the serving path). Errors name the argument:
        TypeError for a non-tensor or a wrong dtype, ValueError for a wrong shape, size, device or value.

        The call's numerics (``reference_deepseek_fp8`` states them step by step): tokens quantized per 128
        values (or given so, ``prepare_deepseek_fp8_activations``), FC1 as FP32 sums of exact code products
        scaled per 128-K block by the product of the two block scales, FP32 preactivation and activation, the
        intermediate quantized per 128 values to E4M3 before FC2, FC2 likewise, BF16 expert rows, ordered FP32
        combine rounded to BF16 (BF16 output only).
        """
        self.require_format(self.target_arch(), WeightFormat.DEEPSEEK_FP8)
        act = parse_activation(activation)
        experts, hidden, intermediate = _check_weight_pair(
            ("w1", "w2"), w1, w2, torch.float8_e4m3fn, act, (DEEPSEEK_BLOCK, DEEPSEEK_BLOCK))
        device = w1.device
        blocks = lambda n: -(-n // DEEPSEEK_BLOCK)  # noqa: E731
        w1_scale = _check_scales("w1_scale", w1_scale, torch.float32,
                                 (experts, blocks(w1.shape[1]), blocks(hidden)), device)
        w2_scale = _check_scales("w2_scale", w2_scale, torch.float32, (experts, blocks(hidden), blocks(intermediate)),
                                 device)
        require_positive_finite("w1_scale", w1_scale)
        require_positive_finite("w2_scale", w2_scale)
        _require_no_e4m3_nan("w1", w1)
        _require_no_e4m3_nan("w2", w2)
        copy = {"memory_format": torch.contiguous_format}
        return DeepSeekFp8Weights(
            format=WeightFormat.DEEPSEEK_FP8, hidden_size=hidden, intermediate_size=intermediate,
            padded_intermediate=intermediate, gated=act.gated,
            w1_codes=w1.clone(**copy), w1_scales=w1_scale.clone(**copy),
            w2_codes=w2.clone(**copy), w2_scales=w2_scale.clone(**copy),
        )

    def prepare_deepseek_fp8_activations(
        self, codes: torch.Tensor, scales: torch.Tensor, weights: DeepSeekFp8Weights | None = None
    ) -> DeepSeekFp8Activations:
        """Prequantized DeepSeek FP8 tokens, kept as given (the same tensors, not copied, so a captured call reads
        whatever they hold at replay): codes float8_e4m3fn [T, H], scales float32 [T, H/128], x[t, k] = e4m3 *
        scales[t, k // 128]; T <= max_num_tokens, H a multiple of 128, both contiguous on one device, codes
        16-byte aligned. The scales must be finite and positive and the codes free of NaN (0x7F / 0xFF): this
        reads them (a device sync), so check once here; the call itself reads no data and re-checks only
        types, shapes and layout. weights: optional, to check H and the device against them.

        BF16 tokens need no preparation: pass them to the call as they are, and it quantizes them per 128
        values on the GPU (``cudnn_moe.formats.quantize_fp8_act128`` numerics)."""
        codes = require_tensor("codes", codes, torch.float8_e4m3fn, rank=2)
        scales = require_tensor("scales", scales, torch.float32, rank=2)
        tokens, hidden = codes.shape
        require_multiple("hidden size (codes.shape[1])", hidden, DEEPSEEK_BLOCK)
        if tokens > self.max_num_tokens:
            raise ValueError(f"codes hold {tokens} tokens, more than max_num_tokens={self.max_num_tokens}")
        if tuple(scales.shape) != (tokens, hidden // DEEPSEEK_BLOCK):
            raise ValueError(f"scales must be [{tokens}, {hidden // DEEPSEEK_BLOCK}] (one per 128 values of codes), "
                             f"got {tuple(scales.shape)}")
        if scales.device != codes.device:
            raise ValueError(f"scales is on {scales.device} but codes is on {codes.device}")
        if weights is not None:
            if not isinstance(weights, DeepSeekFp8Weights):
                raise TypeError(f"weights must be DeepSeekFp8Weights, got {type(weights).__name__}")
            if hidden != weights.hidden_size:
                raise ValueError(f"codes must be [T, {weights.hidden_size}] to match the weights, got {tuple(codes.shape)}")
            if codes.device != weights.w1_codes.device:
                raise ValueError(f"codes is on {codes.device} but the weights are on {weights.w1_codes.device}")
        for name, t in (("codes", codes), ("scales", scales)):
            if not t.is_contiguous():
                raise ValueError(f"{name} must be contiguous (row-major)")
        if codes.data_ptr() % 16:
            raise ValueError("codes must start at a 16-byte aligned address: pass a fresh or .clone()d tensor")
        require_positive_finite("scales", scales)
        _require_no_e4m3_nan("codes", codes)
        return DeepSeekFp8Activations(codes, scales)

    def prepare_fp8_per_tensor_activations(
        self, hidden_states: torch.Tensor, weights: Fp8PerTensorWeights
    ) -> Fp8PerTensorActivations:
        """Quantize tokens x [T, H] (BF16; FP16 or FP32 also taken; T <= max_num_tokens) with the one calibrated
        multiplier of ``weights`` (per-tensor FP8): codes = e4m3(fp32(fp32(x) * fp32(1 / input_scale))), nearest
        even, saturating at +-448 (Inf gives +-448, NaN a NaN code: the data is not read). Returns the codes
        float8_e4m3fn [T, H] with the input scale they belong to. Torch operations on x's device: capturable in
        a CUDA graph with the call (they allocate from torch's graph-aware pool)."""
        if not isinstance(weights, Fp8PerTensorWeights):
            raise TypeError("weights must be the Fp8PerTensorWeights of prepare_fp8_per_tensor_weights, got "
                            f"{type(weights).__name__}")
        x = require_tensor("hidden_states", hidden_states, _FLOAT_SOURCE_DTYPES, rank=2)
        if x.shape[0] > self.max_num_tokens:
            raise ValueError(f"hidden_states has {x.shape[0]} tokens, more than max_num_tokens={self.max_num_tokens}")
        if x.shape[1] != weights.hidden_size:
            raise ValueError(f"hidden_states must be [T, {weights.hidden_size}] to match the weights, got {tuple(x.shape)}")
        if x.device != weights.w1_codes.device:
            raise ValueError(f"hidden_states is on {x.device} but the weights are on {weights.w1_codes.device}")
        codes = to_e4m3(x.float() * weights.input_multiplier)
        return Fp8PerTensorActivations(codes, weights.input_scale)

    def prepare_nvfp4_activations(self, hidden_states: torch.Tensor) -> Nvfp4Activations:
        """Quantize x [T, H] (BF16/FP16/FP32, T <= max_num_tokens, H % 512 == 0) to NVFP4, global scale one.

        Scales are linear float8_e4m3fn [T, H/16]; codes uint8 [T, H/2]. The data is not read (a NaN
        gives its block a NaN scale).
        """
        x = require_tensor("hidden_states", hidden_states, _FLOAT_SOURCE_DTYPES, rank=2)
        if x.shape[0] > self.max_num_tokens:
            raise ValueError(f"hidden_states has {x.shape[0]} tokens, more than max_num_tokens={self.max_num_tokens}")
        require_multiple("hidden size (hidden_states.shape[1])", x.shape[1], PAIR_HIDDEN_MULTIPLE)
        packed, scales = quantize_nvfp4(x, check_finite=False)
        return Nvfp4Activations(packed, scales)



def _served_archs() -> frozenset[Arch]:
    return frozenset().union(*(served_archs(OP_LOW_LATENCY, fmt.value) for fmt in WeightFormat))
