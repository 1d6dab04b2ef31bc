"""GPU tests of the SM90 engine's fused chains: GEMM1 with the activation in its epilogue, after sort + permute
(decode kernel buckets) or after the sort, GEMM1 gathering its rows through the routing from the token rows the op's
stage decoded (wgmma buckets: the prefill chain). Against the unfused chain (sort, permute, GEMM1, activation, GEMM2) on the
same bucket, bit for bit, and the whole op against the float64 reference (tolerance: tests/support/moe_checks.py),
with outputs and unused buffers NaN-poisoned first."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from cudnn_moe import (
    GELU, GeGLU, GeGLUTanh, Identity, Nvfp4MoeConfig, ReLU, ReLU2, Routing, SiLU, SiTU, SwiGLU, SwiGLUStep,
    fused_moe,
)
from cudnn_moe.engines.base import EarlyRouting, TokenOperand
from cudnn_moe.engines.registry import engine_for
from cudnn_moe.engines.sm90.kernels import DecodeVariant, WgmmaVariant
from cudnn_moe.engines.sm90.layout import from_token_layout
from cudnn_moe import kernels
from cudnn_moe.kernels import ROUTING_FP32, IntermediateCode, TokenLayout
from cudnn_moe.pipeline.tokens import TokenCode
from cudnn_moe.fused.reference import reference_for_prepared
from cudnn_moe.pipeline.executor import CallerInputs, MoeExecutor, _BucketStages
from tests.support.low_latency import make_routing
from tests.support.moe_checks import check_close

pytestmark = pytest.mark.gpu

ACTIVATIONS = [SwiGLU(), SwiGLU(alpha=1.702, beta=1.0, limit=7.0), SwiGLUStep(limit=2.0), SiTU(a=2.0, b=3.0), GeGLU(),
               GeGLUTanh(), GELU(), ReLU(), SiLU(), ReLU2(), Identity()]


def _ids(tokens: int, experts: int, top_k: int, gen: torch.Generator, *, hot: bool) -> torch.Tensor:
    """Distinct random experts per token; with ``hot`` every token's first choice is expert 0 (one long segment)."""
    if not hot:
        return torch.rand(tokens, experts, generator=gen).argsort(dim=1)[:, :top_k].to(torch.int32)
    rest = torch.rand(tokens, experts - 1, generator=gen).argsort(dim=1)[:, : top_k - 1] + 1
    return torch.cat([torch.zeros(tokens, 1, dtype=rest.dtype), rest], dim=1).to(torch.int32)


def _layer(experts: int, hidden: int, inter: int, activation, seed: int):
    gen = torch.Generator().manual_seed(seed)
    w1 = torch.randn(experts, activation.gemm1_columns(inter), hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) / inter**0.5
    return gen, w1.cuda().bfloat16(), w2.cuda().bfloat16()


def _poison(t: torch.Tensor) -> None:
    if t.dtype == torch.uint8:
        t.fill_(0xFF)
    else:
        t.fill_(float("nan"))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def _token_rows(operand: TokenOperand) -> torch.Tensor:
    """The operand's data as rows: the tiled planes read back into natural rows, other layouts as stored."""
    return from_token_layout(operand.data, operand.layout) if operand.layout is TokenLayout.BF16_TILED else operand.data


def _token_code(bf16_tokens: bool) -> TokenCode:
    return TokenCode.BF16 if bf16_tokens else TokenCode.NVFP4


def _intermediate(bf16_intermediate: bool) -> IntermediateCode:
    return IntermediateCode.BF16 if bf16_intermediate else IntermediateCode.NVFP4


CHAIN_CASES = [
    # experts, hidden, inter, top_k, tokens, bf16_tokens, bf16_intermediate, hot, local (start, total)
    (8, 256, 256, 2, 256, False, False, False, None),
    (8, 256, 640, 2, 512, False, False, True, None),
    (16, 512, 256, 4, 300, True, True, False, None),
    (16, 256, 256, 4, 1000, False, True, False, (16, 64)),
    (32, 4096, 128, 2, 600, True, False, False, None),
    (8, 256, 2176, 2, 256, False, False, False, None),  # GEMM1 on 256-feature CTAs (N1 >= 4096)
    (8, 256, 384, 8, 96, False, False, True, None),
    # decode kernel buckets: sort + permute in one launch, then GEMM1 with the epilogue
    (8, 256, 256, 2, 1, False, False, False, None),
    (128, 512, 256, 8, 8, True, True, False, None),
    (64, 256, 384, 8, 64, False, False, True, (32, 128)),
    (16, 4096, 128, 4, 24, False, True, False, None),
    (16, 256, 256, 2, 128, False, False, True, None),  # 32-row token tiles
    (16, 4096, 128, 2, 128, True, False, False, None),  # 32-row tiles, split K
    (64, 512, 256, 8, 4, False, False, False, (32, 128)),  # early routing of a rank's local experts
]


@pytest.mark.parametrize("activation", ACTIVATIONS, ids=lambda a: repr(a)[:40])
@pytest.mark.parametrize("case", CHAIN_CASES, ids=lambda c: f"E{c[0]}-H{c[1]}-I{c[2]}-k{c[3]}-T{c[4]}-"
                         f"{'bf16' if c[5] else 'fp4'}-{'bf16' if c[6] else 'fp4'}{'-hot' if c[7] else ''}"
                         f"{'-ep' if c[8] else ''}")
def test_fused_chain_matches_unfused_chain_bitwise(case, activation) -> None:
    """GEMM2's tokens and outputs of the fused chain equal the unfused chain's, bit for bit, eager and replayed
    from the bucket's graph; the fused chain never reads GEMM1's BF16 output (nor, gathering, its permuted
    rows). Decode buckets run GEMM1 and GEMM2 as one stage with a tile handoff, whose counters (and the finalize
    tickets) are zero again after every call."""
    experts, hidden, inter, top_k, tokens, bf16_tokens, bf16_intermediate, hot, local = case
    gen, w1, w2 = _layer(experts, hidden, inter, activation, seed=tokens + experts)
    config = Nvfp4MoeConfig(max_num_tokens=tokens, engine="sm90")
    weights = config.prepare_weights(w1, w2, activation=activation)
    start, total = local if local is not None else (0, experts)
    executor = MoeExecutor(weights, engine_for(weights.spec, weights.device), top_k=top_k, activation=activation,
                           local_expert_start=start, max_num_tokens=tokens, tokens=_token_code(bf16_tokens),
                           intermediate=_intermediate(bf16_intermediate))
    bucket = executor.bucket(tokens)
    # The bucket holds no rows in what its fused chain never touches; the unfused chain gets full buffers here.
    g1 = bucket.gemm1
    assert g1.out.shape[0] == 0 and (g1.tokens.data.shape[0] == 0) == bucket.fusion.gather
    full_tokens = torch.empty(bucket.rows, hidden, dtype=torch.bfloat16, device="cuda")
    bucket.gemm1 = replace(g1, out=torch.empty(bucket.rows, g1.shape.n, dtype=torch.bfloat16, device="cuda"),
                           tokens=TokenOperand(full_tokens, None, g1.tokens.layout))
    stages = _BucketStages(executor, bucket)
    variant = executor.engine.variant(bucket.rows, bucket.gemm1.shape, gemm=1)
    gathers = isinstance(variant, WgmmaVariant)
    assert gathers or isinstance(variant, DecodeVariant)
    fused = executor.stages(bucket)
    if gathers:
        head = ["sort"]
    else:
        head = ["sort+permute"] if bucket.tokens * top_k <= 1024 else ["sort", "permute"]
    hands_off = executor.engine.tile_handoff(bucket.gemm1, bucket.gemm2) is not None
    assert hands_off == (not gathers and bucket.tokens * top_k <= 64)
    tail = ["gemm1+activation+gemm2"] if hands_off else ["gemm1+activation", "gemm2"]
    assert [name for name, _ in fused] == [*head, *tail]
    x = torch.randn(bucket.tokens, hidden, generator=gen).cuda().bfloat16()
    decoded = gathers and not bf16_tokens
    assert (bucket.x_rows is not None) == decoded and (bucket.x.shape[0] == 0) == decoded
    if bf16_tokens:
        bucket.x.copy_(x)
    else:
        acts = config.prepare_activations(x)
        packed, scales = acts.packed, acts.scales.view(torch.uint8)
        if decoded:  # the fused chain gathers the rows the op's stage decodes; the unfused one permutes these
            _poison(bucket.x_rows)
            routing = Routing.unpacked(torch.zeros(bucket.tokens, top_k, dtype=torch.int32, device="cuda"),
                                       torch.zeros(bucket.tokens, top_k, device="cuda"))
            executor.stage(bucket, acts, routing)
            bucket.x, bucket.x_scales = packed, scales
        else:
            bucket.x.copy_(packed)
            bucket.x_scales.copy_(scales)
    ids = _ids(bucket.tokens, total, top_k, gen, hot=hot)
    ids[tokens:] = -1  # the bucket's tokens past T are masked, as the op's stage writes them
    bucket.ids.copy_(ids.cuda())

    unfused = [stages.sort(), stages.permute(), stages.gemm1(), stages.activation(), stages.gemm2()]
    for _, launch in unfused:
        launch()
    used = int(bucket.offsets[-1].item())
    assert used > 0
    want_tokens = _bits(_token_rows(bucket.gemm2.tokens)[:used]).clone()
    want_out = _bits(bucket.gemm2.out[:used]).clone()
    assert torch.count_nonzero(want_out) > 0 and not torch.isnan(bucket.gemm2.out[:used]).any()
    for replay in (False, True):
        for buffer in (bucket.gemm1.tokens.data, bucket.gemm1.out, bucket.gemm2.tokens.data, bucket.gemm2.out):
            _poison(buffer)  # padding rows of the permuted tokens stay NaN: they must not reach GEMM2
        if bf16_tokens:
            bucket.x.copy_(x)
        if replay:
            executor._ensure_graph(bucket).replay()
        else:
            for _, launch in fused:
                launch()
        got_tokens = _bits(_token_rows(bucket.gemm2.tokens)[:used])
        assert torch.equal(got_tokens, want_tokens), f"GEMM2 tokens (replay={replay})"
        assert torch.equal(_bits(bucket.gemm2.out[:used]), want_out), f"GEMM2 rows (replay={replay})"
        workspace = bucket.gemm2.workspace
        assert workspace is None or not workspace.view(torch.int32).any(), f"counters left set (replay={replay})"


def _swiglu_executor(experts: int, hidden: int, inter: int, top_k: int, tokens: int, local):
    """A SwiGLU layer of random weights on the sm90 engine (seeded by ``tokens``) and its executor for calls of up to
    ``tokens`` tokens, local experts from ``local``'s start (None: all): (generator, config, weights, executor,
    (local start, total experts))."""
    gen, w1, w2 = _layer(experts, hidden, inter, SwiGLU(), seed=tokens)
    config = Nvfp4MoeConfig(max_num_tokens=tokens, engine="sm90")
    weights = config.prepare_weights(w1, w2, activation=SwiGLU())
    start, total = local if local is not None else (0, experts)
    executor = MoeExecutor(weights, engine_for(weights.spec, weights.device), top_k=top_k, activation=SwiGLU(),
                           local_expert_start=start, max_num_tokens=tokens)
    return gen, config, weights, executor, (start, total)


@pytest.mark.parametrize("tokens,top_k,local", [(4, 8, None), (3, 4, (16, 48)), (1, 8, None)])
def test_early_routing_changes_no_bit(tokens: int, top_k: int, local) -> None:
    """GEMM1 with the activation epilogue writes the same GEMM2 tokens, bit for bit, whatever its early routing says:
    none, the bucket's ids (the right guess), other experts (every CTA guesses wrong and reloads), nothing routed
    (no guess), and int64 ids; the bucket's own chain takes the bucket's ids. GEMM2 (as behind a routed GEMM1) writes
    the same rows whatever its early routing says."""
    hidden = 512
    gen, config, _, executor, (start, total) = _swiglu_executor(32, hidden, 256, top_k, tokens, local)
    bucket = executor.bucket(tokens)
    stages = _BucketStages(executor, bucket)
    assert isinstance(executor.engine.variant(bucket.rows, bucket.gemm1.shape, gemm=1), DecodeVariant)
    x = torch.randn(bucket.tokens, hidden, generator=gen).cuda().bfloat16()
    acts = config.prepare_activations(x)
    bucket.x.copy_(acts.packed)
    bucket.x_scales.copy_(acts.scales.view(torch.uint8))
    ids = _ids(bucket.tokens, total, top_k, gen, hot=False).cuda()
    bucket.ids.copy_(ids)
    for _, launch in (stages.sort(), stages.permute()):
        launch()
    used = int(bucket.offsets[-1].item())
    assert used > 0
    fused = stages.gemm1_activation(gather=False)
    assert executor.engine._early(replace(bucket.gemm1, epilogue=stages._activation_epilogue(),
                                          early=EarlyRouting(bucket.ids, ROUTING_FP32, start)),
                                  executor.engine.variant(bucket.rows, bucket.gemm1.shape, gemm=1)) is not None
    guesses = {
        "none": None,
        "right": EarlyRouting(bucket.ids, ROUTING_FP32, start),
        "other experts": EarlyRouting(((ids + 1) % total).to(torch.int32), ROUTING_FP32, start),
        "unrouted": EarlyRouting(torch.full_like(ids, -1), ROUTING_FP32, start),
        "int64": EarlyRouting(ids.to(torch.int64), ROUTING_FP32, start),
    }
    g2 = bucket.gemm2.tokens  # the intermediate GEMM2 reads (and its scales where it is NVFP4)

    def run(launch) -> tuple[torch.Tensor, torch.Tensor | None]:
        for t in (g2.data, g2.scales):
            if t is not None:
                _poison(t)
        launch()
        return _bits(g2.data[:used]).clone(), None if g2.scales is None else g2.scales.clone()

    outputs = {name: run(lambda e=early: executor.engine.gemm(
        replace(bucket.gemm1, epilogue=stages._activation_epilogue(), early=e))) for name, early in guesses.items()}
    outputs["chain"] = run(fused.launch)
    want = outputs.pop("none")
    assert torch.count_nonzero(want[0]) > 0 and not torch.isnan(g2.data[:used].float()).any()
    for name, got in outputs.items():
        assert torch.equal(got[0], want[0]) and (want[1] is None or torch.equal(got[1], want[1])), name

    def run_gemm2(early: EarlyRouting | None) -> torch.Tensor:
        _poison(bucket.gemm2.out)
        executor.engine.gemm(replace(bucket.gemm2, early=early))
        return _bits(bucket.gemm2.out[:used]).clone()

    assert executor.engine._early(replace(bucket.gemm2, early=guesses["right"]),
                                  executor.engine.variant(bucket.rows, bucket.gemm2.shape, gemm=2)) is not None
    want_rows = run_gemm2(None)
    assert torch.count_nonzero(want_rows) > 0 and not torch.isnan(bucket.gemm2.out[:used]).any()
    for name, early in guesses.items():
        assert torch.equal(run_gemm2(early), want_rows), f"GEMM2, {name}"


@pytest.mark.parametrize("tokens,local", [(8, None), (6, (32, 160))])
def test_l2_warming_changes_no_bit(tokens: int, local, monkeypatch: pytest.MonkeyPatch) -> None:
    """The call's staged sort + permute launch with its L2-warming blocks (Sm90GemmEngine.l2_warm: they only ask L2 for
    GEMM1's first weight bytes; Qwen3-30B-A3B's shapes, GEMM1 past one wave) finalizes the same output, bit for bit, as
    without them, into a NaN-poisoned output, and that output matches the float64 reference; also with an
    expert-parallel subset."""
    hidden, top_k = 2048, 8
    gen, config, weights, executor, (start, total) = _swiglu_executor(128, hidden, 768, top_k, tokens, local)
    bucket = executor.bucket(tokens)
    warm = executor.engine.l2_warm(bucket.gemm1)
    assert warm is not None and warm.code_bytes > 0 and warm.experts > 0
    acts = config.prepare_activations(torch.randn(tokens, hidden, generator=gen).cuda().bfloat16())
    routing = Routing.unpacked(_ids(tokens, total, top_k, gen, hot=False).cuda(),
                               (torch.rand(tokens, top_k, generator=gen) + 0.1).cuda())
    outs = []
    for warming in (True, False):
        if not warming:
            monkeypatch.setattr(type(executor.engine), "l2_warm", lambda self, gemm1: None)
        caller = CallerInputs(acts, routing, torch.full((tokens, hidden), float("nan"), dtype=torch.bfloat16,
                                                        device="cuda"))
        launches = executor.call_launches(bucket, caller)
        assert launches[0].name == "stage+sort+permute"
        for _, launch in launches:
            launch()
        torch.cuda.synchronize()
        outs.append(caller.out)
    assert torch.equal(_bits(outs[0]), _bits(outs[1]))
    check_close(outs[0], reference_for_prepared(acts, weights, routing, SwiGLU(), local_expert_start=start))


LAYER_CASES = [
    # experts, hidden, inter, top_k, tokens, activation, hot, local (start, total)
    (8, 256, 256, 2, 512, SwiGLU(), False, None),
    (8, 512, 256, 2, 700, SwiGLU(), True, None),
    (64, 256, 128, 8, 2048, GeGLU(), False, (32, 128)),
    (128, 256, 128, 2, 16384, SwiGLU(), True, None),
    (16, 256, 384, 4, 1024, ReLU2(), False, None),
]


@pytest.mark.parametrize("case", LAYER_CASES, ids=lambda c: f"E{c[0]}-H{c[1]}-I{c[2]}-k{c[3]}-T{c[4]}-"
                         f"{type(c[5]).__name__}{'-hot' if c[6] else ''}{'-ep' if c[7] else ''}")
def test_prefill_layers_match_reference(case) -> None:
    """fused_moe on buckets of the prefill chain (skewed routing with one hot expert, an expert-parallel subset,
    16384 tokens) against the float64 reference, into a NaN-poisoned output, eager and graph-replayed."""
    experts, hidden, inter, top_k, tokens, activation, hot, local = case
    gen, w1, w2 = _layer(experts, hidden, inter, activation, seed=tokens)
    start, total = local if local is not None else (0, experts)
    config = Nvfp4MoeConfig(max_num_tokens=tokens, engine="sm90")
    weights = config.prepare_weights(w1, w2, activation=activation)
    acts = config.prepare_activations(torch.randn(tokens, hidden, generator=gen).cuda().bfloat16())
    ids = _ids(tokens, total, top_k, gen, hot=hot)
    routing = Routing.unpacked(ids.cuda(), (torch.rand(tokens, top_k, generator=gen) + 0.1).cuda())
    ref = reference_for_prepared(acts, weights, routing, activation, local_expert_start=start)
    for graph in (False, True):
        out = torch.full((tokens, hidden), float("nan"), dtype=torch.bfloat16, device="cuda")
        fused_moe(config, acts, routing, weights, activation=activation, local_expert_start=start, out=out,
                  use_cuda_graph=graph)
        check_close(out, ref)


ROUTED_CASES = [
    # experts, hidden, inter, top_k, bf16_tokens, bf16_intermediate, local (start, total), routing, finalizes
    (8, 256, 256, 2, False, False, None, "fp32", False),
    (128, 2048, 768, 8, False, False, None, "packed", True),  # Qwen3-30B-A3B's shapes
    (128, 512, 256, 8, True, True, None, "bf16", False),
    (64, 256, 384, 8, False, False, (32, 128), "int64", True),  # an expert-parallel subset: unrouted slots
    (64, 256, 384, 8, False, False, (64, 128), "none local", True),  # no slot routed to this rank: no tile at all
    (16, 4096, 128, 4, False, True, None, "fp32", True),
    (256, 7168, 256, 8, True, True, None, "duplicate", True),  # DeepSeek-V3's H; one expert named twice
]


@pytest.mark.parametrize("case", ROUTED_CASES, ids=lambda c: f"E{c[0]}-H{c[1]}-I{c[2]}-k{c[3]}-"
                         f"{'bf16' if c[4] else 'fp4'}-{'bf16' if c[5] else 'fp4'}{'-ep' if c[6] else ''}-{c[7]}"
                         f"{'-finalize' if c[8] else ''}")
def test_routed_gemm1_matches_unfused_chain_bitwise(case) -> None:
    """A one-token call whose launches know its inputs runs two launches: GEMM1 with the stage and the sort in its
    prologue (and the activation in its epilogue), then GEMM2 (guessing its experts from the caller's routing to
    start its weights early, and finalizing into the caller's output where it is given). Every buffer the rest of
    the chain reads (the sort's outputs, the staged routing, GEMM2's tokens and rows) and the finalized output equal
    the unfused chain's (stage, sort, permute, GEMM1, activation, GEMM2, finalize), bit for bit, after NaN / 0xFF
    poisoning; twice in a row. No slot routed to the rank's experts leaves no tile: zeros."""
    experts, hidden, inter, top_k, bf16_tokens, bf16_intermediate, local, routing_kind, finalizes = case
    activation = SwiGLU()
    gen, w1, w2 = _layer(experts, hidden, inter, activation, seed=experts + hidden)
    config = Nvfp4MoeConfig(max_num_tokens=8, engine="sm90")
    weights = config.prepare_weights(w1, w2, activation=activation)
    start, total = local if local is not None else (0, experts)
    executor = MoeExecutor(weights, engine_for(weights.spec, weights.device), top_k=top_k, activation=activation,
                           local_expert_start=start, max_num_tokens=8, tokens=_token_code(bf16_tokens),
                           intermediate=_intermediate(bf16_intermediate))
    bucket = executor.bucket(1)
    assert bucket.tokens == 1 and bucket.fusion.epilogue
    x = torch.randn(1, hidden, generator=gen).cuda().bfloat16()
    tokens = x if bf16_tokens else config.prepare_activations(x)
    ids = _ids(1, total, top_k, gen, hot=False)
    if routing_kind == "duplicate":
        ids[0, 1] = ids[0, 0]
    if routing_kind == "none local":
        ids = ids % start  # every slot routes to another rank's experts
    routing = make_routing(ids.long(), "fp32" if routing_kind in ("duplicate", "none local") else routing_kind,
                           seed=experts)
    out = torch.empty(1, hidden, dtype=torch.bfloat16, device="cuda") if finalizes else None
    caller = CallerInputs(tokens, routing, out)
    routed = _BucketStages(executor, bucket, caller)
    chain = executor.engine.stages(routed)
    assert [name for name, _ in chain] == [
        "stage+sort+permute+gemm1+activation", "gemm2+finalize" if finalizes else "gemm2"]

    # The unfused chain on full buffers (the routed bucket holds no GEMM1 output rows).
    g1 = bucket.gemm1
    bucket.gemm1 = replace(g1, out=torch.empty(bucket.rows, g1.shape.n, dtype=torch.bfloat16, device="cuda"))
    unfused = _BucketStages(executor, bucket)
    executor.stage(bucket, tokens, routing)
    for _, launch in (unfused.sort(), unfused.permute(), unfused.gemm1(), unfused.activation(), unfused.gemm2()):
        launch()
    used = int(bucket.offsets[-1].item())
    assert used == 0 if routing_kind == "none local" else used > 0
    sorted_names = ("offsets", "slot_to_row", "row_to_slot", "row_expert", "expert_counts", "ids", "route_weights")
    want = {name: getattr(bucket, name).clone() for name in sorted_names}
    want_tokens = _bits(_token_rows(bucket.gemm2.tokens)[:used]).clone()
    want_out = _bits(bucket.gemm2.out[:used]).clone()
    assert used == 0 or torch.count_nonzero(want_out) > 0 and not torch.isnan(bucket.gemm2.out[:used]).any()
    if finalizes:
        want_final = torch.full_like(out, float("nan"))
        kernels.finalize(bucket.gemm2.out, bucket.slot_to_row, bucket.route_weights, top_k, want_final)
        assert not want_final.isnan().any() and (used == 0) == (torch.count_nonzero(want_final) == 0)
    bucket.gemm1 = g1
    for _ in range(2):
        for name in sorted_names:
            getattr(bucket, name).fill_(-7)
        for buffer in (bucket.gemm1.tokens.data, bucket.gemm2.tokens.data, bucket.gemm2.out):
            _poison(buffer)
        if finalizes:
            _poison(out)
        for _, launch in chain:
            launch()
        for name in sorted_names:
            assert torch.equal(getattr(bucket, name), want[name]), name
        assert torch.equal(_bits(_token_rows(bucket.gemm2.tokens)[:used]), want_tokens), "GEMM2 tokens"
        assert torch.equal(_bits(bucket.gemm2.out[:used]), want_out), "GEMM2 rows"
        if finalizes:
            assert torch.equal(_bits(out), _bits(want_final)), "finalized output"


@pytest.mark.parametrize("tokens,experts,top_k", [(1, 8, 2), (8, 128, 8), (64, 64, 8)])
def test_tile_handoff_repeats(tokens: int, experts: int, top_k: int) -> None:
    """fused_moe on decode buckets (GEMM1 handing its tiles to GEMM2): 30 calls in a row, eager and from one CUDA
    graph of the caller's, give the first call's output bit for bit (the counters come back to zero each time)."""
    hidden, inter = 512, 256
    gen, w1, w2 = _layer(experts, hidden, inter, SwiGLU(), seed=tokens + 7)
    config = Nvfp4MoeConfig(max_num_tokens=tokens, engine="sm90")
    weights = config.prepare_weights(w1, w2, activation=SwiGLU())
    acts = config.prepare_activations(torch.randn(tokens, hidden, generator=gen).cuda().bfloat16())
    routing = make_routing(_ids(tokens, experts, top_k, gen, hot=False), "fp32")
    want = fused_moe(config, acts, routing, weights)
    assert not want.isnan().any() and torch.count_nonzero(want) > 0
    out = torch.full_like(want, float("nan"))
    fused_moe(config, acts, routing, weights, out=out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_moe(config, acts, routing, weights, out=out)
    for i in range(30):
        got = fused_moe(config, acts, routing, weights)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), f"eager call {i}"
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.view(torch.int16), want.view(torch.int16)), f"replay {i}"


def test_tile_handoff_recovers_from_a_failed_gemm2(monkeypatch: pytest.MonkeyPatch) -> None:
    """GEMM2 of the handoff pair raising after GEMM1 was enqueued (a failed check or compile): the stage waits for
    GEMM1 and zeroes the counters it set, so the next call's GEMM2 waits for its own GEMM1 and matches the unfused
    chain bit for bit."""
    tokens, experts, top_k, hidden, inter = 8, 64, 8, 512, 256
    gen, w1, w2 = _layer(experts, hidden, inter, SwiGLU(), seed=41)
    config = Nvfp4MoeConfig(max_num_tokens=tokens, engine="sm90")
    weights = config.prepare_weights(w1, w2, activation=SwiGLU())
    executor = MoeExecutor(weights, engine_for(weights.spec, weights.device), top_k=top_k, activation=SwiGLU(),
                           local_expert_start=0, max_num_tokens=tokens)
    bucket = executor.bucket(tokens)
    acts = config.prepare_activations(torch.randn(tokens, hidden, generator=gen).cuda().bfloat16())
    bucket.x.copy_(acts.packed)
    bucket.x_scales.copy_(acts.scales.view(torch.uint8))
    bucket.ids.copy_(_ids(tokens, experts, top_k, gen, hot=False).cuda())
    chain = executor.stages(bucket)
    assert [name for name, _ in chain] == ["sort+permute", "gemm1+activation+gemm2"]
    engine = executor.engine
    gemm = engine.gemm

    def failing(operands) -> None:
        if operands.gemm == 2:
            raise RuntimeError("GEMM2 refused")
        gemm(operands)

    monkeypatch.setattr(engine, "gemm", failing)
    with pytest.raises(RuntimeError, match="GEMM2 refused"):
        for _, launch in chain:
            launch()
    torch.cuda.synchronize()
    assert not bucket.gemm2.workspace.view(torch.int32).any(), "the counters GEMM1 set must be zeroed"
    monkeypatch.setattr(engine, "gemm", gemm)
    _poison(bucket.gemm2.out)
    for _, launch in chain:
        launch()
    got = _bits(bucket.gemm2.out).clone()
    stages = _BucketStages(executor, bucket)
    _poison(bucket.gemm2.out)
    for _, launch in (stages.gemm1_activation(gather=False), stages.gemm2()):
        launch()
    used = int(bucket.offsets[-1].item())
    assert used > 0 and torch.equal(got[:used], _bits(bucket.gemm2.out[:used]))
    assert not bucket.gemm2.out[:used].isnan().any()
