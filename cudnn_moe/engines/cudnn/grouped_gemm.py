"""The NVFP4 grouped GEMM of an MoE layer as one cuDNN frontend graph.

    out[r, :] = dequant(token[r, :]) @ dequant(weight[e])^T   for every row r of expert e's segment

Graph: `block_scale_dequantize` on both FP4 operands (E4M3 scale per 16 values along
K) feeding `moe_grouped_matmul` (mode NONE, FP32 accumulation), FP32 output: the
engine applies the expert globals and the one BF16 rounding afterwards (engine.py).

Physical buffers (torch, row-major, M = `rows`, the token capacity of a bucket):
    token_packed   uint8 [M, K/2]       two E2M1 codes per byte, element 2i in the low nibble
    token_scales   float8_e4m3fn        LINEAR: [M, K/16]; SWIZZLED_128X4: `token_scale_bytes`
                                        bytes starting with the 128x4 swizzle of [M, K/16]
    weight_packed  uint8 [E, N, K/2]    row n of expert e holds its K codes
    weight_scales  float8_e4m3fn        LINEAR: [E, N, K/16]; SWIZZLED_128X4: [E, Np, Kp], each
                                        expert's [N, K/16] swizzled on its own (Np = N rounded up
                                        to 128, Kp = K/16 rounded up to 4)
    offsets        int32 [offsets_len]  expert segment starts, plus the end when offsets_len = E+1
    out            float32 [M, N]
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import torch

from ...arch import Arch, is_blackwell
from ...formats import NVFP4_BLOCK, ScaleLayout
from ...formats.scale_layout import SWIZZLE_COLS, SWIZZLE_ROWS
from .handles import using_handle
from .probe import MIN_BACKEND, NATIVE_NVFP4_MOE_BACKEND, format_version, require_cudnn

EXPLICIT_OFFSETS_SM90_BACKEND = 92800  # 9.19 rejects E+1 offsets on SM90, 9.28 accepts them (measured)


class UID(IntEnum):
    TOKEN = 1
    TOKEN_SCALE = 2
    WEIGHT = 3
    WEIGHT_SCALE = 4
    FIRST_TOKEN_OFFSET = 5
    OUTPUT = 100


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class GroupedGemmKey:
    """Everything a built graph depends on; the graph cache key.

    rows: token capacity M; k: reduction length in elements; n: output columns;
    arch: compute capability (major, minor); backend: cuDNN version as an int (91900).
    """

    rows: int
    k: int
    n: int
    num_experts: int
    scale_layout: ScaleLayout
    offsets_len: int
    device: int
    arch: Arch
    backend: int

    def __post_init__(self) -> None:
        if min(self.rows, self.k, self.n, self.num_experts) < 1:
            raise ValueError(f"{self}: rows, k, n and num_experts must be positive")
        if self.k % NVFP4_BLOCK:
            raise ValueError(f"{self}: k must be a multiple of the NVFP4 block ({NVFP4_BLOCK})")
        if self.offsets_len not in (self.num_experts, self.num_experts + 1):
            raise ValueError(f"{self}: offsets_len must be num_experts (segment starts) or num_experts + 1 (boundaries)")
        if self.num_experts == 1 and self.offsets_len != 2:
            raise ValueError(f"{self}: a single expert needs explicit boundaries (offsets_len 2)")
        if self.scale_layout is ScaleLayout.SWIZZLED_128X4 and self.rows % SWIZZLE_ROWS:
            raise ValueError(f"{self}: swizzled token scales need rows to be a multiple of {SWIZZLE_ROWS}")

    @property
    def swizzled(self) -> bool:
        return self.scale_layout is ScaleLayout.SWIZZLED_128X4

    def describe(self) -> str:
        major, minor = self.arch
        return (
            f"NVFP4 grouped GEMM rows={self.rows} k={self.k} n={self.n} experts={self.num_experts} "
            f"scales={self.scale_layout.value} offsets={self.offsets_len} on cuda:{self.device} "
            f"(SM{major}{minor}, cuDNN {format_version(self.backend)})"
        )


def offsets_len_for(num_experts: int, arch: Arch, backend: int) -> int:
    """E + 1 explicit boundaries where the backend takes them, else E segment starts.

    SM100/SM103 always take boundaries (the frontend's SM100 engine requires them); SM90
    from cuDNN 9.28 on. With starts only, the last segment runs to the token capacity.
    One expert always needs boundaries (the frontend rejects a single start).
    """
    explicit = num_experts == 1 or is_blackwell(arch) or backend >= EXPLICIT_OFFSETS_SM90_BACKEND
    return num_experts + 1 if explicit else num_experts


def segmented_scale_rows(rows: int, num_groups: int) -> int:
    """Scale rows for ``num_groups`` segments of ``rows`` rows in all, each padded to 128 on its own.

    Worst case over all partitions: 128 * (A + (rows - A) // 128) with A = min(rows, groups).
    """
    active = min(rows, num_groups)
    return SWIZZLE_ROWS * (active + (rows - active) // SWIZZLE_ROWS)


def token_scale_bytes(rows: int, k: int, layout: ScaleLayout, num_experts: int) -> int:
    """Bytes the token-scale buffer must hold.

    LINEAR: rows * K/16. SWIZZLED_128X4: the frontend's SM100 engine lays each expert
    segment's scales out from its own 128-row atom and checks that the buffer covers
    the worst case (`segmented_scale_rows`). With segments padded to 128 rows that
    layout is exactly the 128x4 swizzle of all rows, so only the first ceil(rows/128)
    row atoms are ever read; the rest is headroom the check asks for.
    """
    cols = k // NVFP4_BLOCK
    if layout is ScaleLayout.LINEAR:
        return rows * cols
    padded_rows = max(_round_up(rows, SWIZZLE_ROWS), segmented_scale_rows(rows, num_experts))
    return padded_rows * _round_up(cols, SWIZZLE_COLS)


def weight_scale_shape(num_experts: int, n: int, k: int, layout: ScaleLayout) -> tuple[int, int, int]:
    """Physical weight-scale shape: [E, N, K/16] linear; [E, Np, Kp] swizzled, one 128x4 plane per expert."""
    cols = k // NVFP4_BLOCK
    if layout is ScaleLayout.LINEAR:
        return num_experts, n, cols
    return num_experts, _round_up(n, SWIZZLE_ROWS), _round_up(cols, SWIZZLE_COLS)


def dequant_dtypes(layout: ScaleLayout) -> tuple[str, ...]:
    """cuDNN data types to try, in order, for the dequantized operands.

    LINEAR (SM90): only BF16 gives the runtime-fusion engine a plan (measured). SWIZZLED:
    FP32 first, as in cuDNN's block-scale samples and the frontend's SM100 engine table;
    BF16 second.
    """
    return ("BFLOAT16",) if layout is ScaleLayout.LINEAR else ("FLOAT", "BFLOAT16")


def declare_graph(cudnn: Any, key: GroupedGemmKey, dequant_dtype: Any, *, handle: Any = None,
                  device_property: Any = None) -> Any:
    """The graph for ``key``, declared but not built, for a GPU given by a cuDNN ``handle`` (to run
    it) or by cuDNN ``device_property`` (to check it for another GPU, deviceless.py). Dims and
    strides count logical elements."""
    m, k, n, e = key.rows, key.k, key.n, key.num_experts
    dt = cudnn.data_type
    target = {"handle": handle} if device_property is None else {"device_property": device_property}
    graph = cudnn.pygraph(
        io_data_type=dt.BFLOAT16,
        intermediate_data_type=dt.FLOAT,
        compute_data_type=dt.FLOAT,
        is_cuda_graph_replay_expected=True,
        **target,
    )
    reorder = cudnn.tensor_reordering.F8_128x4 if key.swizzled else None
    # Swizzled scale tensors are declared at their padded 128x4 extents, as cuDNN expects
    # (m is already a multiple of 128 there).
    _, scale_n, scale_k = weight_scale_shape(e, n, k, key.scale_layout)

    token = graph.tensor(name="token", dim=[1, m, k], stride=[m * k, k, 1], data_type=dt.FP4_E2M1, uid=int(UID.TOKEN))
    token_scale = graph.tensor(
        name="token_scale",
        dim=[1, m, scale_k],
        stride=[m * scale_k, scale_k, 1],
        data_type=dt.FP8_E4M3,
        reordering_type=reorder,
        uid=int(UID.TOKEN_SCALE),
    )
    weight = graph.tensor(name="weight", dim=[e, k, n], stride=[k * n, 1, k], data_type=dt.FP4_E2M1, uid=int(UID.WEIGHT))
    weight_scale = graph.tensor(
        name="weight_scale",
        dim=[e, scale_k, scale_n],
        stride=[scale_k * scale_n, 1, scale_k],
        data_type=dt.FP8_E4M3,
        reordering_type=reorder,
        uid=int(UID.WEIGHT_SCALE),
    )
    offsets = graph.tensor(
        name="first_token_offset",
        dim=[key.offsets_len, 1, 1],
        stride=[1, 1, 1],
        data_type=dt.INT32,
        uid=int(UID.FIRST_TOKEN_OFFSET),
    )
    if key.swizzled:
        offsets.set_alignment_value(SWIZZLE_ROWS)  # a promise about the values: segments padded to 128 rows

    token_dq = graph.block_scale_dequantize(input=token, descale=token_scale, block_size=[1, NVFP4_BLOCK], name="token_dequant")
    weight_dq = graph.block_scale_dequantize(input=weight, descale=weight_scale, block_size=[NVFP4_BLOCK, 1], name="weight_dequant")
    token_dq.set_data_type(dequant_dtype)
    weight_dq.set_data_type(dequant_dtype)
    out = graph.moe_grouped_matmul(
        token=token_dq,
        weight=weight_dq,
        first_token_offset=offsets,
        mode=cudnn.moe_grouped_matmul_mode.NONE,
        compute_data_type=dt.FLOAT,
        name="moe",
    )
    out.set_output(True).set_data_type(dt.FLOAT).set_uid(int(UID.OUTPUT)).set_dim([1, m, n]).set_stride([m * n, n, 1])
    return graph


_FP4_DTYPE = getattr(torch, "float4_e2m1fn_x2", None)  # torch's packed-FP4 dtype, where it has one
_FP4_STORAGE = (torch.uint8,) if _FP4_DTYPE is None else (torch.uint8, _FP4_DTYPE)
_SCALE_STORAGE = (torch.float8_e4m3fn, torch.uint8)


def _operand(t: torch.Tensor, name: str, key: GroupedGemmKey, dtypes: tuple[torch.dtype, ...], shape: tuple[int, ...]) -> torch.Tensor:
    """``t`` checked (device, dtype, contiguous, element count) and viewed as ``shape``."""
    if not t.is_cuda or t.device.index != key.device:
        raise ValueError(f"{name} must be on cuda:{key.device}, got {t.device}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must be one of {dtypes}, got {t.dtype}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if t.numel() != math.prod(shape):
        raise ValueError(f"{name} holds {t.numel()} elements; {key.describe()} needs {list(shape)}")
    return t.view(shape)


class GroupedFp4Gemm:
    """A built graph for one key; `execute` runs it on caller-owned buffers (no allocation)."""

    def __init__(self, key: GroupedGemmKey, graph: Any, workspace_bytes: int) -> None:
        self.key = key
        self.graph = graph
        self.workspace_bytes = workspace_bytes

    def execute(
        self,
        token_packed: torch.Tensor,
        token_scales: torch.Tensor,
        weight_packed: torch.Tensor,
        weight_scales: torch.Tensor,
        offsets: torch.Tensor,
        out: torch.Tensor,
        workspace: torch.Tensor | None,
        stream_ptr: int,
    ) -> None:
        """Enqueue the GEMM on ``stream_ptr`` (layouts in the module docstring; uint8 is
        accepted for the FP8 scales). Capturable in a CUDA graph once it has run eagerly.

        offsets: int32 with exactly `key.offsets_len` entries. workspace: at least
        `workspace_bytes` bytes (None allowed when that is 0).
        """
        key = self.key
        m, k, n, e, layout = key.rows, key.k, key.n, key.num_experts, key.scale_layout
        token_packed = _operand(token_packed, "token_packed", key, _FP4_STORAGE, (1, m, k // 2))
        weight_packed = _operand(weight_packed, "weight_packed", key, _FP4_STORAGE, (e, n, k // 2))
        if _FP4_DTYPE is not None:  # the frontend's own spelling of packed E2M1 pairs
            token_packed, weight_packed = token_packed.view(_FP4_DTYPE), weight_packed.view(_FP4_DTYPE)
        _, _, scale_k = weight_scale_shape(e, n, k, layout)
        token_scale_shape = (1, token_scale_bytes(m, k, layout, e) // scale_k, scale_k)
        token_scales = _operand(token_scales, "token_scales", key, _SCALE_STORAGE, token_scale_shape)
        weight_scales = _operand(weight_scales, "weight_scales", key, _SCALE_STORAGE, weight_scale_shape(e, n, k, layout))
        pack = {
            int(UID.TOKEN): token_packed,
            int(UID.TOKEN_SCALE): token_scales.view(torch.float8_e4m3fn),
            int(UID.WEIGHT): weight_packed,
            int(UID.WEIGHT_SCALE): weight_scales.view(torch.float8_e4m3fn),
            int(UID.FIRST_TOKEN_OFFSET): _operand(offsets, "offsets", key, (torch.int32,), (key.offsets_len, 1, 1)),
            int(UID.OUTPUT): _operand(out, "out", key, (torch.float32,), (1, m, n)),
        }
        if self.workspace_bytes and (workspace is None or workspace.numel() * workspace.element_size() < self.workspace_bytes):
            raise ValueError(f"{key.describe()} needs a workspace of {self.workspace_bytes} bytes")
        with using_handle(key.device, stream_ptr) as handle:
            self.graph.execute(pack, workspace if self.workspace_bytes else None, handle=handle)


def build_grouped_fp4_gemm(key: GroupedGemmKey) -> GroupedFp4Gemm:
    """Declare, check and build the graph for ``key`` on its device (seconds; do it before capture)."""
    if key.swizzled and (not is_blackwell(key.arch) or key.backend < NATIVE_NVFP4_MOE_BACKEND):
        raise RuntimeError(
            f"{key.describe()}: the F8_128x4 NVFP4 grouped GEMM needs SM100/SM103 and cuDNN >= {format_version(NATIVE_NVFP4_MOE_BACKEND)}"
        )
    cudnn = require_cudnn(NATIVE_NVFP4_MOE_BACKEND if key.swizzled else MIN_BACKEND)
    failures: list[str] = []
    last: Exception | None = None
    with torch.cuda.device(key.device), using_handle(key.device, torch.cuda.current_stream(key.device).cuda_stream) as handle:
        for name in dequant_dtypes(key.scale_layout):
            try:
                graph = declare_graph(cudnn, key, getattr(cudnn.data_type, name), handle=handle)
                graph.validate()
                graph.build_operation_graph()
                graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
                graph.check_support()
                graph.build_plans()
                return GroupedFp4Gemm(key, graph, int(graph.get_workspace_size()))
            except Exception as exc:  # cuDNN reports declines as several exception types
                failures.append(f"with {name} dequantize outputs: {type(exc).__name__}: {exc}")
                last = exc
    hint = (
        "the F8_128x4 NVFP4 grouped GEMM needs SM100/SM103 and cuDNN >= 9.21"
        if key.swizzled
        else "the linear-scale NVFP4 grouped GEMM needs cuDNN >= 9.18; on SM90 only BF16 dequantize outputs get a plan"
    )
    raise RuntimeError(f"cuDNN could not build the {key.describe()} ({hint}): " + "; ".join(failures)) from last
