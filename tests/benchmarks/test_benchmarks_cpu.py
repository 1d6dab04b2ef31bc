"""The benchmark scripts on the CPU: floors, tables, arguments, the BF16 peer layer, and the table
wiring of both mains with the CUDA calls faked (the GPU numbers themselves need a GPU)."""

from __future__ import annotations

import contextlib
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.support import REPO

sys.path.insert(0, str(REPO / "benchmarks"))

import bench_moe  # noqa: E402
import bench_stages  # noqa: E402
import probe_pdl  # noqa: E402
import probe_timeline  # noqa: E402
import probe_weight_stream  # noqa: E402
import profile_call  # noqa: E402
import tune_sm90  # noqa: E402
import common  # noqa: E402

from cudnn_moe.engines.base import GemmOperands, GemmShape, TokenOperand, WeightOperand  # noqa: E402
from cudnn_moe.engines.sm90.engine import choose_variant  # noqa: E402
from cudnn_moe.kernels.codes import TokenLayout  # noqa: E402
from tests.engines.sm90.gpus import H200_TBS, SMS  # noqa: E402

QWEN3, DEEPSEEK = common.MODELS["qwen3-30b-a3b"], common.MODELS["deepseek-v3"]
ROOFLINE = common.Roofline(bandwidth_tbs=4.3, peak_tflops=790.0)
TINY = common.ModelShape("tiny", "Tiny", experts=8, hidden=256, intermediate=128, top_k=2)


def test_presets_load_as_shapes() -> None:
    assert QWEN3 == common.ModelShape("qwen3-30b-a3b", "Qwen3-30B-A3B", 128, 2048, 768, 8)
    assert DEEPSEEK.weights_per_expert == 3 * 7168 * 2048
    assert set(common.DEFAULT_MODELS) <= set(common.MODELS)


def test_floors_of_known_shapes() -> None:
    # Qwen3 T=1, 8 experts touched: memory-bound, 8 * 3*2048*768 weights.
    weights = 8 * 3 * 2048 * 768
    assert ROOFLINE.floor_us(QWEN3, 1, 8, common.FP4_BYTES_PER_WEIGHT) == pytest.approx(weights * 0.5625 / 4.3e6)
    assert ROOFLINE.floor_us(QWEN3, 1, 8, common.FP4_BYTES_PER_WEIGHT) == pytest.approx(4.938, abs=1e-3)
    assert ROOFLINE.floor_us(QWEN3, 1, 8, common.BF16_BYTES_PER_WEIGHT) == pytest.approx(17.558, abs=1e-3)
    # DeepSeek-V3 T=4096, all 256 experts: compute-bound for both formats (2 * T * k * 3HI FLOPs at 790 TFLOP/s).
    compute = 2 * 4096 * 8 * 3 * 7168 * 2048 / 790e6
    assert ROOFLINE.floor_us(DEEPSEEK, 4096, 256, common.FP4_BYTES_PER_WEIGHT) == pytest.approx(compute)
    assert ROOFLINE.floor_us(DEEPSEEK, 4096, 256, common.BF16_BYTES_PER_WEIGHT) == pytest.approx(5243.9, abs=0.1)
    assert compute == pytest.approx(3653.4, abs=0.1)


def test_table_formatting(capsys: pytest.CaptureFixture[str]) -> None:
    report = common.Report()
    report.table(["model", "T", "us"], left=2)
    report.emit(common.md_row(["Qwen3", "1", common.fmt(12.345)]))
    report.note("said once")
    report.note("said once")
    assert report.lines == ["| model | T | us |", "| --- | --- | ---: |", "| Qwen3 | 1 | 12.3 |"]
    assert report.markdown().endswith("| Qwen3 | 1 | 12.3 |\n\n- said once\n")
    assert capsys.readouterr().out.count("note: said once") == 1


def test_report_writes_markdown(tmp_path: Path) -> None:
    report = common.Report()
    report.emit("header")
    report.write(None)
    report.write(tmp_path / "bench.md")
    assert (tmp_path / "bench.md").read_text() == "header\n\n"


def test_default_arguments() -> None:
    args = bench_moe.parse_args([])
    assert args.models == ["qwen3-30b-a3b", "deepseek-v3"]
    assert args.tokens == [1, 8, 64, 512, 4096]
    assert args.engines == ["sm90", "cudnn"]
    assert (args.iters, args.skip_slow_cudnn, args.markdown) == (20, True, None)
    assert (args.bandwidth_tbs, args.peak_tflops, args.host_calls) == (4.3, 790.0, 300)
    stages = common.make_parser("x").parse_args(["--no-skip-slow-cudnn", "--engines", "cudnn", "--tokens", "4"])
    assert (stages.skip_slow_cudnn, stages.engines, stages.tokens) == (False, ["cudnn"], [4])


@pytest.mark.parametrize("argv", [["--tokens", "0"], ["--engines", "cublas"], ["--models", "nope"], ["--iters", "-1"]])
def test_bad_arguments_exit_2(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        bench_moe.parse_args(argv)
    assert exc.value.code == 2


@pytest.mark.parametrize("script, option", [(bench_moe, "--engines"), (bench_stages, "--engines"),
                                            (profile_call, "--engines"), (probe_pdl, "--spin-us"),
                                            (probe_weight_stream, "--forms"), (probe_timeline, "--tokens")])
def test_help(script: object, option: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        script.main(["--help"])
    assert exc.value.code == 0
    assert option in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
@pytest.mark.parametrize("script", [bench_moe, bench_stages, profile_call, probe_pdl, probe_weight_stream,
                                    probe_timeline])
def test_main_without_gpu_returns_2(script: object, capsys: pytest.CaptureFixture[str]) -> None:
    assert script.main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_gpu_clock_waits_out_slowdowns(monkeypatch: pytest.MonkeyPatch) -> None:
    """settle() polls until no power or thermal slowdown is active (the idle reason does not count), giving up after
    SETTLE_SECONDS; record() keeps the reading after a median; the summary counts slowed readings; a reader that
    answers None leaves the clock inert."""
    now = [0.0]
    monkeypatch.setattr(common.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(common.time, "sleep", lambda s: now.__setitem__(0, now[0] + s))
    readings = iter([(1425, 0x4), (1500, 0x4 | 0x1), (1980, 0x1), (1980, 0x0), (1470, 0x4)])
    clock = common.GpuClock(lambda: next(readings))
    clock.settle()
    assert now[0] == pytest.approx(0.4)  # two slowed readings, then the idle one passes
    clock.record()
    clock.record()
    assert clock.seen == [(1980, 0x0), (1470, 0x4)]
    assert clock.summary().startswith("SM clock right after each of 2 timed medians: 1470-1980 MHz, 1 of them under")
    stuck = common.GpuClock(lambda: (1425, 0x4))
    stuck.settle()
    assert stuck.waited_s == pytest.approx(common.SETTLE_SECONDS, abs=0.2)
    inert = common.GpuClock(lambda: None)
    inert.settle()
    inert.record()
    assert inert.summary() is None and inert.waited_s == 0.0


def test_timeline_splits_replays_at_the_flushes() -> None:
    """The kernels after each flush form one replay; each launch's start and end are medians over the replays, from
    the replay's first start; a replay with another kernel count than the graph's is refused."""
    flush = lambda name: "fill" in name.lower()  # noqa: E731
    kernels = [("FillFunctor", 0, 900), ("sort", 1000, 6000), ("gemm", 2000, 40000),
               ("FillFunctor", 50000, 50900), ("gemm", 53000, 90000), ("sort", 51000, 57000)]
    replays = probe_timeline.split_replays(kernels, flush, launches=2)
    assert [[k[0] for k in r] for r in replays] == [["sort", "gemm"], ["sort", "gemm"]]
    assert probe_timeline.spans(replays) == [("sort", 0.0, 5.5), ("gemm", 1.5, 39.0)]
    with pytest.raises(RuntimeError, match="expected 3 kernels"):
        probe_timeline.split_replays(kernels, flush, launches=3)
    with pytest.raises(RuntimeError, match="no flush"):
        probe_timeline.split_replays(kernels[1:3], flush, launches=2)


def test_weight_stream_forms() -> None:
    """The probe's columns: the compile-time form of each, the bytes a warp step covers of each row, and the stages'
    shared memory (the bulk form's [warps][stages][rows][C + 16 bytes]); the persistent forms' unit order."""
    assert probe_weight_stream.defines("tiles:4", 2, 4, 1) == {"MT": 2, "WM": 4, "WK": 1, "P": 0, "S": 4}
    rows = probe_weight_stream.defines("rowsh:2:2", 2, 2, 2)
    assert rows["P"] == 1 and rows["H"] == 1 and probe_weight_stream.step_bytes(rows) == 128
    bulk = probe_weight_stream.defines("bulk:256:2", 2, 4, 1)
    assert probe_weight_stream.step_bytes(bulk) == 256 and probe_weight_stream.stage_smem(bulk, 1024) == 4 * 2 * 32 * 272
    slab = probe_weight_stream.defines("slab:4", 2, 4, 1)
    assert slab["P"] == 3 and slab["NCH"] == 4 and probe_weight_stream.stage_smem(slab, 384) == 128 * 384
    assert probe_weight_stream.defines("persist:2", 2, 2, 2) == {"MT": 2, "WM": 2, "WK": 2, "P": 4, "S": 2, "CONTIG": 0}
    assert probe_weight_stream.defines("persistc:4", 2, 2, 2)["CONTIG"] == 1
    for form in probe_weight_stream.FORMS:
        assert probe_weight_stream.form_arg(form) == form


@pytest.mark.parametrize("form", ["tile:4", "rows:3:2", "rows:1:0", "bulk:100:2", "bulk:1024:2", "tiles:9", "bulk:256",
                                  "slab:0", "slab:9", "persist:0", "persistc:9"])
def test_weight_stream_refuses_bad_forms(form: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        probe_weight_stream.main(["--forms", form])
    assert exc.value.code == 2 and "expected tiles:S" in capsys.readouterr().err


def test_slow_cudnn_skip_and_cell_status() -> None:
    assert common.slow_skip(True, DEEPSEEK, "cudnn", 512)
    assert not common.slow_skip(True, DEEPSEEK, "cudnn", 64)
    assert not common.slow_skip(True, DEEPSEEK, "sm90", 4096)
    assert not common.slow_skip(True, QWEN3, "cudnn", 4096)
    assert not common.slow_skip(False, DEEPSEEK, "cudnn", 4096)
    report = common.Report()
    prepared = {"cudnn": ("config", "weights")}

    def fail(config: object, weights: object) -> float:
        raise NotImplementedError("no kernel")

    assert common.measure_engine(report, True, DEEPSEEK, 1, "sm90", prepared, lambda c, w: 1.0) == "n/a"
    assert common.measure_engine(report, True, DEEPSEEK, 512, "cudnn", prepared, lambda c, w: 1.0) == "skipped"
    measured = common.measure_engine(report, True, DEEPSEEK, 8, "cudnn", prepared, lambda c, w: (c, w))
    assert measured == ("config", "weights")
    assert common.measure_engine(report, True, DEEPSEEK, 8, "cudnn", prepared, fail) == "error"
    assert report.notes == ["DeepSeek-V3 engine cudnn: NotImplementedError: no kernel ('error' cells)"]


def test_row_batch_depends_on_the_row_alone() -> None:
    """A row's batch is the same whatever was drawn before it (weights, other rows), differs between token counts and
    models, and holds distinct in-range ids with softmax weights."""
    first = common.row_batch(TINY, 5, "cpu")
    common.random_weights(TINY, torch.Generator().manual_seed(7))
    common.row_batch(TINY, 3, "cpu")
    again = common.row_batch(TINY, 5, "cpu")
    for a, b in zip(first, again):
        assert torch.equal(a, b)
    other = common.ModelShape("tiny2", "Tiny 2", experts=8, hidden=256, intermediate=128, top_k=2)
    assert not torch.equal(common.row_batch(TINY, 6, "cpu")[1][:5], first[1])
    assert not torch.equal(common.row_batch(other, 5, "cpu")[1], first[1])
    x, ids, route_w = first
    assert x.shape == (5, TINY.hidden) and x.dtype == torch.bfloat16 and ids.dtype == torch.int32
    assert all(len(set(row.tolist())) == TINY.top_k for row in ids) and 0 <= ids.min() and ids.max() < TINY.experts
    assert torch.allclose(route_w.sum(1), torch.ones(5))


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch without _grouped_mm")
def test_bf16_peer_matches_a_loop() -> None:
    gen = torch.Generator().manual_seed(0)
    x, ids, route_w = common.random_batch(TINY, 5, gen)
    w1, w2 = common.random_weights(TINY, gen)
    got = bench_moe.grouped_mm_layer(x, ids.long(), route_w, w1.transpose(1, 2), w2.transpose(1, 2), TINY.intermediate)
    want = torch.zeros(5, TINY.hidden)
    for t in range(5):
        for s in range(TINY.top_k):
            h = w1[ids[t, s]].float() @ x[t].float()
            up, gate = h[: TINY.intermediate], h[TINY.intermediate :]
            want[t] += route_w[t, s] * (w2[ids[t, s]].float() @ (torch.nn.functional.silu(gate) * up))
    assert got.dtype == torch.bfloat16 and got.shape == (5, TINY.hidden)
    assert torch.linalg.norm(got.float() - want) <= 0.02 * torch.linalg.norm(want)


def test_bf16_peer_offsets_are_cumulative_counts() -> None:
    ids = torch.tensor([[3, 0], [3, 5], [7, 0]])
    sorted_ids, _ = torch.sort(ids.reshape(-1), stable=True)
    offs = torch.searchsorted(sorted_ids, torch.arange(8), right=True, out_int32=True)
    assert offs.tolist() == torch.cumsum(torch.bincount(ids.reshape(-1), minlength=8), 0).tolist()


class _FakeGraph:
    def __init__(self, keep_graph: bool = False) -> None:
        pass

    def replay(self) -> None:
        pass


class _FakeTimer:
    def __init__(self, iters: int) -> None:
        self.iters = iters
        self.clock = common.GpuClock(lambda: (1980, 0x1))  # idle, no slowdown

    def median_us(self, fn: object) -> float:
        for _ in range(self.iters):
            fn()
        self.clock.record()
        return 10.0


class _FakeExecutor:
    engine = SimpleNamespace(variant=lambda rows, shape, gemm: choose_variant(rows, shape, sm_count=SMS, gemm=gemm,
                                                                                   dram_tbs=H200_TBS))

    def bucket(self, tokens: int) -> SimpleNamespace:
        rows = common.MODELS["tiny"].top_k * tokens + 7 * min(tokens * 2, 8)
        gemm = [SimpleNamespace(rows=rows, shape=GemmShape(k, n, 8)) for k, n in ((256, 256), (128, 256))]
        return SimpleNamespace(rows=rows, gemm1=gemm[0], gemm2=gemm[1])

    def stages(self, bucket: SimpleNamespace) -> list[tuple[str, object]]:
        return [(name, lambda: None) for name in ("sort+permute", "gemm1", "activation", "gemm2")]

    def call_launches(self, bucket: SimpleNamespace, caller: object) -> list[tuple[str, object]]:
        # a call whose chain takes over the op's stage and leaves the finalize to a launch of its own
        return [(name, lambda: None) for name in ("stage+sort+permute+gemm1+activation", "gemm2", "finalize")]


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """The benchmarks' CUDA calls replaced by CPU stand-ins, and a tiny preset."""
    real_generator = torch.Generator
    monkeypatch.setitem(common.MODELS, "tiny", TINY)
    monkeypatch.setattr(torch, "Generator", lambda device=None: real_generator())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", lambda graph: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: None)
    monkeypatch.setattr(torch.cuda, "set_stream", lambda stream: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "Fake GPU")
    monkeypatch.setattr(common, "Timer", _FakeTimer)
    monkeypatch.setattr(common, "fused_moe", lambda config, acts, routing, weights, out: out.zero_())
    for script in (bench_moe, bench_stages):
        monkeypatch.setattr(script, "executor_for", lambda *args: _FakeExecutor())
        monkeypatch.setattr(script, "gpu_missing", lambda name: False)
    # a fake graph holds no nodes: 5 kernels for the launches column, and a memset bench_stages names
    monkeypatch.setattr(bench_moe, "kernel_launches", lambda graph: 5)
    monkeypatch.setattr(bench_stages, "graph_nodes", lambda graph: Counter({"kernel": 5, "memset": 1}))


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch without _grouped_mm")
def test_bench_moe_tables_with_fake_cuda(fake_cuda: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    md = tmp_path / "bench.md"
    argv = ["--models", "tiny", "--tokens", "1", "4", "--engines", "sm90", "cudnn", "--iters", "2", "--host-calls", "3"]
    assert bench_moe.main([*argv, "--markdown", str(md)]) == 0
    text = md.read_text()
    assert "| Tiny | 1 |" in capsys.readouterr().out
    rows = [line for line in text.splitlines() if line.startswith("| Tiny |")]
    assert len(rows) == 2 + 2 + 2  # two token counts, SM90 variants, the host rows of both engines at T=1
    cells = rows[0].strip("| ").split(" | ")
    assert cells[:3] == ["Tiny", "1", "10.0"] and cells[4] == "10.0" and cells[-1] == "1.00x"
    header = next(line for line in text.splitlines() if line.startswith("| model | T |"))
    assert header.strip("| ").split(" | ")[-3:] == ["Triton BF16 layer (graph) (us)",
                                                    "Triton INT4 W4A16 layer (graph) (us)", "best peer / best engine"]
    assert len(cells) == len(header.strip("| ").split(" | ")) and "INT4 peer" in text
    assert cells[3] == common.fmt(10.0 / ROOFLINE.floor_us(TINY, 1, 2, common.FP4_BYTES_PER_WEIGHT))
    assert "host us per fused_moe call (T=1)" in text
    assert rows[-2].startswith("| Tiny | sm90 |") and rows[-1].startswith("| Tiny | cudnn |")
    assert [row.split(" | ")[1:3] for row in rows[2:4]] == [["1", "sm90"], ["4", "sm90"]]
    assert "Variant(" in rows[2]
    assert "- SM clock right after each of" in text and "1980-1980 MHz, 0 of them under" in text


def test_bench_stages_table_with_fake_cuda(fake_cuda: None, tmp_path: Path) -> None:
    md = tmp_path / "stages.md"
    assert bench_stages.main(["--models", "tiny", "--tokens", "2", "--engines", "cudnn", "--iters", "1",
                              "--markdown", str(md)]) == 0
    lines = md.read_text().splitlines()
    assert lines[4] == ("| model | T | engine | sort | permute | sort+permute | gemm1 | "
                        "gemm1+activation | activation | gemm2 | gemm1+activation+gemm2 | sum of stages | launches | "
                        "whole call | GEMM1 GB/s | GEMM2 GB/s | GEMM1 TFLOP/s | GEMM2 TFLOP/s |")
    # stages the chain lacks are "-"; launches = the kernel nodes of the call's graph (the fake's 5); GB/s = the touched
    # experts' NVFP4 bytes of each GEMM over its 10 us; TFLOP/s = the 2 x 2 routed slots' FLOPs over 10 us
    cells = lines[6].strip("| ").split(" | ")
    assert cells[:14] == ["Tiny", "2", "cudnn", "-", "-", "10.0", "10.0", "-", "10.0", "10.0", "-", "40.0", "5",
                          "10.0"]
    per_expert = TINY.hidden * TINY.intermediate * common.FP4_BYTES_PER_WEIGHT / 10 / 1e3  # GEMM2, one expert
    assert (cells[14], cells[15]) in [(common.fmt(2 * t * per_expert), common.fmt(t * per_expert)) for t in (2, 3, 4)]
    gemm2_tflops = 2 * 2 * TINY.top_k * TINY.hidden * TINY.intermediate / 10 / 1e6
    assert cells[16:18] == [common.fmt(2 * gemm2_tflops), common.fmt(gemm2_tflops)]
    # the in-chain table: every prefix takes the fake timer's 10 us, so the first stage adds 10 and the rest 0
    chain, call = [line for line in lines if line.startswith("| Tiny |")][-2:]
    assert chain == "| Tiny | 2 | cudnn | sort+permute 10.0, gemm1 0.0, activation 0.0, gemm2 0.0 |"
    # the call's own chain (the caller's inputs and output): each launch alone / added in that chain, and its GEMM's
    # GB/s (the same bytes and 10 us as the table's GEMM columns)
    assert call == (f"| Tiny | 2 | cudnn | stage+sort+permute+gemm1+activation 10.0 / 10.0 ({cells[14]} GB/s), "
                    f"gemm2 10.0 / 0.0 ({cells[15]} GB/s), finalize 10.0 / 0.0 |")
    # the whole call's other graph nodes, and its time again after the rest
    assert ("- Tiny T=2 cudnn, the whole call: its graph holds 5 kernel nodes and 1 memset; the whole call timed again "
            "after the stages: 10.0 us (first 10.0)") in lines


def test_bf16_peer_falls_back_to_eager_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_capture(fn: object) -> None:
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(bench_moe, "capture", no_capture)
    report = common.Report()
    peer = bench_moe.Bf16Peer(report)
    calls = []
    assert peer.time_us(_FakeTimer(2), lambda: calls.append(1)) == (10.0, "10.0 (eager)")
    assert peer.time_us(_FakeTimer(2), lambda: calls.append(1)) == (10.0, "10.0 (eager)")
    assert len(calls) == 6 and len(report.notes) == 1 and "timed eagerly" in report.notes[0]


def test_tune_sm90_routes_the_call_tokens_into_rows() -> None:
    """The tuner's GEMM1 rows for a gathering bucket are the call's tokens as the permute would place them: row r
    holds token row_to_slot[r] // top_k, padding rows (-1) are zero."""
    gen = torch.Generator().manual_seed(3)
    source = torch.randn(5, 16, generator=gen).bfloat16()
    row_to_slot = torch.tensor([3, 0, -1, 9, 4, -1, 1, 8], dtype=torch.int32)
    rows = tune_sm90.routed_rows(source, row_to_slot, top_k=2)
    assert rows.shape == (8, 16) and rows.dtype == torch.bfloat16
    for r, slot in enumerate(row_to_slot.tolist()):
        want = torch.zeros(16, dtype=torch.bfloat16) if slot < 0 else source[slot // 2]
        assert torch.equal(rows[r], want), r
    assert torch.count_nonzero(rows[[0, 1, 3]]) > 0


def _bucket_gemm1(rows: int, token_rows: int, out_rows: int) -> GemmOperands:
    """GEMM1 operands of a bucket of ``rows`` rows (K = 64, N = 32, 2 experts) whose token buffer holds
    ``token_rows`` rows and whose output buffer ``out_rows``: 0 where the fused chain never touches it."""
    shape = GemmShape(k=64, n=32, num_experts=2)
    tokens = TokenOperand(torch.randn(token_rows, 64).bfloat16(), None, TokenLayout.BF16_FRAGMENTS)
    weights = WeightOperand(torch.zeros(2, 1, dtype=torch.uint8), torch.zeros(2, 1, dtype=torch.uint8),
                            torch.ones(2))
    return GemmOperands(rows, shape, tokens, weights, torch.tensor([0, 8, 16], dtype=torch.int32),
                        torch.empty(out_rows, 32, dtype=torch.bfloat16), None, gemm=1)


def test_tune_sm90_gives_a_decode_bucket_gemm1_an_output_buffer() -> None:
    """A decode bucket whose GEMM1 runs with the activation epilogue holds no GEMM1 output rows; the tuner's plain
    GEMM1 then gets an R x N BF16 buffer and keeps the bucket's permuted token rows (no source rows needed)."""
    ops = _bucket_gemm1(rows=16, token_rows=16, out_rows=0)
    full = tune_sm90.full_buffers(ops, None, torch.arange(16, dtype=torch.int32), top_k=2)
    assert full.out.shape == (16, 32) and full.out.dtype == torch.bfloat16
    assert full.tokens is ops.tokens


def test_tune_sm90_refuses_a_bucket_without_token_rows_and_no_source() -> None:
    """A gathering bucket holds no token rows: without the call's rows to route the tuner says so."""
    ops = _bucket_gemm1(rows=16, token_rows=0, out_rows=16)
    with pytest.raises(ValueError, match="no token rows"):
        tune_sm90.full_buffers(ops, None, torch.arange(16, dtype=torch.int32), top_k=2)


@pytest.mark.parametrize("launches, count, described", [
    (["stage", "sort+permute", "gemm1+activation", "gemm2", "finalize"], 5,
     "5: stage, sort+permute, gemm1+activation, gemm2, finalize"),
    (["stage+sort+permute+gemm1+activation", "gemm2+finalize"], 2,
     "2: stage+sort+permute+gemm1+activation, gemm2+finalize"),
    (["stage", "sort+permute", "gemm1+activation", "gemm2", "finalize"], 7,
     "7: stage, sort+permute, gemm1+activation, gemm2, finalize and 2 more"),
    (["stage+sort+permute", "gemm1+activation+gemm2", "finalize"], 4,
     "4: stage+sort+permute, gemm1+activation+gemm2 (two), finalize"),
    (["stage+sort+permute", "gemm1+activation+gemm2+finalize"], 3,
     "3: stage+sort+permute, gemm1+activation+gemm2+finalize (two)"),
])
def test_launches_name_the_executors_launches(launches: list[str], count: int, described: str) -> None:
    """A captured call's kernel nodes against the launches the executor makes for it, a stage holding both GEMMs as
    two; a count they do not account for is said."""
    assert bench_moe.describe_launches(launches, count) == described
