"""The float64 MoE oracle against an independent, plain per-token, per-slot computation.

The plain version shares no code with cudnn_moe.formats: it decodes E2M1 from its own table,
E4M3 scales through torch's float8 cast, and requantizes the intermediate block by block with
the same float32 arithmetic the kernel uses (y rounded to float32, s = e4m3(amax / 6), codes =
nearest E2M1 of y / s with ties to the even code). Both sides then agree to rounding noise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from cudnn_moe.activations import ACTIVATION_NAMES, Activation, parse_activation
from cudnn_moe.formats import quantize_nvfp4
from cudnn_moe.fused.reference import UnfinalizedReference, reference_moe, requantize_nvfp4_rows
from cudnn_moe.routing import Routing, pack_routing

HIDDEN, INTERMEDIATE = 64, 32
GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


# ----------------------------------------------------------------------------- plain oracle
def plain_dequantize(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] + e4m3 [..., K/16] -> float64 [..., K]; element 2i is the low nibble."""
    nibbles = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2).long()
    values = GRID[nibbles & 7] * torch.where(nibbles >= 8, -1.0, 1.0).double()
    return values * scales.float().double().repeat_interleave(16, dim=-1)


def plain_e2m1(q: float) -> float:
    """Nearest E2M1 value of q (|q| beyond 6 saturates), ties to the even grid index."""
    distances = [abs(abs(q) - g) for g in GRID.tolist()]
    best = min(distances)
    index = next(i for i, d in enumerate(distances) if d == best and (i % 2 == 0 or distances.count(best) == 1))
    return math.copysign(GRID[index].item(), q) if index else 0.0


def plain_requantize(y: torch.Tensor) -> torch.Tensor:
    """float64 [I] -> float64 [I] of NVFP4 values (global scale one), one block of 16 at a time."""
    y32 = y.float()
    out = torch.zeros_like(y)
    for start in range(0, y.numel(), 16):
        block = y32[start : start + 16]
        scale = (block.abs().max() / 6.0).clamp(max=448.0).to(torch.float8_e4m3fn).float()
        if scale.item() == 0.0:
            continue
        quotients = (block / scale).tolist()  # float32 division, as the kernel does
        out[start : start + 16] = torch.tensor([plain_e2m1(q) for q in quotients], dtype=torch.float64)
        out[start : start + 16] *= scale.item()
    return out


@dataclass
class Layer:
    act_packed: torch.Tensor
    act_scales: torch.Tensor
    w1_packed: torch.Tensor
    w1_scales: torch.Tensor
    w1_alpha: torch.Tensor
    w2_packed: torch.Tensor
    w2_scales: torch.Tensor
    w2_alpha: torch.Tensor

    def args(self) -> tuple[torch.Tensor, ...]:
        return (self.act_packed, self.act_scales, self.w1_packed, self.w1_scales, self.w1_alpha,
                self.w2_packed, self.w2_scales, self.w2_alpha)


def plain_moe(layer: Layer, ids: torch.Tensor, weights: torch.Tensor, act: Activation, start: int):
    """Per (token, slot) loop. Returns (out float64 [T, H], rows float64 [T, k, H], mask bool [T, k])."""
    x = plain_dequantize(layer.act_packed, layer.act_scales)
    w1 = plain_dequantize(layer.w1_packed, layer.w1_scales)
    w2 = plain_dequantize(layer.w2_packed, layer.w2_scales)
    num_tokens, top_k = ids.shape
    out = torch.zeros(num_tokens, HIDDEN, dtype=torch.float64)
    rows = torch.zeros(num_tokens, top_k, HIDDEN, dtype=torch.float64)
    mask = torch.zeros(num_tokens, top_k, dtype=torch.bool)
    for t in range(num_tokens):
        for s in range(top_k):
            e = int(ids[t, s]) - start
            if not 0 <= e < w1.shape[0]:
                continue
            mask[t, s] = True
            h1 = (float(layer.w1_alpha[e]) * (w1[e] @ x[t])).to(torch.bfloat16).double()
            if act.gated:
                y = act.apply(h1[:INTERMEDIATE], h1[INTERMEDIATE:])
            else:
                y = act.apply(h1)
            rows[t, s] = (float(layer.w2_alpha[e]) * (w2[e] @ plain_requantize(y))).to(torch.bfloat16).double()
            out[t] += float(weights[t, s]) * rows[t, s]
    return out, rows, mask


# ----------------------------------------------------------------------------- random layers
def make_layer(num_tokens: int, num_experts: int, act: Activation, seed: int, w1_alpha_scale: float = 1.0) -> Layer:
    gen = torch.Generator().manual_seed(seed)
    n1 = act.gemm1_columns(INTERMEDIATE)
    x = torch.randn(num_tokens, HIDDEN, generator=gen) * 3
    w1 = torch.randn(num_experts, n1, HIDDEN, generator=gen) * torch.rand(num_experts, n1, 1, generator=gen)
    w1[0, :16] = 0.0  # a zero block in expert 0's intermediate: exercises the zero-scale path
    w2 = torch.randn(num_experts, HIDDEN, INTERMEDIATE, generator=gen)
    act_packed, act_scales = quantize_nvfp4(x)
    w1_packed, w1_scales = quantize_nvfp4(w1)
    w2_packed, w2_scales = quantize_nvfp4(w2)
    w1_alpha = (torch.rand(num_experts, generator=gen) + 0.05) * w1_alpha_scale / 8
    w2_alpha = torch.rand(num_experts, generator=gen) + 0.05
    return Layer(act_packed, act_scales, w1_packed, w1_scales, w1_alpha, w2_packed, w2_scales, w2_alpha)


def make_routing(num_tokens: int, top_k: int, global_experts: int, fmt: str, seed: int):
    """Distinct ids per token; returns (Routing, ids int64, weights as the oracle sees them)."""
    gen = torch.Generator().manual_seed(seed + 1)
    ids = torch.rand(num_tokens, global_experts, generator=gen).argsort(dim=1)[:, :top_k].contiguous()
    weights = torch.rand(num_tokens, top_k, generator=gen)
    if fmt == "packed":
        return Routing.packed(pack_routing(ids, weights)), ids, weights.to(torch.bfloat16).float()
    if fmt == "bf16":
        return Routing.unpacked(ids, weights.to(torch.bfloat16)), ids, weights.to(torch.bfloat16).float()
    return Routing.unpacked(ids.to(torch.int32), weights), ids, weights


# (local experts E, top_k, global experts, local_expert_start, tokens, routing format)
CASES = [
    (1, 1, 1, 0, 5, "packed"),
    (4, 2, 4, 0, 7, "fp32"),
    (8, 4, 8, 0, 9, "bf16"),
    (4, 4, 12, 4, 10, "packed"),  # expert parallel: only global experts 4..7 are local
    (1, 2, 6, 5, 6, "fp32"),
    (8, 1, 16, 0, 1, "bf16"),
    (4, 2, 4, 0, 0, "packed"),
]


def _assert_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    scale = max(expected.abs().max().item(), 1.0) if expected.numel() else 1.0
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12 * scale)


@pytest.mark.parametrize("name", ACTIVATION_NAMES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "E{}-k{}-G{}-s{}-T{}-{}".format(*c))
def test_matches_plain_loop(case, name: str) -> None:
    num_experts, top_k, global_experts, start, num_tokens, fmt = case
    act = parse_activation(name)
    seed = 100 * CASES.index(case) + ACTIVATION_NAMES.index(name)
    layer = make_layer(num_tokens, num_experts, act, seed)
    routing, ids, weights = make_routing(num_tokens, top_k, global_experts, fmt, seed)
    expected_out, expected_rows, expected_mask = plain_moe(layer, ids, weights, act, start)

    out = reference_moe(*layer.args(), routing, act, local_expert_start=start)
    assert out.dtype == torch.float64 and out.shape == (num_tokens, HIDDEN)
    _assert_close(out, expected_out)

    unfinalized = reference_moe(*layer.args(), routing, act, local_expert_start=start, finalize=False)
    assert isinstance(unfinalized, UnfinalizedReference)
    assert torch.equal(unfinalized.mask, expected_mask)
    assert unfinalized.weights.dtype == torch.float32 and torch.equal(unfinalized.weights, weights)
    _assert_close(unfinalized.rows, expected_rows)
    if global_experts > num_experts and num_tokens > 1:
        assert not expected_mask.all(), "the expert-parallel case should mask some slots"


def test_requantize_divides_by_the_scale_and_ties_to_even() -> None:
    # Block 0 has amax 6 * 1.875, so s = 1.875 and every quotient below is an exact E2M1 tie;
    # multiplying by a rounded 1 / s instead would push 1.25, 2.5 and 5 up to 1.5, 3 and 6.
    s = 1.875
    quotients = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -1.25, -2.5, -0.25, 0.5, 0.0, 1.0, 3.0, 4.0]
    rounded = [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -1.0, -2.0, 0.0, 0.5, 0.0, 1.0, 3.0, 4.0]
    big = [1e5] + [-2e5] * 15  # block 1: s saturates at 448, codes at +-6
    y = torch.tensor([q * s for q in quotients] + big + [0.0] * 16, dtype=torch.float64)
    expected = torch.tensor([r * s for r in rounded] + [6 * 448.0] + [-6 * 448.0] * 15 + [0.0] * 16)
    assert torch.equal(requantize_nvfp4_rows(y[None]), expected.double()[None])
    assert torch.equal(plain_requantize(y), expected.double())


@pytest.mark.parametrize("name", ["identity", "relu2", "swiglu"])
def test_saturating_scales_match_plain_loop(name: str) -> None:
    """Intermediates far beyond 6 * 448 saturate both the E4M3 scale and the E2M1 codes."""
    act = parse_activation(name)
    layer = make_layer(4, 2, act, seed=3, w1_alpha_scale=1e4)
    routing, ids, weights = make_routing(4, 2, 2, "fp32", seed=3)
    expected_out, _, _ = plain_moe(layer, ids, weights, act, 0)
    _assert_close(reference_moe(*layer.args(), routing, act), expected_out)


def test_masked_slot_with_nan_weight_is_ignored() -> None:
    act = parse_activation("swiglu")
    layer = make_layer(3, 2, act, seed=11)
    ids = torch.tensor([[0, 5], [1, 0], [7, 1]], dtype=torch.int32)  # experts 5 and 7 are not local
    weights = torch.tensor([[0.5, math.nan], [0.25, 0.75], [math.inf, 1.0]])
    out = reference_moe(*layer.args(), Routing.unpacked(ids, weights), act)
    assert torch.isfinite(out).all()
    clean = torch.where(torch.isfinite(weights), weights, 0.0)
    _assert_close(out, reference_moe(*layer.args(), Routing.unpacked(ids, clean), act))
    unfinalized = reference_moe(*layer.args(), Routing.unpacked(ids, weights), act, finalize=False)
    assert (unfinalized.rows[~unfinalized.mask] == 0).all()
    assert math.isnan(unfinalized.weights[0, 1].item())  # weights are returned as given


def test_repeated_expert_rejected() -> None:
    act = parse_activation("gelu")
    layer = make_layer(2, 4, act, seed=5)
    ids = torch.tensor([[0, 1], [2, 2]], dtype=torch.int32)
    with pytest.raises(ValueError, match="token 1 names an expert more than once"):
        reference_moe(*layer.args(), Routing.unpacked(ids, torch.ones(2, 2)), act)


def test_activation_given_as_kind_or_name() -> None:
    act = parse_activation("geglu")
    layer = make_layer(3, 2, act, seed=9)
    routing, _, _ = make_routing(3, 2, 2, "packed", seed=9)
    by_object = reference_moe(*layer.args(), routing, act)
    assert torch.equal(by_object, reference_moe(*layer.args(), routing, "GeGLU"))
    assert torch.equal(by_object, reference_moe(*layer.args(), routing, act.kind))


def _replace(layer: Layer, **changes: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return Layer(**{**layer.__dict__, **changes}).args()


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        (lambda l: {"act_scales": l.act_scales.float()}, TypeError, "act_scales must be torch.float8_e4m3fn"),
        (lambda l: {"act_packed": l.act_packed[:, :4]}, ValueError, "multiples of 16"),
        (lambda l: {"act_packed": l.act_packed[0]}, ValueError, "act_packed must be a 2-D"),
        (lambda l: {"w1_packed": l.w1_packed[:, :32]}, ValueError, r"w1_packed must have shape \[2, 64, 32\]"),
        (lambda l: {"w1_scales": l.w1_scales[:1]}, ValueError, "w1_scales must have shape"),
        (lambda l: {"w1_alpha": l.w1_alpha.double()}, TypeError, "w1_alpha must be torch.float32"),
        (lambda l: {"w2_packed": l.w2_packed[0]}, ValueError, "w2_packed must be a 3-D"),
        (lambda l: {"w2_scales": l.w2_scales[:, :8]}, ValueError, "w2_scales must have shape"),
        (lambda l: {"w2_alpha": l.w2_alpha[:1]}, ValueError, r"w2_alpha must have shape \[2\]"),
        (lambda l: {"w2_alpha": l.w2_alpha.to("meta")}, ValueError, "w2_alpha is on meta"),
    ],
)
def test_argument_validation(change, error: type[Exception], message: str) -> None:
    act = parse_activation("swiglu")
    layer = make_layer(3, 2, act, seed=1)
    routing, _, _ = make_routing(3, 2, 2, "fp32", seed=1)
    with pytest.raises(error, match=message):
        reference_moe(*_replace(layer, **change(layer)), routing, act)


def test_routing_and_activation_validation() -> None:
    act = parse_activation("swiglu")
    layer = make_layer(3, 2, act, seed=1)
    routing, _, _ = make_routing(4, 2, 2, "fp32", seed=1)
    with pytest.raises(ValueError, match="routing has 4 tokens, act_packed has 3"):
        reference_moe(*layer.args(), routing, act)
    with pytest.raises(TypeError, match="routing must be a Routing"):
        reference_moe(*layer.args(), torch.zeros(3, 2), act)  # type: ignore[arg-type]
    routing3, _, _ = make_routing(3, 2, 2, "fp32", seed=1)
    with pytest.raises(ValueError, match="w1_packed must have shape"):
        reference_moe(*layer.args(), routing3, "relu")  # gated weights with a non-gated activation
    with pytest.raises(ValueError, match="valid names"):
        reference_moe(*layer.args(), routing3, "swish")
    with pytest.raises(ValueError, match="local_expert_start must be a non-negative int"):
        reference_moe(*layer.args(), routing3, act, local_expert_start=-1)
