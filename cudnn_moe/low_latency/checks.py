"""The low-latency op's argument checks (TypeError for a wrong type or dtype, ValueError for a wrong value,
shape or device, each naming the argument), run before anything is launched; they read no tensor data."""

from __future__ import annotations

import torch

from ..activations import Activation, require_gating
from ..engines.base import MX_PAIRS
from ..routing import Routing
from ..validate import require_no_overlap, require_tensor
from ..weights.low_latency import (
    BlockScaledWeights,
    DeepSeekFp8Activations,
    DeepSeekFp8Weights,
    DenseWeights,
    Fp8PerTensorActivations,
    Fp8PerTensorWeights,
    Fp8WeightOnlyWeights,
    LowLatencyWeights,
    Mxfp8Activations,
    WeightFormat,
)
from ..weights.nvfp4 import Nvfp4Activations
from .config import MAX_TOP_K, LowLatencyMoeConfig

OUT_DTYPES = (torch.bfloat16, torch.float16)
ALIGNMENT = 16  # bytes: the kernels load 16 bytes at a time
_DENSE_DTYPES = {WeightFormat.BF16: torch.bfloat16, WeightFormat.FP16: torch.float16}


def require_aligned(name: str, t: torch.Tensor) -> None:
    if t.data_ptr() % ALIGNMENT:
        raise ValueError(f"{name} must start at a {ALIGNMENT}-byte aligned address (the kernels load 16 bytes at a "
                         f"time); got an offset of {t.data_ptr() % ALIGNMENT} bytes: pass a fresh or .clone()d tensor")




def check_inputs(inputs: object, weights: LowLatencyWeights) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(x, NVFP4 codes or E4M3 codes; NVFP4, DeepSeek FP8 or MXFP8 token scales, or None) after the checks on
    ``inputs``."""
    fmt, hidden = weights.format, weights.hidden_size
    if fmt in MX_PAIRS:
        return _check_mxfp8_inputs(inputs, fmt, hidden)
    if isinstance(inputs, Mxfp8Activations):
        raise TypeError(f"inputs must fit {fmt.value} weights; Mxfp8Activations are for the MX weight + MXFP8 "
                        "activation pairs (config.prepare_weights)")
    if fmt is WeightFormat.DEEPSEEK_FP8:
        return _check_deepseek_inputs(inputs, hidden)
    if isinstance(inputs, DeepSeekFp8Activations):
        raise TypeError(f"inputs must fit {fmt.value} weights; DeepSeekFp8Activations are for DeepSeek FP8 weights")
    if fmt is WeightFormat.FP8_PER_TENSOR:
        if not isinstance(inputs, Fp8PerTensorActivations):
            raise TypeError("inputs must be the Fp8PerTensorActivations of config.prepare_fp8_per_tensor_activations() "
                            f"for per-tensor FP8 weights, got {type(inputs).__name__}")
        codes = require_tensor("inputs.codes", inputs.codes, torch.float8_e4m3fn, rank=2)
        if codes.shape[1] != hidden:
            raise ValueError(f"inputs.codes must be [T, {hidden}] to match the weights, got {tuple(codes.shape)}")
        if not codes.is_contiguous():
            raise ValueError("inputs.codes must be contiguous (row-major)")
        require_aligned("inputs.codes", codes)
        if inputs.input_scale != weights.input_scale:
            raise ValueError(f"inputs were quantized with input_scale={inputs.input_scale!r} but the weights were "
                             f"calibrated with input_scale={weights.input_scale!r}: quantize them with these weights")
        return codes, None
    if isinstance(inputs, Fp8PerTensorActivations):
        raise TypeError(f"inputs must be a BF16/FP16 tensor [T, H] for {fmt.value} weights; Fp8PerTensorActivations "
                        "are for per-tensor FP8 weights")
    if fmt is WeightFormat.NVFP4_W_NVFP4_A:
        if not isinstance(inputs, Nvfp4Activations):
            raise TypeError("inputs must be the Nvfp4Activations of config.prepare_nvfp4_activations() for the NVFP4 "
                            f"weight + NVFP4 activation pair, got {type(inputs).__name__}")
        packed = require_tensor("inputs.packed", inputs.packed, torch.uint8, rank=2)
        scales = require_tensor("inputs.scales", inputs.scales, torch.float8_e4m3fn, rank=2)
        tokens = packed.shape[0]
        if tuple(packed.shape) != (tokens, hidden // 2) or tuple(scales.shape) != (tokens, hidden // 16):
            raise ValueError(f"inputs must be packed [T, {hidden // 2}] and scales [T, {hidden // 16}] for H = {hidden}, "
                             f"got {tuple(packed.shape)} and {tuple(scales.shape)}")
        for name, t in (("inputs.packed", packed), ("inputs.scales", scales)):
            if not t.is_contiguous():
                raise ValueError(f"{name} must be contiguous (row-major)")
        require_aligned("inputs.packed", packed)
        return packed, scales
    if isinstance(inputs, Nvfp4Activations):
        raise TypeError(f"inputs must be a BF16/FP16 tensor [T, H] for {fmt.value} weights; Nvfp4Activations are "
                        "for the NVFP4 weight + NVFP4 activation pair")
    return _check_hidden_states(inputs, token_dtypes(fmt), hidden), None


def token_dtypes(fmt: WeightFormat) -> tuple[torch.dtype, ...]:
    """The dtypes of the token values a call of ``fmt`` weights takes (``hidden_states``, or the codes of its
    prepared activations: uint8 for the NVFP4 pair, float8_e4m3fn for per-tensor FP8, the MX pairs and
    prequantized DeepSeek FP8 tokens), the usual one first."""
    if fmt in _DENSE_DTYPES:
        return (_DENSE_DTYPES[fmt],)
    if fmt is WeightFormat.NVFP4_W_NVFP4_A:
        return (torch.uint8,)
    if fmt is WeightFormat.FP8_PER_TENSOR or fmt in MX_PAIRS:
        return (torch.float8_e4m3fn,)
    if fmt is WeightFormat.DEEPSEEK_FP8:
        return (torch.bfloat16, torch.float8_e4m3fn)
    return OUT_DTYPES


def _check_hidden_states(inputs: object, dtypes: tuple[torch.dtype, ...], hidden: int) -> torch.Tensor:
    """16-bit tokens [T, hidden] of one of ``dtypes``, contiguous and aligned."""
    x = require_tensor("hidden_states", inputs, dtypes, rank=2)
    if x.shape[1] != hidden:
        raise ValueError(f"hidden_states must be [T, {hidden}] to match the weights, got {tuple(x.shape)}")
    if not x.is_contiguous():
        raise ValueError("hidden_states must be contiguous (row-major); call .contiguous() first")
    require_aligned("hidden_states", x)
    return x


def _check_mxfp8_inputs(inputs: object, fmt: WeightFormat, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """MX pairs: the Mxfp8Activations of ``prepare_mxfp8_activations`` (codes float8_e4m3fn [T, H], E8M0 scales
    [T, H/32], contiguous, codes aligned; their values are not read)."""
    if not isinstance(inputs, Mxfp8Activations):
        raise TypeError(f"inputs must be the Mxfp8Activations of config.prepare_mxfp8_activations() for {fmt.value} "
                        f"weights (MXFP8 tokens; BF16/FP16 tokens are not taken), got {type(inputs).__name__}")
    return _check_coded_tokens(inputs.codes, inputs.scales, torch.float8_e8m0fnu, 32, hidden)


def _check_coded_tokens(codes: object, scales: object, scale_dtype: torch.dtype, block: int,
                        hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 token codes [T, hidden] with one scale of ``scale_dtype`` per ``block`` values, [T, hidden / block]:
    contiguous, on one device, the codes 16-byte and the scales 4-byte aligned (``inputs.codes`` / ``inputs.scales`` in
    the errors)."""
    codes = require_tensor("inputs.codes", codes, torch.float8_e4m3fn, rank=2)
    scales = require_tensor("inputs.scales", scales, scale_dtype, rank=2)
    if codes.shape[1] != hidden:
        raise ValueError(f"inputs.codes must be [T, {hidden}] to match the weights, got {tuple(codes.shape)}")
    if tuple(scales.shape) != (codes.shape[0], hidden // block):
        raise ValueError(f"inputs.scales must be [{codes.shape[0]}, {hidden // block}] (one per {block} values), "
                         f"got {tuple(scales.shape)}")
    if scales.device != codes.device:
        raise ValueError(f"inputs.scales is on {scales.device} but inputs.codes is on {codes.device}")
    for name, t in (("inputs.codes", codes), ("inputs.scales", scales)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (row-major)")
    require_aligned("inputs.codes", codes)
    if scales.data_ptr() % 4:
        raise ValueError("inputs.scales must start at a 4-byte aligned address (the tensor-core kernels copy 4 scale "
                         f"bytes at a time); got an offset of {scales.data_ptr() % 4} bytes: pass a .clone()d tensor")
    return codes, scales


def _check_deepseek_inputs(inputs: object, hidden: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """DeepSeek FP8 tokens: BF16 [T, H] (the call quantizes them per 128 values), or the DeepSeekFp8Activations of
    ``prepare_deepseek_fp8_activations`` (codes [T, H], FP32 scales [T, H/128]; their values are not read here)."""
    if isinstance(inputs, DeepSeekFp8Activations):
        return _check_coded_tokens(inputs.codes, inputs.scales, torch.float32, 128, hidden)
    if isinstance(inputs, torch.Tensor) and inputs.dtype is not torch.bfloat16:
        raise TypeError(f"hidden_states must be torch.bfloat16 [T, H] (or DeepSeekFp8Activations) for DeepSeek FP8 "
                        f"weights, got {inputs.dtype}")
    if not isinstance(inputs, torch.Tensor):
        raise TypeError("inputs must be a BF16 tensor [T, H] or the DeepSeekFp8Activations of "
                        f"config.prepare_deepseek_fp8_activations() for DeepSeek FP8 weights, got {type(inputs).__name__}")
    return _check_hidden_states(inputs, (torch.bfloat16,), hidden), None


def weight_tensors(weights: LowLatencyWeights) -> tuple[torch.Tensor, ...]:
    if isinstance(weights, DenseWeights):
        return weights.w1, weights.w2
    if isinstance(weights, Fp8WeightOnlyWeights):
        return weights.w1_codes, weights.w1_scale, weights.w2_codes, weights.w2_scale
    if isinstance(weights, Fp8PerTensorWeights):
        return (weights.w1_codes, weights.fc1_factor, weights.w2_codes, weights.fc2_factor, weights.inter_multiplier,
                weights.w1_scale, weights.w2_scale)
    if isinstance(weights, DeepSeekFp8Weights):
        return weights.w1_codes, weights.w1_scales, weights.w2_codes, weights.w2_scales
    if not isinstance(weights, BlockScaledWeights):
        raise TypeError(f"weights of format {weights.format.value} hold no tensors this op knows")
    tiles = getattr(weights, "tile_form", None) or ()  # tiled MXFP4: its form's scale tiles and globals
    return weights.w1_codes, weights.w1_scales, weights.w2_codes, weights.w2_scales, *tiles


def check_call(
    config: object, weights: object, routing: object, activation: Activation, out_dtype: object, finalize: object
) -> None:
    """Everything but the inputs and ``out``: types, gating, the output dtype, ``finalize``."""
    if not isinstance(routing, Routing):
        raise TypeError("routing must be a cudnn_moe.Routing (Routing.packed(...) or Routing.unpacked(...)), "
                        f"got {type(routing).__name__}")
    check_layer(config, weights, activation, out_dtype, finalize)


def check_layer(config: object, weights: object, activation: Activation, out_dtype: object, finalize: object) -> None:
    """What a call's layer must be, whatever its tokens: the config and weights types, gating, the output dtype,
    ``finalize`` (checked by every call, and by ``LowLatencyMoeConfig.tune``)."""
    if not isinstance(config, LowLatencyMoeConfig):
        raise TypeError(f"config must be a LowLatencyMoeConfig, got {type(config).__name__}")
    if not isinstance(weights, LowLatencyWeights):
        raise TypeError(f"weights must be prepared by LowLatencyMoeConfig (a LowLatencyWeights), got {type(weights).__name__}")
    require_gating(activation, weights.gated)
    if not isinstance(out_dtype, torch.dtype) or out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype must be torch.bfloat16 or torch.float16, got {out_dtype!r}")
    if weights.format is WeightFormat.NVFP4_W_NVFP4_A and out_dtype is not torch.bfloat16:
        raise ValueError(f"out_dtype must be torch.bfloat16 for the NVFP4 weight + NVFP4 activation pair, got {out_dtype!r}")
    if weights.format is WeightFormat.FP8_PER_TENSOR and out_dtype is not torch.bfloat16:
        raise ValueError(f"out_dtype must be torch.bfloat16 for per-tensor FP8 (BF16 expert and final outputs), "
                         f"got {out_dtype!r}")
    if weights.format is WeightFormat.DEEPSEEK_FP8 and out_dtype is not torch.bfloat16:
        raise ValueError(f"out_dtype must be torch.bfloat16 for DeepSeek FP8 (BF16 expert and final outputs), "
                         f"got {out_dtype!r}")
    if not isinstance(finalize, bool):
        raise TypeError(f"finalize must be a bool, got {type(finalize).__name__}")


def check_sizes(tokens: int, routing_tokens: int, top_k: int) -> None:
    """Routing of the inputs' T tokens, top_k <= MAX_TOP_K (T against max_num_tokens: fallback.fallback_for_call)."""
    if routing_tokens != tokens:
        raise ValueError(f"routing covers {routing_tokens} tokens but the inputs hold {tokens}")
    if top_k > MAX_TOP_K:
        raise ValueError(f"routing has top_k={top_k}; the low-latency config takes top_k <= {MAX_TOP_K}")


def check_devices(x: torch.Tensor, ids: torch.Tensor, weights: LowLatencyWeights) -> torch.device:
    device = x.device
    if device.type != "cuda":
        raise ValueError(f"low_latency_moe runs on a CUDA device; the inputs are on {device}")
    for name, t in (("routing", ids), ("weights", weight_tensors(weights)[0])):
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but the inputs are on {device}; all must share one device")
    return device


def check_out(out: object, shape: tuple[int, ...], out_dtype: torch.dtype, finalize: bool, device: torch.device,
              others: list[tuple[str, torch.Tensor]]) -> torch.Tensor:
    """``out``: ``out_dtype`` of ``shape``, contiguous, aligned, on ``device``, sharing no memory with ``others``."""
    out = require_tensor("out", out, out_dtype, rank=len(shape))
    if tuple(out.shape) != shape:
        raise ValueError(f"out must have shape {shape} ({'[T, H]' if finalize else '[T, top_k, H]'}), got {tuple(out.shape)}")
    if not out.is_contiguous():
        raise ValueError("out must be contiguous (row-major)")
    if out.device != device:
        raise ValueError(f"out is on {out.device} but the inputs are on {device}")
    require_aligned("out", out)
    for name, t in others:
        require_no_overlap("out", out, name, t)
    return out


def check_scores_request(return_scores: object, scores_out: object, finalize: bool) -> None:
    """``return_scores`` a bool, only with finalize=False; ``scores_out`` only with return_scores."""
    if not isinstance(return_scores, bool):
        raise TypeError(f"return_scores must be a bool, got {type(return_scores).__name__}")
    if return_scores and finalize:
        raise ValueError("return_scores=True needs finalize=False (the scores come with the raw rows)")
    if scores_out is not None and not return_scores:
        raise ValueError("scores_out is given but return_scores is False; pass return_scores=True with finalize=False")


def check_scores_out(scores_out: object, shape: tuple[int, int], device: torch.device,
                     others: list[tuple[str, torch.Tensor]]) -> torch.Tensor:
    """``scores_out``: float32 [T, top_k], contiguous, on ``device``, sharing no memory with ``others``."""
    scores_out = require_tensor("scores_out", scores_out, torch.float32, rank=2)
    if tuple(scores_out.shape) != shape:
        raise ValueError(f"scores_out must have shape {shape} ([T, top_k]), got {tuple(scores_out.shape)}")
    if not scores_out.is_contiguous():
        raise ValueError("scores_out must be contiguous (row-major)")
    if scores_out.device != device:
        raise ValueError(f"scores_out is on {scores_out.device} but the inputs are on {device}")
    if scores_out.data_ptr() % 4:
        raise ValueError("scores_out must be 4-byte aligned")
    for name, t in others:
        require_no_overlap("scores_out", scores_out, name, t)
    return scores_out
