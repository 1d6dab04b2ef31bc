"""GPU tests of the tensor-core path of the low-latency call (cudnn_moe.low_latency.grouped): NVFP4, MXFP4 (in
its exact shifted form, its own tiles), MXINT4 weight-only and BF16 layers with BF16 tokens on the SM90 engine, called directly at
every T = 1..8 (the call's dispatch sends such calls there), against the float64 reference; repeated calls bitwise
equal; recorded into the caller's CUDA graph, three launches (the stage and the finalize folded into the chain)
bitwise equal to a call that launches them.
Tolerances: tests.support.low_latency (the same rounding points; only the FP32 summation order differs)."""

from __future__ import annotations

import pytest
import torch

from cudnn_moe.activations import GELU, GeGLU, Identity, ReLU2, SiTU, SwiGLU, SwiGLUStep
from cudnn_moe.engines.base import LowLatencyCall
from cudnn_moe.engines.registry import choose
from cudnn_moe.capture import capture_graph
from cudnn_moe.engines.sm90.engine import Sm90GemmEngine
from cudnn_moe.kernels import driver
from cudnn_moe.low_latency import LowLatencyMoeConfig, WeightFormat, grouped, low_latency_moe, reference_low_latency
from cudnn_moe.low_latency.tactics import layer_request
from cudnn_moe.routing import Routing
from cudnn_moe.weights.nvfp4 import Nvfp4Activations
from tests.support.low_latency import (
    E, TOP_K, assert_close_to_reference, make_inputs, make_layer, make_routing, nan_out, random_ids,
)

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")
FMT = WeightFormat.NVFP4_WEIGHT_ONLY
def run_tensor_cores(x, x_scales, weights, routing, act, out) -> None:
    """The tensor-core path alone, as the op runs it for a checked call."""
    grouped.run(Sm90GemmEngine, LowLatencyCall(weights, x, x_scales, routing, act, torch.bfloat16, True, out, 8))


def engine_of(weights, x_dtype, out_dtype, finalize, arch) -> str:
    """The engine the registry picks for a low-latency call of these properties."""
    return choose(layer_request(weights, arch, 1, x_dtype, out_dtype, finalize)).name


CASES = [
    (1, SwiGLU(), "fp32"), (2, GeGLU(), "packed"), (3, SwiGLUStep(limit=2.0), "bf16"), (4, SiTU(a=2.0, b=3.0), "int64"),
    (5, SwiGLU(alpha=1.702, beta=1.0, limit=7.0), "fp32"), (6, GELU(), "packed"), (7, ReLU2(), "fp32"),
    (8, Identity(), "packed"), (8, SwiGLU(), "bf16"),
]


@pytest.mark.parametrize("tokens, act, kind", CASES, ids=[f"T{t}-{type(a).__name__}-{k}" for t, a, k in CASES])
def test_tensor_cores_match_reference(tokens, act, kind) -> None:
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the tensor-core path is the SM90 engine's")
    config, weights = make_layer(FMT, act.gated, shape=(512, 160), seed=tokens)
    x = make_inputs(config, FMT, torch.bfloat16, tokens, weights.hidden_size, seed=tokens + 1)
    routing = make_routing(random_ids(tokens, TOP_K, E, tokens + 2), kind, tokens + 3)
    out = nan_out((tokens, weights.hidden_size), torch.bfloat16)
    run_tensor_cores(x, None, weights, routing, act, out)
    want = reference_low_latency(x, weights, routing, act, out_dtype=torch.bfloat16)
    torch.cuda.synchronize()
    assert_close_to_reference(out, want, f"tensor cores T={tokens} {type(act).__name__} {kind}")
    again = nan_out((tokens, weights.hidden_size), torch.bfloat16)
    for _ in range(3):  # the cached signature, then its full-call graph: bitwise the same
        again.fill_(float("nan"))
        run_tensor_cores(x, None, weights, routing, act, again)
        assert torch.equal(again, out)


def test_dispatch_sends_nvfp4_weight_only_bf16_to_the_tensor_cores() -> None:
    config, weights = make_layer(FMT, True, shape=(256, 128), seed=9)
    arch, bf16 = (9, 0), torch.bfloat16
    assert engine_of(weights, bf16, bf16, True, arch) == "sm90"
    assert engine_of(weights, torch.float16, bf16, True, arch) == "cuda_cores"  # FP16 tokens
    assert engine_of(weights, bf16, torch.float16, True, arch) == "cuda_cores"  # FP16 output
    assert engine_of(weights, bf16, bf16, False, arch) == "cuda_cores"  # raw rows
    assert engine_of(weights, bf16, bf16, True, (10, 0)) == "cuda_cores"
    _, mx = make_layer(WeightFormat.MXFP4_WEIGHT_ONLY, True, shape=(256, 128), seed=9)
    assert engine_of(mx, bf16, bf16, True, arch) == "sm90"  # in its exact shifted form
    assert engine_of(mx, torch.float16, bf16, True, arch) == "cuda_cores"
    _, mxint = make_layer(WeightFormat.MXINT4_WEIGHT_ONLY, True, shape=(256, 128), seed=9)
    assert engine_of(mxint, bf16, bf16, True, arch) == "sm90"
    assert engine_of(mxint, torch.float16, bf16, True, arch) == "cuda_cores"
    assert engine_of(mxint, bf16, bf16, False, arch) == "cuda_cores"  # raw rows
    _, pair = make_layer(WeightFormat.NVFP4_W_NVFP4_A, True, shape=(512, 128), seed=9)
    assert engine_of(pair, None, bf16, True, arch) == "sm90"
    assert engine_of(pair, None, bf16, False, arch) == "cuda_cores"  # raw rows


PAIR_CASES = [(1, SwiGLU(), "packed"), (3, GeGLU(), "fp32"), (8, SiTU(a=2.0, b=3.0), "int64")]


@pytest.mark.parametrize("tokens, act, kind", PAIR_CASES, ids=[f"T{t}-{type(a).__name__}-{k}" for t, a, k in PAIR_CASES])
def test_tensor_cores_nvfp4_pair_with_unrouted_nan_slots(tokens, act, kind) -> None:
    """The pair's unrouted slots (ids outside [0, E)) carry NaN route weights: skipped, nothing NaN leaks."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the tensor-core path is the SM90 engine's")
    pair = WeightFormat.NVFP4_W_NVFP4_A
    config, weights = make_layer(pair, act.gated, shape=(512, 256), seed=tokens)
    acts = make_inputs(config, pair, torch.bfloat16, tokens, weights.hidden_size, seed=tokens + 1)
    ids = random_ids(tokens, TOP_K, E, tokens + 2)
    route_w = torch.rand(ids.shape) + 0.05
    ids[0, 1], ids[-1, 2] = -1, E  # (ids beyond int32 are covered by test_low_latency_gpu; the reference refuses them)
    unrouted = (ids < 0) | (ids >= E)
    if kind == "packed":  # pack_routing refuses NaN scores: BF16 NaN bits placed by hand
        packed = ids.to(torch.int32) * (1 << 16) + (route_w.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF)
        routing = Routing.packed(torch.where(unrouted, ids.to(torch.int32) * (1 << 16) + 0x7FC0, packed).to(DEV))
    else:
        routing = make_routing(ids, kind, tokens + 3, torch.where(unrouted, torch.tensor(float("nan")), route_w))
    out = nan_out((tokens, weights.hidden_size), torch.bfloat16)
    run_tensor_cores(acts.packed, acts.scales, weights, routing, act, out)
    want = reference_low_latency(acts, weights, routing, act, out_dtype=torch.bfloat16)
    torch.cuda.synchronize()
    assert_close_to_reference(out, want, f"pair on tensor cores T={tokens} {type(act).__name__} {kind}")


MXFP4 = WeightFormat.MXFP4_WEIGHT_ONLY


def mxfp4_layer(config, exponents: tuple[int, int], gated: bool, shape: tuple[int, int], seed: int):
    """MXFP4 weight-only weights of random codes with block scales 2^j, j uniform in ``exponents`` (inclusive)."""
    (hidden, inter), (lo, hi) = shape, exponents
    gen = torch.Generator().manual_seed(seed)
    n1 = (2 if gated else 1) * inter

    def scales(*size: int) -> torch.Tensor:
        return torch.randint(127 + lo, 128 + hi, size, generator=gen, dtype=torch.uint8).view(torch.float8_e8m0fnu)

    w1 = torch.randint(0, 256, (E, n1, hidden // 2), generator=gen, dtype=torch.uint8)
    w2 = torch.randint(0, 256, (E, hidden, inter // 2), generator=gen, dtype=torch.uint8)
    payloads = (w1, scales(E, n1, hidden // 32), w2, scales(E, hidden, inter // 32))
    return config.prepare_mxfp4_weight_only_weights(*(t.to(DEV) for t in payloads),
                                                    activation=SwiGLU() if gated else ReLU2())


MX_CASES = [  # (T, activation, routing kind, block scale exponents, the shift they take)
    (1, SwiGLU(), "packed", (-14, -1), -5), (2, ReLU2(), "fp32", (-9, -4), 0), (5, GeGLU(), "bf16", (4, 13), 5),
    (8, SwiGLU(), "int64", (-30, -20), -21),
]


@pytest.mark.parametrize("tokens, act, kind, exponents, shift", MX_CASES,
                         ids=[f"T{c[0]}-{type(c[1]).__name__}-2^{c[3][0]}..2^{c[3][1]}" for c in MX_CASES])
def test_mxfp4_weight_only_on_the_tensor_cores(tokens, act, kind, exponents, shift) -> None:
    """The op sends finalized BF16 MXFP4 calls to sm90 (the exact shifted form in MXFP4 tiles, shifted by a power of
    two where the scales leave E4M3's range), and the CUDA-core engine runs the same tiles: both against the float64
    reference."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the tensor-core path is the SM90 engine's")
    config = LowLatencyMoeConfig(8)
    weights = mxfp4_layer(config, exponents, act.gated, (512, 256), seed=tokens + 40)
    assert [s.unique().tolist() for s in weights.nvfp4_shifts] == [[shift], [shift]]
    x = make_inputs(config, MXFP4, torch.bfloat16, tokens, weights.hidden_size, seed=tokens + 41)
    routing = make_routing(random_ids(tokens, TOP_K, E, tokens + 42), kind, tokens + 43)
    assert engine_of(weights, torch.bfloat16, torch.bfloat16, True, (9, 0)) == "sm90"
    want = reference_low_latency(x, weights, routing, act, out_dtype=torch.bfloat16)
    for engine in ("auto", "cuda_cores"):
        out = nan_out((tokens, weights.hidden_size), torch.bfloat16)
        low_latency_moe(LowLatencyMoeConfig(8, engine=engine), x, weights, routing, activation=act, out=out)
        torch.cuda.synchronize()
        assert_close_to_reference(out, want, f"MXFP4 weight-only on {engine} T={tokens} scales 2^{exponents}")


def sm90_and_cuda_cores_match_reference(fmt, tokens, act, kind, seed):
    """A (512, 256) layer in ``fmt`` from ``seed`` (skipped off SM90), BF16 tokens and ``kind`` routing: the registry
    picks sm90 for it; "auto", the CUDA cores and "auto" again each match the float64 reference, and the two
    tensor-core calls are bitwise equal. Returns the weights."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the tensor-core path is the SM90 engine's")
    config, weights = make_layer(fmt, act.gated, shape=(512, 256), seed=seed)
    x = make_inputs(config, fmt, torch.bfloat16, tokens, weights.hidden_size, seed=seed + 1)
    routing = make_routing(random_ids(tokens, TOP_K, E, seed + 2), kind, seed + 3)
    assert engine_of(weights, torch.bfloat16, torch.bfloat16, True, (9, 0)) == "sm90"
    want = reference_low_latency(x, weights, routing, act, out_dtype=torch.bfloat16)
    outs = {}
    for engine in ("auto", "cuda_cores", "auto"):
        out = nan_out((tokens, weights.hidden_size), torch.bfloat16)
        low_latency_moe(LowLatencyMoeConfig(8, engine=engine), x, weights, routing, activation=act, out=out)
        torch.cuda.synchronize()
        assert_close_to_reference(out, want, f"{fmt.value} on {engine} T={tokens} {type(act).__name__}")
        if engine in outs:
            assert torch.equal(out, outs[engine]), "repeated tensor-core calls differ"
        outs[engine] = out
    return weights


MXINT4 = WeightFormat.MXINT4_WEIGHT_ONLY
BF16 = WeightFormat.BF16
MXINT4_CASES = [(1, SwiGLU(), "packed"), (2, ReLU2(), "fp32"), (4, SiTU(a=2.0, b=3.0), "bf16"),
                (8, GeGLU(), "int64"), (8, SwiGLUStep(limit=2.0), "fp32")]


@pytest.mark.parametrize("tokens, act, kind", MXINT4_CASES,
                         ids=[f"T{t}-{type(a).__name__}-{k}" for t, a, k in MXINT4_CASES])
def test_mxint4_weight_only_on_the_tensor_cores(tokens, act, kind) -> None:
    """The op sends finalized BF16 MXINT4 calls to sm90 (INT4 tiles, BF16 block scales on FP32 partial sums, the
    FP32 preactivation into the activation epilogue), and the CUDA-core engine still runs them: both against the
    float64 reference; repeated tensor-core calls are bitwise equal."""
    sm90_and_cuda_cores_match_reference(MXINT4, tokens, act, kind, seed=tokens + 60)


BF16_CASES = [(1, SwiGLU(), "packed"), (2, ReLU2(), "fp32"), (5, GeGLU(), "bf16"), (8, SwiGLU(), "int64"),
              (8, Identity(), "fp32")]


@pytest.mark.parametrize("tokens, act, kind", BF16_CASES,
                         ids=[f"T{t}-{type(a).__name__}-{k}" for t, a, k in BF16_CASES])
def test_bf16_weights_on_the_tensor_cores(tokens, act, kind) -> None:
    """The op sends finalized BF16 calls with BF16 tokens to sm90 (the decode kernel reading the row-major weights in
    place, tokens in natural rows), and the CUDA-core engine still runs them: both against the float64 reference;
    repeated tensor-core calls are bitwise equal; the engine's view holds the weights' own memory."""
    weights = sm90_and_cuda_cores_match_reference(BF16, tokens, act, kind, seed=tokens + 70)
    view = grouped.layer_view(Sm90GemmEngine, weights)
    assert view.w1.data_ptr() == weights.w1.data_ptr() and view.w2.data_ptr() == weights.w2.data_ptr()


def test_mxfp4_weights_without_an_exact_shifted_form_stay_on_the_cuda_cores() -> None:
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the tensor-core path is the SM90 engine's")
    config = LowLatencyMoeConfig(8)
    weights = mxfp4_layer(config, (-27, -4), True, (512, 256), seed=50)  # 23 binades
    assert "more than the 17 binades" in weights.nvfp4_problem
    assert engine_of(weights, torch.bfloat16, torch.bfloat16, True, (9, 0)) == "cuda_cores"
    x = make_inputs(config, MXFP4, torch.bfloat16, 3, weights.hidden_size, seed=51)
    routing = make_routing(random_ids(3, TOP_K, E, 52), "fp32", 53)
    out = nan_out((3, weights.hidden_size), torch.bfloat16)
    low_latency_moe(config, x, weights, routing, out=out)
    want = reference_low_latency(x, weights, routing, SwiGLU(), out_dtype=torch.bfloat16)
    torch.cuda.synchronize()
    assert_close_to_reference(out, want, "MXFP4 weight-only beyond E4M3's span, on the CUDA cores")
    with pytest.raises(ValueError, match="exact shifted form, which these lack"):
        low_latency_moe(LowLatencyMoeConfig(8, engine="sm90"), x, weights, routing)


def chain_layer(fmt, tokens, seed):
    """(config, weights, inputs, x, x_scales) of a small layer in ``fmt`` on the SM90 tensor-core path (skipped on other
    GPUs) and ``tokens`` BF16 or NVFP4 tokens: the layer from ``seed``, the tokens from ``seed + 1``."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the tensor-core path is the SM90 engine's")
    shape = (512, 256) if fmt in (WeightFormat.NVFP4_W_NVFP4_A, WeightFormat.BF16) else (512, 160)  # I % 128 == 0
    config, weights = make_layer(fmt, True, shape=shape, seed=seed)
    inputs = make_inputs(config, fmt, torch.bfloat16, tokens, weights.hidden_size, seed=seed + 1)
    x, x_scales = (inputs.packed, inputs.scales) if isinstance(inputs, Nvfp4Activations) else (inputs, None)
    return config, weights, inputs, x, x_scales


FOLD_CASES = [(FMT, 1), (FMT, 5), (MXFP4, 1), (MXFP4, 2), (MXINT4, 1), (MXINT4, 6), (WeightFormat.NVFP4_W_NVFP4_A, 1),
              (WeightFormat.NVFP4_W_NVFP4_A, 3), (WeightFormat.NVFP4_W_NVFP4_A, 8), (WeightFormat.BF16, 2),
              (WeightFormat.BF16, 7)]


@pytest.mark.parametrize("fmt, tokens", FOLD_CASES, ids=[f"{f.value}-T{t}" for f, t in FOLD_CASES])
def test_tensor_cores_in_the_callers_graph_fold_the_stage_and_the_finalize(fmt, tokens) -> None:
    """Recorded into the caller's CUDA graph (the launches know the caller's tensors), the call is three launches:
    stage + sort + permute, GEMM1 + activation, GEMM2 + finalize; two for one token (the stage, the sort and the
    permute in GEMM1's prologue). Replayed after its tokens and routing change in
    place, it equals a call that launches the stage and the finalize (the first call of a new output: the bucket's
    graph between them) bit for bit, and the float64 reference."""
    act = SwiGLU()
    config, weights, inputs, x, x_scales = chain_layer(fmt, tokens, seed=tokens + 20)
    routing = make_routing(random_ids(tokens, TOP_K, E, tokens + 22), "fp32", tokens + 23)
    out = nan_out((tokens, weights.hidden_size), torch.bfloat16)
    graph = capture_graph(lambda: run_tensor_cores(x, x_scales, weights, routing, act, out), keep_graph=True)
    launches = sum(t == driver.CU_GRAPH_NODE_TYPE_KERNEL for t in driver.graph_node_types(graph.raw_cuda_graph()))
    assert launches == (2 if tokens == 1 else 3), f"the captured call holds {launches} launches"
    new_inputs = make_inputs(config, fmt, torch.bfloat16, tokens, weights.hidden_size, seed=tokens + 24)
    new_routing = make_routing(random_ids(tokens, TOP_K, E, tokens + 25), "fp32", tokens + 26)
    if x_scales is None:
        x.copy_(new_inputs)
    else:
        x.copy_(new_inputs.packed)
        x_scales.copy_(new_inputs.scales)
    routing.ids.copy_(new_routing.ids)
    routing.weights.copy_(new_routing.weights)
    out.fill_(float("nan"))
    graph.replay()
    launched = nan_out((tokens, weights.hidden_size), torch.bfloat16)
    run_tensor_cores(x, x_scales, weights, routing, act, launched)
    want = reference_low_latency(inputs, weights, routing, act, out_dtype=torch.bfloat16)
    torch.cuda.synchronize()
    assert torch.equal(out, launched), "the folded launches differ from the stage and finalize launches"
    assert_close_to_reference(out, want, f"{fmt.value} T={tokens} in the caller's graph")


@pytest.mark.parametrize("tokens", [1, 3, 8])
def test_tensor_cores_with_every_slot_unrouted_give_zeros(tokens) -> None:
    """Every slot unrouted (ids -1 and E; only the NVFP4 pair has unrouted slots, the weight-only formats require
    ids in range): the launched chain's GEMM2, which finalizes into out at these token counts, has no tile at all
    and must still write out: zeros, as the reference."""
    fmt, act = WeightFormat.NVFP4_W_NVFP4_A, SwiGLU()
    _, weights, inputs, x, x_scales = chain_layer(fmt, tokens, seed=tokens + 30)
    ids = torch.full((tokens, TOP_K), -1, dtype=torch.int64)
    ids[:, 1::2] = E  # past the experts: unrouted too
    routing = make_routing(ids, "fp32", tokens + 32)
    out = nan_out((tokens, weights.hidden_size), torch.bfloat16)
    run_tensor_cores(x, x_scales, weights, routing, act, out)
    want = reference_low_latency(inputs, weights, routing, act, out_dtype=torch.bfloat16)
    torch.cuda.synchronize()
    assert torch.count_nonzero(want) == 0
    assert not bool(out.isnan().any()) and torch.count_nonzero(out) == 0, "out must hold zeros"


ONE_COPY = [FMT, WeightFormat.MXFP4_WEIGHT_ONLY, WeightFormat.MXINT4_WEIGHT_ONLY, WeightFormat.NVFP4_W_NVFP4_A]


@pytest.mark.parametrize("fmt", ONE_COPY)
def test_sm90_layers_hold_one_weight_copy(fmt) -> None:
    """Prepared on SM90, NVFP4, MXFP4 (in its exact shifted form) and MXINT4 layers are stored as the engine's tiles: the
    tensor-core view holds their own memory, the first tensor-core call allocates far less than the weights
    (workspaces only, no repack), and a CUDA-core call on the same tiles agrees with the float64 reference."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the tiles are the SM90 engine's layout")
    config, weights = make_layer(fmt, True, experts=16, shape=(1024, 1024), seed=11)
    assert weights.tiled
    view = grouped.layer_view(Sm90GemmEngine, weights)
    assert view.w1.data_ptr() == weights.w1_codes.data_ptr() and view.w2.data_ptr() == weights.w2_codes.data_ptr()
    scales = weights.tile_form[0] if fmt is WeightFormat.MXFP4_WEIGHT_ONLY else weights.w1_scales
    assert view.w1_scales.data_ptr() == scales.data_ptr()
    weight_bytes = sum(t.numel() * t.element_size()
                       for t in (weights.w1_codes, weights.w1_scales, weights.w2_codes, weights.w2_scales))
    tokens, act = 4, SwiGLU()
    x_dtype = None if fmt is WeightFormat.NVFP4_W_NVFP4_A else torch.bfloat16
    x = make_inputs(config, fmt, torch.bfloat16, tokens, weights.hidden_size, seed=12)
    routing = make_routing(random_ids(tokens, TOP_K, weights.num_experts, 13), "fp32", 14)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    out = nan_out((tokens, weights.hidden_size), torch.bfloat16)
    low_latency_moe(config, x, weights, routing, activation=act)  # the first call: executor and workspaces
    low_latency_moe(config, x, weights, routing, activation=act, out=out)
    torch.cuda.synchronize()
    grown = torch.cuda.memory_allocated() - before
    assert grown < weight_bytes // 4, f"the first call allocated {grown} bytes beside {weight_bytes} of weights"
    want = reference_low_latency(x, weights, routing, act, out_dtype=torch.bfloat16)
    assert_close_to_reference(out, want, f"{fmt.value} on the tensor cores")
    assert engine_of(weights, x_dtype, torch.bfloat16, True, (9, 0)) == "sm90"
    cores = nan_out((tokens, weights.hidden_size), torch.bfloat16)
    low_latency_moe(LowLatencyMoeConfig(8, engine="cuda_cores"), x, weights, routing, activation=act, out=cores)
    torch.cuda.synchronize()
    assert_close_to_reference(cores, want, f"{fmt.value} on the CUDA cores")
