"""Which launches a decode call's chain starts and ends with, on the CPU: the executor's sort + permute stages the
caller's inputs itself when it is given them (NVFP4 or BF16 tokens at a 16-byte aligned address), and otherwise
leaves the stage to its own launch; its GEMM2 finalizes into the caller's output where the call gives one and the engine can. The kernel wrappers are replaced by recorders; what the kernels compute is tested on the GPU
(tests/kernels/test_kernels_gpu.py, tests/ops/fused/test_fused_moe_gpu.py)."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from cudnn_moe import Routing, kernels
from cudnn_moe.engines.base import GemmOperands, GemmShape, Stage
from cudnn_moe.kernels import IntermediateCode, TokenLayout
from cudnn_moe.pipeline.executor import CallerInputs, MoeExecutor, _BucketStages, _with_ends
from cudnn_moe.pipeline.tokens import TokenCode
from cudnn_moe.weights.nvfp4 import Nvfp4Activations

TOKENS, TOP_K, HIDDEN, EXPERTS, ROWS = 2, 4, 64, 8, 64


def _code(bf16_tokens: bool) -> TokenCode:
    return TokenCode.BF16 if bf16_tokens else TokenCode.NVFP4


def _executor(bf16_tokens: bool = False) -> SimpleNamespace:
    return SimpleNamespace(tokens=_code(bf16_tokens), top_k=TOP_K, local_expert_start=3,
                           weights=SimpleNamespace(num_experts=EXPERTS),
                           engine=SimpleNamespace(row_alignment=8, l2_warm=lambda gemm1: None))


def _bucket() -> SimpleNamespace:
    i32 = torch.int32
    sorted_ = kernels.SortBuffers(torch.zeros(EXPERTS + 1, dtype=i32), torch.zeros(TOKENS * TOP_K, dtype=i32),
                                  torch.zeros(ROWS, dtype=i32), torch.zeros(ROWS, dtype=i32),
                                  torch.zeros(EXPERTS, dtype=i32))
    tokens = SimpleNamespace(layout=TokenLayout.BF16_FRAGMENTS, data=torch.zeros(ROWS, HIDDEN, dtype=torch.bfloat16))
    return SimpleNamespace(tokens=TOKENS, fusion=None, gemm1=SimpleNamespace(tokens=tokens), sorted=sorted_,
                           ids=torch.zeros(TOKENS, TOP_K, dtype=i32), route_weights=torch.zeros(TOKENS, TOP_K),
                           x=torch.zeros(TOKENS, HIDDEN // 2, dtype=torch.uint8),
                           x_scales=torch.zeros(TOKENS, HIDDEN // 16, dtype=torch.uint8))


def _caller(byte_offset: int = 0, bf16_tokens: bool = False) -> CallerInputs:
    routing = Routing.unpacked(torch.zeros(TOKENS, TOP_K, dtype=torch.int32), torch.rand(TOKENS, TOP_K))
    if bf16_tokens:
        rows = torch.zeros(TOKENS * HIDDEN + 8, dtype=torch.bfloat16)[byte_offset // 2:][: TOKENS * HIDDEN]
        return CallerInputs(rows.view(TOKENS, HIDDEN), routing)
    codes = torch.zeros(TOKENS * HIDDEN // 2 + 16, dtype=torch.uint8)[byte_offset:][: TOKENS * HIDDEN // 2]
    acts = Nvfp4Activations(codes.view(TOKENS, HIDDEN // 2), torch.zeros(TOKENS, HIDDEN // 16, dtype=torch.uint8))
    return CallerInputs(acts, routing)


@pytest.fixture
def launched(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, tuple]]:
    calls: list[tuple[str, tuple]] = []
    for name in ("sort_permute_bf16", "stage_sort_permute_bf16"):
        monkeypatch.setattr(kernels, name, lambda *args, name=name: calls.append((name, args)))
    return calls


@pytest.mark.parametrize("bf16_tokens", [False, True], ids=["nvfp4-tokens", "bf16-tokens"])
def test_given_the_callers_inputs_the_sort_permute_stages_them(launched: list[tuple[str, tuple]],
                                                               bf16_tokens: bool) -> None:
    bucket, caller = _bucket(), _caller(bf16_tokens=bf16_tokens)
    layer = _BucketStages(_executor(bf16_tokens), bucket, caller)
    stage = layer.sort_permute()
    assert stage is not None and stage.name == "stage+sort+permute" and layer.staging is stage
    stage.launch()
    (name, args), = launched
    ids, weights, fmt = caller.routing.kernel_operands()
    tokens = (caller.tokens, None) if bf16_tokens else (caller.tokens.packed, caller.tokens.scales)
    assert name == "stage_sort_permute_bf16"
    assert args[0] is tokens[0] and args[1] is tokens[1] and args[2:5] == (ids, weights, fmt)
    assert args[5] is bucket.ids and args[6] is bucket.route_weights and args[10] is bucket.sorted
    assert args[7:10] == (3, EXPERTS, 8) and args[11] is bucket.gemm1.tokens.data


@pytest.mark.parametrize("why", ["no caller", "unaligned tokens", "unaligned bf16 tokens"])
def test_otherwise_the_sort_permute_reads_the_bucket(launched: list[tuple[str, tuple]], why: str) -> None:
    bucket = _bucket()
    bf16_tokens = why == "unaligned bf16 tokens"
    caller = None if why == "no caller" else _caller(byte_offset=2 if bf16_tokens else 1, bf16_tokens=bf16_tokens)
    layer = _BucketStages(_executor(bf16_tokens=bf16_tokens), bucket, caller)
    stage = layer.sort_permute()
    assert stage is not None and stage.name == "sort+permute" and layer.staging is None
    stage.launch()
    (name, args), = launched
    assert name == "sort_permute_bf16" and args[5] is bucket.sorted and args[6] is bucket.x


def _finalizing_executor(can: bool, gemms: list) -> SimpleNamespace:
    engine = SimpleNamespace(can_finalize=lambda operands, tokens: can, gemm=gemms.append)
    return SimpleNamespace(top_k=TOP_K, engine=engine)


def _gemm2_bucket() -> SimpleNamespace:
    bucket = _bucket()
    bucket.slot_to_row = bucket.sorted.slot_to_row
    bucket.gemm2 = GemmOperands(ROWS, GemmShape(HIDDEN, HIDDEN, EXPERTS), None, None, None, None, None, gemm=2)
    return bucket


def test_given_the_callers_output_gemm2_finalizes_into_it() -> None:
    gemms: list = []
    bucket, out = _gemm2_bucket(), torch.zeros(TOKENS, HIDDEN, dtype=torch.bfloat16)
    caller = replace(_caller(), out=out)
    layer = _BucketStages(_finalizing_executor(True, gemms), bucket, caller)
    stage = layer.gemm2_finalize()
    assert stage is not None and stage.name == "gemm2+finalize" and layer.finishing is stage
    stage.launch()
    (operands,) = gemms
    fin = operands.finalize
    assert operands.rows == ROWS and fin.out is out and fin.top_k == TOP_K and fin.slot_to_row is bucket.slot_to_row
    assert fin.weights.data_ptr() == bucket.route_weights.data_ptr() and fin.weights.shape == (TOKENS * TOP_K,)


@pytest.mark.parametrize("why", ["no caller", "no output", "engine cannot"])
def test_otherwise_gemm2_leaves_the_finalize_to_its_own_launch(why: str) -> None:
    gemms: list = []
    out = torch.zeros(TOKENS, HIDDEN, dtype=torch.bfloat16)
    caller = {"no caller": None, "no output": _caller(), "engine cannot": replace(_caller(), out=out)}[why]
    layer = _BucketStages(_finalizing_executor(why != "engine cannot", gemms), _gemm2_bucket(), caller)
    assert layer.gemm2_finalize() is None and layer.finishing is None and not gemms


@pytest.mark.parametrize("bf16_tokens", [False, True])
def test_caller_tokens_must_match_the_executors_token_kind(bf16_tokens: bool) -> None:
    executor = SimpleNamespace(tokens=_code(bf16_tokens))
    with pytest.raises(ValueError, match="caller.tokens must be"):
        MoeExecutor.run_call(executor, TOKENS, None, None, use_cuda_graph=False,
                             caller=_caller(bf16_tokens=not bf16_tokens))


@pytest.mark.parametrize("bf16_tokens", [False, True], ids=["nvfp4-tokens", "bf16-tokens"])
def test_the_stage_launch_stages_either_token_kind(monkeypatch: pytest.MonkeyPatch, bf16_tokens: bool) -> None:
    """MoeExecutor.stage: NVFP4 codes and scales as they are (decoded into x_rows where the bucket has them); BF16
    tokens copied as bytes into the bucket's BF16 rows, with an empty scale row."""
    calls: list[tuple[tuple, dict]] = []
    monkeypatch.setattr(kernels, "stage_inputs", lambda *args, **kw: calls.append((args, kw)))
    caller = _caller(bf16_tokens=bf16_tokens)
    bucket = _bucket()
    if bf16_tokens:
        bucket.x, bucket.x_scales = torch.zeros(TOKENS, HIDDEN, dtype=torch.bfloat16), torch.zeros(TOKENS, 0,
                                                                                                   dtype=torch.uint8)
    bucket.x_rows = None
    MoeExecutor.stage(_executor(bf16_tokens), bucket, caller.tokens, caller.routing)
    (args, kw), = calls
    ids, weights, fmt = caller.routing.kernel_operands()
    assert args[2:5] == (ids, weights, fmt) and args[6] is bucket.x_scales and args[7:] == (bucket.ids,
                                                                                              bucket.route_weights)
    assert kw == {"x_rows": None}
    if bf16_tokens:
        assert args[0].dtype == torch.uint8 and args[0].data_ptr() == caller.tokens.data_ptr()
        assert args[0].shape == (TOKENS, 2 * HIDDEN) and args[1].shape == (TOKENS, 0)
        assert args[5].dtype == torch.uint8 and args[5].data_ptr() == bucket.x.data_ptr()
    else:
        assert args[0] is caller.tokens.packed and args[1] is caller.tokens.scales
        assert args[5].data_ptr() == bucket.x.data_ptr() and args[5].dtype == torch.uint8


def _routing_executor(can: bool, gemms: list, bf16_tokens: bool = False) -> SimpleNamespace:
    engine = SimpleNamespace(can_route=lambda operands: can, gemm=gemms.append, row_alignment=8)
    return SimpleNamespace(tokens=_code(bf16_tokens), top_k=TOP_K, local_expert_start=3, engine=engine,
                           activation="act", intermediate=IntermediateCode.NVFP4)


def _one_token_bucket() -> SimpleNamespace:
    bucket = _bucket()
    bucket.tokens = 1
    bucket.row_to_slot = bucket.sorted.row_to_slot
    bucket.gemm1 = GemmOperands(ROWS, GemmShape(HIDDEN, 2 * HIDDEN, EXPERTS), bucket.gemm1.tokens, None,
                                bucket.sorted.offsets, None, None, gemm=1)
    bucket.gemm2 = GemmOperands(ROWS, GemmShape(HIDDEN, HIDDEN, EXPERTS), "gemm2 tokens", None, None, None, None,
                                gemm=2)
    return bucket


def _one_token_caller(byte_offset: int = 0, bf16_tokens: bool = False) -> CallerInputs:
    caller = _caller(byte_offset, bf16_tokens)
    routing = Routing.unpacked(torch.zeros(1, TOP_K, dtype=torch.int32), torch.rand(1, TOP_K))
    tokens = caller.tokens[:1] if bf16_tokens else Nvfp4Activations(caller.tokens.packed[:1], caller.tokens.scales[:1])
    return CallerInputs(tokens, routing)


@pytest.mark.parametrize("bf16_tokens", [False, True], ids=["nvfp4-tokens", "bf16-tokens"])
def test_one_token_calls_stage_and_sort_in_gemm1(bf16_tokens: bool) -> None:
    """Given a one-token call's inputs, GEMM1 takes the stage, the sort and the permute (GemmOperands.route): the
    caller's token and routing in, the bucket's routing and sort buffers out, the activation epilogue as the unrouted
    chain's."""
    gemms: list = []
    bucket, caller = _one_token_bucket(), _one_token_caller(bf16_tokens=bf16_tokens)
    layer = _BucketStages(_routing_executor(True, gemms, bf16_tokens), bucket, caller)
    stage = layer.gemm1_routed()
    assert stage is not None and stage.name == "stage+sort+permute+gemm1+activation" and layer.staging is stage
    stage.launch()
    (operands,) = gemms
    route, epilogue = operands.route, operands.epilogue
    tokens = (caller.tokens, None) if bf16_tokens else (caller.tokens.packed, caller.tokens.scales)
    assert route.tokens is tokens[0] and route.token_scales is tokens[1]
    assert (route.ids, route.weights, route.routing_format) == caller.routing.kernel_operands()
    assert route.ids_out is bucket.ids and route.w_out is bucket.route_weights and route.sorted is bucket.sorted
    assert (route.local_start, route.align) == (3, 8)
    assert epilogue.row_to_slot is bucket.row_to_slot and epilogue.out == "gemm2 tokens" and (
        epilogue.intermediate is IntermediateCode.NVFP4)
    assert operands.offsets is bucket.sorted.offsets


@pytest.mark.parametrize("why", ["no caller", "two tokens", "unaligned tokens", "engine cannot"])
def test_otherwise_gemm1_reads_the_sorted_bucket(why: str) -> None:
    gemms: list = []
    bucket = _one_token_bucket()
    caller = None if why == "no caller" else _one_token_caller(byte_offset=1 if why == "unaligned tokens" else 0)
    if why == "two tokens":
        bucket.tokens = 2
    layer = _BucketStages(_routing_executor(why != "engine cannot", gemms), bucket, caller)
    assert layer.gemm1_routed() is None and layer.staging is None and not gemms


def _warming_executor(bf16_tokens: bool, folds: tuple[bool, bool], launches: list[tuple]) -> SimpleNamespace:
    """An executor whose call chain stages and finishes as ``folds`` says (its one entry: the caller it was built
    for), recording (bucket, caller) for each chain launched."""
    return SimpleNamespace(weights=SimpleNamespace(device=torch.device("cpu"), hidden_size=HIDDEN),
                           tokens=_code(bf16_tokens), top_k=TOP_K, _call_chain=lambda bucket, caller: ([caller], *folds),
                           _finalized_launches=lambda bucket, chain, caller: [
                               Stage("call", lambda: launches.append((bucket, chain[0][0])))])


@pytest.mark.parametrize("folds", [(True, True), (True, False), (False, True)], ids=["both", "stage", "finalize"])
@pytest.mark.parametrize("bf16_tokens", [False, True], ids=["nvfp4-tokens", "bf16-tokens"])
def test_warmup_launches_a_folding_call_chain_once_per_bucket_with_every_slot_unrouted(
        bf16_tokens: bool, folds: tuple[bool, bool]) -> None:
    launches: list[tuple] = []
    executor = _warming_executor(bf16_tokens, folds, launches)
    bucket = SimpleNamespace(tokens=TOKENS, call_chain_warm=False)
    MoeExecutor._warm_call_chain(executor, bucket)
    MoeExecutor._warm_call_chain(executor, bucket)  # once per bucket
    (launched_bucket, caller), = launches
    assert launched_bucket is bucket and bucket.call_chain_warm
    ids, weights, _ = caller.routing.kernel_operands()
    assert ids.shape == (TOKENS, TOP_K) and bool((ids == -1).all()) and weights.shape == (TOKENS, TOP_K)
    codes, scales = caller.token_operands()
    if bf16_tokens:
        assert codes.dtype == torch.bfloat16 and codes.shape == (TOKENS, HIDDEN) and scales is None
    else:
        assert codes.dtype == torch.uint8 and codes.shape == (TOKENS, HIDDEN // 2)
        assert scales.dtype == torch.float8_e4m3fn and scales.shape == (TOKENS, HIDDEN // 16)
    assert caller.out.dtype == torch.bfloat16 and caller.out.shape == (TOKENS, HIDDEN)


def test_warmup_launches_no_call_chain_without_a_fold() -> None:
    launches: list[tuple] = []
    bucket = SimpleNamespace(tokens=TOKENS, call_chain_warm=False)
    MoeExecutor._warm_call_chain(_warming_executor(False, (False, False), launches), bucket)
    assert launches == [] and bucket.call_chain_warm


@pytest.mark.parametrize("staged, finished", [(False, False), (True, False), (False, True), (True, True)])
def test_a_calls_launches_hold_the_stage_and_the_finish_the_chain_does_not_fold(staged: bool, finished: bool) -> None:
    order: list[str] = []
    chain = ([Stage(name, lambda name=name: order.append(name)) for name in ("first", "last")], staged, finished)
    launches = _with_ends(chain, Stage("stage", lambda: order.append("stage")),
                          Stage("finish", lambda: order.append("finish")))
    names = ["stage"] * (not staged) + ["first", "last"] + ["finish"] * (not finished)
    assert [name for name, _ in launches] == names
    for _, launch in launches:
        launch()
    assert order == names


def test_call_launches_are_the_stage_the_chain_and_the_finalize_into_the_callers_output() -> None:
    """MoeExecutor.call_launches, what benchmarks time launch by launch: the op's stage of the caller's inputs and the
    finalize into its output around the chain (here a chain that folds neither); a caller without an output is
    refused."""
    recorded: list[tuple] = []
    out = torch.zeros(TOKENS, HIDDEN, dtype=torch.bfloat16)
    caller, bucket = replace(_caller(), out=out), SimpleNamespace()
    executor = SimpleNamespace(
        stage=lambda b, tokens, routing: recorded.append(("stage", b, tokens, routing)),
        _finalize=lambda b, o: recorded.append(("finalize", b, o)),
        _call_chain=lambda b, c: ([Stage("chain", lambda: recorded.append(("chain", b, c)))], False, False))
    executor._finalized_launches = lambda b, chain, c: MoeExecutor._finalized_launches(executor, b, chain, c)
    launches = MoeExecutor.call_launches(executor, bucket, caller)
    assert [name for name, _ in launches] == ["stage", "chain", "finalize"]
    for _, launch in launches:
        launch()
    assert recorded == [("stage", bucket, caller.tokens, caller.routing), ("chain", bucket, caller),
                        ("finalize", bucket, out)]
    with pytest.raises(ValueError, match="caller.out must be"):
        MoeExecutor.call_launches(executor, bucket, _caller())
