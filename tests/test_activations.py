"""Activation family: each apply() against scalar formulas from the math module."""

from __future__ import annotations

import math

import pytest
import torch

from cudnn_moe.activations import (
    GELU,
    ActivationKind,
    GeGLU,
    GeGLUTanh,
    Identity,
    ReLU,
    ReLU2,
    SiLU,
    SiTU,
    SwiGLU,
    SwiGLUStep,
    parse_activation,
)

POINTS = [-9.0, -3.5, -1.0, -0.25, 0.0, 0.3, 1.0, 2.5, 6.9, 7.0, 8.0, 30.0]


def _sigmoid(v: float) -> float:
    return 1.0 / (1.0 + math.exp(-v))


def _gelu(v: float) -> float:
    return 0.5 * v * (1.0 + math.erf(v / math.sqrt(2.0)))


def _gelu_tanh(v: float) -> float:
    return 0.5 * v * (1.0 + math.tanh(math.sqrt(2.0 / math.pi) * (v + 0.044715 * v**3)))


ELEMENTWISE = [
    (Identity(), lambda v: v),
    (ReLU(), lambda v: max(v, 0.0)),
    (GELU(), _gelu),
    (SiLU(), lambda v: v * _sigmoid(v)),
    (ReLU2(), lambda v: max(v, 0.0) ** 2),
]


def _swiglu(up: float, gate: float, alpha: float, beta: float, limit: float) -> float:
    g = min(gate, limit)
    u = min(max(up, -limit), limit)
    return g * _sigmoid(alpha * g) * (u + beta)


GATED = [
    (SwiGLU(), lambda u, g: g * _sigmoid(g) * u),
    (SwiGLU(alpha=1.702, beta=1.0, limit=7.0), lambda u, g: _swiglu(u, g, 1.702, 1.0, 7.0)),
    (GeGLU(), lambda u, g: _gelu(g) * u),
    (GeGLUTanh(), lambda u, g: _gelu_tanh(g) * u),
    (SwiGLUStep(), lambda u, g: min(g * _sigmoid(g), 7.0) * min(max(u, -7.0), 7.0)),
    (SiTU(), lambda u, g: 4.0 * math.tanh(g / 4.0) * _sigmoid(g) * 25.0 * math.tanh(u / 25.0)),
]


@pytest.mark.parametrize(("act", "formula"), ELEMENTWISE, ids=lambda p: type(p).__name__)
def test_elementwise_matches_scalar_formula(act, formula) -> None:
    x = torch.tensor(POINTS, dtype=torch.float64)
    expected = torch.tensor([formula(v) for v in POINTS], dtype=torch.float64)
    torch.testing.assert_close(act.apply(x), expected, rtol=1e-14, atol=1e-15)
    assert not act.gated and act.gemm1_columns(32) == 32


@pytest.mark.parametrize(("act", "formula"), GATED, ids=lambda p: type(p).__name__)
def test_gated_matches_scalar_formula(act, formula) -> None:
    pairs = [(u, g) for u in POINTS for g in POINTS]
    up = torch.tensor([u for u, _ in pairs], dtype=torch.float64)
    gate = torch.tensor([g for _, g in pairs], dtype=torch.float64)
    expected = torch.tensor([formula(u, g) for u, g in pairs], dtype=torch.float64)
    torch.testing.assert_close(act.apply(up, gate), expected, rtol=1e-13, atol=1e-14)
    assert act.gated and act.gemm1_columns(32) == 64


def test_gemm1_split_is_up_then_gate() -> None:
    h1 = torch.tensor([[2.0, -1.0, 0.5, 3.0]], dtype=torch.float64)  # up = [2, -1], gate = [0.5, 3]
    expected = torch.tensor([[2.0 * 0.5 * _sigmoid(0.5), -1.0 * 3.0 * _sigmoid(3.0)]], dtype=torch.float64)
    torch.testing.assert_close(SwiGLU().apply_gemm1(h1), expected, rtol=1e-15, atol=0)
    torch.testing.assert_close(ReLU().apply_gemm1(h1), h1.clamp(min=0), rtol=0, atol=0)


def test_swiglu_defaults_equal_silu_times_up() -> None:
    torch.manual_seed(0)
    up, gate = torch.randn(2, 64, dtype=torch.float64) * 5
    torch.testing.assert_close(SwiGLU().apply(up, gate), torch.nn.functional.silu(gate) * up, rtol=1e-15, atol=0)


def test_swiglu_limit_clamps_gate_above_and_up_both_ways() -> None:
    act = SwiGLU(limit=2.0)
    up = torch.tensor([10.0, -10.0, 1.0], dtype=torch.float64)
    gate = torch.tensor([10.0, 10.0, -10.0], dtype=torch.float64)
    expected = [2.0 * _sigmoid(2.0) * 2.0, 2.0 * _sigmoid(2.0) * -2.0, -10.0 * _sigmoid(-10.0) * 1.0]
    torch.testing.assert_close(act.apply(up, gate), torch.tensor(expected, dtype=torch.float64), rtol=1e-15, atol=0)


def test_swiglu_step_clamps_after_silu() -> None:
    # silu(7.5) ~ 7.496 > 7 is capped at 7; SwiGLU(limit=7) would clamp the gate first (7 * sigmoid(7)).
    gate = torch.tensor([7.5], dtype=torch.float64)
    up = torch.tensor([1.0], dtype=torch.float64)
    assert SwiGLUStep().apply(up, gate).item() == 7.0
    assert SwiGLU(limit=7.0).apply(up, gate).item() == pytest.approx(7.0 * _sigmoid(7.0), rel=1e-15)


def test_situ_is_bounded_by_a_times_b() -> None:
    big = torch.tensor([1e4, -1e4, 1e4], dtype=torch.float64)
    out = SiTU(a=2.0, b=3.0).apply(big, big.flip(0))
    assert out.abs().max().item() <= 6.0


def test_params_triples() -> None:
    assert SwiGLU(alpha=1.702, beta=1.0, limit=7.0).params() == (1.702, 1.0, 7.0)
    assert SwiGLU().params() == (1.0, 0.0, math.inf)
    assert SwiGLUStep(limit=5.0).params() == (0.0, 0.0, 5.0)
    assert SiTU().params() == (4.0, 25.0, math.inf)
    for act in (Identity(), ReLU(), GELU(), SiLU(), ReLU2(), GeGLU(), GeGLUTanh()):
        assert act.params() == (0.0, 0.0, math.inf)


def test_kind_codes_are_the_kernel_contract() -> None:
    codes = {a.kind: int(a.kind) for a, _ in ELEMENTWISE + GATED}
    assert codes == {
        ActivationKind.IDENTITY: 0, ActivationKind.RELU: 1, ActivationKind.GELU: 2, ActivationKind.SILU: 3,
        ActivationKind.RELU2: 4, ActivationKind.SWIGLU: 10, ActivationKind.GEGLU: 11,
        ActivationKind.GEGLU_TANH: 12, ActivationKind.SWIGLU_STEP: 13, ActivationKind.SITU: 14,
    }


def test_parse_activation() -> None:
    custom = SwiGLU(limit=3.0)
    assert parse_activation(custom) is custom
    assert parse_activation("SwiGLU") == SwiGLU()
    assert parse_activation(" gelu ") == GELU()
    assert parse_activation("swiglu_step") == SwiGLUStep()
    assert parse_activation(ActivationKind.SITU) == SiTU()
    assert parse_activation(ActivationKind.GEGLU_TANH) == GeGLUTanh()
    with pytest.raises(ValueError, match="valid names: identity, relu, gelu.*situ"):
        parse_activation("swish")
    with pytest.raises(TypeError, match="activation must be"):
        parse_activation(3.0)  # type: ignore[arg-type]


def test_gate_argument_errors() -> None:
    x = torch.zeros(4)
    with pytest.raises(ValueError, match="is gated"):
        SwiGLU().apply(x)
    with pytest.raises(ValueError, match="not gated"):
        ReLU().apply(x, x)
    with pytest.raises(ValueError, match="one shape"):
        GeGLU().apply(x, torch.zeros(3))
    with pytest.raises(ValueError, match="even"):
        GeGLU().apply_gemm1(torch.zeros(2, 5))


@pytest.mark.parametrize(
    "make",
    [
        lambda: SwiGLU(limit=0.0),
        lambda: SwiGLU(limit=math.nan),
        lambda: SwiGLU(alpha=math.inf),
        lambda: SwiGLUStep(limit=-1.0),
        lambda: SiTU(a=0.0),
        lambda: SiTU(b=math.inf),
    ],
)
def test_invalid_parameters_rejected(make) -> None:
    with pytest.raises(ValueError, match="must be"):
        make()


def test_apply_keeps_dtype() -> None:
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    assert SiTU().apply(x, x).dtype == torch.bfloat16
    assert GELU().apply(x.float()).dtype == torch.float32
