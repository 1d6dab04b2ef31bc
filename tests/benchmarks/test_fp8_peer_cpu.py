"""The torch FP8 peer of the low-latency benchmark (benchmarks/fp8_peer.py) on the CPU: its quantizer, both layer
forms against a float64 reference of the same recipe (torch._scaled_mm runs on the CPU; torch._scaled_grouped_mm
does not, so the grouped form runs on an emulation of that op's contract), its operands and its cell (the grouped
form's failure falls back to the per-expert form; both failing gives the reason)."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

from tests.support import REPO

sys.path.insert(0, str(REPO / "benchmarks"))

import fp8_peer  # noqa: E402
from common import Report  # noqa: E402

from cudnn_moe.low_latency import LowLatencyMoeConfig, WeightFormat  # noqa: E402
from cudnn_moe.low_latency.stand_in import stand_in_weights  # noqa: E402

E, H, I, TOP_K, T = 4, 128, 128, 2, 3


def layer(fmt: WeightFormat = WeightFormat.FP8_WEIGHT_ONLY):
    return stand_in_weights(LowLatencyMoeConfig(8, arch="sm90"), fmt, E, H, I, torch.Generator().manual_seed(0))


def batch(seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=gen)[:TOP_K] for _ in range(T)])
    ids[1, 0] = ids[0, 0]  # two tokens on one expert
    if ids[1, 1] == ids[1, 0]:
        ids[1, 1] = (ids[1, 0] + 1) % E
    return x, ids, torch.softmax(torch.randn(T, TOP_K, generator=gen), 1)


def _e4m3_rows(v: torch.Tensor) -> torch.Tensor:
    """float64 values of v's rows quantized to E4M3 with scale fp32(amax / 448), as the recipe says."""
    v = v.float()
    scale = (v.abs().amax(1) / 448).float()
    return (v / scale[:, None]).to(torch.float8_e4m3fn).double() * scale.double()[:, None]


def reference(x, ids, route_w, weights) -> torch.Tensor:
    """float64 per slot: E4M3 rows of x, GEMM1 with the dequantized weights rounded to BF16, SwiGLU ([up; gate]),
    E4M3 rows, GEMM2 rounded to BF16, weighted sum, BF16."""
    w1 = weights.w1_codes.double() * weights.w1_scale.double()[:, None, None]
    w2 = weights.w2_codes.double() * weights.w2_scale.double()[:, None, None]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = (_e4m3_rows(x[t : t + 1]) @ w1[e].T).to(torch.bfloat16).double()
            up, gate = h.chunk(2, dim=1)
            a = torch.nn.functional.silu(gate) * up
            y = (_e4m3_rows(a) @ w2[e].T).to(torch.bfloat16).double()
            out[t] += float(route_w[t, j]) * y[0]
    return out.to(torch.bfloat16)


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    g, w = got.double(), want.double()
    assert float(w.abs().max()) > 0.1
    assert float((g - w).norm() / w.norm()) < 2.0**-6
    assert float((g - w).abs().max()) < 0.05 * float(w.abs().max())


def emulated_scaled_grouped_mm(mat_a, mat_b, scale_a, scale_b, offs=None, out_dtype=None):
    """torch._scaled_grouped_mm's 2D x 3D contract: group g = rows [offs[g-1], offs[g]) of mat_a [M, K] (row-major)
    times mat_b[g] [K, N] (column-major), row scales scale_a [M], column scales scale_b [G, N]; BF16 out."""
    assert mat_a.stride(1) == 1 and mat_b.stride(1) == 1 and scale_a.shape == (mat_a.shape[0],)
    out = torch.empty(mat_a.shape[0], mat_b.shape[2], dtype=out_dtype)
    start = 0
    for g, end in enumerate(offs.tolist()):
        a = mat_a[start:end].float() * scale_a[start:end, None]
        out[start:end] = (a @ (mat_b[g].float() * scale_b[g][None, :])).to(out_dtype)
        start = end
    return out


def test_rowwise_e4m3() -> None:
    v = torch.randn(5, 64, generator=torch.Generator().manual_seed(2)) * torch.tensor([1.0, 1e-3, 30.0, 1.0, 0.0])[:, None]
    codes, scale = fp8_peer.rowwise_e4m3(v)
    assert codes.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.shape == (5,)
    assert torch.equal(scale[:4], (v[:4].abs().amax(1) / 448).float())
    assert float(scale[4]) == pytest.approx(1e-12 / 448) and not bool(codes[4].float().any())
    deq = codes.double() * scale.double()[:, None]
    assert bool((deq - v.double()).abs().le(2.0**-4 * v.double().abs() + 2.0**-9 * scale.double()[:, None] * 448).all())
    assert float(codes.float().abs().amax()) == 448.0


def test_per_expert_layer_matches_the_reference() -> None:
    weights = layer()
    x, ids, route_w = batch()
    slots = fp8_peer.expert_slots(ids, route_w)
    assert [s.expert for s in slots] == sorted(set(ids.reshape(-1).tolist()))
    shared = next(s for s in slots if s.expert == int(ids[0, 0]))
    assert 0 in shared.tokens.tolist() and 1 in shared.tokens.tolist()
    assert float(shared.route_w[shared.tokens.tolist().index(0)]) == float(route_w[0, 0])
    assert_close(fp8_peer.per_expert_layer(x, slots, fp8_peer.operands(weights)), reference(x, ids, route_w, weights))


def test_grouped_layer_matches_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "_scaled_grouped_mm", emulated_scaled_grouped_mm, raising=False)
    weights = layer()
    x, ids, route_w = batch(3)
    assert_close(fp8_peer.grouped_layer(x, ids, route_w, fp8_peer.operands(weights)), reference(x, ids, route_w, weights))


@pytest.mark.parametrize("fmt", [WeightFormat.FP8_WEIGHT_ONLY, WeightFormat.FP8_PER_TENSOR, WeightFormat.DEEPSEEK_FP8])
def test_operands(fmt) -> None:
    weights = layer(fmt)
    ops = fp8_peer.operands(weights)
    assert ops.w1 is weights.w1_codes and ops.w2 is weights.w2_codes
    assert ops.s1.shape == (E, 2 * I) and ops.s2.shape == (E, H) and ops.s1.is_contiguous()
    first = (weights.w1_scales[:, 0, 0], weights.w2_scales[:, 0, 0]) if fmt is WeightFormat.DEEPSEEK_FP8 else (
        weights.w1_scale, weights.w2_scale)
    assert torch.equal(ops.s1, first[0][:, None].expand(E, 2 * I)) and torch.equal(ops.s2, first[1][:, None].expand(E, H))


class _FakeTimer:
    def median_us(self, fn) -> float:
        fn()
        return 12.34


def test_cell_falls_back_to_per_expert_then_gives_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fp8_peer, "capture", lambda fn: SimpleNamespace(replay=fn))
    report = Report()
    peer = fp8_peer.Fp8Peer(report)
    x, ids, route_w = batch()
    monkeypatch.setattr(torch, "_scaled_grouped_mm", lambda *a, **k: (_ for _ in ()).throw(
        NotImplementedError("no CPU kernel")), raising=False)
    assert peer.cell(_FakeTimer(), layer(), x, ids, route_w) == "12.3 (per expert)"
    assert report.notes == ["torch FP8 layer on torch._scaled_grouped_mm: NotImplementedError: no CPU kernel"]

    def refuse(*args, **kwargs):
        raise RuntimeError("scale_b must be\n a float32 tensor of shape [1, N] and this reason goes on for a while")

    monkeypatch.setattr(torch, "_scaled_mm", refuse)
    cell = peer.cell(_FakeTimer(), layer(), x, ids, route_w)
    reason = "RuntimeError: scale_b must be a float32 tensor of shape [1, N] and this reason goes on for a while"
    assert cell == "failed: " + reason[: fp8_peer.REASON_CHARS - 3] + "..."  # one line, cut
    assert len(cell) == len("failed: ") + fp8_peer.REASON_CHARS and "\n" not in cell
    assert report.notes[-1].startswith("torch FP8 layer on torch._scaled_mm per expert: RuntimeError: scale_b")
