"""Test material of the low-latency FP8 formats whose intermediate is quantized to E4M3 (per-tensor FP8, DeepSeek
FP8), shared by the GPU tests of every engine that runs them (tests/ops/low_latency: the CUDA-core engine, the
default; tests/engines/ll_mma: the tensor-core engine): random layers and tokens, and the checks of a call that
has just run, which read the intermediate the engine left in its workspace of the weights.

Why the checks look at the intermediate. The kernels round where the references do, but an E4M3 rounding of one
intermediate value that lies within FP32 ulps of a boundary may go the other way (2^-3 of the value), more than
the BF16-level bounds of tests.support.low_latency allow downstream. So each check asserts that the GPU's
intermediate equals the reference's step 2 except for at most 0.5% of the values, each at most one E4M3 step off,
and then compares the rows and outputs with the reference run on the GPU's own intermediate.
"""

from __future__ import annotations

import functools

import torch

from cudnn_moe.activations import SiLU, SwiGLU
from cudnn_moe.formats.fp8 import quantize_fp8_act128
from cudnn_moe.low_latency import (
    LowLatencyMoeConfig,
    deepseek_fp8_intermediate,
    fp8_per_tensor_intermediate,
    reference_deepseek_fp8,
    reference_fp8_per_tensor,
)
from cudnn_moe.pipeline.workspaces import workspace_for
from tests.support.low_latency import DEV, E, assert_close_to_reference, fp8_codes

PER_TENSOR_SHAPE = (256, 96)  # (H, I): I = 96 pads to 128
INPUT_SCALE = 4.0 / 448  # N(0, 1) tokens: |x| up to about 4
INTERMEDIATE_SCALE = 8.0 / 448
DEEPSEEK_SHAPE = (256, 256)  # two 128-blocks along each
MAX_FLIPS = 0.005  # fraction of intermediate values allowed one E4M3 step off the reference


@functools.cache
def fp8_per_tensor_layer(gated: bool, experts: int = E, shape: tuple[int, int] = PER_TENSOR_SHAPE, seed: int = 0):
    """(config, Fp8PerTensorWeights) quantized from random BF16 weights (preactivations near unit size)."""
    hidden, inter = shape
    gen = torch.Generator().manual_seed(seed)
    w1 = (torch.randn(experts, (2 if gated else 1) * inter, hidden, generator=gen) / hidden**0.5).bfloat16().to(DEV)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) / inter**0.5).bfloat16().to(DEV)
    config = LowLatencyMoeConfig(8)
    weights = config.prepare_fp8_per_tensor_weights(w1, w2, INPUT_SCALE, INTERMEDIATE_SCALE,
                                                    activation=SwiGLU() if gated else SiLU())
    return config, weights


@functools.cache
def deepseek_fp8_layer(gated: bool, experts: int = E, shape: tuple[int, int] = DEEPSEEK_SHAPE, seed: int = 0):
    """(config, DeepSeekFp8Weights) of random E4M3 codes with block scales putting preactivations near unit size."""
    hidden, inter = shape
    gen = torch.Generator().manual_seed(seed)
    n1 = (2 if gated else 1) * inter
    w1 = fp8_codes(gen, (experts, n1, hidden))
    w2 = fp8_codes(gen, (experts, hidden, inter))
    s1 = (torch.rand(experts, n1 // 128, hidden // 128, generator=gen) + 0.5) / (16 * hidden**0.5)
    s2 = (torch.rand(experts, hidden // 128, inter // 128, generator=gen) + 0.5) / (16 * inter**0.5)
    config = LowLatencyMoeConfig(8)
    weights = config.prepare_deepseek_fp8_weights(w1.to(DEV), s1.to(DEV), w2.to(DEV), s2.to(DEV),
                                                  activation=SwiGLU() if gated else SiLU())
    return config, weights


def tokens_bf16(tokens: int, hidden: int, seed: int) -> torch.Tensor:
    """N(0, 1) BF16 tokens [T, H] (per-tensor FP8's, quantized with its static input scale)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, hidden, generator=gen).bfloat16().to(DEV)


def scaled_tokens_bf16(tokens: int, hidden: int, seed: int) -> torch.Tensor:
    """BF16 tokens [T, H] of a random size per token (0.25 .. 3.25: DeepSeek FP8's scales per 128 see it)."""
    gen = torch.Generator().manual_seed(seed)
    scale = torch.rand(tokens, 1, generator=gen) * 3 + 0.25
    return (torch.randn(tokens, hidden, generator=gen) * scale).bfloat16().to(DEV)


def engine_workspace(config: LowLatencyMoeConfig, weights, top_k: int, engine: str) -> dict[str, torch.Tensor]:
    """The buffers ``engine`` keeps for these weights and calls of ``config`` (cudnn_moe.pipeline.workspaces)."""
    key = (engine, (config.max_num_tokens, top_k))
    return workspace_for(weights, key, {}, weights.w1_codes.device).buffers


def e4m3_index(codes: torch.Tensor) -> torch.Tensor:
    """Signed position of E4M3 codes (float8_e4m3fn or uint8) on the code line (+-0 -> 0, neighbours one apart)."""
    c = codes.view(torch.uint8).long()
    return torch.where(c >= 128, -(c - 128), c)


def _check_flips(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """got, want: E4M3 codes of one shape; at most MAX_FLIPS of them differ in value (+0 and -0 are one value),
    each by one step."""
    steps = (e4m3_index(got) - e4m3_index(want)).abs()
    flips = steps != 0
    assert float(flips.double().mean()) <= MAX_FLIPS, f"{what}: {int(flips.sum())} of {flips.numel()} intermediate values differ"
    assert bool((steps <= 1).all()), f"{what}: an intermediate value is {int(steps.max())} E4M3 steps from the reference"


def check_fp8_per_tensor_call(config, weights, acts, routing, act, got: torch.Tensor, finalize: bool, what: str,
                              engine: str = "cuda_cores") -> None:
    """Per-tensor FP8, on a call that has just run on ``engine`` (nothing else since on these weights): the
    intermediate (BF16 storage of unscaled E4M3 values, padding features +0) against the reference's step 2, then
    the rows / output against the reference on that intermediate."""
    torch.cuda.synchronize()
    tokens, top_k, inter = acts.num_tokens, routing.top_k, weights.intermediate_size
    buffers = engine_workspace(config, weights, top_k, engine)
    gpu_q = buffers["inter"][: tokens * top_k].view(torch.bfloat16).double().reshape(tokens, top_k, -1)
    want_q = fp8_per_tensor_intermediate(acts, weights, routing, act)
    assert not bool(gpu_q.isnan().any()), f"{what}: the intermediate holds NaN"
    assert bool((gpu_q[..., inter:] == 0).all()), f"{what}: padding features of the intermediate are not +0"
    gpu_q = gpu_q[..., :inter]
    codes = gpu_q.float().to(torch.float8_e4m3fn)
    assert torch.equal(gpu_q, codes.double()), f"{what}: intermediate not E4M3-valued"
    _check_flips(codes, want_q.float().to(torch.float8_e4m3fn), what)
    want = reference_fp8_per_tensor(acts, weights, routing, act, finalize=finalize, intermediate=gpu_q)
    assert_close_to_reference(got, want if finalize else want.rows, what)


def check_deepseek_fp8_call(config, weights, inputs, routing, act, got: torch.Tensor, finalize: bool, what: str,
                            engine: str = "cuda_cores") -> None:
    """DeepSeek FP8, on a call that has just run on ``engine``: (0) BF16 tokens' codes and scales equal
    quantize_fp8_act128 of the tokens bit for bit; (1) the FP32 activation matches the reference's within FP32
    summation-order error; (2) the intermediate codes and scales equal quantize_fp8_act128 of the GPU's own
    activation bit for bit and the reference's step 2 but for rare one-step flips; (3) the rows / output match the
    reference run on the GPU's intermediate codes and scales."""
    torch.cuda.synchronize()
    top_k, inter = routing.top_k, weights.intermediate_size
    buffers = engine_workspace(config, weights, top_k, engine)
    if isinstance(inputs, torch.Tensor):
        tokens = inputs.shape[0]
        codes, scales = quantize_fp8_act128(inputs)
        assert torch.equal(buffers["x_codes"][:tokens], codes.view(torch.uint8)), f"{what}: token codes"
        assert torch.equal(buffers["x_scales"][:tokens].view(torch.int32), scales.view(torch.int32)), f"{what}: token scales"
    else:
        tokens = inputs.num_tokens
    slots = tokens * top_k
    y = buffers["inter"][:slots].reshape(tokens, top_k, inter)
    q = buffers["inter_codes"][:slots].reshape(tokens, top_k, inter).view(torch.float8_e4m3fn)
    s = buffers["inter_scales"][:slots].reshape(tokens, top_k, inter // 128)
    want = deepseek_fp8_intermediate(inputs, weights, routing, act)
    assert not bool(y.isnan().any()), f"{what}: the FP32 activation holds NaN"
    bound = 2.0**-14 * want.activation.abs().amax(dim=-1, keepdim=True) + 2.0**-16 * want.activation.abs()
    err = (y - want.activation).abs()
    assert bool((err <= bound).all()), f"{what}: FP32 activation off by {float(err.max()):.3g}"
    own_q, own_s = quantize_fp8_act128(y)
    assert torch.equal(q.view(torch.uint8), own_q.view(torch.uint8)), f"{what}: ll_quant128 codes differ from quantize_fp8_act128"
    assert torch.equal(s.view(torch.int32), own_s.view(torch.int32)), f"{what}: ll_quant128 scales differ"
    _check_flips(q, want.codes, what)
    assert bool(((s / want.scales - 1).abs() <= 2.0**-16).all()), f"{what}: intermediate scales differ"
    ref = reference_deepseek_fp8(inputs, weights, routing, act, finalize=finalize, intermediate=(q, s))
    assert_close_to_reference(got, ref if finalize else ref.rows, what)
