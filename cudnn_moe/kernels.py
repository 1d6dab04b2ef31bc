"""CUDA glue kernels around the cuDNN grouped GEMMs: stage, sort, permute, activation + NVFP4 requantize, finalize.

Sources in kernels_cuda/ compile with CuPy (NVRTC) on first use; wrappers launch on torch's current stream.
"""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .activations import GPU_KERNEL_ACTIVATIONS, ActivationKind
from .formats.scale_layout import swizzled_shape

# Routing formats of stage_inputs (stage.cu uses the same values).
ROUTING_PACKED = 0  # int32 [T, k]: signed expert id in bits 31..16, BF16 weight bits in 15..0
ROUTING_FP32 = 1  # ids int32/int64 [T, k] + weights float32 [T, k]
ROUTING_BF16 = 2  # ids int32/int64 [T, k] + weights bfloat16 [T, k]

SORT_MAX_EXPERTS = 512  # local experts one moe_sort block handles (sort.cu)

# Activation codes activate_quantize accepts, split by whether GEMM1's output is [up | gate]
# (gated codes start at SWIGLU = 10, as in activation.cu).
_GATED_ACTIVATIONS = frozenset(k for k in GPU_KERNEL_ACTIVATIONS if k >= ActivationKind.SWIGLU)
_PLAIN_ACTIVATIONS = GPU_KERNEL_ACTIVATIONS - _GATED_ACTIVATIONS

_SORT_THREADS = 1024
_ROW_THREADS = 128

_lock = threading.RLock()
_modules: dict[tuple[int, str, tuple[str, ...]], Any] = {}
_functions: dict[tuple[int, str, str], Any] = {}
_streams: dict[tuple[int, int], Any] = {}


def kernels_dir() -> Path:
    """The CUDA sources: cudnn_moe/_kernels_cuda in an installed wheel, else the repository's kernels_cuda/."""
    package = Path(__file__).resolve().parent
    for candidate in (package / "_kernels_cuda", package.parent / "kernels_cuda"):
        if (candidate / "common.cuh").is_file():
            return candidate
    raise FileNotFoundError(f"CUDA kernel sources not found next to {package}")


def compile_options() -> tuple[str, ...]:
    """NVRTC options of every kernel module."""
    return ("-std=c++17", f"-I{kernels_dir()}")


def module_source(code: str) -> str:
    """``code`` prefixed with a digest of common.cuh, so CuPy's on-disk cache (keyed by source text)
    recompiles when the shared header changes."""
    digest = hashlib.sha256((kernels_dir() / "common.cuh").read_bytes()).hexdigest()
    return f"// common.cuh sha256 {digest}\n{code}"


def load_module(filename: str, device: int, extra_options: tuple[str, ...] = ()) -> Any:
    """The compiled cupy.RawModule of kernels_cuda/``filename`` on CUDA device ``device`` (cached)."""
    key = (device, filename, extra_options)
    with _lock:
        module = _modules.get(key)
        if module is None:
            import cupy

            code = module_source((kernels_dir() / filename).read_text())
            with cupy.cuda.Device(device):
                module = cupy.RawModule(code=code, options=compile_options() + extra_options)
                module.compile()
            _modules[key] = module
        return module


def _function(filename: str, name: str, device: int) -> Any:
    key = (device, filename, name)
    function = _functions.get(key)
    if function is None:
        with _lock:
            function = _functions.get(key)
            if function is None:
                function = _functions[key] = load_module(filename, device).get_function(name)
    return function


class _StreamRef:
    """A raw cudaStream_t behind the CUDA stream protocol (for cupy.cuda.Stream.from_external)."""

    def __init__(self, handle: int) -> None:
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)


def _cupy_stream(handle: int, index: int) -> Any:
    """A CuPy view of the raw CUDA stream ``handle`` of device ``index`` (cached: building one costs host time)."""
    key = (handle, index)
    stream = _streams.get(key)
    if stream is None:
        import cupy

        if hasattr(cupy.cuda.Stream, "from_external"):  # CuPy >= 14
            stream = cupy.cuda.Stream.from_external(_StreamRef(handle))
        else:
            stream = cupy.cuda.ExternalStream(handle, index)
        stream = _streams.setdefault(key, stream)
    return stream


def _launch(filename: str, name: str, device: torch.device, grid: int, block: int, args: tuple[Any, ...]) -> None:
    """Launch kernel ``name`` of kernels_cuda/``filename`` with a 1-D grid on torch's current stream of ``device``."""
    if grid <= 0:
        return
    import cupy

    index = device.index if device.index is not None else torch.cuda.current_device()
    function = _function(filename, name, index)
    # The raw handle of torch's current stream, without building a torch.cuda.Stream object per launch.
    stream = _cupy_stream(torch._C._cuda_getCurrentRawStream(index), index)
    with cupy.cuda.Device(index), stream:
        function((grid,), (block,), args)


def _ptr(tensor: torch.Tensor | None, align: int = 1) -> np.uint64:
    """Device address of a contiguous CUDA tensor (0 for None), checked to be a multiple of ``align`` bytes."""
    if tensor is None:
        return np.uint64(0)
    if not tensor.is_cuda or not tensor.is_contiguous():
        raise ValueError(f"kernel operands must be contiguous CUDA tensors, got {tensor.device} {tuple(tensor.shape)}")
    address = tensor.data_ptr()
    if address % align:
        raise ValueError(f"kernel operand at {address:#x} must be {align}-byte aligned")
    return np.uint64(address)


def _require_scale_room(scales: torch.Tensor, rows: int, cols: int, swizzled: bool) -> None:
    """Check that ``scales`` holds a rows x cols E4M3 matrix, linear or padded to 128 x 4 tiles."""
    padded_rows, padded_cols = swizzled_shape(rows, cols) if swizzled else (rows, cols)
    if scales.numel() * scales.element_size() < padded_rows * padded_cols:
        raise ValueError(f"a {rows}x{cols} scale buffer ({'128x4' if swizzled else 'linear'}) is too small")


def stage_inputs(
    x_packed: torch.Tensor,
    x_scales: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor | None,
    routing_format: int,
    xs: torch.Tensor,
    xss: torch.Tensor,
    ids_out: torch.Tensor,
    w_out: torch.Tensor,
) -> None:
    """Copy T tokens into a bucket of B >= T rows.

    x_packed uint8 [T, H/2] -> xs [B, H/2]; x_scales (1-byte E4M3, linear) [T, H/16] -> xss [B, H/16];
    rows >= T of xs/xss are left as they are. ids: packed int32 [T, k] (ROUTING_PACKED, weights None) or
    int32/int64 [T, k] with weights float32 (ROUTING_FP32) / bfloat16 (ROUTING_BF16) [T, k].
    ids_out int32 [B, k] and w_out float32 [B, k] get the decoded routing, -1 / 0.0 for rows >= T.
    """
    tokens, row_bytes = x_packed.shape
    bucket, top_k = ids_out.shape
    if routing_format == ROUTING_PACKED:
        if ids.dtype != torch.int32:
            raise ValueError(f"packed routing must be int32, got {ids.dtype}")
    else:
        expected = {ROUTING_FP32: torch.float32, ROUTING_BF16: torch.bfloat16}.get(routing_format)
        if expected is None or weights is None or weights.dtype != expected:
            found = None if weights is None else weights.dtype
            raise ValueError(f"routing format {routing_format} does not match weights of dtype {found}")
        if ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"routing ids must be int32 or int64, got {ids.dtype}")
    if tokens > bucket or tuple(ids.shape) != (tokens, top_k) or x_scales.element_size() != 1:
        raise ValueError(f"cannot stage {tokens} tokens x top-{top_k} into a bucket of {bucket}")
    _launch(
        "stage.cu",
        "moe_stage_inputs",
        xs.device,
        bucket,
        _ROW_THREADS,
        (
            _ptr(x_packed),
            _ptr(x_scales),
            _ptr(ids),
            _ptr(weights),
            np.int32(routing_format),
            np.int32(ids.dtype == torch.int64),
            _ptr(xs),
            _ptr(xss),
            _ptr(ids_out),
            _ptr(w_out),
            np.int32(tokens),
            np.int32(top_k),
            np.int32(row_bytes),
            np.int32(x_scales.shape[1]),
        ),
    )


def sort_routing(
    ids_flat: torch.Tensor,
    top_k: int,
    local_start: int,
    num_local: int,
    align: int,
    offsets: torch.Tensor,
    slot_to_row: torch.Tensor,
    row_to_slot: torch.Tensor,
    row_expert: torch.Tensor,
    counts: torch.Tensor,
) -> None:
    """Group the B*k routing slots by local expert into segments padded to ``align`` rows.

    ids_flat int32 [B*k] (slot t*k+s); a slot is masked unless its id is in [local_start, local_start + num_local).
    Outputs (int32): offsets [num_local + 1] segment starts (offsets[num_local] = rows used), slot_to_row [B*k]
    (-1 masked), row_to_slot [R] and row_expert [R] for R = row_capacity = row_to_slot.numel() (every entry
    written: -1 for padding rows and rows past the end; row_expert is the segment's expert for padding rows
    inside a segment), counts [num_local] slots per local expert before padding. Rows within a segment
    follow slot order. R must cover the worst case
    roundup(B*k + min(num_local, B*k) * (align - 1), align).
    """
    num_slots, row_capacity = ids_flat.numel(), row_to_slot.numel()
    if not 1 <= num_local <= SORT_MAX_EXPERTS or align < 1 or top_k < 1 or num_slots % top_k:
        raise ValueError(
            f"sort needs 1 <= num_local <= {SORT_MAX_EXPERTS}, align >= 1 and top_k dividing the slot count; "
            f"got num_local={num_local}, align={align}, {num_slots} slots, top_k={top_k}"
        )
    if (ids_flat.dtype != torch.int32 or offsets.numel() != num_local + 1 or row_expert.numel() != row_capacity
            or counts.numel() != num_local):
        raise ValueError("sort operands: int32 ids, offsets [num_local + 1], counts [num_local], "
                         "row_expert as long as row_to_slot")
    _launch(
        "sort.cu",
        "moe_sort",
        ids_flat.device,
        1,
        _SORT_THREADS,
        (
            _ptr(ids_flat),
            np.int32(num_slots),
            np.int32(local_start),
            np.int32(num_local),
            np.int32(align),
            np.int32(row_capacity),
            _ptr(offsets),
            _ptr(slot_to_row),
            _ptr(row_to_slot),
            _ptr(row_expert),
            _ptr(counts),
        ),
    )


def permute_tokens(
    xs: torch.Tensor,
    xss: torch.Tensor,
    slot_to_row: torch.Tensor,
    num_slots: int,
    top_k: int,
    xp: torch.Tensor,
    xps: torch.Tensor,
    swizzled: bool,
) -> None:
    """Copy token t = slot // top_k of every routed slot to its row r = slot_to_row[slot] >= 0.

    xs uint8 [B, H/2] -> xp uint8 [R, H/2]; scales xss (1-byte, linear) [B, H/16] -> xps, either linear
    [R, H/16] or the 128x4 swizzle of an R x H/16 matrix (flat, >= roundup(R, 128) * roundup(H/16, 4) bytes).
    Rows no slot maps to are not written.
    """
    rows, row_bytes = xp.shape
    scale_cols = xss.shape[1]
    if top_k < 1 or num_slots > slot_to_row.numel():
        raise ValueError(f"permute: top_k={top_k}, {num_slots} slots, slot_to_row of {slot_to_row.numel()}")
    _require_scale_room(xps, rows, scale_cols, swizzled)
    _launch(
        "permute.cu",
        "moe_permute",
        xs.device,
        num_slots,
        _ROW_THREADS,
        (
            _ptr(xs),
            _ptr(xss),
            _ptr(slot_to_row),
            np.int32(top_k),
            np.int32(row_bytes),
            np.int32(scale_cols),
            np.int32(swizzled),
            _ptr(xp),
            _ptr(xps),
        ),
    )


def activate_quantize(
    g1: torch.Tensor,
    alpha1: torch.Tensor,
    row_to_slot: torch.Tensor,
    row_expert: torch.Tensor,
    offsets: torch.Tensor,
    act_code: int,
    a: float,
    b: float,
    limit: float,
    gated: bool,
    out_packed: torch.Tensor,
    out_scales: torch.Tensor,
    swizzled: bool,
) -> None:
    """Activate GEMM1's output and quantize it to NVFP4 with global scale one.

    g1 bfloat16 [R, N1] (N1 = 2I as [up | gate] when gated, else I; I % 16 == 0), alpha1 float32 [E]:
    inputs are float(g1) * alpha1[row_expert[r]]. act_code: an ActivationKind value (0-4 plain, 10-12 gated);
    (a, b, limit) are SwiGLU's (alpha, beta, limit), unused otherwise. out_packed uint8 [R, I/2] (element 2i
    in the low nibble); out_scales: E4M3 bytes of the R x I/16 block scales, linear or 128x4 swizzled.
    Rows >= offsets[E] are not written; padding rows (row_to_slot < 0) are written as zero bytes.
    """
    rows, half_inter = out_packed.shape
    inter = 2 * half_inter
    allowed = _GATED_ACTIVATIONS if gated else _PLAIN_ACTIVATIONS
    if act_code not in allowed:
        raise ValueError(f"activation code {act_code} is not a {'gated' if gated else 'plain'} kernel activation")
    if inter % 16 or tuple(g1.shape) != (rows, 2 * inter if gated else inter) or row_to_slot.numel() < rows:
        raise ValueError(f"activation: g1 {tuple(g1.shape)} does not match output [{rows}, {inter}/2], gated={gated}")
    if g1.dtype != torch.bfloat16 or alpha1.dtype != torch.float32 or alpha1.numel() != offsets.numel() - 1:
        raise ValueError("activation: g1 must be bfloat16 and alpha1 float32 [E] with offsets [E + 1]")
    _require_scale_room(out_scales, rows, inter // 16, swizzled)
    _launch(
        "activation.cu",
        "moe_activation",
        g1.device,
        rows,
        _ROW_THREADS,
        (
            _ptr(g1, 16),
            _ptr(alpha1),
            _ptr(row_to_slot),
            _ptr(row_expert),
            _ptr(offsets),
            np.int32(offsets.numel() - 1),
            np.int32(act_code),
            np.int32(gated),
            np.float32(a),
            np.float32(b),
            np.float32(limit),
            np.int32(inter),
            np.int32(swizzled),
            _ptr(out_packed, 8),
            _ptr(out_scales),
        ),
    )


def _check_gemm2_operands(g2: torch.Tensor, alpha2: torch.Tensor, out: torch.Tensor) -> int:
    """Common checks of finalize / scale_rows; returns the hidden size H (a multiple of 8)."""
    hidden = g2.shape[1]
    if g2.dtype != torch.bfloat16 or out.dtype != torch.bfloat16 or out.shape[1] != hidden or hidden % 8:
        raise ValueError(f"need bfloat16 g2 {tuple(g2.shape)} and out {tuple(out.shape)} of one width H, H % 8 == 0")
    if alpha2.dtype != torch.float32:
        raise ValueError(f"alpha2 must be float32, got {alpha2.dtype}")
    return hidden


def finalize(
    g2: torch.Tensor,
    slot_to_row: torch.Tensor,
    row_expert: torch.Tensor,
    weights: torch.Tensor,
    alpha2: torch.Tensor,
    top_k: int,
    out: torch.Tensor,
) -> None:
    """out bfloat16 [T, H] (T <= B): out[t] = sum over slots s in order with r = slot_to_row[t*k+s] >= 0 of
    weights[t*k+s] * (alpha2[row_expert[r]] * g2[r]), in FP32, rounded to BF16 once.

    g2 bfloat16 [R, H]; slot_to_row int32 [B*k]; weights float32 [B*k]; alpha2 float32 [E].
    """
    hidden = _check_gemm2_operands(g2, alpha2, out)
    tokens = out.shape[0]
    if tokens * top_k > min(slot_to_row.numel(), weights.numel()) or weights.dtype != torch.float32:
        raise ValueError(f"finalize: {tokens} tokens x top-{top_k} exceed the float32 routing of the bucket")
    _launch(
        "finalize.cu",
        "moe_finalize",
        out.device,
        tokens,
        _ROW_THREADS,
        (
            _ptr(g2, 16),
            _ptr(slot_to_row),
            _ptr(row_expert),
            _ptr(weights),
            _ptr(alpha2),
            np.int32(top_k),
            np.int32(hidden),
            _ptr(out, 16),
        ),
    )


def scale_rows(
    g2: torch.Tensor,
    row_to_slot: torch.Tensor,
    row_expert: torch.Tensor,
    alpha2: torch.Tensor,
    out_rows: torch.Tensor,
) -> None:
    """out_rows bfloat16 [R_out, H] (R_out <= R): alpha2[row_expert[r]] * g2[r] for rows with row_to_slot[r] >= 0,
    zero for the others. g2 bfloat16 [R, H]; row_to_slot, row_expert int32 [R]; alpha2 float32 [E]."""
    hidden = _check_gemm2_operands(g2, alpha2, out_rows)
    rows = out_rows.shape[0]
    if rows > min(g2.shape[0], row_to_slot.numel()):
        raise ValueError(f"scale_rows: {rows} output rows exceed the {g2.shape[0]} GEMM rows")
    _launch(
        "finalize.cu",
        "moe_scale_rows",
        out_rows.device,
        rows,
        _ROW_THREADS,
        (_ptr(g2, 16), _ptr(row_to_slot), _ptr(row_expert), _ptr(alpha2), np.int32(hidden), _ptr(out_rows, 16)),
    )
