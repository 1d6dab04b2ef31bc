"""The CUDA-core engine: every low-latency weight format on CUDA cores, the whole layer in two launches
(DeepSeek FP8: three or four, its per-128 quantizations of the tokens and the intermediate being launches of
their own, see ``_run_deepseek_fp8``; the MX pairs quantize their intermediate inside GEMM1's launch).

GEMM1 + activation into an intermediate workspace, then GEMM2 with the finalize folded into its last CTA
per feature column (the raw output skips the finalize): cudnn_moe.engines.cuda_cores.kernels. The kernels
stream each touched expert's weights once, with exact decoders (kernels_cuda/low_latency/decode.cuh), and
round at the points of cudnn_moe.low_latency.reference. NVRTC compiles them for the GPU at hand; they run on
SM80 (16-bit weights only), SM90, SM100, SM103, SM107 and SM120.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Hashable, Mapping

import torch

from ...arch import SM80, SM90, SM100, SM103, SM107, SM120
from ...capture import refuse_during_capture
from ..base import (
    MX_PAIRS,
    OP_LOW_LATENCY,
    LayerEngine,
    LowLatencyCall,
    Request,
    Service,
    Support,
    WeightFormat,
    WorkspaceSpec,
)
from . import kernels

MAX_TOKENS = 8
_FOUR_BIT = frozenset({WeightFormat.NVFP4_WEIGHT_ONLY.value, WeightFormat.MXFP4_WEIGHT_ONLY.value,
                       WeightFormat.MXINT4_WEIGHT_ONLY.value, WeightFormat.NVFP4_W_NVFP4_A.value})
# FP8 weights: SM89 on have the E4M3 conversion (the kernels use it); the contract lists them from SM90 on.
_FP8 = frozenset({WeightFormat.FP8_WEIGHT_ONLY.value, WeightFormat.FP8_PER_TENSOR.value,
                  WeightFormat.DEEPSEEK_FP8.value})
# SM80 runs the 16-bit formats only. The contract lists the NVFP4 weight + NVFP4 activation pair without an
# architecture of its own; it shares the 4-bit kernels (software E2M1 decode), so it runs where they do.
_MODERN = frozenset({SM90, SM100, SM103, SM107, SM120})
# MXFP4 / MXFP8 weights with MXFP8 tokens: E4M3 conversions (SM89 on) like the FP8 formats; the contract's archs.
_MX_PAIRS = frozenset(f.value for f in MX_PAIRS)
_ready: set[tuple[str, WeightFormat, torch.dtype | None, bool, int]] = set()
_ready_lock = threading.Lock()


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


class CudaCoresEngine(LayerEngine):
    """The low-latency layer on CUDA cores (see the module docstring). ``tactic``: how its kernels' dot products
    run (kernels.FMA here; an engine serving the same calls with other dot products, e.g. tensor cores, subclasses
    this one with its own tactic and services)."""

    name = "cuda_cores"
    tactic: kernels.Tactic = kernels.FMA
    services = (
        Service(OP_LOW_LATENCY, frozenset({WeightFormat.BF16.value, WeightFormat.FP16.value}), _MODERN | {SM80},
                max_tokens=MAX_TOKENS),
        Service(OP_LOW_LATENCY, _FOUR_BIT, _MODERN, max_tokens=MAX_TOKENS),
        Service(OP_LOW_LATENCY, _FP8, _MODERN, max_tokens=MAX_TOKENS),
        Service(OP_LOW_LATENCY, _MX_PAIRS, _MODERN, max_tokens=MAX_TOKENS),
    )

    @classmethod
    def check(cls, request: Request) -> Support:
        for shape in request.shapes:
            if shape.k % 8:
                return Support(False, f"the cuda_cores kernels need the hidden size to be a multiple of 8, got {shape.k}")
            if request.weight_format in _FP8 and shape.k % 16:
                return Support(False, f"the cuda_cores FP8 kernels need K to be a multiple of 16, got {shape.k}")
        return Support(True)

    @classmethod
    def workspace_spec(cls, call: LowLatencyCall) -> tuple[Hashable, WorkspaceSpec]:
        """Per (max tokens, top_k): ``inter`` int16 [S, Ip] (the 16-bit intermediate of every slot, S = max tokens
        x top_k), ``rows`` int16 [S, H] (the expert rows the finalize combines; int16 storage so one set serves
        every dtype), ``counters`` int32 [GEMM2 feature columns] (zero between calls: the tickets by which the
        last CTA of a column knows it may combine it; it resets them).

        DeepSeek FP8 adds ``inter`` as float32 [S, Ip] (GEMM1's unrounded FP32 activation), ``inter_codes`` uint8
        [S, Ip] + ``inter_scales`` float32 [S, Ip/128] (that activation quantized per 128 values), and
        ``x_codes`` uint8 [max tokens, H] + ``x_scales`` float32 [max tokens, H/128] (BF16 tokens quantized per
        128 values).

        The MX pairs hold no 16-bit ``inter``: ``inter_codes`` uint8 [S, Ip] + ``inter_scales`` uint8 [S, Ip/32] (the
        MXFP8 intermediate GEMM1 writes: E4M3 codes and E8M0 scale bytes)."""
        w, slots = call.weights, call.max_tokens * call.top_k
        spec = {
            "inter": ((slots, w.padded_intermediate), torch.int16),
            "rows": ((slots, w.hidden_size), torch.int16),
            "counters": ((cls.tactic.max_gemm2_columns(w.hidden_size),), torch.int32),
        }
        if w.format is WeightFormat.DEEPSEEK_FP8:
            ip, h = w.padded_intermediate, w.hidden_size
            spec.update({
                "inter": ((slots, ip), torch.float32),
                "inter_codes": ((slots, ip), torch.uint8),
                "inter_scales": ((slots, ip // 128), torch.float32),
                "x_codes": ((call.max_tokens, h), torch.uint8),
                "x_scales": ((call.max_tokens, h // 128), torch.float32),
            })
        if w.format.value in _MX_PAIRS:
            del spec["inter"]
            spec.update({
                "inter_codes": ((slots, w.padded_intermediate), torch.uint8),
                "inter_scales": ((slots, w.padded_intermediate // kernels.MX_BLOCK), torch.uint8),
            })
        return (call.max_tokens, call.top_k), spec

    @classmethod
    def run(cls, call: LowLatencyCall, workspace: Mapping[str, torch.Tensor]) -> None:
        w, device = call.weights, call.x.device
        index = device.index if device.index is not None else torch.cuda.current_device()
        tactic = cls.tactic
        _ensure_ready(cls.name, tactic, w.format, call.x_dtype, w.tiled, index)
        ids, route_weights, routing_code = call.routing.kernel_operands()
        tokens, top_k, sms = call.tokens, call.top_k, _sm_count(index)
        out_fp16 = call.out_dtype is torch.float16
        if w.format is WeightFormat.DEEPSEEK_FP8:
            _run_deepseek_fp8(call, workspace, ids, route_weights, routing_code, sms, tactic)
            return
        mx = w.format.value in _MX_PAIRS  # MXFP8 intermediate: codes and scales
        inter = workspace["inter_codes" if mx else "inter"]
        inter_scales = workspace["inter_scales"] if mx else None
        kernels.gemm1(w, call.x, call.x_scales, ids, routing_code, tokens, top_k, call.activation, inter, sms,
                      inter_scales=inter_scales, tactic=tactic)
        if call.finalize:
            kernels.gemm2(w, call.x_dtype, inter, ids, route_weights, routing_code, tokens, top_k, out_fp16,
                          workspace["rows"], call.out, workspace["counters"], sms, inter_scales=inter_scales,
                          tactic=tactic)
        else:
            kernels.gemm2(w, call.x_dtype, inter, ids, route_weights, routing_code, tokens, top_k, out_fp16,
                          call.out, None, None, sms, call.scores, inter_scales=inter_scales, tactic=tactic)


def _run_deepseek_fp8(call: LowLatencyCall, workspace: Mapping[str, torch.Tensor], ids: torch.Tensor,
                      route_weights: torch.Tensor | None, routing_code: int, sms: int, tactic: kernels.Tactic) -> None:
    """DeepSeek FP8 in four launches (three for prequantized tokens): BF16 tokens quantized per 128 values
    (ll_quant128), GEMM1 + activation into the FP32 workspace, that activation quantized per 128 values
    (ll_quant128), GEMM2 on the codes and scales (and the finalize). The quantization of the intermediate is a
    launch of its own because GEMM1's CTAs each hold a few features of a 128-feature block, so none sees the
    block's amax; the numbers are the same as a fused quantization would give."""
    w, fmt, tokens, top_k = call.weights, call.weights.format, call.tokens, call.top_k
    x, x_scales = call.x, call.x_scales
    if x_scales is None:  # BF16 tokens
        x_codes, x_scales = workspace["x_codes"], workspace["x_scales"]
        kernels.quant128(fmt, x, tokens, x_codes, x_scales, tactic)
        x = x_codes
    inter = workspace["inter"]
    kernels.gemm1(w, x, x_scales, ids, routing_code, tokens, top_k, call.activation, inter, sms, tactic=tactic)
    kernels.quant128(fmt, inter, tokens * top_k, workspace["inter_codes"], workspace["inter_scales"], tactic)
    if call.finalize:
        kernels.gemm2(w, None, workspace["inter_codes"], ids, route_weights, routing_code, tokens, top_k, False,
                      workspace["rows"], call.out, workspace["counters"], sms, inter_scales=workspace["inter_scales"],
                      tactic=tactic)
    else:
        kernels.gemm2(w, None, workspace["inter_codes"], ids, route_weights, routing_code, tokens, top_k, False,
                      call.out, None, None, sms, call.scores, inter_scales=workspace["inter_scales"], tactic=tactic)


def _ensure_ready(engine: str, tactic: kernels.Tactic, fmt: WeightFormat, x_dtype: torch.dtype | None, tiles: bool,
                  index: int) -> None:
    """Compile (or load) the module once per process, engine, layout and device; never inside a CUDA-graph
    capture."""
    key = (engine, fmt, x_dtype, tiles, index)
    if key in _ready:
        return
    refuse_during_capture("the low-latency kernels for these weights and inputs are not loaded yet",
                          "run one call eagerly before capturing")
    kernels.load_modules(fmt, x_dtype, index, tactic, tiles)
    with _ready_lock:
        _ready.add(key)
