"""The low-latency op's fallback for calls above its config's max_num_tokens: the shared pipeline's view of the
same NVFP4 payloads, prepared beside the low-latency weights (``LowLatencyMoeConfig.prepare_fallback``): their own
tensors where they are stored in the engine's tiles (weights prepared for SM90), else a repacked copy.

What runs a fallback call: the shared pipeline (cudnn_moe.pipeline.executor, the fused op's) on an engine whose
grouped GEMMs read BF16 token fragments (the SM90 engine), with BF16 tokens for NVFP4 weight-only (they enter as
they are) or the pair's NVFP4 tokens decoded exactly, and a BF16 intermediate (the activation rounded to BF16, never
requantized). That is the path the op takes for T <= 8 on SM90
(cudnn_moe.low_latency.grouped), in larger token buckets: the low-latency contract's rounding points
(cudnn_moe.low_latency.reference), only the FP32 summation order inside the GEMMs differs.

Where no fallback is offered (a call above max_num_tokens raises ValueError saying why):
- ``fused_moe`` as such is never a fallback: it requantizes the intermediate to NVFP4 (cudnn_moe.fused.reference,
  step 4) where both NVFP4 low-latency formats round it to BF16, and it takes NVFP4 tokens, so the weight-only
  format's BF16 tokens would be quantized first: another numerical contract;
- engines reading NVFP4 tokens (cuDNN on Blackwell): the same requantized intermediate, so no view is prepared;
- every other format: FP16 and the FP8 formats run on no grouped engine; MXFP4 and MXINT4 weight-only layers and
  BF16 layers run on the SM90 engine within max_num_tokens (cudnn_moe.low_latency.grouped), but no larger-batch view
  is prepared for them;
- FP16 tokens or output, and raw rows (finalize=False): the pipeline writes finalized BF16 outputs only.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..arch import Arch, arch_name
from ..engines.base import BlockCode, GemmEngine, WeightLayout
from ..engines.registry import engine_class_of
from ..formats.mxfp4_as_nvfp4 import nvfp4_globals
from ..fused.config import Nvfp4MoeConfig
from ..kernels.codes import TokenLayout
from ..weights.low_latency import (
    LowLatencyWeights,
    Mxfp4PairWeights,
    Mxfp4WeightOnlyWeights,
    Mxint4WeightOnlyWeights,
    Nvfp4WeightOnlyWeights,
    WeightFormat,
)
from ..weights.nvfp4 import Nvfp4Weights, require_expert_count

_BITS = {1: torch.uint8, 4: torch.int32}


@dataclass(frozen=True, eq=False)
class LowLatencyFallback:
    """What runs a low-latency call above the config's max_num_tokens.

    config: the Nvfp4MoeConfig whose max_num_tokens bounds those calls (its arch and engine chose the layout).
    weights: the low-latency payloads in that engine's layout, bit for bit: w1 [E, N1p, H], w2 [E, H, Ip], the
        globals as alphas float32 [E], intermediate size Ip (the low-latency zero padding included).
    """

    config: Nvfp4MoeConfig
    weights: Nvfp4Weights


def unit_alphas(experts: int, device: torch.device) -> torch.Tensor:
    """The alphas of an SM90 view of weights without a global (MXINT4, BF16): float32 [E] of 1/256, so that the
    engine's alpha * 256 is 1."""
    return torch.full((experts,), 1 / 256, dtype=torch.float32, device=device)


def tiled_view(
    engine: type[GemmEngine], arch: Arch,
    weights: Nvfp4WeightOnlyWeights | Mxfp4WeightOnlyWeights | Mxint4WeightOnlyWeights,
) -> Nvfp4Weights | None:
    """The ``engine`` view on ``arch`` of tiled low-latency weights: their own tensors (no copy) as w1 [E, N1p * H/2]
    and w1_scales bytes [E, N1p * H/16] (MXFP4: its form's scale tiles [E, N1p * H/32], ``tile_form``), w2 likewise,
    with the globals as alphas (MXINT4: alphas 1/256, the engine's alpha * 256 being 1, a new tensor), intermediate
    size Ip, and the code of the tiles; None where the weights are not tiled or the engine reads another layout.
    Allocates nothing but MXINT4's alphas."""
    spec = engine.spec(arch)
    if not weights.tiled or spec.weight_layout is not WeightLayout.SM90_TILES:
        return None
    experts = weights.num_experts
    w1_scales, w2_scales = weights.w1_scales, weights.w2_scales
    if isinstance(weights, Mxint4WeightOnlyWeights):
        alpha1 = alpha2 = unit_alphas(experts, weights.w1_codes.device)
        code = BlockCode.MXINT4
    elif isinstance(weights, Mxfp4WeightOnlyWeights):
        w1_scales, alpha1, w2_scales, alpha2 = weights.tile_form
        code = BlockCode.MXFP4
    else:
        alpha1, alpha2 = weights.w1_global, weights.w2_global
        code = BlockCode.NVFP4

    def flat(t: torch.Tensor) -> torch.Tensor:
        return t.view(torch.uint8).view(experts, -1)

    return Nvfp4Weights(
        flat(weights.w1_codes), flat(w1_scales), alpha1, flat(weights.w2_codes), flat(w2_scales), alpha2, spec,
        weights.gated, weights.hidden_size, weights.padded_intermediate, code=code,
    )


def grouped_view(
    engine: type[GemmEngine], arch: Arch, weights: Nvfp4WeightOnlyWeights | Mxfp4WeightOnlyWeights
) -> Nvfp4Weights:
    """The ``engine`` view on ``arch`` of NVFP4 low-latency weights, or of MXFP4 weight-only weights in their exact
    shifted form: w1 [E, N1p, H] in the engine's layout with the w1 global as alpha, w2 [E, H, Ip] likewise;
    intermediate size Ip. Tiled weights in the engine's layout give their own tensors (``tiled_view``), an untiled
    MXFP4 pair its own row-major tensors (``mxfp4_rows_view``), others a repacked copy (MXFP4: its tiles,
    ``to_tiles``)."""
    view = tiled_view(engine, arch, weights)
    if view is not None:
        return view
    if isinstance(weights, Mxfp4PairWeights):
        return mxfp4_rows_view(engine, arch, weights)
    if isinstance(weights, Mxfp4WeightOnlyWeights):
        view = tiled_view(engine, arch, weights.to_tiles())
        if view is None:
            raise ValueError(f"the {engine.name} engine on {arch_name(arch)} reads no MXFP4 tiles")
        return view
    w1_codes, w1_scales, w1_global, w2_codes, w2_scales, w2_global = weights.nvfp4_payloads()
    w1, w1_scales = engine.pack_weights_chunked(arch, w1_codes, w1_scales)
    w2, w2_scales = engine.pack_weights_chunked(arch, w2_codes, w2_scales)
    return Nvfp4Weights(
        w1, w1_scales, w1_global, w2, w2_scales, w2_global, engine.spec(arch),
        weights.gated, weights.hidden_size, weights.padded_intermediate,
    )


def mxfp4_rows_view(engine: type[GemmEngine], arch: Arch, weights: Mxfp4PairWeights) -> Nvfp4Weights:
    """The ``engine`` view on ``arch`` of the MXFP4 pair's weights read in place (BlockCode.MXFP4_ROWS): their own
    codes as w1 uint8 [E, N1p * H/2] and w2 [E, H * Ip/2], their E8M0 scale bytes as uint8 [E, N1p * H/32] and
    [E, H * Ip/32], and the globals 2^a of their exact shifted form as alphas (new float32 [E] tensors, all it
    allocates); intermediate size Ip. ValueError where the weights have no such form, or the engine no such kernels."""
    if engine.spec(arch).weight_layout is not WeightLayout.SM90_TILES:
        raise ValueError(f"the {engine.name} engine on {arch_name(arch)} reads no row-major MXFP4 weights")
    problem = weights.nvfp4_problem
    if problem is not None:
        raise ValueError(f"these MXFP4 weights have no exact shifted form: {problem}")
    shifts1, shifts2 = weights.nvfp4_shifts
    experts = weights.num_experts

    def flat(t: torch.Tensor) -> torch.Tensor:
        return t.view(torch.uint8).reshape(experts, -1)

    return Nvfp4Weights(
        flat(weights.w1_codes), flat(weights.w1_scales), nvfp4_globals(shifts1), flat(weights.w2_codes),
        flat(weights.w2_scales), nvfp4_globals(shifts2), engine.spec(arch), weights.gated, weights.hidden_size,
        weights.padded_intermediate, code=BlockCode.MXFP4_ROWS,
    )


def no_fallback_reason(fmt: WeightFormat) -> str:
    """Why ``fmt`` weights have no fallback, or how to prepare one (NVFP4 formats)."""
    if fmt in (WeightFormat.NVFP4_WEIGHT_ONLY, WeightFormat.NVFP4_W_NVFP4_A):
        return ("prepare a fallback for larger calls with config.prepare_fallback(weights, "
                "Nvfp4MoeConfig(max_num_tokens=N)) (SM90), or split the batch")
    return (f"{fmt.value} weights have no fallback (only the NVFP4 formats have a larger-batch path with the "
            "low-latency rounding points): split the batch")


def prepare_fallback(
    max_num_tokens: int,
    arch: Arch,
    weights: object,
    fused_config: object,
    fused_weights: object = None,
) -> Nvfp4WeightOnlyWeights:
    """``weights`` (the same tensors) holding a LowLatencyFallback for calls of max_num_tokens + 1 ..
    fused_config.max_num_tokens tokens; ``arch`` and ``max_num_tokens`` are the low-latency config's.

    fused_weights: optional, the caller's Nvfp4Weights of the same layer in the fused config's layout (e.g. a
    checkpoint's ``fused_weights``), used instead of a repacked copy once checked bit for bit (this reads them:
    preparation, not the serving path). Errors name the argument (TypeError for a wrong type, ValueError else).
    """
    if not isinstance(weights, LowLatencyWeights):
        raise TypeError(f"weights must be prepared by LowLatencyMoeConfig (a LowLatencyWeights), got {type(weights).__name__}")
    if not isinstance(weights, Nvfp4WeightOnlyWeights):
        raise ValueError(f"weights: {no_fallback_reason(weights.format)}")
    if not isinstance(fused_config, Nvfp4MoeConfig):
        raise TypeError(f"fused_config must be an Nvfp4MoeConfig, got {type(fused_config).__name__}")
    if fused_config.max_num_tokens <= max_num_tokens:
        raise ValueError(f"fused_config.max_num_tokens={fused_config.max_num_tokens} must exceed the low-latency "
                         f"config's max_num_tokens={max_num_tokens} (the fallback runs the larger calls)")
    if fused_config.target_arch() != arch:
        raise ValueError(f"fused_config prepares for {arch_name(fused_config.target_arch())} but the low-latency "
                         f"config for {arch_name(arch)}: give both the same arch")
    require_expert_count("weights", weights.num_experts)
    spec = fused_config.engine_spec(weights.hidden_size, weights.padded_intermediate, weights.num_experts,
                                    weights.gated)
    if spec.token_layout is not TokenLayout.BF16_FRAGMENTS:
        raise ValueError(f"fused_config picks the {spec.describe()}, whose GEMMs read NVFP4 tokens: the fused "
                         "pipeline there requantizes the intermediate to NVFP4, not the low-latency contract's BF16 "
                         "intermediate, so no exact fallback runs on this GPU (split the batch)")
    if fused_weights is None:
        view = grouped_view(engine_class_of(spec), spec.arch, weights)
    else:
        view = _check_fused_weights(fused_weights, weights, spec)
    return replace(weights, fallback=LowLatencyFallback(fused_config, view))


def _check_fused_weights(fused: object, weights: Nvfp4WeightOnlyWeights, spec: object) -> Nvfp4Weights:
    """``fused``: Nvfp4Weights in layout ``spec`` holding exactly the payloads and globals of ``weights``."""
    if not isinstance(fused, Nvfp4Weights):
        raise TypeError(f"fused_weights must be Nvfp4Weights (Nvfp4MoeConfig.prepare_weights), got {type(fused).__name__}")
    if fused.spec != spec:
        raise ValueError(f"fused_weights are laid out for the {fused.spec.describe()} but fused_config picks the "
                         f"{spec.describe()}: prepare them with fused_config")
    if fused.num_experts != weights.num_experts:
        raise ValueError(f"fused_weights hold {fused.num_experts} experts but weights hold {weights.num_experts}")
    if fused.gated != weights.gated:
        raise ValueError(f"fused_weights are {'' if fused.gated else 'not '}gated but weights are "
                         f"{'' if weights.gated else 'not '}gated")
    if (fused.hidden_size, fused.intermediate_size) != (weights.hidden_size, weights.padded_intermediate):
        raise ValueError(f"fused_weights are a layer of H={fused.hidden_size}, I={fused.intermediate_size} but weights "
                         f"have H={weights.hidden_size}, I={weights.padded_intermediate} (padded from "
                         f"{weights.intermediate_size})")
    if fused.w1_alpha_split is not None or fused.w1_alpha is None or fused.w2_alpha is None:
        raise ValueError("fused_weights must hold one global per expert and GEMM (w1_alpha, w2_alpha [E]), as the "
                         "low-latency NVFP4 format does")
    if fused.device != weights.w1_codes.device:
        raise ValueError(f"fused_weights are on {fused.device} but weights are on {weights.w1_codes.device}")
    w1, w1_scales, w2, w2_scales = fused.canonical()
    w1_codes, w1_row_scales, w2_codes, w2_row_scales = weights.row_payloads()
    pairs = (("w1", w1, w1_codes), ("w1_scales", w1_scales, w1_row_scales),
             ("w1_alpha", fused.w1_alpha, weights.w1_global), ("w2", w2, w2_codes),
             ("w2_scales", w2_scales, w2_row_scales), ("w2_alpha", fused.w2_alpha, weights.w2_global))
    for name, got, want in pairs:
        if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(
                got.contiguous().view(_BITS[got.element_size()]), want.contiguous().view(_BITS[want.element_size()])):
            raise ValueError(f"fused_weights.{name} is not bit for bit the low-latency weights' payload: pass the fused "
                             "view of the same layer (or leave fused_weights out to repack these)")
    return fused


def fallback_for_call(
    max_num_tokens: int,
    weights: LowLatencyWeights,
    tokens: int,
    token_dtype: torch.dtype | None,
    out_dtype: torch.dtype,
    finalize: bool,
) -> LowLatencyFallback | None:
    """None for a call within max_num_tokens; else the weights' fallback, after checking it runs this call
    (ValueError naming the argument and why, before any launch). token_dtype: None for NVFP4 tokens."""
    if tokens <= max_num_tokens:
        return None
    over = f"hidden_states hold {tokens} tokens, more than the config's max_num_tokens={max_num_tokens}"
    fallback = weights.fallback if isinstance(weights, Nvfp4WeightOnlyWeights) else None
    if fallback is None:
        raise ValueError(f"{over}; {no_fallback_reason(weights.format)}")
    if tokens > fallback.config.max_num_tokens:
        raise ValueError(f"hidden_states hold {tokens} tokens, more than the fallback's max_num_tokens="
                         f"{fallback.config.max_num_tokens} (weights.fallback.config): prepare the fallback with a "
                         "larger one, or split the batch")
    if not finalize:
        raise ValueError(f"{over}: the fallback returns finalized outputs only, so finalize=False takes at most "
                         f"{max_num_tokens} tokens")
    if out_dtype != torch.bfloat16:
        raise ValueError(f"{over}: the fallback writes BF16 outputs only, so out_dtype={out_dtype} takes at most "
                         f"{max_num_tokens} tokens")
    if token_dtype is not None and token_dtype != torch.bfloat16:
        raise ValueError(f"{over}: the fallback takes BF16 tokens only, so hidden_states of {token_dtype} take at most "
                         f"{max_num_tokens} tokens")
    return fallback


def check_fallback_device(fallback: LowLatencyFallback, arch: Arch) -> None:
    """The GPU of a fallback call (``arch``) must be the one its view was prepared for."""
    if fallback.weights.spec.arch != arch:
        raise ValueError(f"weights.fallback was prepared for the {fallback.weights.spec.describe()} but this GPU is "
                         f"{arch_name(arch)}; prepare it with configs for this GPU")


def fallback_tensors(fallback: LowLatencyFallback) -> tuple[torch.Tensor, ...]:
    """The device tensors a fallback call reads from its view (an ``out`` may share memory with none)."""
    w = fallback.weights
    return w.w1, w.w1_scales, w.w1_alpha, w.w2, w.w2_scales, w.w2_alpha
