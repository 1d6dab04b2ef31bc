"""Random stand-in weights of a low-latency layer, one per weight format, for timing it (tuning its tactic in
``cudnn-moe prebuild``, the benchmarks): the engines' speed depends on the shapes and formats, not the values.

Payloads are random bytes of the format (finite E4M3 codes: no 0x7F / 0xFF; any E2M1 / INT4 nibbles) with
block scales and globals that keep the sums of unit size; the 16-bit formats are N(0, 1/fan-in) values. Each
goes through its prepare method (checked, padded, copied), except the NVFP4 pair and per-tensor FP8, whose
prepare methods quantize a float source (minutes and tens of GB for a DeepSeek-V3 layer): their records are
built from random codes directly (the pair then laid out as the config stores it: ``LowLatencyMoeConfig.stored``), so
they need I % 128 == 0 (nothing to pad).
"""

from __future__ import annotations

import torch

from ..activations import Activation, SwiGLU, parse_activation
from ..validate import require_multiple
from ..weights.low_latency import PAD_MULTIPLE, Fp8PerTensorWeights, LowLatencyWeights, Nvfp4PairWeights, WeightFormat
from .config import PAIR_HIDDEN_MULTIPLE, WEIGHT_ONLY_HIDDEN_MULTIPLE, LowLatencyMoeConfig


def _bytes(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 256, shape, dtype=torch.uint8, device=gen.device, generator=gen)


def _e4m3(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Random finite E4M3 codes (the NaN bytes 0x7F / 0xFF moved one down)."""
    codes = _bytes(shape, gen)
    return torch.where((codes & 0x7F) == 0x7F, codes - 1, codes).view(torch.float8_e4m3fn)


def stand_in_weights(
    config: LowLatencyMoeConfig, fmt: WeightFormat, experts: int, hidden: int, intermediate: int,
    gen: torch.Generator, activation: Activation | str = SwiGLU(),
) -> LowLatencyWeights:
    """Random ``fmt`` weights of E = ``experts``, H = ``hidden``, I = ``intermediate`` for ``activation``
    (gated: w1 has 2I rows) on ``gen``'s device, prepared by ``config`` (the format's size rules apply; the
    pair and per-tensor FP8 also need I % 128 == 0; ValueError naming the size otherwise)."""
    act = parse_activation(activation)
    e, h, i, dev = experts, hidden, intermediate, gen.device
    n1 = act.gemm1_columns(i)
    if fmt in (WeightFormat.BF16, WeightFormat.FP16):
        dtype = torch.bfloat16 if fmt is WeightFormat.BF16 else torch.float16
        w1 = torch.randn(e, n1, h, device=dev, generator=gen).div_(h**0.5).to(dtype)
        w2 = torch.randn(e, h, i, device=dev, generator=gen).div_(i**0.5).to(dtype)
        prepare = config.prepare_bf16_weights if fmt is WeightFormat.BF16 else config.prepare_fp16_weights
        return prepare(w1, w2, activation=act)
    s1, s2 = torch.full((e,), 1 / (16 * h**0.5), device=dev), torch.full((e,), 1 / (16 * i**0.5), device=dev)
    if fmt is WeightFormat.FP8_WEIGHT_ONLY:
        return config.prepare_fp8_weight_only_weights(_e4m3((e, n1, h), gen), s1, _e4m3((e, h, i), gen), s2,
                                                      activation=act)
    if fmt is WeightFormat.DEEPSEEK_FP8:
        b1 = torch.full((e, -(-n1 // 128), -(-h // 128)), 1 / (16 * h**0.5), device=dev)
        b2 = torch.full((e, -(-h // 128), -(-i // 128)), 1 / (16 * i**0.5), device=dev)
        return config.prepare_deepseek_fp8_weights(_e4m3((e, n1, h), gen), b1, _e4m3((e, h, i), gen), b2,
                                                   activation=act)
    if fmt in (WeightFormat.FP8_PER_TENSOR, WeightFormat.NVFP4_W_NVFP4_A):  # records built here: their rules
        config.require_format(config.target_arch(), fmt)
        pair = fmt is WeightFormat.NVFP4_W_NVFP4_A
        require_multiple("hidden", h, PAIR_HIDDEN_MULTIPLE if pair else WEIGHT_ONLY_HIDDEN_MULTIPLE)
        require_multiple("intermediate", i, PAD_MULTIPLE)
    if fmt is WeightFormat.FP8_PER_TENSOR:
        return Fp8PerTensorWeights(
            format=fmt, hidden_size=h, intermediate_size=i, padded_intermediate=i, gated=act.gated,
            w1_codes=_e4m3((e, n1, h), gen), w1_scale=s1, w2_codes=_e4m3((e, h, i), gen), w2_scale=s2,
            input_scale=1 / 32, intermediate_scale=1 / 64, input_multiplier=32.0, fc1_factor=s1 / 32,
            fc2_factor=s2 / 64, inter_multiplier=torch.full((1,), 64.0, device=dev))
    c1, c2 = _bytes((e, n1, h // 2), gen), _bytes((e, h, i // 2), gen)
    if fmt in (WeightFormat.NVFP4_WEIGHT_ONLY, WeightFormat.NVFP4_W_NVFP4_A):
        sc1 = (torch.rand(e, n1, h // 16, device=dev, generator=gen) * 0.05 + 0.01).to(torch.float8_e4m3fn)
        sc2 = (torch.rand(e, h, i // 16, device=dev, generator=gen) * 0.05 + 0.01).to(torch.float8_e4m3fn)
        g1, g2 = torch.full((e,), 0.5, device=dev), torch.full((e,), 0.5, device=dev)
        if fmt is WeightFormat.NVFP4_WEIGHT_ONLY:
            return config.prepare_nvfp4_weight_only_weights(c1, sc1, g1, c2, sc2, g2, activation=act)
        return config.stored(Nvfp4PairWeights(format=fmt, hidden_size=h, intermediate_size=i, padded_intermediate=i,
                                              gated=act.gated, w1_codes=c1, w1_scales=sc1, w2_codes=c2,
                                              w2_scales=sc2, w1_global=g1, w2_global=g2))
    if fmt in (WeightFormat.MXFP4_WEIGHT_ONLY, WeightFormat.MXFP4_W_MXFP8_A, WeightFormat.MXFP8_W_MXFP8_A):
        # E8M0 bytes 118..123: 2^-9 .. 2^-4
        sc1 = torch.randint(118, 124, (e, n1, h // 32), dtype=torch.uint8, device=dev, generator=gen)
        sc2 = torch.randint(118, 124, (e, h, i // 32), dtype=torch.uint8, device=dev, generator=gen)
        sc1, sc2 = sc1.view(torch.float8_e8m0fnu), sc2.view(torch.float8_e8m0fnu)
        if fmt is WeightFormat.MXFP8_W_MXFP8_A:  # E4M3 codes reach 448: scales 2^-16 .. 2^-11
            sc1, sc2 = ((sc.view(torch.uint8) - 7).view(torch.float8_e8m0fnu) for sc in (sc1, sc2))
            return config.prepare_weights(_e4m3((e, n1, h), gen), sc1, _e4m3((e, h, i), gen), sc2, activation=act)
        if fmt is WeightFormat.MXFP4_W_MXFP8_A:
            return config.prepare_weights(c1, sc1, c2, sc2, activation=act)
        return config.prepare_mxfp4_weight_only_weights(c1, sc1, c2, sc2, activation=act)
    sc1 = (torch.rand(e, n1, h // 32, device=dev, generator=gen) * 0.02 + 0.002).to(torch.bfloat16)
    sc2 = (torch.rand(e, h, i // 32, device=dev, generator=gen) * 0.02 + 0.002).to(torch.bfloat16)
    return config.prepare_mxint4_weight_only_weights(c1, sc1, c2, sc2, activation=act)
