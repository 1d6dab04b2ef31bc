"""What the benchmark scripts share: model shapes, random layers and batches, the engines' prepared
weights, CUDA-graph capture, L2-flushed CUDA-event timing, host time per call, roofline floors, and
the tables they print (and write as markdown).

Timing is the same for every contender: one warm-up call, ONE call captured in a CUDA graph, then
the median over ``--iters`` CUDA-event-timed replays, each after a 256 MiB write that flushes L2
(outside the event pair). Before each median the GPU is let out of any power or thermal slowdown that
earlier work left (GpuClock), so that no contender is timed on clocks another one lowered.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import shutil
import statistics
import subprocess
import sys
import time
import zlib
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import torch

from checkout import ROOT, add_checkout  # every benchmark puts this folder first on sys.path

add_checkout()

import cudnn_moe  # noqa: E402
from cudnn_moe import Nvfp4MoeConfig, Nvfp4Weights, Routing, SwiGLU, fused_moe, get_executor  # noqa: E402
from cudnn_moe.engines.base import OP_FUSED  # noqa: E402
from cudnn_moe.engines.registry import engine_names  # noqa: E402
from cudnn_moe.pipeline.executor import CallerInputs, MoeExecutor  # noqa: E402
from cudnn_moe.engines.cudnn.probe import backend_version, format_version  # noqa: E402
from cudnn_moe.capture import capture_graph  # noqa: E402
from cudnn_moe.kernels import driver  # noqa: E402
from cudnn_moe.timing import median_us  # noqa: E402

PRESETS = ROOT / "graphs" / "presets.json"
DEFAULT_MODELS = ("qwen3-30b-a3b", "deepseek-v3")
DEFAULT_TOKENS = (1, 8, 64, 512, 4096)
DEFAULT_ENGINES = ("sm90", "cudnn")
FLUSH_BYTES = 256 << 20  # written before each timed replay: five times the H200's 50 MB L2
FP4_BYTES_PER_WEIGHT = 0.5 + 1 / 16  # one E2M1 code + one E4M3 scale per 16 weights
BF16_BYTES_PER_WEIGHT = 2.0
# --skip-slow-cudnn: the cudnn engine is not run above this many tokens for these models (on SM90
# its dequantizing graph takes 100-170 ms per DeepSeek-V3 call there).
SLOW_CUDNN_MAX_TOKENS = {"deepseek-v3": 64}

R = TypeVar("R")


@dataclass(frozen=True)
class ModelShape:
    """One MoE layer shape from graphs/presets.json (gated: GEMM1 gives 2I columns [up; gate])."""

    key: str
    name: str
    experts: int
    hidden: int
    intermediate: int
    top_k: int

    @property
    def weights_per_expert(self) -> int:
        """Weight elements of one expert: w1 [2I, H] and w2 [H, I]."""
        return 3 * self.hidden * self.intermediate

    def flops(self, tokens: int) -> int:
        """Multiply-add FLOPs of ``tokens`` tokens through top-k experts (both GEMMs)."""
        return 2 * tokens * self.top_k * self.weights_per_expert


def load_models(path: Path = PRESETS) -> dict[str, ModelShape]:
    """The presets of ``path`` by key."""
    fields = ("name", "experts", "hidden", "intermediate", "top_k")
    return {key: ModelShape(key, *(preset[f] for f in fields)) for key, preset in json.loads(path.read_text()).items()}


MODELS = load_models()


@dataclass(frozen=True)
class Roofline:
    """Floors from HBM bandwidth (TB/s) and BF16 tensor-core peak (TFLOP/s)."""

    bandwidth_tbs: float
    peak_tflops: float

    def floor_us(self, m: ModelShape, tokens: int, active_experts: int, bytes_per_weight: float) -> float:
        """max(weight bytes of the active experts / bandwidth, FLOPs / peak), in microseconds."""
        memory = active_experts * m.weights_per_expert * bytes_per_weight / (self.bandwidth_tbs * 1e12)
        compute = m.flops(tokens) / (self.peak_tflops * 1e12)
        return max(memory, compute) * 1e6


def positive_int(text: str) -> int:
    """argparse type: an int >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def make_parser(description: str) -> argparse.ArgumentParser:
    """The options every benchmark script takes: models, token counts, engines, iterations, markdown."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS), choices=list(MODELS),
                        help="presets of graphs/presets.json (default: %(default)s)")
    parser.add_argument("--tokens", nargs="+", type=positive_int, default=list(DEFAULT_TOKENS),
                        help="token counts T (default: %(default)s)")
    parser.add_argument("--engines", nargs="+", default=list(DEFAULT_ENGINES), choices=engine_names(OP_FUSED),
                        help="Nvfp4MoeConfig engines, one column each (default: %(default)s)")
    parser.add_argument("--iters", type=positive_int, default=20,
                        help="timed replays per median (default: %(default)s)")
    parser.add_argument("--skip-slow-cudnn", action=argparse.BooleanOptionalAction, default=True,
                        help="skip the cudnn engine on DeepSeek-V3 above T=64 (100-170 ms per call on SM90)")
    parser.add_argument("--markdown", type=Path, help="also write the header and tables here")
    return parser


def nvrtc_module(source: str, options: tuple[str, ...] = ()) -> int:
    """A probe's CUDA ``source`` compiled by NVRTC (CuPy's, for the current device) and loaded into the current
    context: the module handle (driver.module_get_function takes its kernels)."""
    from cupy.cuda import compiler

    binary, _ = compiler.compile_using_nvrtc(source, options)
    return driver.module_load_data(binary.encode() if isinstance(binary, str) else bytes(binary))


def gpu_missing(script: str) -> bool:
    """True (after saying so on stderr) when there is no CUDA GPU to benchmark on."""
    if torch.cuda.is_available():
        return False
    print(f"{script} needs a CUDA GPU (torch {torch.__version__} sees none)", file=sys.stderr)
    return True


def cudnn_backend() -> str:
    """The loaded cuDNN backend version ('9.19.0'), or 'n/a' when cuDNN cannot be loaded."""
    try:
        return format_version(backend_version())
    except Exception:  # noqa: BLE001 - any failure to load cuDNN only blanks this header field
        return "n/a"


def header_line(extra: str = "") -> str:
    """Date, GPU, cuDNN backend, torch version, the folder the cudnn_moe package came from (and ``extra``)."""
    parts = [str(datetime.date.today()), torch.cuda.get_device_name(), f"cuDNN backend {cudnn_backend()}",
             f"torch {torch.__version__}", f"cudnn_moe from {Path(cudnn_moe.__file__).resolve().parent.parent}"]
    return " | ".join(parts + ([extra] if extra else []))


def md_row(cells: Sequence[str]) -> str:
    """A markdown table row."""
    return "| " + " | ".join(cells) + " |"


def fmt(value: float) -> str:
    """A time or ratio cell: one decimal."""
    return f"{value:.1f}"


@dataclass
class Report:
    """Lines printed as they come and kept for --markdown; notes go after the tables."""

    lines: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def emit(self, line: str = "") -> None:
        """Print a line now and keep it."""
        print(line, flush=True)
        self.lines.append(line)

    def table(self, columns: Sequence[str], left: int = 1) -> None:
        """Start a table: the column row and the alignment row (the first ``left`` columns left-aligned)."""
        self.emit(md_row(columns))
        self.emit(md_row(["---"] * left + ["---:"] * (len(columns) - left)))

    def note(self, text: str) -> None:
        """Say something once (repeats are dropped)."""
        if text not in self.notes:
            print(f"note: {text}", flush=True)
            self.notes.append(text)

    def markdown(self) -> str:
        """The lines, then the notes as a list."""
        return "\n".join(self.lines + [""] + [f"- {note}" for note in self.notes]) + "\n"

    def write(self, path: Path | None) -> None:
        """Write ``markdown()`` to ``path`` (--markdown), if given."""
        if path is not None:
            path.write_text(self.markdown())


REASON_CHARS = 60  # a peer's failure reason as a table cell (the whole reason goes to the notes)


def reason(exc: BaseException) -> str:
    """'<type>: <message>' on one line."""
    return " ".join(f"{type(exc).__name__}: {exc}".split())


def failure_cell(exc: BaseException) -> str:
    """A table cell saying why a peer did not run: 'failed: <type>: <reason>' cut to REASON_CHARS."""
    text = reason(exc)
    return "failed: " + (text if len(text) <= REASON_CHARS else text[: REASON_CHARS - 3] + "...")


def progress(text: str) -> None:
    """A progress line on stderr (kept out of the tables)."""
    print(text, file=sys.stderr, flush=True)


def random_weights(m: ModelShape, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """BF16 w1 [E, 2I, H] (rows [up; gate]) and w2 [E, H, I] on gen's device, scaled by 1/sqrt(fan-in)."""
    dev = gen.device
    w1 = torch.randn(m.experts, 2 * m.intermediate, m.hidden, device=dev, dtype=torch.bfloat16, generator=gen)
    w2 = torch.randn(m.experts, m.hidden, m.intermediate, device=dev, dtype=torch.bfloat16, generator=gen)
    return w1.div_(m.hidden**0.5), w2.div_(m.intermediate**0.5)


def random_batch(m: ModelShape, tokens: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """BF16 x [T, H], distinct uniform top-k ids int32 [T, k], softmax route weights FP32 [T, k]."""
    dev = gen.device
    x = torch.randn(tokens, m.hidden, device=dev, dtype=torch.bfloat16, generator=gen)
    ids = torch.rand(tokens, m.experts, device=dev, generator=gen).argsort(1)[:, : m.top_k].to(torch.int32)
    return x, ids, torch.softmax(torch.randn(tokens, m.top_k, device=dev, generator=gen), 1)


def row_batch(m: ModelShape, tokens: int, device: str | torch.device = "cuda") -> tuple[torch.Tensor, torch.Tensor,
                                                                                        torch.Tensor]:
    """The batch of row (m, T) of every benchmark: random_batch from a generator seeded by the preset's key and T
    alone, so a row draws the same tokens and routing in every script and whatever else the run measures (other
    models, other token counts, weights drawn before it)."""
    seed = zlib.crc32(f"{m.key}/{tokens}".encode())
    return random_batch(m, tokens, torch.Generator(device=device).manual_seed(seed))


Prepared = dict[str, tuple[Nvfp4MoeConfig, Nvfp4Weights]]


def prepare_engines(
    m: ModelShape, w1: torch.Tensor, w2: torch.Tensor, engines: Sequence[str], max_tokens: int, report: Report
) -> Prepared:
    """SwiGLU NVFP4 weights per engine; an engine whose preparation raises ValueError is left out (noted)."""
    prepared: Prepared = {}
    for engine in engines:
        config = Nvfp4MoeConfig(max_num_tokens=max_tokens, engine=engine)
        try:
            prepared[engine] = config, config.prepare_weights(w1, w2, activation=SwiGLU())
        except ValueError as exc:
            report.note(f"{m.name}: engine {engine} not run ({exc})")
    return prepared


def slow_skip(skip_slow_cudnn: bool, m: ModelShape, engine: str, tokens: int) -> bool:
    """Whether --skip-slow-cudnn leaves this cell out."""
    return skip_slow_cudnn and engine == "cudnn" and tokens > SLOW_CUDNN_MAX_TOKENS.get(m.key, tokens)


def measure_engine(
    report: Report, skip_slow_cudnn: bool, m: ModelShape, tokens: int, engine: str, prepared: Prepared,
    measure: Callable[[Nvfp4MoeConfig, Nvfp4Weights], R],
) -> R | str:
    """measure(config, weights) for one engine cell, else the cell's text: 'n/a' (the engine cannot
    prepare this layer), 'skipped' (--skip-slow-cudnn) or 'error' (the exception is noted)."""
    if engine not in prepared:
        return "n/a"
    if slow_skip(skip_slow_cudnn, m, engine, tokens):
        return "skipped"
    try:
        return measure(*prepared[engine])
    except Exception as exc:  # noqa: BLE001 - one failing engine must not lose the rest of the table
        report.note(f"{m.name} engine {engine}: {type(exc).__name__}: {exc} ('error' cells)")
        return "error"


def call_inputs(
    config: Nvfp4MoeConfig, weights: Nvfp4Weights, x: torch.Tensor, ids: torch.Tensor, route_w: torch.Tensor
) -> CallerInputs:
    """A fused_moe call's inputs on this batch (NVFP4 tokens, the routing) and a freshly allocated output."""
    acts, routing = config.prepare_activations(x), Routing.unpacked(ids, route_w)
    return CallerInputs(acts, routing, torch.empty(x.shape[0], weights.hidden_size, device=x.device,
                                                   dtype=torch.bfloat16))


def moe_call(
    config: Nvfp4MoeConfig, weights: Nvfp4Weights, x: torch.Tensor, ids: torch.Tensor, route_w: torch.Tensor
) -> Callable[[], object]:
    """One SwiGLU fused_moe call on this batch, with its inputs prepared and its output allocated."""
    inputs = call_inputs(config, weights, x, ids, route_w)
    return lambda: fused_moe(config, inputs.tokens, inputs.routing, weights, out=inputs.out)


def executor_for(m: ModelShape, config: Nvfp4MoeConfig, weights: Nvfp4Weights) -> MoeExecutor:
    """The executor the SwiGLU fused_moe calls of ``moe_call`` run on (cached on ``weights``)."""
    return get_executor(config, weights, top_k=m.top_k, activation=SwiGLU(), local_expert_start=0)


def capture(fn: Callable[[], object], keep_graph: bool = False) -> torch.cuda.CUDAGraph:
    """fn() once eagerly (warm-up: buckets, plans, kernels), then ONE call captured in a CUDA graph,
    replayed once (the upload): cudnn_moe.capture.capture_graph."""
    return capture_graph(fn, keep_graph)


# The driver API's CUgraphNodeType values, named as graph_nodes counts them.
GRAPH_NODE_NAMES = {driver.CU_GRAPH_NODE_TYPE_KERNEL: "kernel", 1: "memcpy", 2: "memset", 3: "host", 4: "child graph",
                    5: "empty", 6: "event wait", 7: "event record", 8: "semaphore signal", 9: "semaphore wait",
                    10: "memory alloc", 11: "memory free", 12: "batch memory op", 13: "conditional"}


def graph_nodes(graph: torch.cuda.CUDAGraph) -> Counter[str]:
    """How many nodes of each type (GRAPH_NODE_NAMES; "type N" for others) a graph captured with keep_graph=True
    holds; "kernel" counts the launches of the call it holds."""
    return Counter(GRAPH_NODE_NAMES.get(t, f"type {t}") for t in driver.graph_node_types(graph.raw_cuda_graph()))


def kernel_launches(graph: torch.cuda.CUDAGraph) -> int:
    """The kernel nodes of a graph captured with keep_graph=True: the launches of the call it holds."""
    return graph_nodes(graph)["kernel"]


# nvidia-smi's clock event reasons that lower the clocks under load: software power cap, hardware slowdown, software
# and hardware thermal slowdown, power brake. On the H200 a few seconds of dense matmuls hold the SW power cap (700 W)
# with the SM clock at 1425-1515 MHz instead of 1980, and the decode layer slows with it: DeepSeek-V3 T=1 92-96 us
# against 76 (benchmarks/RESULTS.md, twenty-ninth session).
SLOWDOWN_REASONS = 0x4 | 0x8 | 0x20 | 0x40 | 0x80
SETTLE_SECONDS = 10.0  # the longest wait for a slowdown to clear before a timed median
ClockReading = tuple[int, int]  # SM clock (MHz), active clock event reasons (bit mask)


def smi_clock_reader() -> Callable[[], ClockReading | None]:
    """A reader of the current CUDA device's SM clock and active clock event reasons through nvidia-smi (by UUID, so
    CUDA_VISIBLE_DEVICES does not matter); it returns None where nvidia-smi is missing or its answer does not parse."""
    exe = shutil.which("nvidia-smi")
    uuid = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "uuid", None)

    def read() -> ClockReading | None:
        if exe is None or uuid is None:
            return None
        try:
            out = subprocess.run([exe, "-i", f"GPU-{uuid}", "--query-gpu=clocks.sm,clocks_throttle_reasons.active",
                                  "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10).stdout
            mhz, reasons = out.strip().split(",")
            return int(mhz), int(reasons.strip(), 16)
        except (OSError, ValueError, subprocess.SubprocessError):
            return None

    return read


class GpuClock:
    """The GPU's clock around timed medians, handled as NVBench handles throttling: settle() waits (up to
    SETTLE_SECONDS, polling) until no SLOWDOWN_REASONS is active, so a median never starts on clocks that earlier work
    (a peer's dense GEMMs, weight preparation) lowered; record() keeps the reading right after a median, for
    summary(). Inert where ``read`` returns None."""

    def __init__(self, read: Callable[[], ClockReading | None]) -> None:
        self.read = read
        self.seen: list[ClockReading] = []
        self.waited_s = 0.0

    def settle(self) -> None:
        start = time.monotonic()
        while (state := self.read()) is not None and state[1] & SLOWDOWN_REASONS:
            if time.monotonic() - start >= SETTLE_SECONDS:
                break
            time.sleep(0.2)
        self.waited_s += time.monotonic() - start

    def record(self) -> None:
        state = self.read()
        if state is not None:
            self.seen.append(state)

    def summary(self) -> str | None:
        """The SM clocks read right after the medians, how many of them under a slowdown, and the time spent waiting
        for slowdowns to clear; None without readings."""
        if not self.seen:
            return None
        mhz = [m for m, _ in self.seen]
        slowed = sum(1 for _, reasons in self.seen if reasons & SLOWDOWN_REASONS)
        return (f"SM clock right after each of {len(self.seen)} timed medians: {min(mhz)}-{max(mhz)} MHz, {slowed} of "
                f"them under a power or thermal slowdown; {self.waited_s:.1f} s spent waiting for slowdowns to clear "
                f"before the medians (nvidia-smi)")


class Timer:
    """Median GPU time of a callable, each run between its own CUDA events after an L2 flush, each median started
    out of any clock slowdown (GpuClock)."""

    def __init__(self, iters: int, clock: GpuClock | None = None) -> None:
        self.iters = iters
        self.flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
        self.clock = clock if clock is not None else GpuClock(smi_clock_reader())

    def median_us(self, fn: Callable[[], object]) -> float:
        self.clock.settle()
        us = median_us(fn, self.iters, flush=self.flush)
        self.clock.record()
        return us


def host_us_back_to_back(fn: Callable[[], object], calls: int, repeats: int = 3) -> float:
    """Host time per call of ``calls`` back-to-back fn() without synchronizing (perf_counter around the
    loop / calls; median of ``repeats`` loops). Reads the GPU time instead once the GPU is the slower side."""
    per_call = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        per_call.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(per_call)


def host_us_idle_gpu(fn: Callable[[], object], calls: int) -> float:
    """Median host time to submit one fn() to an idle GPU (synchronized before each call)."""
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def run_models(args: argparse.Namespace, bench_model: Callable[[ModelShape, torch.Generator, Timer], None],
               report: Report) -> None:
    """bench_model per model of --models (one seeded generator, one L2 flush buffer), freeing the GPU
    memory between models; then the clocks the medians saw (GpuClock.summary) as a note of ``report``."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    timer = Timer(args.iters)
    for key in args.models:
        bench_model(MODELS[key], gen, timer)
        gc.collect()
        torch.cuda.empty_cache()
    summary = timer.clock.summary()
    if summary is not None:
        report.note(summary)
