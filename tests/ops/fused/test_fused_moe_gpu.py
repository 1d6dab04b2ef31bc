"""GPU tests of the fused NVFP4 MoE op against the float64 reference (tolerance: tests/support/moe_checks.py)."""

from __future__ import annotations

import pytest
import torch

from cudnn_moe import (
    GELU, GeGLU, GeGLUTanh, Identity, Nvfp4Activations, Nvfp4MoeConfig, ReLU, ReLU2, Routing, SiLU, SiTU, SwiGLU,
    SwiGLUStep, fused_moe, get_executor, pack_routing,
)
from cudnn_moe.arch import peak_dram_tbs
from cudnn_moe.engines.sm90.engine import _SLOW_DRAM_TBS
from cudnn_moe.engines.sm90.kernels import DecodeVariant
from cudnn_moe.fused.checks import unfinalized_row_count
from cudnn_moe.fused.reference import reference_for_prepared
from cudnn_moe.pipeline.executor import CallerInputs
from tests.support.moe_checks import check_close as _check_close

pytestmark = pytest.mark.gpu


def _layer(experts, hidden, inter, top_k, tokens, activation, seed, *, local=None, routing="fp32"):
    gen = torch.Generator().manual_seed(seed)
    rows1 = activation.gemm1_columns(inter)
    x = torch.randn(tokens, hidden, generator=gen)
    w1 = torch.randn(experts, rows1, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) / inter**0.5
    total_experts = experts if local is None else local[1]
    ids = torch.rand(tokens, total_experts, generator=gen).argsort(dim=1)[:, :top_k].to(torch.int32)
    route_w = torch.rand(tokens, top_k, generator=gen) + 0.1
    dev = torch.device("cuda")
    if routing == "packed":
        r = Routing.packed(pack_routing(ids, route_w).to(dev))
    elif routing == "bf16":
        r = Routing.unpacked(ids.to(dev), route_w.to(dev, torch.bfloat16))
    else:
        r = Routing.unpacked(ids.to(dev), route_w.to(dev))
    return (x.to(dev, torch.bfloat16), w1.to(dev, torch.bfloat16), w2.to(dev, torch.bfloat16), r)


ENGINES = ["sm90", "cudnn"]


def _run_case(experts, hidden, inter, top_k, tokens, activation, *, seed=0, local=None, routing="fp32",
              finalize=True, graph=True, engine="auto"):
    """local = (start, total_experts): this rank holds experts start .. start+experts-1 of total."""
    x, w1, w2, r = _layer(experts, hidden, inter, top_k, tokens, activation, seed, local=local, routing=routing)
    start = 0 if local is None else local[0]
    config = Nvfp4MoeConfig(max_num_tokens=max(tokens, 1), engine=engine)
    weights = config.prepare_weights(w1, w2, activation=activation)
    acts = config.prepare_activations(x)
    ref = reference_for_prepared(acts, weights, r, activation, local_expert_start=start, finalize=finalize)
    if finalize:
        out = torch.full((tokens, hidden), float("nan"), dtype=torch.bfloat16, device="cuda")
    else:
        rows = unfinalized_row_count(weights, tokens, top_k)
        out = torch.full((rows, hidden), float("nan"), dtype=torch.bfloat16, device="cuda")
    got = fused_moe(config, acts, r, weights, activation=activation, local_expert_start=start,
                    finalize=finalize, out=out, use_cuda_graph=graph)
    return got, ref, (config, acts, r, weights, activation, start)


CASES = [
    # experts, hidden, inter, top_k, tokens, activation
    (8, 256, 256, 2, 64, SwiGLU()),
    (8, 256, 128, 1, 1, SwiGLU()),
    (8, 128, 256, 8, 3, GeGLU()),
    (64, 512, 256, 8, 64, SwiGLU()),
    (64, 256, 384, 2, 1000, GELU()),
    (256, 256, 128, 8, 64, ReLU()),
    (8, 2048, 2048, 2, 64, SwiGLU()),
    (8, 256, 256, 2, 64, SiLU()),
    (8, 256, 256, 2, 64, Identity()),
    (8, 256, 256, 2, 64, ReLU2()),
    (8, 256, 256, 2, 64, GeGLUTanh()),
    (8, 256, 256, 2, 64, SwiGLU(alpha=1.702, beta=1.0, limit=7.0)),
    (8, 256, 256, 2, 64, SwiGLUStep(limit=2.0)),
    (8, 256, 256, 2, 64, SiTU(a=2.0, b=3.0)),
]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"E{c[0]}-H{c[1]}-I{c[2]}-k{c[3]}-T{c[4]}-{type(c[5]).__name__}")
def test_matches_reference(case, engine):
    got, ref, (_, _, _, weights, _, _) = _run_case(*case, engine=engine)
    assert weights.spec.engine == engine
    _check_close(got, ref)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("routing", ["packed", "fp32", "bf16"])
def test_routing_formats(routing, engine):
    got, ref, _ = _run_case(8, 256, 256, 4, 64, SwiGLU(), routing=routing, seed=3, engine=engine)
    _check_close(got, ref)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("tokens", [0, 1, 3])
def test_small_token_counts(tokens, engine):
    got, ref, _ = _run_case(64, 256, 256, 8, tokens, SwiGLU(), seed=tokens, engine=engine)
    _check_close(got, ref)


def _random_case(seed: int) -> dict:
    """A random layer: E, H, I, top-k, T (1..4096), activation, expert-parallel subset, finalize or not."""
    gen = torch.Generator().manual_seed(1000 + seed)
    pick = lambda options: options[int(torch.randint(len(options), (1,), generator=gen))]  # noqa: E731
    experts = pick([1, 4, 8, 32, 128, 256])
    total = experts * pick([1, 1, 2, 4])
    top_k = min(total, pick([1, 2, 4, 6, 8]))
    tokens = pick([1, 2, 5, 8, 17, 64, 100, 512, 1500, 4096])
    hidden = 128 * pick([1, 2, 3, 8, 16])
    inter = 128 * pick([1, 2, 5, 6, 12])
    activation = pick([SwiGLU(), SwiGLU(alpha=1.702, beta=1.0, limit=7.0), GeGLU(), GeGLUTanh(), GELU(), ReLU(),
                       SiLU(), ReLU2(), Identity()])
    start = experts * int(torch.randint(total // experts, (1,), generator=gen))
    return dict(experts=experts, hidden=hidden, inter=inter, top_k=top_k, tokens=tokens, activation=activation,
                local=(start, total), finalize=bool(seed % 3), seed=seed, routing=pick(["fp32", "packed", "bf16"]))


def _dense_rows(got, ref):
    """Unfinalized GPU rows gathered to the reference's [T*k, H] order (zero where masked), and the reference rows."""
    rows, token_to_row = got.rows, got.token_to_row
    gathered = rows[token_to_row.clamp_min(0).long()]
    gathered[token_to_row < 0] = 0
    return gathered.reshape(-1, rows.shape[1]), ref.rows.reshape(-1, rows.shape[1])


@pytest.mark.parametrize("seed", range(12))
def test_random_layers_every_engine_and_each_other(seed):
    """Both engines against the float64 reference, and against each other, on a random layer."""
    case = _random_case(seed)
    outputs = []
    for engine in ENGINES:
        if engine == "cudnn" and case["experts"] == 1:
            continue  # one expert needs E+1 offsets, which cuDNN takes on SM90 only from 9.28
        got, ref, _ = _run_case(case["experts"], case["hidden"], case["inter"], case["top_k"], case["tokens"],
                                case["activation"], seed=case["seed"], local=case["local"], routing=case["routing"],
                                finalize=case["finalize"], engine=engine)
        if not case["finalize"]:
            got, ref = _dense_rows(got, ref)
        if torch.count_nonzero(ref) == 0:
            assert torch.count_nonzero(got) == 0 and not torch.isnan(got).any()
            continue
        _check_close(got, ref)
        outputs.append(got)
    for other in outputs[1:]:
        _check_close(other, outputs[0])


@pytest.mark.parametrize("engine", ENGINES)
def test_expert_parallel_subset(engine):
    # This rank holds experts 16..31 of 64: most slots are masked, some tokens get no local expert.
    got, ref, (config, acts, r, weights, act, start) = _run_case(16, 256, 256, 4, 64, SwiGLU(), local=(16, 64), seed=5,
                                                                 engine=engine)
    _check_close(got, ref)
    ids = r.ids_and_weights()[0].cpu().flatten()
    local = ids[(ids >= 16) & (ids < 32)] - 16
    executor = get_executor(config, weights, top_k=4, activation=act, local_expert_start=start)
    assert torch.equal(executor.bucket(64).expert_counts.cpu(), torch.bincount(local, minlength=16).to(torch.int32))


def test_all_slots_masked_gives_zeros():
    got, ref, _ = _run_case(8, 256, 128, 2, 16, SwiGLU(), local=(200, 8), seed=6)
    assert not torch.isnan(got).any()
    assert torch.count_nonzero(got) == 0 and torch.count_nonzero(ref) == 0


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "full-call-graph"])
@pytest.mark.parametrize("tokens", [1, 3])
def test_no_local_expert_routed_gives_zeros_where_gemm2_finalizes(tokens, graph):
    # The call's own chain (eager, or the full-call graph a repeated call captures) finalizes in the sm90 decode GEMM2
    # at few tokens. With no slot on a local expert that GEMM has no tile at all, and out (NaN here) must still come
    # back all zeros.
    got, ref, (config, acts, r, weights, act, start) = _run_case(8, 256, 128, 2, tokens, SwiGLU(), local=(200, 8),
                                                                 seed=6, graph=graph, engine="sm90")
    executor = get_executor(config, weights, top_k=2, activation=act, local_expert_start=start)
    chain = executor.stages(executor.bucket(tokens), CallerInputs(acts, r, got))
    assert chain[-1].name.endswith("gemm2+finalize"), [stage.name for stage in chain]  # alone or after GEMM1
    # With a graph, the second call with the same tensors captures the full-call graph and the third replays it.
    for _ in range(2 if graph else 1):
        got.fill_(float("nan"))
        fused_moe(config, acts, r, weights, activation=act, local_expert_start=start, out=got, use_cuda_graph=graph)
    assert torch.count_nonzero(ref) == 0
    assert not torch.isnan(got).any() and torch.count_nonzero(got) == 0


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("routing", ["packed", "fp32"])
def test_unfinalized_rows(routing, engine):
    got, ref, _ = _run_case(8, 256, 256, 2, 64, SwiGLU(), routing=routing, finalize=False, seed=7, engine=engine)
    rows, weights, token_to_row = got.rows, got.expert_weights, got.token_to_row
    assert token_to_row.shape == (64, 2) and token_to_row.dtype == torch.int32
    assert torch.equal(token_to_row.cpu() >= 0, ref.mask.cpu())
    used = token_to_row[token_to_row >= 0]
    assert used.unique().numel() == used.numel(), "two slots share a row"
    _check_close(*_dense_rows(got, ref))
    torch.testing.assert_close(weights.cpu(), ref.weights.cpu(), rtol=0, atol=0)
    unused = torch.ones(rows.shape[0], dtype=torch.bool, device=rows.device)
    unused[used.long()] = False
    assert torch.count_nonzero(rows[unused]) == 0, "rows no slot points at must be zero"


@pytest.mark.parametrize("engine", ENGINES)
def test_graph_replay_equals_eager_and_repeats(engine):
    eager, ref, (config, acts, r, weights, act, start) = _run_case(64, 512, 256, 8, 100, SwiGLU(), graph=False,
                                                                   engine=engine)
    _check_close(eager, ref)
    replays = [fused_moe(config, acts, r, weights, activation=act, use_cuda_graph=True) for _ in range(3)]
    for out in replays:
        assert torch.equal(out, eager)


@pytest.mark.parametrize("routing", ["packed", "fp32", "bf16"])
@pytest.mark.parametrize("tokens", [1, 5, 64])
def test_stage_folded_into_the_sort_gives_the_bucket_graphs_bits(routing, tokens):
    """Eager calls fold the op's stage into the decode chain's sort + permute launch (one-token calls: the stage, the
    sort and the permute into GEMM1); the bucket graph of a first graphed call stages separately. The same bits
    either way."""
    graphed, ref, (config, acts, r, weights, act, start) = _run_case(64, 512, 256, 8, tokens, SwiGLU(), seed=21,
                                                                     routing=routing, engine="sm90")
    _check_close(graphed, ref)
    executor = get_executor(config, weights, top_k=8, activation=act, local_expert_start=0)
    first = "stage+sort+permute+gemm1+activation" if tokens == 1 else "stage+sort+permute"
    assert executor.stages(executor.bucket(tokens), CallerInputs(acts, r))[0].name == first
    out = torch.full_like(graphed, float("nan"))
    eager = fused_moe(config, acts, r, weights, activation=act, out=out, use_cuda_graph=False)
    assert torch.equal(eager.view(torch.int16), graphed.view(torch.int16))


def test_bucket_reuse_with_fewer_tokens():
    # Run 100 tokens (bucket 128), then 37 tokens in the same bucket: stale rows must not leak.
    _, _, (config, acts, r, weights, act, start) = _run_case(8, 256, 256, 2, 100, SwiGLU(), seed=9)
    x, w1, w2, r2 = _layer(8, 256, 256, 2, 37, act, seed=10)
    acts2 = config.prepare_activations(x)
    ref = reference_for_prepared(acts2, weights, r2, act)
    out = torch.full((37, 256), float("nan"), dtype=torch.bfloat16, device="cuda")
    _check_close(fused_moe(config, acts2, r2, weights, activation=act, out=out), ref)


def test_records_into_callers_cuda_graph():
    eager, ref, (config, acts, r, weights, act, start) = _run_case(8, 256, 256, 2, 32, SwiGLU(), seed=11)
    out = torch.full_like(eager, float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_moe(config, acts, r, weights, activation=act, out=out)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


def test_runs_on_a_side_stream():
    eager, ref, (config, acts, r, weights, act, start) = _run_case(8, 256, 256, 2, 32, SwiGLU(), seed=12)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out = torch.full_like(eager, float("nan"))
        fused_moe(config, acts, r, weights, activation=act, out=out)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


def test_warmup_then_capture_without_a_prior_call():
    x, w1, w2, r = _layer(8, 256, 256, 2, 20, SwiGLU(), seed=13)
    config = Nvfp4MoeConfig(max_num_tokens=32)
    weights = config.prepare_weights(w1, w2)
    acts = config.prepare_activations(x)
    get_executor(config, weights, top_k=2, activation=SwiGLU(), local_expert_start=0).warmup()
    out = torch.full((20, 256), float("nan"), dtype=torch.bfloat16, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_moe(config, acts, r, weights, out=out)
    graph.replay()
    torch.cuda.synchronize()
    _check_close(out, reference_for_prepared(acts, weights, r, SwiGLU()))


def _sharing_storage(t: torch.Tensor, out_shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(a copy of t, a bfloat16 tensor of out_shape) laid over the same bytes."""
    out_bytes = out_shape[0] * out_shape[1] * 2
    buffer = torch.zeros(max(out_bytes, t.numel() * t.element_size()), dtype=torch.uint8, device=t.device)
    copy = buffer[: t.numel() * t.element_size()].view(t.dtype).view(t.shape)
    copy.copy_(t)
    return copy, buffer[:out_bytes].view(torch.bfloat16).view(out_shape)


@pytest.mark.parametrize("victim", ["w2", "activations", "routing"])
def test_out_overlapping_an_input_is_refused(victim):
    x, w1, w2, r = _layer(8, 256, 256, 2, 16, SwiGLU(), seed=14)
    config = Nvfp4MoeConfig(max_num_tokens=16)
    weights = config.prepare_weights(w1, w2)
    acts = config.prepare_activations(x)
    if victim == "w2":
        owner = weights.w2
        out = owner.view(-1)[: 16 * 256 * 2].view(torch.bfloat16).view(16, 256)
    elif victim == "activations":
        owner, out = _sharing_storage(acts.packed, (16, 256))
        acts = Nvfp4Activations(owner, acts.scales)
    else:
        owner, out = _sharing_storage(r.ids, (16, 256))
        r = Routing.unpacked(owner, r.weights)
    before = owner.clone()
    with pytest.raises(ValueError, match="overlaps"):
        fused_moe(config, acts, r, weights, out=out)
    torch.cuda.synchronize()
    assert torch.equal(owner, before)


def test_qwen3_shapes_at_eight_tokens_past_one_wave_of_gemm1():
    """Qwen3-30B-A3B's shapes at T=8 on 132 SMs: GEMM1 runs 768 128-feature decode CTAs, 1.45 waves of four an SM on
    the H200 and one wave of six an SM on the H100's slower DRAM, and GEMM2 128-feature ones on both; the layer equals
    the float reference, and eager calls the graphed call bit for bit."""
    if torch.cuda.get_device_properties(0).multi_processor_count != 132 or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the wave arithmetic is the H100's and the H200's")
    graphed, ref, (config, acts, r, weights, act, start) = _run_case(128, 2048, 768, 8, 8, SwiGLU(), seed=33,
                                                                     engine="sm90")
    _check_close(graphed, ref)
    executor = get_executor(config, weights, top_k=8, activation=act, local_expert_start=0)
    bucket = executor.bucket(8)
    variants = [executor.engine.variant(bucket.rows, g.shape, gemm=g.gemm) for g in (bucket.gemm1, bucket.gemm2)]
    assert [v.wk for v in variants] == [1, 1], variants
    assert variants[0].min_blocks == (0 if peak_dram_tbs(0) >= _SLOW_DRAM_TBS else 6), (variants, peak_dram_tbs(0))
    out = torch.full_like(graphed, float("nan"))
    eager = fused_moe(config, acts, r, weights, activation=act, out=out, use_cuda_graph=False)
    assert torch.equal(eager.view(torch.int16), graphed.view(torch.int16))


def test_decode_gemm1_past_the_epilogue_runs_the_activation_launch():
    """A decode bucket whose GEMM1 takes more CTAs than the activation epilogue is fused for (64 experts x 34 feature
    blocks: 2176 CTAs) runs GEMM1, then the activation launch: against the reference, and the graph replay against
    the eager call bit for bit."""
    graphed, ref, (config, acts, r, weights, act, start) = _run_case(64, 256, 2176, 8, 64, SwiGLU(), seed=31,
                                                                     engine="sm90")
    executor = get_executor(config, weights, top_k=8, activation=act, local_expert_start=start)
    bucket = executor.bucket(64)
    assert not bucket.fusion.epilogue
    assert isinstance(executor.engine.variant(bucket.rows, bucket.gemm1.shape, gemm=1), DecodeVariant)
    _check_close(graphed, ref)
    eager = fused_moe(config, acts, r, weights, activation=act, use_cuda_graph=False)
    assert torch.equal(eager.view(torch.int16), graphed.view(torch.int16))
