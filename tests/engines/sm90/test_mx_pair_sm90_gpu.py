"""GPU tests of the MXFP4 pair (MXFP4 weights, MXFP8 tokens) on the SM90 decode chain, and of the two kernels it adds:

- the sort + permute of MXFP8 tokens (bucket and caller forms) writes, bit for bit, what the BF16-token kernels write
  for the tokens' exact BF16 values;
- the activation kernel with an MXFP8 intermediate writes quantize_mxfp8's elements as BF16 values (the identity
  activation, so the values are exact), and GEMM1's epilogue writes what that kernel writes, bit for bit;
- ``low_latency_moe`` of the pair on the SM90 engine at T = 1..8 against ``reference_mx_pair``: the intermediate the
  chain left in GEMM2's tokens against the reference's step 2 (tests.support.low_latency_mx), then the output on that
  intermediate (tests.support.low_latency's bounds); repeated and graph-replayed calls bitwise equal. The weights in
  both of their SM90 forms: prepared for SM90, their own MXFP4 tiles (BlockCode.MXFP4); prepared for another arch,
  read in place, row-major (BlockCode.MXFP4_ROWS).
Every output is pre-filled with NaN.

Written without a GPU in reach: not run yet when committed. Run with
    python -m pytest -q tests/engines/sm90/test_mx_pair_sm90_gpu.py
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from cudnn_moe import kernels
from cudnn_moe.activations import GeGLU, Identity, SiLU, SwiGLU
from cudnn_moe.engines.sm90.engine import Sm90GemmEngine
from cudnn_moe.engines.sm90.layout import from_token_layout
from cudnn_moe.formats import quantize_mxfp8
from cudnn_moe.kernels import IntermediateCode, TokenLayout
from cudnn_moe.low_latency import LowLatencyMoeConfig, grouped, low_latency_moe, reference_mx_pair
from cudnn_moe.low_latency.config import MAX_NUM_TOKENS
from cudnn_moe.pipeline.executor import _BucketStages, row_capacity
from cudnn_moe.pipeline.tokens import TokenCode
from tests.support.low_latency import (
    DEV, E, assert_close_to_reference, make_routing, mx_payloads, nan_out, random_ids,
)
from tests.support.low_latency_mx import check_intermediate, tokens_bf16

pytestmark = pytest.mark.gpu

HIDDEN, INTER, TOP_K = 512, 256, 4
BF16_LAYOUTS = (TokenLayout.BF16_FRAGMENTS, TokenLayout.BF16_ROWS)


@pytest.fixture(autouse=True)
def _sm90() -> None:
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the SM90 decode chain")


def _mxfp8_tokens(tokens: int, hidden: int, seed: int):
    """MXFP8 tokens of random BF16 rows, and their exact BF16 values."""
    codes, scales = quantize_mxfp8(tokens_bf16(tokens, hidden, seed))
    values = (codes.double() * torch.pow(2.0, scales.view(torch.uint8).double() - 127).repeat_interleave(32, -1))
    return codes, scales, values.bfloat16()


@pytest.mark.parametrize("layout", BF16_LAYOUTS, ids=lambda layout: layout.name)
@pytest.mark.parametrize("tokens,top_k", [(1, 8), (5, 4), (8, 32)])
def test_sort_permute_of_mxfp8_tokens_is_that_of_their_values(layout: TokenLayout, tokens: int, top_k: int) -> None:
    """Both sort + permute kernels of MXFP8 tokens (the bucket's, and the one staging the caller's routing) write the
    rows and sort outputs of the BF16-token kernels given the tokens' exact values, bit for bit."""
    gen = torch.Generator().manual_seed(tokens)
    codes, scales, values = _mxfp8_tokens(tokens, HIDDEN, tokens + 1)
    ids = torch.randint(-1, E, (tokens, top_k), generator=gen, dtype=torch.int32).to(DEV)
    route_weights = torch.rand(tokens, top_k, generator=gen).to(DEV)
    rows = row_capacity(tokens, top_k, E, 8)

    def run(x: torch.Tensor, x_scales: torch.Tensor | None, staged: bool) -> list[torch.Tensor]:
        sorted_ = kernels.SortBuffers(*(torch.full((n,), -7, dtype=torch.int32, device=DEV)
                                        for n in (E + 1, tokens * top_k, rows, rows, E)))
        xp = torch.full((rows, HIDDEN), float("nan"), dtype=torch.bfloat16, device=DEV)
        ids_out = torch.full((tokens, top_k), -7, dtype=torch.int32, device=DEV)
        w_out = torch.full((tokens, top_k), float("nan"), device=DEV)
        if staged:
            kernels.stage_sort_permute_bf16(x, x_scales, ids, route_weights, kernels.ROUTING_FP32, ids_out, w_out, 0,
                                            E, 8, sorted_, xp, layout)
        else:
            kernels.sort_permute_bf16(ids.view(-1), top_k, 0, E, 8, sorted_, x, x_scales, xp, layout)
        return [xp.view(torch.int16), sorted_.offsets, sorted_.slot_to_row, sorted_.row_to_slot, sorted_.row_expert,
                sorted_.counts, ids_out, w_out.view(torch.int32)]

    for staged in (False, True):
        want = run(values, None, staged)
        got = run(codes, scales, staged)
        for index, (g, w) in enumerate(zip(got, want)):
            assert torch.equal(g, w), f"output {index} (staged={staged}) differs"


def test_sort_permute_decodes_every_code_at_every_scale_byte() -> None:
    """The device's MXFP8 token decode (expand_mxfp8_unit's hardware form) over all 256 E4M3 codes at all 256 E8M0 scale
    bytes, gathered to natural rows: each element the nearest-even BF16 of c x 2^(b - 127), exact for 10 <= b <= 246
    (infinity past BF16's range), NaN for NaN codes and the scale byte 255 (the host form's values, which
    test_mx_pair_sm90_cpu.py checks)."""
    tokens, hidden = 8, 256 * 256 // 8  # each scale byte over eight units of 32 codes: every code once
    codes = torch.arange(256, dtype=torch.uint8).repeat(256).view(tokens, hidden)
    scales = torch.arange(256, dtype=torch.uint8).repeat_interleave(8).view(tokens, hidden // 32)
    rows = row_capacity(tokens, 1, E, 8)
    sorted_ = kernels.SortBuffers(*(torch.full((n,), -7, dtype=torch.int32, device=DEV)
                                    for n in (E + 1, tokens, rows, rows, E)))
    xp = torch.full((rows, hidden), float("nan"), dtype=torch.bfloat16, device=DEV)
    ids = torch.zeros(tokens, dtype=torch.int32, device=DEV)  # every token to expert 0
    kernels.sort_permute_bf16(ids, 1, 0, E, 8, sorted_, codes.view(torch.float8_e4m3fn).to(DEV),
                              scales.view(torch.float8_e8m0fnu).to(DEV), xp, TokenLayout.BF16_ROWS)
    got = xp[sorted_.slot_to_row.long()].cpu().view(256, 256)  # row b: the 256 codes at scale byte b
    code_values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
    scale_bytes = torch.arange(256).double().unsqueeze(1)
    nan = (torch.arange(256).bitwise_and(0x7F) == 0x7F).unsqueeze(0) | (scale_bytes == 255)
    value = code_values.unsqueeze(0) * torch.pow(2.0, scale_bytes - 127)
    want = value.float().bfloat16()  # exact in FP32 (|value| >= 2^-136), then nearest even
    assert bool(got[nan].isnan().all()), "a NaN code or the NaN scale byte lost its NaN"
    assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))
    in_range = ((scale_bytes >= 10) & (scale_bytes <= 246)).expand_as(nan) & ~nan
    assert torch.equal(got[in_range].double(), value[in_range]), "a value in the stated scales is not exact"


def _identity_g1(rows: int, inter: int, seed: int) -> torch.Tensor:
    """GEMM1 rows whose blocks span many binades (scales 2^-30 .. 2^30) and hold zeros and exact ties."""
    gen = torch.Generator().manual_seed(seed)
    g1 = torch.randn(rows, inter // 32, 32, generator=gen) * torch.pow(2.0, torch.randint(-30, 30, (rows, inter // 32, 1),
                                                                                         generator=gen).float())
    g1[:, 0] = 0.0
    g1[0, 1] = torch.tensor([448.0] + [256.0 + 16 * i for i in range(31)]) * 2.0**-4  # E4M3 ties after scaling
    return g1.reshape(rows, inter).bfloat16()


@pytest.mark.parametrize("layout", (*BF16_LAYOUTS, TokenLayout.BF16_TILED), ids=lambda layout: layout.name)
def test_activation_kernel_writes_the_mxfp8_elements(layout: TokenLayout) -> None:
    """With the identity activation, IntermediateCode.MXFP8 writes quantize_mxfp8's elements times their scales as
    BF16 (exact here), bit for bit, in each BF16 layout; padding rows zero, rows past the segments untouched."""
    rows, inter, used = 64, 256, 56
    g1 = _identity_g1(rows, inter, 0).to(DEV)
    row_to_slot = torch.arange(rows, dtype=torch.int32, device=DEV)
    row_to_slot[3] = -1  # a padding row
    offsets = torch.tensor([0, 20, used], dtype=torch.int32, device=DEV)
    out = torch.full((rows, inter), float("nan"), dtype=torch.bfloat16, device=DEV)
    kernels.activate_quantize(g1, row_to_slot, offsets, Identity(), layout, out, None,
                              intermediate=IntermediateCode.MXFP8)
    got = from_token_layout(out, layout) if layout is not TokenLayout.BF16_ROWS else out
    codes, scales = quantize_mxfp8(g1[:used].float().cpu())
    want = (codes.double() * torch.pow(2.0, scales.view(torch.uint8).double() - 127).repeat_interleave(32, -1))
    want[3] = 0.0
    assert torch.equal(got[:used].cpu().double(), want), "an MXFP8 element differs"
    assert bool(got[used:].isnan().all()), "rows past the segments were written"


# Where the pair's weights are prepared for: SM90 stores them as tiles, another arch keeps them row-major.
ARCHS = ("sm90", "sm100")


def _pair_layer(gated: bool, seed: int = 0, arch: str = "sm90"):
    w1, s1, w2, s2 = mx_payloads("mxfp4", gated, E, HIDDEN, INTER, seed)
    config = LowLatencyMoeConfig(MAX_NUM_TOKENS, arch=arch, engine="sm90")
    weights = config.prepare_weights(w1.to(DEV), s1.view(torch.float8_e8m0fnu).to(DEV), w2.to(DEV), s2.to(DEV),
                                     activation=SwiGLU() if gated else SiLU())
    assert weights.tiled == (arch == "sm90")
    return config, weights


@pytest.mark.parametrize("arch", ARCHS)
def test_gemm1_epilogue_writes_what_the_activation_kernel_writes(arch: str) -> None:
    """The pair's chain: GEMM1 with the MXFP8 epilogue writes GEMM2's tokens and GEMM2 its rows as the unfused chain
    does (GEMM1, the activation kernel, GEMM2), bit for bit, on the tiles (with the tile handoff) and on the weights
    read in place."""
    act = SwiGLU()
    config, weights = _pair_layer(True, arch=arch)
    view = grouped.layer_view(Sm90GemmEngine, weights)
    executor = grouped._executor(view, TOP_K, act, TokenCode.MXFP8, MAX_NUM_TOKENS)
    assert executor.intermediate is IntermediateCode.MXFP8
    tokens = 6
    bucket = executor.bucket(tokens)
    codes, scales, _ = _mxfp8_tokens(bucket.tokens, HIDDEN, 3)
    bucket.x.copy_(codes)
    bucket.x_scales.copy_(scales.view(torch.uint8))
    ids = random_ids(bucket.tokens, TOP_K, E, 4).to(DEV)
    ids[tokens:] = -1
    bucket.ids.copy_(ids)
    g1 = bucket.gemm1
    bucket.gemm1 = replace(g1, out=torch.empty(bucket.rows, g1.shape.n, dtype=torch.bfloat16, device=DEV))
    assert bucket.fusion.epilogue  # the fused chain folds the activation into GEMM1
    stages = _BucketStages(executor, bucket)
    for _, launch in (stages.sort_permute(), stages.gemm1(), stages.activation(), stages.gemm2()):
        launch()
    used = int(bucket.offsets[-1].item())
    want_tokens = bucket.gemm2.tokens.data[:used].view(torch.int16).clone()
    want_rows = bucket.gemm2.out[:used].view(torch.int16).clone()
    assert used > 0 and torch.count_nonzero(want_rows) > 0
    fused = executor.stages(bucket)
    handoff = ["gemm1+activation+gemm2"] if weights.tiled else ["gemm1+activation", "gemm2"]  # row-major: none
    assert [name for name, _ in fused] == ["sort+permute", *handoff]
    for buffer in (bucket.gemm2.tokens.data, bucket.gemm2.out):
        buffer.fill_(float("nan"))
    for _, launch in fused:
        launch()
    assert torch.equal(bucket.gemm2.tokens.data[:used].view(torch.int16), want_tokens), "GEMM2 tokens"
    assert torch.equal(bucket.gemm2.out[:used].view(torch.int16), want_rows), "GEMM2 rows"


def _chain_intermediate(weights, act, tokens: int) -> dict[str, torch.Tensor]:
    """The MXFP8 intermediate the SM90 chain of the last call of ``tokens`` tokens left in GEMM2's tokens, per slot, as
    codes uint8 [T k, Ip] and scale bytes [T k, Ip / 32] (zero for unrouted slots): its BF16 values are exact MXFP8
    elements, so quantize_mxfp8 of them gives their codes and scales back."""
    view = grouped.layer_view(Sm90GemmEngine, weights)
    executor = grouped._executor(view, TOP_K, act, TokenCode.MXFP8, MAX_NUM_TOKENS)
    bucket = executor.bucket(tokens)
    operand = bucket.gemm2.tokens
    rows = from_token_layout(operand.data, operand.layout).float()
    slot_rows = bucket.slot_to_row[: tokens * TOP_K].long()
    values = torch.where((slot_rows >= 0)[:, None], rows[slot_rows.clamp(min=0)], 0.0)
    codes, scales = quantize_mxfp8(values)
    return {"inter_codes": codes.view(torch.uint8), "inter_scales": scales.view(torch.uint8)}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tokens,act,kind", [(1, SwiGLU(), "packed"), (2, GeGLU(), "fp32"), (5, SiLU(), "bf16"),
                                             (8, SwiGLU(), "int64")], ids=lambda v: getattr(v, "__name__", str(v)))
def test_low_latency_pair_on_the_sm90_chain_matches_reference(tokens: int, act, kind: str, arch: str) -> None:
    config, weights = _pair_layer(act.gated, seed=tokens, arch=arch)
    acts = config.prepare_mxfp8_activations(tokens_bf16(tokens, HIDDEN, tokens + 1))
    ids = random_ids(tokens, TOP_K, E, tokens + 2)
    ids[0, -1] = E + 3  # an unrouted slot, with a NaN score (packed routing holds finite ones only)
    scores = torch.rand(tokens, TOP_K) + 0.05
    scores[0, -1] = 1.0 if kind == "packed" else float("nan")
    routing = make_routing(ids, kind, tokens + 3, weights=scores)
    out = nan_out((tokens, HIDDEN), torch.bfloat16)
    low_latency_moe(config, acts, weights, routing, activation=act, out=out)
    torch.cuda.synchronize()
    what = f"MXFP4 pair on sm90 T={tokens} {type(act).__name__} {kind} prepared for {arch}"
    q, s = check_intermediate(_chain_intermediate(weights, act, tokens), acts, weights, routing, act, what)
    want = reference_mx_pair(acts, weights, routing, act, intermediate=(q, s))
    assert_close_to_reference(out, want, what)
    again = nan_out((tokens, HIDDEN), torch.bfloat16)
    for _ in range(3):  # a new signature, then its full-call graph captured and replayed: bitwise the same
        again.fill_(float("nan"))
        low_latency_moe(config, acts, weights, routing, activation=act, out=again)
        assert torch.equal(again.view(torch.int16), out.view(torch.int16))

