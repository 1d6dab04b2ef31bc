"""The cuDNN NVFP4 grouped GEMM on the GPU against a float64 reference (ragged segments, empty experts)."""

from __future__ import annotations

import pytest
import torch

from cudnn_moe.arch import SUPPORTED_ARCHS, device_arch
from cudnn_moe.formats import ScaleLayout, dequantize_nvfp4, quantize_nvfp4, swizzle_128x4

pytestmark = pytest.mark.gpu

K, N = 256, 384


def _engine():
    from cudnn_moe.engines import CudnnGemmEngine

    if device_arch() not in SUPPORTED_ARCHS:
        pytest.skip(f"cudnn-moe does not target SM{''.join(map(str, device_arch()))}")
    return CudnnGemmEngine(torch.device("cuda", torch.cuda.current_device()))


def _problem(engine, counts: list[int], seed: int = 0):
    """Operands in the engine's layouts for experts with ``counts`` live rows, plus the float64 reference."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    align, experts = engine.row_alignment, len(counts)
    starts, rows = [], 0
    for count in counts:
        starts.append(rows)
        rows += -(-count // align) * align
    x = torch.randn(rows, K, device="cuda", generator=gen)
    w = torch.randn(experts, N, K, device="cuda", generator=gen) * 0.05
    x_packed, x_scales = quantize_nvfp4(x)
    w_packed, w_scales = quantize_nvfp4(w)

    xd = dequantize_nvfp4(x_packed, x_scales).double()
    wd = dequantize_nvfp4(w_packed, w_scales).double()
    ref = torch.zeros(rows, N, dtype=torch.float64, device="cuda")
    bounds = starts + [rows]
    for e in range(experts):
        ref[bounds[e] : bounds[e + 1]] = xd[bounds[e] : bounds[e + 1]] @ wd[e].T

    if engine.scale_layout is ScaleLayout.SWIZZLED_128X4:
        blob = swizzle_128x4(x_scales)
        x_scales = torch.zeros(engine.token_scale_bytes(rows, K, experts), dtype=torch.float8_e4m3fn, device="cuda")
        x_scales[: blob.numel()] = blob
        w_scales = swizzle_128x4(w_scales)
    operands = dict(
        token_packed=x_packed,
        token_scales=x_scales,
        weight_packed=w_packed,
        weight_scales=w_scales,
        offsets=torch.tensor(bounds, dtype=torch.int32, device="cuda"),
        out=torch.full((rows, N), float("nan"), dtype=torch.bfloat16, device="cuda"),
        workspace=torch.empty(max(engine.workspace_bytes(rows, K, N, experts), 1), dtype=torch.uint8, device="cuda"),
    )
    return rows, operands, ref


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("counts", [[37, 0, 70, 5], [13, 0, 150, 1, 0]], ids=["empty-middle", "empty-middle-and-last"])
def test_grouped_gemm_matches_reference(counts):
    engine = _engine()
    rows, ops, ref = _problem(engine, counts)
    engine.gemm(rows, K, N, len(counts), **ops)
    torch.cuda.synchronize()
    out = ops["out"]
    assert torch.isfinite(out).all(), "rows left unwritten (NaN poison survived)"
    assert _relative_error(out, ref) < 1e-2


def test_grouped_gemm_replays_in_cuda_graph():
    engine = _engine()
    counts = [20, 0, 33, 9]
    rows, ops, ref = _problem(engine, counts, seed=1)
    run = lambda: engine.gemm(rows, K, N, len(counts), **ops)  # noqa: E731
    run()  # builds the plan and runs it eagerly before capture
    torch.cuda.synchronize()
    eager = ops["out"].clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    ops["out"].fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(ops["out"], eager)
    assert _relative_error(eager, ref) < 1e-2
