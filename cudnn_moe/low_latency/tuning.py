"""Measuring the low-latency op's tactic (``LowLatencyMoeConfig.tune``): per token count, every engine of the
registry that supports the call is timed on the GPU and the fastest is stored (cudnn_moe.low_latency.tactics),
so later "auto" calls of that layer and token count run on it.

Per token count T: random tokens of the layer's kind (x_dtype) and random routing (top_k distinct experts per
token, softmax route weights), one output buffer; per candidate engine, the call with that engine named is
captured in its own CUDA graph after one eager call (cudnn_moe.capture.capture_graph), replayed WARMUP_REPLAYS
times, then timed over ``iters`` replays (the median, cudnn_moe.timing.median_us), each after a write of
twice the GPU's L2 (so the weights come from HBM, as in a model whose other layers pass through L2 between
two calls of this one). Every engine computes the layer to the same rounding points (only the order of the
FP32 sums inside the GEMMs differs, as between the engines and the float64 reference), so the choice changes
the time, not the contract. The weights are the caller's; nothing they hold is written.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

import torch

from ..activations import Activation, parse_activation
from ..arch import device_arch
from ..capture import capture_graph, refuse_during_capture
from ..engines.base import MX_PAIRS
from ..engines.registry import choose, supporting
from ..formats.fp8 import quantize_fp8_act128
from ..routing import Routing
from ..timing import median_us
from ..weights.low_latency import LowLatencyWeights, WeightFormat
from .checks import check_layer, token_dtypes, weight_tensors
from .config import MAX_TOP_K, LowLatencyMoeConfig
from .op import low_latency_moe
from .tactics import TacticKey, TuningResult, layer_request, store

WARMUP_REPLAYS = 3


def _check_tokens(tokens: int | Iterable[int] | None, max_num_tokens: int) -> list[int]:
    """The token counts to tune: 1..max_num_tokens by default; else ints in that range (sorted, deduplicated)."""
    if tokens is None:
        return list(range(1, max_num_tokens + 1))
    counts = [tokens] if isinstance(tokens, int) and not isinstance(tokens, bool) else tokens
    try:
        counts = list(counts)
    except TypeError:
        raise TypeError(f"tokens must be an int, a sequence of ints or None, got {type(tokens).__name__}") from None
    if not counts:
        raise ValueError("tokens must name at least one token count")
    for t in counts:
        if isinstance(t, bool) or not isinstance(t, int):
            raise TypeError(f"tokens must hold ints, got {t!r}")
        if not 1 <= t <= max_num_tokens:
            raise ValueError(f"tokens must lie in 1..max_num_tokens={max_num_tokens} (calls above it run on the "
                             f"fallback, which has no tactic), got {t}")
    return sorted(set(counts))


def _check_top_k(top_k: object, experts: int) -> int:
    if isinstance(top_k, bool) or not isinstance(top_k, int):
        raise TypeError(f"top_k must be an int, got {type(top_k).__name__}")
    if not 1 <= top_k <= min(MAX_TOP_K, experts):
        raise ValueError(f"top_k must lie in 1..{min(MAX_TOP_K, experts)} (at most {MAX_TOP_K}, and distinct experts "
                         f"of the weights' {experts}), got {top_k}")
    return top_k


def _check_x_dtype(x_dtype: object, fmt: WeightFormat) -> torch.dtype:
    allowed = token_dtypes(fmt)
    if x_dtype is None:
        return allowed[0]
    if not isinstance(x_dtype, torch.dtype):
        raise TypeError(f"x_dtype must be a torch.dtype or None, got {type(x_dtype).__name__}")
    if x_dtype not in allowed:
        raise ValueError(f"x_dtype must be one of {', '.join(map(str, allowed))} for {fmt.value} weights (the dtype "
                         f"of the token values the calls pass), got {x_dtype}")
    return x_dtype


def _token_dtype(fmt: WeightFormat, x_dtype: torch.dtype) -> torch.dtype | None:
    """The request's token dtype of calls passing token values of ``x_dtype``: None where they come as codes
    with scales (the NVFP4 pair, the MX pairs, prequantized DeepSeek FP8), as the op sets it."""
    codes_with_scales = fmt is WeightFormat.NVFP4_W_NVFP4_A or fmt in MX_PAIRS or (
        fmt is WeightFormat.DEEPSEEK_FP8 and x_dtype is torch.float8_e4m3fn)
    return None if codes_with_scales else x_dtype


def _inputs(config: LowLatencyMoeConfig, weights: LowLatencyWeights, x_dtype: torch.dtype, tokens: int,
            gen: torch.Generator) -> object:
    """Random inputs of ``tokens`` tokens as a call of these weights takes them (token values of ``x_dtype``)."""
    x = torch.randn(tokens, weights.hidden_size, device=gen.device, generator=gen)
    fmt = weights.format
    if fmt is WeightFormat.NVFP4_W_NVFP4_A:
        return config.prepare_nvfp4_activations(x)
    if fmt in MX_PAIRS:
        return config.prepare_mxfp8_activations(x)
    if fmt is WeightFormat.FP8_PER_TENSOR:
        return config.prepare_fp8_per_tensor_activations(x, weights)
    if fmt is WeightFormat.DEEPSEEK_FP8 and x_dtype is torch.float8_e4m3fn:
        return config.prepare_deepseek_fp8_activations(*quantize_fp8_act128(x), weights)
    return x.to(x_dtype)


def _cuda_device(weights: LowLatencyWeights) -> torch.device:
    """The weights' CUDA device; ValueError when they are elsewhere."""
    device = weight_tensors(weights)[0].device
    if device.type != "cuda":
        raise ValueError(f"weights must be on a CUDA device to be tuned, they are on {device}")
    return device


def _routing(tokens: int, top_k: int, experts: int, gen: torch.Generator) -> Routing:
    ids = torch.rand(tokens, experts, device=gen.device, generator=gen).argsort(1)[:, :top_k].to(torch.int32)
    return Routing.unpacked(ids, torch.softmax(torch.randn(tokens, top_k, device=gen.device, generator=gen), 1))


def tune(
    config: LowLatencyMoeConfig,
    weights: LowLatencyWeights,
    *,
    top_k: int,
    activation: Activation | str,
    out_dtype: torch.dtype,
    finalize: bool,
    tokens: int | Iterable[int] | None,
    x_dtype: torch.dtype | None,
    iters: int,
    progress: Callable[[str], None] | None,
) -> dict[int, TuningResult]:
    """``LowLatencyMoeConfig.tune`` (its docstring); the module docstring says how the engines are timed."""
    act = parse_activation(activation)
    check_layer(config, weights, act, out_dtype, finalize)
    top_k = _check_top_k(top_k, weights.num_experts)
    counts = _check_tokens(tokens, config.max_num_tokens)
    x_dtype = _check_x_dtype(x_dtype, weights.format)
    if isinstance(iters, bool) or not isinstance(iters, int) or iters < 1:
        raise ValueError(f"iters must be a positive int, got {iters!r}")
    if progress is not None and not callable(progress):
        raise TypeError(f"progress must be a callable taking a str, or None, got {type(progress).__name__}")
    device = _cuda_device(weights)
    refuse_during_capture("LowLatencyMoeConfig.tune times the engines in CUDA graphs of its own",
                          "tune before capturing")
    arch, token_dtype = device_arch(device), _token_dtype(weights.format, x_dtype)
    requests = {t: layer_request(weights, arch, t, token_dtype, out_dtype, finalize) for t in counts}
    candidates = {t: supporting(request) for t, request in requests.items()}
    for t, engines in candidates.items():
        if not engines:
            choose(requests[t])  # raises ValueError saying why no engine runs the call
    table: dict[int, TuningResult] = {}
    with torch.cuda.device(device):
        gen = torch.Generator(device=device).manual_seed(0)
        flush = torch.empty(2 * torch.cuda.get_device_properties(device).L2_cache_size, dtype=torch.uint8,
                            device=device)
        for t in counts:
            inputs = _inputs(config, weights, x_dtype, t, gen)
            routing = _routing(t, top_k, weights.num_experts, gen)
            out = torch.empty((t, weights.hidden_size) if finalize else (t, top_k, weights.hidden_size),
                              dtype=out_dtype, device=device)
            times = {}
            for engine in candidates[t]:
                named = LowLatencyMoeConfig(config.max_num_tokens, arch=config.arch, engine=engine.name)
                graph = capture_graph(functools.partial(low_latency_moe, named, inputs, weights, routing,
                                                        activation=act, out_dtype=out_dtype, finalize=finalize,
                                                        out=out))
                times[engine.name] = median_us(graph.replay, iters, warmup=WARMUP_REPLAYS, flush=flush)
                del graph
            result = TuningResult(min(times, key=times.get), times)
            store(TacticKey(requests[t], top_k, weights.gated, x_dtype, device.index), result, iters)
            table[t] = result
            if progress is not None:
                progress(f"{weights.format.value} T={t}: " + ", ".join(f"{n} {us:.1f} us" for n, us in times.items())
                         + f" -> {result.engine}")
    return table
