"""CPU tests of the NVFP4 config: weight/activation preparation, layouts, validation errors."""

from __future__ import annotations

import pytest
import torch

from cudnn_moe import GELU, Nvfp4MoeConfig, Routing, fused_moe
from cudnn_moe.engines.base import WeightLayout
from cudnn_moe.formats import E2M1_GRID, unswizzle_128x4

E, H, I = 3, 256, 128


def _weights(gated: bool = True, dtype: torch.dtype = torch.bfloat16):
    gen = torch.Generator().manual_seed(0)
    w1 = torch.randn(E, (2 if gated else 1) * I, H, generator=gen).to(dtype)
    w2 = torch.randn(E, H, I, generator=gen).to(dtype)
    return w1, w2


def _decode(packed: torch.Tensor, scales_linear: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """Independent decode: table lookup per nibble, times the block scale and the expert's alpha."""
    table = torch.tensor(E2M1_GRID + tuple(-v for v in E2M1_GRID), dtype=torch.float64)
    low, high = (packed & 0xF).long(), (packed >> 4).long()
    values = torch.stack((table[low], table[high]), -1).reshape(*packed.shape[:-1], -1)
    blocks = values.reshape(*values.shape[:-1], -1, 16) * scales_linear.double().unsqueeze(-1)
    return blocks.reshape(values.shape) * alpha.double()[:, None, None]


def test_prepare_weights_sm90_linear():
    w1, w2 = _weights()
    wts = Nvfp4MoeConfig(arch="sm90", engine="cudnn").prepare_weights(w1, w2)
    assert wts.spec.weight_layout is WeightLayout.LINEAR and wts.spec.engine == "cudnn" and wts.gated
    assert wts.w1.shape == (E, 2 * I, H // 2) and wts.w1.dtype == torch.uint8
    assert wts.w1_scales.shape == (E, 2 * I, H // 16) and wts.w1_scales.dtype == torch.float8_e4m3fn
    assert wts.w2.shape == (E, H, I // 2) and wts.w2_scales.shape == (E, H, I // 16)
    for packed, scales, alpha, ref in ((wts.w1, wts.w1_scales, wts.w1_alpha, w1), (wts.w2, wts.w2_scales, wts.w2_alpha, w2)):
        torch.testing.assert_close(alpha, ref.float().abs().amax(dim=(1, 2)) / 2688.0)
        decoded = _decode(packed, scales, alpha)
        rel = (decoded - ref.double()).norm() / ref.double().norm()
        assert 0.02 < rel < 0.15, rel  # NVFP4 error on Gaussian data is about 9%
        # each expert's largest block uses the top of the E4M3 range
        assert torch.all(scales.float().amax(dim=(1, 2)) == 448.0)


def test_prepare_weights_sm100_swizzled_matches_linear():
    w1, w2 = _weights()
    lin = Nvfp4MoeConfig(arch="sm90", engine="cudnn").prepare_weights(w1, w2)
    swz = Nvfp4MoeConfig(arch="sm100").prepare_weights(w1, w2)
    assert swz.spec.weight_layout is WeightLayout.SWIZZLED_128X4 and swz.spec.row_alignment == 128
    assert swz.w1_scales.shape == (E, 2 * I * H // 16) and swz.w2_scales.shape == (E, H * I // 16)
    assert torch.equal(swz.w1, lin.w1) and torch.equal(swz.w2, lin.w2)
    for got, want, rows, cols in ((swz.w1_scales, lin.w1_scales, 2 * I, H // 16), (swz.w2_scales, lin.w2_scales, H, I // 16)):
        assert torch.equal(unswizzle_128x4(got, rows, cols).view(torch.uint8), want.view(torch.uint8))
        # element (r=33, c=5) of expert 1 sits at the formula's offset
        offset = ((33 // 128) * (cols // 4) + 5 // 4) * 512 + (33 % 32) * 16 + ((33 % 128) // 32) * 4 + 5 % 4
        assert got[1, offset].view(torch.uint8) == want[1, 33, 5].view(torch.uint8)
    _, s1, _, s2 = swz.canonical()
    assert torch.equal(s1.view(torch.uint8), lin.w1_scales.view(torch.uint8))
    assert torch.equal(s2.view(torch.uint8), lin.w2_scales.view(torch.uint8))


def test_prepare_weights_sm90_engine_tiles_match_linear():
    """The default SM90 engine stores the same codes and scales repacked into fragment tiles."""
    w1, w2 = _weights()
    lin = Nvfp4MoeConfig(arch="sm90", engine="cudnn").prepare_weights(w1, w2)
    tiles = Nvfp4MoeConfig(arch="sm90").prepare_weights(w1, w2)
    assert tiles.spec.engine == "sm90" and tiles.spec.weight_layout is WeightLayout.SM90_TILES
    assert tiles.w1.shape == (E, 2 * I * H // 2) and tiles.w1_scales.shape == (E, 2 * I * H // 16)
    assert not torch.equal(tiles.w1.view(E, 2 * I, H // 2), lin.w1)  # really repacked
    for got, want in zip(tiles.canonical(), (lin.w1, lin.w1_scales, lin.w2, lin.w2_scales)):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(tiles.w1_alpha, lin.w1_alpha) and torch.equal(tiles.w2_alpha, lin.w2_alpha)


@pytest.mark.parametrize("engine, arch, match", [
    ("sm90", "sm100", "runs on sm90, not sm100"),
    ("nope", "sm90", "engine must be one of"),
])
def test_engine_choice_errors(engine, arch, match):
    w1, w2 = _weights()
    with pytest.raises(ValueError, match=match):
        Nvfp4MoeConfig(arch=arch, engine=engine).prepare_weights(w1, w2)


@pytest.mark.parametrize("arch", ["sm80", "sm120", 9, (8, 9)])
def test_unsupported_arch_rejected_at_construction(arch):
    with pytest.raises(ValueError, match="not supported"):
        Nvfp4MoeConfig(arch=arch)


def test_prepare_weights_non_gated():
    w1, w2 = _weights(gated=False, dtype=torch.float32)
    wts = Nvfp4MoeConfig(arch="sm90").prepare_weights(w1, w2, activation=GELU())
    assert not wts.gated and wts.gemm1_rows == I and wts.canonical()[0].shape == (E, I, H // 2)


@pytest.mark.parametrize(
    "mutate, error, match",
    [
        (lambda w1, w2: (w1.to(torch.int32), w2), TypeError, "w1_bf16 must have dtype"),
        (lambda w1, w2: (w1[0], w2), ValueError, "w1_bf16 must have 3 dimensions"),
        (lambda w1, w2: (w1, w2[:2]), ValueError, "experts"),
        (lambda w1, w2: (w1[:1].expand(513, -1, -1), w2[:1].expand(513, -1, -1)), ValueError, "holds 513 experts"),
        (lambda w1, w2: (w1[:0], w2[:0]), ValueError, "holds 0 experts"),
        (lambda w1, w2: (w1[:, :, :128], w2), ValueError, "H = 128"),
        (lambda w1, w2: (w1[:, :, :192], w2[:, :192]), ValueError, "hidden size"),
        (lambda w1, w2: (w1[:, :160], w2[:, :, :80]), ValueError, "intermediate size"),
        (lambda w1, w2: (w1[:, :128], w2), ValueError, "256 rows per expert"),
        (lambda w1, w2: (w1.index_fill(1, torch.tensor([3]), float("nan")), w2), ValueError, "w1_bf16 contains NaN"),
        (lambda w1, w2: (w1, w2.index_fill(2, torch.tensor([3]), float("inf"))), ValueError, "w2_bf16 contains NaN or Inf"),
        (lambda w1, w2: (w1.numpy(), w2), TypeError, "w1_bf16 must be a torch.Tensor"),
    ],
)
def test_prepare_weights_rejects(mutate, error, match):
    w1, w2 = _weights(dtype=torch.float32)
    with pytest.raises(error, match=match):
        Nvfp4MoeConfig(arch="sm90").prepare_weights(*mutate(w1, w2))


def test_prepare_activations():
    x = torch.randn(5, H, dtype=torch.bfloat16)
    acts = Nvfp4MoeConfig().prepare_activations(x)
    assert acts.packed.shape == (5, H // 2) and acts.scales.shape == (5, H // 16)
    assert acts.scales.dtype == torch.float8_e4m3fn and acts.num_tokens == 5 and acts.hidden_size == H
    decoded = _decode(acts.packed.unsqueeze(0), acts.scales.unsqueeze(0), torch.ones(1))[0]
    assert (decoded - x.double()).norm() / x.double().norm() < 0.15
    with pytest.raises(ValueError, match="hidden size"):
        Nvfp4MoeConfig().prepare_activations(torch.randn(5, 200))
    with pytest.raises(ValueError, match="2 dimensions"):
        Nvfp4MoeConfig().prepare_activations(torch.randn(5, 2, 128))
    with pytest.raises(TypeError, match="dtype"):
        Nvfp4MoeConfig().prepare_activations(torch.ones(5, 128, dtype=torch.int64))


def test_supported_and_arch_parsing():
    cfg = Nvfp4MoeConfig
    assert cfg.supported("sm90") and cfg.supported((10, 0)) and cfg.supported("sm_103a") and cfg.supported(100)
    assert not cfg.supported("sm80") and not cfg.supported("sm120") and not cfg.supported((8, 9))
    with pytest.raises(ValueError, match="architecture"):
        cfg.supported("hopper")
    with pytest.raises(ValueError, match="max_num_tokens"):
        Nvfp4MoeConfig(max_num_tokens=0)


def _op_inputs(tokens: int = 4, top_k: int = 2):
    cfg = Nvfp4MoeConfig(arch="sm90", max_num_tokens=8)
    wts = cfg.prepare_weights(*_weights())
    acts = cfg.prepare_activations(torch.randn(tokens, H))
    ids = torch.tensor([[0, 1]] * tokens, dtype=torch.int32)[:, :top_k]
    routing = Routing.unpacked(ids, torch.ones(tokens, top_k))
    return cfg, acts, routing, wts


def test_fused_moe_validates_before_launch():
    cfg, acts, routing, wts = _op_inputs()
    with pytest.raises(ValueError, match="CUDA device"):
        fused_moe(cfg, acts, routing, wts)
    with pytest.raises(TypeError, match="config must be"):
        fused_moe(object(), acts, routing, wts)
    with pytest.raises(TypeError, match="routing must be"):
        fused_moe(cfg, acts, (routing,), wts)
    with pytest.raises(ValueError, match="routing covers 3 tokens"):
        fused_moe(cfg, acts, Routing.unpacked(torch.zeros(3, 2, dtype=torch.int32), torch.ones(3, 2)), wts)
    with pytest.raises(ValueError, match="max_num_tokens"):
        _, big_acts, big_routing, _ = _op_inputs(tokens=9)
        fused_moe(cfg, big_acts, big_routing, wts)
    with pytest.raises(ValueError, match="non-gated"):
        fused_moe(cfg, acts, routing, wts, activation=GELU())
    with pytest.raises(ValueError, match="local_expert_start"):
        fused_moe(cfg, acts, routing, wts, local_expert_start=-1)
    with pytest.raises(ValueError, match="activation"):
        fused_moe(cfg, acts, routing, wts, activation="nope")
