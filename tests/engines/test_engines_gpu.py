"""Every GEMM engine that runs on this GPU against the float64 rounding contract, and against each other:
out[r] = bf16(alpha[e] * (x[r] @ W_e^T)) over ragged segments with empty experts, NaN-poisoned outputs."""

from __future__ import annotations

import pytest
import torch

from cudnn_moe.arch import device_arch
from cudnn_moe.engines.base import NVFP4, OP_FUSED, GemmEngine, GemmOperands, GemmShape, Request, TokenOperand, WeightOperand
from cudnn_moe.engines.registry import ENGINES, engine_class
from cudnn_moe.engines.sm90.layout import to_token_layout
from cudnn_moe.formats import dequantize_nvfp4, quantize_nvfp4, swizzle_128x4
from cudnn_moe.kernels import TokenLayout

pytestmark = pytest.mark.gpu


def _engine_names() -> list[str]:
    return [engine.name for engine in ENGINES if issubclass(engine, GemmEngine)]


def _runs_here(cls) -> object:
    return cls.supports(Request(OP_FUSED, device_arch(), NVFP4))


def _engine(name: str):
    cls = engine_class(name)
    answer = _runs_here(cls)
    if not answer:
        pytest.skip(answer.reason)
    return cls(torch.device("cuda", torch.cuda.current_device()))


def _tokens(engine, x_packed: torch.Tensor, x_scales: torch.Tensor, rows: int, shape: GemmShape) -> TokenOperand:
    _, _, scale_bytes = engine.token_buffers(rows, shape.k, shape.num_experts)
    layout = engine.token_layout_for(rows, shape, gemm=2)
    if layout.is_bf16:
        values = dequantize_nvfp4(x_packed, x_scales, dtype=torch.bfloat16)
        return TokenOperand(to_token_layout(values, layout).contiguous(), None, layout)
    scales = torch.zeros(scale_bytes, dtype=torch.uint8, device="cuda")
    blob = swizzle_128x4(x_scales) if engine.token_layout is TokenLayout.NVFP4_SWIZZLED_128X4 else x_scales
    scales[: blob.numel()] = blob.reshape(-1).view(torch.uint8)
    return TokenOperand(x_packed, scales.view(torch.float8_e4m3fn), layout)


def _problem(engine, counts: list[int], k: int, n: int, seed: int = 0):
    """Operands in the engine's layouts for experts with ``counts`` live rows, plus the float64 reference
    of alpha * acc (before the BF16 rounding)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    align, experts = engine.row_alignment, len(counts)
    starts, rows = [], 0
    for count in counts:
        starts.append(rows)
        rows += -(-count // align) * align
    capacity = rows + 2 * align  # rows past the used ones must stay untouched
    x = torch.randn(capacity, k, device="cuda", generator=gen)
    w = torch.randn(experts, n, k, device="cuda", generator=gen) * 0.05
    alpha = torch.rand(experts, device="cuda", generator=gen) * 2 + 0.25
    x_packed, x_scales = quantize_nvfp4(x)
    w_codes, w_scales = quantize_nvfp4(w)

    xd = dequantize_nvfp4(x_packed, x_scales).double()
    wd = dequantize_nvfp4(w_codes, w_scales).double()
    ref = torch.full((capacity, n), float("nan"), dtype=torch.float64, device="cuda")
    bounds = starts + [rows]
    for e in range(experts):
        ref[bounds[e] : bounds[e + 1]] = alpha[e].double() * (xd[bounds[e] : bounds[e + 1]] @ wd[e].T)

    data, scales = engine.pack_weights(engine.layout.arch, w_codes, w_scales)
    shape = GemmShape(k, n, experts)
    workspace_bytes = engine.workspace_bytes(capacity, shape)
    operands = GemmOperands(
        rows=capacity,
        shape=shape,
        tokens=_tokens(engine, x_packed, x_scales, capacity, shape),
        weights=WeightOperand(data, scales, alpha),
        offsets=torch.tensor(bounds, dtype=torch.int32, device="cuda"),
        out=torch.full((capacity, n), float("nan"), dtype=torch.bfloat16, device="cuda"),
        workspace=torch.zeros(workspace_bytes, dtype=torch.uint8, device="cuda") if workspace_bytes else None,
        gemm=2,  # GEMM2's token layout (_tokens)
    )
    return rows, operands, ref


def _check(out: torch.Tensor, ref: torch.Tensor, used: int) -> None:
    assert torch.isnan(out[used:].float()).all(), "rows past the segments were written"
    got, want = out[:used].double(), ref[:used]
    assert not torch.isnan(got).any(), "rows left unwritten (NaN poison survived)"
    rel = ((got - want).norm(dim=1) / want.norm(dim=1).clamp_min(1e-30)).max().item()
    assert rel < 1e-2, f"worst row relative error {rel:.2e}"
    # one BF16 rounding of alpha * acc: almost every element equals bf16(ref)
    exact = (got == want.to(torch.bfloat16).double()).float().mean().item()
    assert exact > 0.9, f"only {exact:.3f} of the elements equal bf16(alpha * acc)"


SHAPES = [  # (counts per expert, K, N)
    ([37, 0, 70, 5], 256, 384),
    ([13, 0, 150, 1, 0], 2048, 256),
    ([1] * 8, 768, 2048),
    ([300, 2], 704, 128),
]


@pytest.mark.parametrize("name", _engine_names())
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"E{len(s[0])}-K{s[1]}-N{s[2]}")
def test_engine_matches_contract(name, shape):
    engine = _engine(name)
    counts, k, n = shape
    used, ops, ref = _problem(engine, counts, k, n)
    engine.gemm(ops)
    torch.cuda.synchronize()
    _check(ops.out, ref, used)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"E{len(s[0])}-K{s[1]}-N{s[2]}")
def test_engines_agree(shape):
    names = [name for name in _engine_names() if _runs_here(engine_class(name))]
    if len(names) < 2:
        pytest.skip("fewer than two engines run on this GPU")
    counts, k, n = shape
    outputs = []
    for name in names:
        engine = _engine(name)
        if engine.row_alignment != 8:
            pytest.skip("engines with other row alignments see other row positions")
        used, ops, _ = _problem(engine, counts, k, n, seed=3)
        engine.gemm(ops)
        outputs.append(ops.out[:used].double())
    torch.cuda.synchronize()
    for other in outputs[1:]:
        rel = ((other - outputs[0]).norm() / outputs[0].norm()).item()
        assert rel < 2e-3, f"engines {names} differ by {rel:.2e} (more than FP32 order + one BF16 rounding)"


@pytest.mark.parametrize("name", _engine_names())
def test_engine_replays_in_cuda_graph(name):
    engine = _engine(name)
    used, ops, ref = _problem(engine, [20, 0, 33, 9], 256, 384, seed=1)
    engine.gemm(ops)  # builds plans / compiles kernels before capture
    torch.cuda.synchronize()
    eager = ops.out.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        engine.gemm(ops)
    ops.out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(ops.out[:used], eager[:used])
    _check(ops.out, ref, used)
