"""The low-latency MoE call: ``low_latency_moe`` (1..8 tokens, contract 004) on the GPU.

Two kernel launches on torch's current stream (cudnn_moe.low_latency.kernels, CUDA cores): GEMM1 +
activation, then GEMM2 with the finalize folded into its last CTA per feature column (the raw output skips
the finalize). On SM90, finalized calls with NVFP4 weight-only weights and BF16 tokens and output, or with
the NVFP4 pair, run on the tensor cores instead (cudnn_moe.low_latency.tensor_cores: the SM90 engine's
pipeline, same rounding points).
The call allocates nothing when ``out`` is given (workspaces are cached per weights,
cudnn_moe.low_latency.workspace) and reads no device data, so a caller can record it in its own CUDA
graph once one eager call has warmed it up (kernels compiled, workspace allocated). The CUDA-core path
never synchronizes; the tensor-core path captures CUDA graphs (a device sync each) on the first call of
a token count and on the second consecutive call of a new set of tensors, then replays them: reuse the
input and ``out`` tensors across decode steps.
Every argument is checked before anything is launched; errors name the argument (TypeError for a wrong
type or dtype, ValueError for a wrong value).

Numerics are those of cudnn_moe.low_latency.reference, rounding point for rounding point:

- preactivation (GEMM1 in FP32) rounded to the input dtype (BF16 or FP16) for BF16, FP16, NVFP4 and
  MXFP4 weights; kept in FP32 for MXINT4; rounded to BF16 for the NVFP4 weight + NVFP4 activation pair;
- activation in FP32, intermediate rounded to the input dtype (BF16 for the pair);
- expert rows (GEMM2 in FP32) rounded to ``out_dtype``;
- finalize: per token, in slot order, acc = fp32(acc + fp32(w * row)) (separate multiply and add),
  rounded once to ``out_dtype``; packed route weights are their BF16 values.

Only the order of the FP32 sums inside the GEMMs differs from the float64 reference.

Expert ids outside [0, E): for the NVFP4 pair they mark unrouted slots (finalize skips them and their
route weights, so a NaN there never reaches the output; the raw output has zero rows for them). For the
other formats the contract requires ids in [0, E); checking that would need a device sync, so it is not
checked: the kernels never read out of bounds for such ids and currently treat them like the pair does,
but that result is not part of the contract (the float reference raises ValueError for them).
"""

from __future__ import annotations

import functools
import threading

import torch

from ..activations import Activation, SwiGLU, parse_activation
from ..arch import arch_name, device_arch
from ..config import Nvfp4Activations
from ..pipeline import release_deferred
from ..routing import Routing
from ..validate import require_no_overlap, require_tensor
from . import kernels, tensor_cores
from .config import MAX_TOP_K, LowLatencyMoeConfig
from .weights import BlockScaledWeights, DenseWeights, LowLatencyWeights, WeightFormat
from .workspace import workspace_for

OUT_DTYPES = (torch.bfloat16, torch.float16)
_DENSE_DTYPES = {WeightFormat.BF16: torch.bfloat16, WeightFormat.FP16: torch.float16}
_ready: set[tuple[WeightFormat, torch.dtype | None, int]] = set()
_ready_lock = threading.Lock()


def _aligned(name: str, t: torch.Tensor, align: int = 16) -> None:
    if t.data_ptr() % align:
        raise ValueError(f"{name} must start at a {align}-byte aligned address (the kernels load 16 bytes at a "
                         f"time); got an offset of {t.data_ptr() % align} bytes: pass a fresh or .clone()d tensor")


def _check_inputs(
    inputs: object, weights: LowLatencyWeights
) -> tuple[torch.Tensor, torch.Tensor | None, torch.dtype | None, int]:
    """(x or NVFP4 codes, NVFP4 scales or None, x dtype or None, T) after the checks on ``inputs``."""
    fmt, hidden = weights.format, weights.hidden_size
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
        _aligned("inputs.packed", packed)
        return packed, scales, None, tokens
    if isinstance(inputs, Nvfp4Activations):
        raise TypeError(f"inputs must be a BF16/FP16 tensor [T, H] for {fmt.value} weights; Nvfp4Activations are "
                        "for the NVFP4 weight + NVFP4 activation pair")
    dtypes = (_DENSE_DTYPES[fmt],) if fmt in _DENSE_DTYPES else OUT_DTYPES
    x = require_tensor("hidden_states", inputs, dtypes, rank=2)
    if x.shape[1] != hidden:
        raise ValueError(f"hidden_states must be [T, {hidden}] to match the weights, got {tuple(x.shape)}")
    if not x.is_contiguous():
        raise ValueError("hidden_states must be contiguous (row-major); call .contiguous() first")
    _aligned("hidden_states", x)
    return x, None, x.dtype, x.shape[0]


def _weight_tensors(weights: LowLatencyWeights) -> tuple[torch.Tensor, ...]:
    if isinstance(weights, DenseWeights):
        return weights.w1, weights.w2
    assert isinstance(weights, BlockScaledWeights)
    return weights.w1_codes, weights.w1_scales, weights.w2_codes, weights.w2_scales


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _ensure_ready(fmt: WeightFormat, x_dtype: torch.dtype | None, device: torch.device) -> None:
    """Compile (or load) the module once per process and device; never inside a CUDA-graph capture."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (fmt, x_dtype, index)
    if key in _ready:
        return
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("the low-latency MoE kernels for these weights and inputs are not loaded yet and the current "
                           "stream is capturing a CUDA graph; run one call eagerly before capturing")
    kernels.load_modules(fmt, x_dtype, index)
    with _ready_lock:
        _ready.add(key)


def low_latency_moe(
    config: LowLatencyMoeConfig,
    inputs: torch.Tensor | Nvfp4Activations,
    weights: LowLatencyWeights,
    routing: Routing,
    *,
    activation: Activation | str = SwiGLU(),
    out_dtype: torch.dtype = torch.bfloat16,
    finalize: bool = True,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run one routed MoE layer of 1..``config.max_num_tokens`` tokens on the GPU.

    inputs: hidden states [T, H], BF16 or FP16 (BF16 for BF16 weights, FP16 for FP16 weights; either
        for the 4-bit weight-only formats), 16-byte aligned and contiguous; for the NVFP4 pair the
        Nvfp4Activations of ``config.prepare_nvfp4_activations``.
    weights: from one of the config's prepare methods (any format of ``weights.format``).
    routing: ``Routing.packed`` or ``Routing.unpacked`` [T, top_k], top_k <= 32, on the same device.
    activation: one of the ten typed activations (gated iff the weights were prepared gated).
    out_dtype: torch.bfloat16 or torch.float16 (the expert rows and the output; BF16 only for the pair).
    finalize: True returns out_dtype [T, H], the route-weighted sum; False returns the raw per-slot
        rows out_dtype [T, top_k, H] (row (t, j) is slot j of token t; zero rows for unrouted slots).
    out: optional destination of that shape and dtype (contiguous, 16-byte aligned, same device,
        sharing no memory with the inputs); with it the call allocates nothing.

    Returns ``out`` (or a new tensor). T = 0 returns an empty result and launches nothing.
    """
    release_deferred()  # GPU objects of dropped weights, destroyed here rather than inside a capture
    if not isinstance(config, LowLatencyMoeConfig):
        raise TypeError(f"config must be a LowLatencyMoeConfig, got {type(config).__name__}")
    if not isinstance(weights, LowLatencyWeights):
        raise TypeError(f"weights must be prepared by LowLatencyMoeConfig (a LowLatencyWeights), got {type(weights).__name__}")
    if not isinstance(routing, Routing):
        raise TypeError("routing must be a cudnn_moe.Routing (Routing.packed(...) or Routing.unpacked(...)), "
                        f"got {type(routing).__name__}")
    act = parse_activation(activation)
    if act.gated != weights.gated:
        raise ValueError(f"activation {type(act).__name__} is {'gated' if act.gated else 'non-gated'} but the weights were "
                         f"prepared for a {'gated' if weights.gated else 'non-gated'} activation")
    if not isinstance(out_dtype, torch.dtype) or out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype must be torch.bfloat16 or torch.float16, got {out_dtype!r}")
    fmt = weights.format
    if fmt is WeightFormat.NVFP4_W_NVFP4_A and out_dtype is not torch.bfloat16:
        raise ValueError(f"out_dtype must be torch.bfloat16 for the NVFP4 weight + NVFP4 activation pair, got {out_dtype!r}")
    if not isinstance(finalize, bool):
        raise TypeError(f"finalize must be a bool, got {type(finalize).__name__}")
    x, x_scales, x_dtype, tokens = _check_inputs(inputs, weights)
    hidden = weights.hidden_size
    if tokens > config.max_num_tokens:
        raise ValueError(f"hidden_states hold {tokens} tokens, more than the config's max_num_tokens={config.max_num_tokens}")
    if routing.num_tokens != tokens:
        raise ValueError(f"routing covers {routing.num_tokens} tokens but the inputs hold {tokens}")
    top_k = routing.top_k
    if top_k > MAX_TOP_K:
        raise ValueError(f"routing has top_k={top_k}; the low-latency config takes top_k <= {MAX_TOP_K}")
    ids, route_weights, routing_code = routing.kernel_operands()
    device = x.device
    if device.type != "cuda":
        raise ValueError(f"low_latency_moe runs on a CUDA device; the inputs are on {device}")
    for name, t in (("routing", ids), ("weights", _weight_tensors(weights)[0])):
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but the inputs are on {device}; all must share one device")
    if hidden % 8:
        raise ValueError(f"the GPU kernels need the hidden size to be a multiple of 8, got {hidden}")
    arch = device_arch(device)
    if not config.supported(arch):
        raise ValueError(f"the low-latency config does not run on {arch_name(arch)}")
    config.require_format(arch, fmt)
    shape = (tokens, hidden) if finalize else (tokens, top_k, hidden)
    if out is not None:
        out = require_tensor("out", out, out_dtype, rank=len(shape))
        if tuple(out.shape) != shape:
            raise ValueError(f"out must have shape {shape} ({'[T, H]' if finalize else '[T, top_k, H]'}), got {tuple(out.shape)}")
        if not out.is_contiguous():
            raise ValueError("out must be contiguous (row-major)")
        if out.device != device:
            raise ValueError(f"out is on {out.device} but the inputs are on {device}")
        _aligned("out", out)
        others = [("hidden_states", x), ("routing", ids)]
        if x_scales is not None:
            others.append(("inputs.scales", x_scales))
        if route_weights is not None:
            others.append(("routing weights", route_weights))
        others += [(f"weights tensor {i}", t) for i, t in enumerate(_weight_tensors(weights))]
        for name, t in others:
            require_no_overlap("out", out, name, t)
    if tokens == 0:
        return out if out is not None else torch.empty(shape, dtype=out_dtype, device=device)
    if out is None:
        out = torch.empty(shape, dtype=out_dtype, device=device)
    if tensor_cores.applies(weights, x_dtype, out_dtype, finalize, arch):
        tensor_cores.run(x, x_scales, weights, routing, act, out)
        return out
    _ensure_ready(fmt, x_dtype, device)
    workspace = workspace_for(weights, config.max_num_tokens, top_k, device)
    out_fp16 = out_dtype is torch.float16
    sms = _sm_count(device)
    kernels.gemm1(weights, x, x_scales, ids, routing_code, tokens, top_k, act, workspace.inter, sms)
    if finalize:
        kernels.gemm2(weights, x_dtype, workspace.inter, ids, route_weights, routing_code, tokens, top_k, out_fp16,
                      workspace.rows, out, workspace.counters, sms)
    else:
        kernels.gemm2(weights, x_dtype, workspace.inter, ids, route_weights, routing_code, tokens, top_k, out_fp16,
                      out, None, None, sms)
    return out
