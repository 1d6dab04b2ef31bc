"""CPU tests of the stand-in weights (cudnn_moe.low_latency.stand_in) the tuner's CLI and the benchmarks time: each
format's record with the asked shape and gatedness, finite values of unit size, and the size rules refused naming
the size."""

from __future__ import annotations

import pytest
import torch

from cudnn_moe.activations import SiLU, SwiGLU
from cudnn_moe.low_latency import LowLatencyMoeConfig, WeightFormat, reference_low_latency
from cudnn_moe.low_latency.checks import token_dtypes
from cudnn_moe.low_latency.stand_in import stand_in_weights
from cudnn_moe.low_latency.tuning import call_inputs
from cudnn_moe.routing import Routing

E, H, I = 3, 512, 128


def make(fmt: WeightFormat, gated: bool = True, hidden: int = H, intermediate: int = I, seed: int = 0):
    return stand_in_weights(LowLatencyMoeConfig(2, arch="sm90"), fmt, E, hidden, intermediate,
                            torch.Generator().manual_seed(seed), SwiGLU() if gated else SiLU())


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "non-gated"])
@pytest.mark.parametrize("fmt", list(WeightFormat), ids=[f.value for f in WeightFormat])
def test_stand_in_is_a_layer_of_the_format_with_unit_size_outputs(fmt, gated) -> None:
    weights = make(fmt, gated)
    assert weights.format is fmt
    assert (weights.num_experts, weights.hidden_size, weights.intermediate_size, weights.gated) == (E, H, I, gated)
    assert weights.gemm1_rows == (2 * I if gated else I)
    for t in weights.canonical():
        if t.dtype == torch.float8_e4m3fn:
            assert not bool(((t.view(torch.uint8) & 0x7F) == 0x7F).any()), "an E4M3 NaN code"
    config = LowLatencyMoeConfig(2, arch="sm90")
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, H, generator=gen)
    ids = torch.tensor([[0, 2], [1, 0]])
    routing = Routing.unpacked(ids, torch.tensor([[0.7, 0.3], [0.4, 0.6]]))
    out_dtype = torch.float16 if fmt is WeightFormat.FP16 else torch.bfloat16
    inputs = call_inputs(config, weights, x, token_dtypes(fmt)[0])
    want = reference_low_latency(inputs, weights, routing, SwiGLU() if gated else SiLU(),
                                 out_dtype=out_dtype).double()
    assert bool(torch.isfinite(want).all())
    rms = float(want.pow(2).mean().sqrt())
    assert 1e-3 < rms < 1e3, f"{fmt.value}: output rms {rms:.3g}: the stand-in's scales are off"


@pytest.mark.parametrize("fmt", [WeightFormat.FP8_PER_TENSOR, WeightFormat.NVFP4_W_NVFP4_A])
def test_records_built_directly_keep_their_size_rules(fmt) -> None:
    with pytest.raises(ValueError, match="intermediate must be a positive multiple of 128, got 96"):
        make(fmt, intermediate=96)
    multiple = 512 if fmt is WeightFormat.NVFP4_W_NVFP4_A else 128
    with pytest.raises(ValueError, match=f"hidden must be a positive multiple of {multiple}, got 320"):
        make(fmt, hidden=320)


def test_stand_ins_of_formats_prepared_by_the_config_pad_as_the_config_does() -> None:
    weights = make(WeightFormat.MXFP4_WEIGHT_ONLY, intermediate=96)
    assert (weights.intermediate_size, weights.padded_intermediate) == (96, 128)
    assert make(WeightFormat.FP8_WEIGHT_ONLY, seed=1).w1_codes.shape == (E, 2 * I, H)
