"""Launch wrappers of the low-latency kernels (kernels_cuda/low_latency/ll_moe.cu).

One NVRTC module per (weight format, token input) pair, compiled on first use with
``-DLL_WEIGHTS=<LowLatencyWeightCode> -DLL_INPUT=<LowLatencyInputCode>`` (codes from
cudnn_moe.kernels.codes, so Python and CUDA share one definition), and ``-DLL_TILES=1`` for weights stored as
SM90 fragment tiles (``weights.tiled``: each feature group then computes a row pair of a 16-row block, so a GEMM1
group covers two features). Two kernels (a third in DeepSeek FP8's module):

- ``ll_gemm1``: GEMM1 + activation into the intermediate workspace [S, Ip] (S = T * top_k);
- ``ll_gemm2``: GEMM2 into expert rows [S, H] (a workspace, or the caller's raw output), and for a
  finalized call the ordered FP32 combine into out [T, H] in the same launch (the last CTA of each
  feature column does it), so a call is two launches;
- ``ll_quant128`` (DeepSeek FP8's module only): E4M3 codes and FP32 scales per 128 values of BF16 tokens or of
  GEMM1's FP32 activation, launched before GEMM1 (BF16 tokens) and between the GEMMs.

Every wrapper takes tensors whose shapes, dtypes, devices and alignment the caller has checked
(cudnn_moe.low_latency.checks); they only derive the launch geometry and pack the arguments, so they
allocate nothing, read no device data and never synchronize. Launches go on torch's current stream.

A ``Tactic`` says how the GEMMs' dot products run and how the work is cut into CTAs: ``FMA`` (this module:
CUDA-core FMAs, lanes splitting each row's K) or the tensor-core tactic of cudnn_moe.engines.ll_mma (the same
source built with its extra -D option, the same kernels, arguments and epilogues).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ...activations import Activation
from ...kernels.codes import LL_THREADS
from ...kernels.codes import LowLatencyInputCode as InputCode
from ...kernels.codes import LowLatencyWeightCode as WeightCode
from ...kernels.loader import kernel_function, launch, ptr
from ..base import MX_PAIRS, WeightFormat

SOURCE = "low_latency/ll_moe.cu"
WARPS = LL_THREADS // 32
CHUNK_BYTES = 16  # one weight load per lane
MX_BLOCK = 32  # values per E8M0 scale of the MX pairs' tokens, weights and intermediate

_WEIGHT_CODES = {
    WeightFormat.BF16: WeightCode.BF16,
    WeightFormat.FP16: WeightCode.FP16,
    WeightFormat.NVFP4_WEIGHT_ONLY: WeightCode.NVFP4,
    WeightFormat.MXFP4_WEIGHT_ONLY: WeightCode.MXFP4,
    WeightFormat.MXINT4_WEIGHT_ONLY: WeightCode.MXINT4,
    WeightFormat.NVFP4_W_NVFP4_A: WeightCode.NVFP4,
    WeightFormat.FP8_WEIGHT_ONLY: WeightCode.FP8,
    WeightFormat.FP8_PER_TENSOR: WeightCode.FP8,
    WeightFormat.DEEPSEEK_FP8: WeightCode.FP8_BLOCK,
    WeightFormat.MXFP4_W_MXFP8_A: WeightCode.MXFP4,
    WeightFormat.MXFP8_W_MXFP8_A: WeightCode.MXFP8,
}
_INPUT_CODES = {torch.bfloat16: InputCode.BF16, torch.float16: InputCode.FP16}

# Every (weights, input) module a call can build: 16-bit weights take their own dtype, the 4-bit and FP8
# weight-only formats BF16 or FP16, the NVFP4 pair NVFP4 tokens, per-tensor FP8 E4M3 tokens, DeepSeek FP8 E4M3
# tokens with scales per 128 (BF16 tokens are quantized to those by ll_quant128 first), the MX pairs MXFP8 tokens;
# then the tile modules (TILE_VARIANTS) of the formats stored tiled on SM90.
TILE_VARIANTS: tuple[tuple[WeightCode, InputCode, bool], ...] = (
    (WeightCode.NVFP4, InputCode.BF16, True),
    (WeightCode.NVFP4, InputCode.FP16, True),
    (WeightCode.NVFP4, InputCode.NVFP4, True),
    (WeightCode.MXINT4, InputCode.BF16, True),
    (WeightCode.MXINT4, InputCode.FP16, True),
    (WeightCode.MXFP4, InputCode.BF16, True),
    (WeightCode.MXFP4, InputCode.FP16, True),
    (WeightCode.MXFP4, InputCode.MXFP8, True),
)
MODULE_VARIANTS: tuple[tuple[WeightCode, InputCode] | tuple[WeightCode, InputCode, bool], ...] = (
    (WeightCode.BF16, InputCode.BF16),
    (WeightCode.FP16, InputCode.FP16),
    *((w, i) for w in (WeightCode.NVFP4, WeightCode.MXFP4, WeightCode.MXINT4, WeightCode.FP8)
      for i in (InputCode.BF16, InputCode.FP16)),
    (WeightCode.NVFP4, InputCode.NVFP4),
    (WeightCode.FP8, InputCode.FP8),
    (WeightCode.FP8_BLOCK, InputCode.FP8_BLOCK),
    (WeightCode.MXFP4, InputCode.MXFP8),
    (WeightCode.MXFP8, InputCode.MXFP8),
    *TILE_VARIANTS,
)


def module_options(weights: WeightCode, inputs: InputCode, tiles: bool = False) -> tuple[str, ...]:
    """The -D options selecting one module of ll_moe.cu (``tiles``: the weights are SM90 fragment tiles)."""
    return (f"-DLL_WEIGHTS={int(weights)}", f"-DLL_INPUT={int(inputs)}", *(("-DLL_TILES=1",) if tiles else ()))


def weight_code(fmt: WeightFormat) -> WeightCode:
    """The module's weight decoder: the format's (tiled MXFP4 weight-only layers, in their exact shifted form, take
    MXFP4's with -DLL_TILES=1)."""
    return _WEIGHT_CODES[fmt]


def input_code(fmt: WeightFormat, x_dtype: torch.dtype | None) -> InputCode:
    """NVFP4 for the NVFP4 pair, FP8 for per-tensor FP8, FP8_BLOCK for DeepSeek FP8, MXFP8 for the MX pairs (x_dtype
    ignored), else the 16-bit dtype of x."""
    if fmt is WeightFormat.NVFP4_W_NVFP4_A:
        return InputCode.NVFP4
    if fmt in MX_PAIRS:
        return InputCode.MXFP8
    if fmt is WeightFormat.FP8_PER_TENSOR:
        return InputCode.FP8
    if fmt is WeightFormat.DEEPSEEK_FP8:
        return InputCode.FP8_BLOCK
    return _INPUT_CODES[x_dtype]


def row_bytes(fmt: WeightFormat, k: int) -> int:
    """Bytes of one weight row of k values (codes only)."""
    if fmt in (WeightFormat.FP8_WEIGHT_ONLY, WeightFormat.FP8_PER_TENSOR, WeightFormat.DEEPSEEK_FP8,
               WeightFormat.MXFP8_W_MXFP8_A):
        return k
    return 2 * k if fmt in (WeightFormat.BF16, WeightFormat.FP16) else k // 2


def group_chunks(weights: Any, k: int) -> int:
    """16-byte chunks of what one feature group of the FMA tactic streams along K = ``k``: a row's codes (row mode),
    or a row pair's share of its block's tiles (tile mode: twice as many)."""
    return (2 if weights.tiled else 1) * row_bytes(weights.format, k) // CHUNK_BYTES


def lanes_per_row(chunks: int) -> int:
    """Lanes splitting one weight row of ``chunks`` 16-byte chunks: 32 from 64 chunks, 16 from 32, else 8
    (short rows leave no lane idle for long; a warp then serves 32 / lanes rows at once)."""
    return 32 if chunks >= 64 else 16 if chunks >= 32 else 8


KERNELS = ("ll_gemm1", "ll_gemm2")
QUANT_KERNEL = "ll_quant128"  # DeepSeek FP8's module only


def kernels_of(fmt: WeightFormat) -> tuple[str, ...]:
    """The kernels of the module ``fmt`` runs: the two GEMMs, and ll_quant128 for DeepSeek FP8."""
    return (*KERNELS, QUANT_KERNEL) if fmt is WeightFormat.DEEPSEEK_FP8 else KERNELS


CTA_BYTES = 64 << 10  # weight bytes a CTA should stream at least, to amortize its routing plan


@dataclass(frozen=True)
class Geometry:
    """One GEMM launch's cut: ``grid`` (feature columns, slots), ``split`` (the kernels' lanes_per_row argument:
    lanes per row with FMA, warps per tile pair with the tensor cores), ``rounds`` (feature blocks per CTA) and
    ``shared_mem`` (dynamic shared memory bytes)."""

    grid: tuple[int, int]
    split: int
    rounds: int
    shared_mem: int = 0


class Tactic:
    """The CUDA-core tactic (``FMA``): the modules of ll_moe.cu as they are, lanes_per_row lanes splitting each
    weight row. A subclass changes the build (``options``, extra -D options) and the geometry."""

    options: tuple[str, ...] = ()

    def gemm1_geometry(self, weights: Any, x_kind: InputCode, slots: int, sms: int) -> Geometry:
        """ll_gemm1's cut for ``slots`` routed slots (T k) of tokens of kind ``x_kind``."""
        fmt = weights.format
        lpr = lanes_per_row(group_chunks(weights, weights.hidden_size))
        if fmt in MX_PAIRS and weights.tiled:  # at most 32 features a round (two a group): 16 lanes a row pair or more
            lpr = max(lpr, 16)
        features_per_block = WARPS * (32 // lpr) * (2 if weights.tiled else 1)
        columns = -(-weights.padded_intermediate // features_per_block)
        block_bytes = features_per_block * (2 if weights.gated else 1) * row_bytes(fmt, weights.hidden_size)
        if fmt in MX_PAIRS:  # a CTA covers exactly one block of 32 features (it quantizes them to MXFP8)
            rounds = MX_BLOCK // features_per_block
        else:
            rounds = choose_rounds(columns, slots, sms, block_bytes)
        return Geometry((-(-columns // rounds), slots), lpr, rounds)

    def gemm2_geometry(self, weights: Any, x_kind: InputCode, slots: int, sms: int) -> Geometry:
        """ll_gemm2's cut; ``x_kind``: the kind of its input, the intermediate (see ``inter_kind``)."""
        fmt = weights.format
        lpr = lanes_per_row(group_chunks(weights, weights.padded_intermediate))
        columns = gemm2_columns(weights.hidden_size, lpr)
        block_bytes = 2 * WARPS * (32 // lpr) * row_bytes(fmt, weights.padded_intermediate)
        rounds = choose_rounds(columns, slots, sms, block_bytes)
        return Geometry((-(-columns // rounds), slots), lpr, rounds)

    def max_gemm2_columns(self, hidden: int) -> int:
        """The most columns any ll_gemm2 cut of H = ``hidden`` gives: the size of the counters workspace."""
        return max_gemm2_columns(hidden)

    def module_options(self, fmt: WeightFormat, x_dtype: torch.dtype | None, tiles: bool = False) -> tuple[str, ...]:
        """The -D options of the module a call with these weights (``tiles``: stored tiled) and tokens launches."""
        return (*module_options(weight_code(fmt), input_code(fmt, x_dtype), tiles), *self.options)


FMA = Tactic()


def inter_kind(fmt: WeightFormat, x_dtype: torch.dtype | None) -> InputCode:
    """The kind of GEMM2's input (ll_moe.cu's INTER_INPUT): E4M3 codes with scales per 128 for DeepSeek FP8, MXFP8
    for the MX pairs, FP16 for FP16 tokens, else BF16."""
    if fmt is WeightFormat.DEEPSEEK_FP8:
        return InputCode.FP8_BLOCK
    if fmt in MX_PAIRS:
        return InputCode.MXFP8
    return InputCode.FP16 if input_code(fmt, x_dtype) is InputCode.FP16 else InputCode.BF16


def choose_rounds(columns: int, slots: int, sms: int, block_bytes: int) -> int:
    """Feature blocks per CTA (1, 2 or 4): the fewest whose weights (``block_bytes`` each) reach CTA_BYTES, as
    long as the grid of ``columns`` blocks x ``slots`` slots (an upper bound on the touched experts) keeps at
    least 4 CTAs per SM; else fewer. More rounds spread each CTA's fixed cost (the routing plan) over more
    weights; fewer keep every SM busy and shorten the tail."""
    rounds = 1
    while rounds < 4 and rounds * block_bytes < CTA_BYTES:
        rounds *= 2
    while rounds > 1 and -(-columns // rounds) * slots < 4 * sms:
        rounds //= 2
    return rounds


def load_modules(fmt: WeightFormat, x_dtype: torch.dtype | None, device: int, tactic: Tactic = FMA,
                 tiles: bool = False) -> None:
    """Compile, or load from the cache, the module a call with these weights (``tiles``: stored tiled) and inputs
    launches, and resolve its kernels (so that a later call inside a CUDA-graph capture only launches)."""
    options = tactic.module_options(fmt, x_dtype, tiles)
    for name in kernels_of(fmt):
        kernel_function(SOURCE, name, device, options)


def _payloads(weights: Any, second: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(codes or dense weights, scales, FP32 globals) of GEMM1 (second=False) or GEMM2 of a low-latency record
    (cudnn_moe.weights.low_latency: dense formats hold w1/w2, block-scaled ones codes and scales, NVFP4 globals too,
    FP8 weight-only E4M3 codes and a per-expert scale, per-tensor FP8 E4M3 codes and the per-expert FP32 factors
    input_scale * w1_scale and intermediate_scale * w2_scale; tiled MXFP4 weight-only its shifted form's scale tiles
    and globals)."""
    gemm = "w2" if second else "w1"
    if getattr(weights, "tile_form", None) is not None:  # tiled MXFP4: the codes with their shifted form's scales
        tile_scales, tile_global = weights.tile_form[2:] if second else weights.tile_form[:2]
        return getattr(weights, f"{gemm}_codes"), tile_scales, tile_global
    if weights.format in (WeightFormat.BF16, WeightFormat.FP16):
        return getattr(weights, gemm), None, None
    if weights.format is WeightFormat.FP8_WEIGHT_ONLY:  # the per-expert FP32 scale goes where the global goes
        return getattr(weights, f"{gemm}_codes"), None, getattr(weights, f"{gemm}_scale")
    if weights.format is WeightFormat.FP8_PER_TENSOR:
        return getattr(weights, f"{gemm}_codes"), None, weights.fc2_factor if second else weights.fc1_factor
    if weights.format is WeightFormat.DEEPSEEK_FP8:  # FP32 scales [E, N / 128, K / 128], no global
        return getattr(weights, f"{gemm}_codes"), getattr(weights, f"{gemm}_scales"), None
    return getattr(weights, f"{gemm}_codes"), getattr(weights, f"{gemm}_scales"), getattr(weights, f"{gemm}_global", None)


def _routing_args(ids: torch.Tensor, routing_code: int) -> tuple[np.uint64, np.int32, np.int32]:
    return ptr(ids), np.int32(routing_code), np.int32(ids.element_size())


def gemm1(
    weights: Any,
    x: torch.Tensor,
    x_scales: torch.Tensor | None,
    ids: torch.Tensor,
    routing_code: int,
    num_tokens: int,
    top_k: int,
    activation: Activation,
    inter_out: torch.Tensor,
    sms: int = 132,
    inter_scales: torch.Tensor | None = None,
    tactic: Tactic = FMA,
) -> None:
    """GEMM1 + activation: inter_out [>= T k, Ip] (int16 storage of BF16/FP16 bits) for every routed slot.

    x: BF16/FP16 [T, H], or NVFP4 codes uint8 [T, H/2] with x_scales float8_e4m3fn [T, H/16], or E4M3 codes
    [T, H] (per-tensor FP8; the kernel reads the intermediate's multiplier from weights.inter_multiplier), or
    E4M3 codes [T, H] with x_scales float32 [T, H/128] (DeepSeek FP8; inter_out is then float32 [>= T k, Ip], the
    unrounded FP32 activation), or E4M3 codes [T, H] with x_scales E8M0 [T, H/32] (the MX pairs; inter_out is then
    uint8 [>= T k, Ip], the MXFP8 codes of the intermediate, and inter_scales uint8 [>= T k, Ip/32] their E8M0
    scales, quantized in this launch: each CTA covers exactly one block of 32 features, so the FMA tactic's
    ``rounds`` is 32 / features per round instead of choose_rounds'; the tensor-core tactic's cut: ll_mma.kernels).
    ids: packed int32 [T, k] (routing_code ROUTING_PACKED) or int32/int64 ids [T, k].
    """
    fmt = weights.format
    w, w_scales, w_global = _payloads(weights, second=False)
    cut = tactic.gemm1_geometry(weights, input_code(fmt, x.dtype), num_tokens * top_k, sms)
    alpha, beta, limit = activation.params()
    launch(
        SOURCE, "ll_gemm1", x.device, cut.grid, LL_THREADS,
        (
            ptr(x, 16), ptr(x_scales), *_routing_args(ids, routing_code), np.int32(num_tokens), np.int32(top_k),
            np.int32(weights.num_experts), ptr(w, 16), ptr(w_scales), ptr(w_global), np.int32(weights.hidden_size),
            np.int32(weights.intermediate_size), np.int32(weights.padded_intermediate), np.int32(weights.gated),
            np.int32(cut.split), np.int32(cut.rounds), np.int32(int(activation.kind)), np.float32(alpha),
            np.float32(beta), np.float32(limit),
            ptr(inter_out, 16), ptr(getattr(weights, "inter_multiplier", None), 4), ptr(inter_scales),
        ),
        shared_mem=cut.shared_mem,
        extra_options=tactic.module_options(fmt, x.dtype, weights.tiled),
    )


def gemm2(
    weights: Any,
    x_dtype: torch.dtype | None,
    inter: torch.Tensor,
    ids: torch.Tensor,
    route_weights: torch.Tensor | None,
    routing_code: int,
    num_tokens: int,
    top_k: int,
    out_fp16: bool,
    rows: torch.Tensor,
    out: torch.Tensor | None,
    counters: torch.Tensor | None,
    sms: int = 132,
    scores: torch.Tensor | None = None,
    inter_scales: torch.Tensor | None = None,
    tactic: Tactic = FMA,
) -> None:
    """GEMM2 into rows [>= T k, H] (16-bit storage), then, when ``out`` is given, the finalize in the same launch.

    out None: rows is the raw output [T k, H]; unrouted slots get zero rows.
    out [T, H]: rows is a workspace; the last CTA of each feature column combines it into out (ordered FP32
    multiply then add over each token's routed slots) using counters (int32 [>= columns], all zero before the
    launch and left zero after it).
    scores: float32 [>= T k] or None; when given, every slot's route weight as the combine reads it (packed:
    the BF16 value), unrouted slots included (the raw output's scores).
    inter_scales: DeepSeek FP8: float32 [>= T k, Ip/128], the scales of ``inter`` (E4M3 codes [>= T k, Ip]) from
    ``quant128``; the MX pairs: uint8 [>= T k, Ip/32], the E8M0 scales of ``inter`` (MXFP8 codes) from ``gemm1``;
    None otherwise.
    """
    fmt = weights.format
    w, w_scales, w_global = _payloads(weights, second=True)
    cut = tactic.gemm2_geometry(weights, inter_kind(fmt, x_dtype), num_tokens * top_k, sms)
    if counters is not None and counters.numel() < cut.grid[0]:
        raise ValueError(f"gemm2 needs {cut.grid[0]} column counters, got {counters.numel()}")
    launch(
        SOURCE, "ll_gemm2", rows.device, cut.grid, LL_THREADS,
        (
            ptr(inter, 16), ptr(ids), ptr(route_weights), np.int32(routing_code), np.int32(ids.element_size()),
            np.int32(num_tokens), np.int32(top_k), np.int32(weights.num_experts), ptr(w, 16), ptr(w_scales),
            ptr(w_global), np.int32(weights.hidden_size), np.int32(weights.padded_intermediate),
            np.int32(cut.split), np.int32(cut.rounds), np.int32(out_fp16), np.int32(out is not None), ptr(rows, 16),
            ptr(out, 16), ptr(counters, 4), ptr(scores, 4), ptr(inter_scales, 4),
        ),
        shared_mem=cut.shared_mem,
        extra_options=tactic.module_options(fmt, x_dtype, weights.tiled),
    )


def quant128(fmt: WeightFormat, src: torch.Tensor, rows: int, codes: torch.Tensor, scales: torch.Tensor,
             tactic: Tactic = FMA) -> None:
    """DeepSeek FP8's quantization per 128 values (ll_quant128): the first ``rows`` rows of src (BF16 tokens
    [T, H] or GEMM1's FP32 activation [S, Ip], contiguous; columns a multiple of 128) into E4M3 codes (same
    shape, uint8 or float8_e4m3fn storage) and FP32 scales [rows, columns / 128]: scale = fp32(amax / 448) (1.0
    for an all-zero block), code = e4m3(fp32(v / scale)), as cudnn_moe.formats.quantize_fp8_act128."""
    cols = src.shape[-1]
    blocks = rows * (cols // 128)
    launch(
        SOURCE, QUANT_KERNEL, src.device, (-(-blocks // WARPS), 1), LL_THREADS,
        (ptr(src, 16), np.int32(src.dtype is torch.float32), np.int32(rows), np.int32(cols), ptr(codes, 16),
         ptr(scales, 4)),
        extra_options=tactic.module_options(fmt, None),
    )


def gemm2_columns(hidden: int, lanes: int) -> int:
    """Feature blocks of ll_gemm2 (its CTAs along x at one round): each covers 2 * WARPS * (32 / lanes) features."""
    return -(-hidden // (2 * WARPS * (32 // lanes)))


def max_gemm2_columns(hidden: int) -> int:
    """The most columns any lane split and round count gives (32 lanes a row, one round): the size of the
    counters workspace."""
    return gemm2_columns(hidden, 32)
