"""``cudnn-moe prebuild``: build a layer shape's token buckets ahead of serving, or measure its low-latency
tactics, and manage the cache.

Shapes come from presets (graphs/presets.json, or a JSON file of the same format) and
``--shape E,H,I,TOPK``; each (shape, bucket) is built through build_layer, or with ``--low-latency FORMAT``
each (shape, format) is tuned through tune_layer (LowLatencyMoeConfig.tune on stand-in weights of that
format: the choice depends on the shapes, not the values), the two functions here that touch the GPU
(torch, CuPy and cuDNN are imported inside them). ``--list``, ``--verify`` and ``--clear`` work on the
cache directory and need no GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from .activations import ACTIVATION_NAMES, Activation, parse_activation
from .cache import (
    ENV_VAR,
    KIND_CUDNN_PLAN,
    KIND_KERNEL,
    KIND_TACTIC,
    DiskCache,
    EntryKey,
    NotACacheError,
    cache_dir,
    set_cache_dir,
    stats,
)
from .engines.base import OP_FUSED, WeightFormat
from .engines.registry import engine_names
from .fused.config import SIZE_MULTIPLE
from .low_latency.tactics import TuningResult


def _presets_file() -> Path:
    """graphs/presets.json: cudnn_moe/_graphs in an installed wheel, else the repository's graphs/."""
    package = Path(__file__).resolve().parent
    for candidate in (package / "_graphs" / "presets.json", package.parent / "graphs" / "presets.json"):
        if candidate.is_file():
            return candidate
    return package.parent / "graphs" / "presets.json"


PRESETS_FILE = _presets_file()
PRESET_FIELDS = ("name", "experts", "hidden", "intermediate", "top_k")
MAX_BUCKET = 4096
DEFAULT_BUCKETS = tuple(1 << i for i in range(13))  # 1, 2, 4, ..., 4096
NO_GPU = "prebuild needs a CUDA GPU; --list/--verify/--clear work without one"
LOW_LATENCY_FORMATS = tuple(f.value for f in WeightFormat)
MAX_LOW_LATENCY_TOKENS = 8


@dataclass(frozen=True)
class LayerShape:
    """One MoE layer shape: E experts, hidden size H, intermediate size I, top-k."""

    name: str
    experts: int
    hidden: int
    intermediate: int
    top_k: int

    def describe(self) -> str:
        return f"{self.name} (E{self.experts} H{self.hidden} I{self.intermediate} top-{self.top_k})"


@dataclass(frozen=True)
class BuildResult:
    """One (shape, bucket): 'built' (some cache entry had to be built), 'disk' (served from the cache
    without building anything) or 'failed' (with the error); and how many persistent entries (cuDNN
    plans, kernel binaries) it built and loaded from disk."""

    shape: LayerShape
    bucket: int
    source: str
    seconds: float
    error: str | None = None
    entries_built: int = 0
    entries_loaded: int = 0


def _shape(name: str, experts: object, hidden: object, intermediate: object, top_k: object) -> LayerShape:
    values = {"experts": experts, "hidden": hidden, "intermediate": intermediate, "top_k": top_k}
    for field, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{field} must be a positive integer, got {value!r}")
    if top_k > experts:  # type: ignore[operator]
        raise ValueError(f"top_k ({top_k}) cannot exceed experts ({experts})")
    return LayerShape(name, experts, hidden, intermediate, top_k)  # type: ignore[arg-type]


def load_presets(path: Path) -> dict[str, LayerShape]:
    """Preset file -> {key: LayerShape}; ValueError naming the file and entry when malformed."""
    try:
        document = json.loads(path.read_text())
    except OSError as exc:
        raise ValueError(f"cannot read preset file {path}: {exc.strerror or exc}") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"preset file {path} is not JSON: {exc}") from exc
    if not isinstance(document, dict) or not document:
        raise ValueError(f"preset file {path} must hold a non-empty JSON object of presets")
    presets = {}
    for key, entry in document.items():
        if not isinstance(entry, dict) or set(entry) != set(PRESET_FIELDS):
            raise ValueError(f"preset {key!r} in {path} must have exactly the fields {', '.join(PRESET_FIELDS)}")
        try:
            presets[key] = _shape(str(entry["name"]), entry["experts"], entry["hidden"], entry["intermediate"], entry["top_k"])
        except ValueError as exc:
            raise ValueError(f"preset {key!r} in {path}: {exc}") from exc
    return presets


def parse_preset(text: str) -> list[LayerShape]:
    """--preset NAME (a key of graphs/presets.json) or PATH (a preset file: all its presets)."""
    path = Path(text).expanduser()
    if text.endswith(".json") or path.is_file():
        try:
            return list(load_presets(path).values())
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc
    if not PRESETS_FILE.is_file():
        raise argparse.ArgumentTypeError(f"preset names need {PRESETS_FILE}; pass a preset file PATH instead")
    presets = load_presets(PRESETS_FILE)
    if text not in presets:
        raise argparse.ArgumentTypeError(f"unknown preset {text!r}; known: {', '.join(presets)} (or a .json file)")
    return [presets[text]]


def parse_shape(text: str) -> LayerShape:
    """--shape E,H,I,TOPK -> LayerShape; H and I must be multiples of SIZE_MULTIPLE (128), as
    Nvfp4MoeConfig.prepare_weights requires."""
    parts = text.split(",")
    try:
        values = [int(p) for p in parts]
        if len(values) != 4:
            raise ValueError(f"expected 4 comma-separated integers E,H,I,TOPK, got {len(values)}")
        shape = _shape(f"custom {text}", *values)
        for field, value in (("hidden size H", shape.hidden), ("intermediate size I", shape.intermediate)):
            if value % SIZE_MULTIPLE:
                raise ValueError(f"{field} must be a multiple of {SIZE_MULTIPLE}, got {value}")
        return shape
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"bad shape {text!r}: {exc}") from exc


def parse_buckets(text: str) -> tuple[int, ...]:
    """--buckets 1,2,4,... or max=N -> sorted distinct powers of two up to 4096.

    max=N (1 <= N <= 4096) gives every power of two below N and N rounded up to a power of two
    (max=100 -> 1, 2, ..., 64, 128).
    """
    try:
        if text.startswith("max="):
            limit = int(text[4:])
            if limit < 1:
                raise ValueError(f"max must be >= 1, got {limit}")
            if limit > MAX_BUCKET:
                raise ValueError(f"max must be <= {MAX_BUCKET} (the largest token bucket), got {limit}")
            buckets = tuple(b for b in DEFAULT_BUCKETS if b < limit) + (1 << (limit - 1).bit_length(),)
        else:
            buckets = tuple(int(p) for p in text.split(","))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"bad buckets {text!r}: {exc}; use e.g. 1,2,4,8 or max=4096") from exc
    for b in buckets:
        if b < 1 or b & (b - 1) or b > MAX_BUCKET:
            raise argparse.ArgumentTypeError(
                f"bad buckets {text!r}: {b} is not a power of two in [1, {MAX_BUCKET}] (token buckets are powers of two)"
            )
    return tuple(sorted(set(buckets)))


def parse_low_latency_tokens(text: str) -> int:
    """--low-latency-tokens N: 1..MAX_LOW_LATENCY_TOKENS."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_LOW_LATENCY_TOKENS:
        raise argparse.ArgumentTypeError(f"must be an integer in 1..{MAX_LOW_LATENCY_TOKENS}, got {text!r}")
    return value


def parse_gpu_activation(text: str) -> Activation:
    try:
        act = parse_activation(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    return act


class Progress:
    """A one-line progress bar with ETA on ``stream`` (redrawn in place on a terminal, one line per step otherwise)."""

    def __init__(self, total: int, stream: TextIO | None = None, enabled: bool = True, width: int = 24) -> None:
        self.total, self.done, self.width = total, 0, width
        self.stream = sys.stderr if stream is None else stream
        self.enabled = enabled and total > 0
        self.start = time.monotonic()

    def advance(self, label: str = "") -> None:
        """Count one step done and redraw."""
        self.done = min(self.done + 1, self.total)
        if not self.enabled:
            return
        elapsed = time.monotonic() - self.start
        eta = elapsed / self.done * (self.total - self.done)
        filled = self.width * self.done // self.total
        bar = "#" * filled + "." * (self.width - filled)
        line = f"[{bar}] {self.done}/{self.total} {label}  {elapsed:.1f}s elapsed, ETA {eta:.1f}s"
        tty = getattr(self.stream, "isatty", lambda: False)()
        self.stream.write(f"\r\x1b[K{line}" if tty else f"{line}\n")
        if tty and self.done == self.total:
            self.stream.write("\n")
        self.stream.flush()


def build_layer(
    shape: LayerShape,
    buckets: Sequence[int],
    cache: DiskCache,
    activation: Activation,
    engine: str,
    progress: Progress,
) -> list[BuildResult]:
    """Build every bucket of one layer shape on the current GPU: random weights prepared with
    Nvfp4MoeConfig, then the executor's warmup per bucket (workspace, GEMM plans, CUDA graph).

    cache: the store the engines read and write (run_prebuild selects its directory with
    set_cache_dir). Each bucket counts the cuDNN plans and kernel binaries it built and loaded from
    disk (cudnn_moe.cache.stats()). A failing bucket is recorded and the next one tried.
    """
    import torch

    from .fused.config import Nvfp4MoeConfig
    from .fused.op import get_executor

    config = Nvfp4MoeConfig(max_num_tokens=max(buckets), engine=engine)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows1 = activation.gemm1_columns(shape.intermediate)
    like = dict(device="cuda", dtype=torch.bfloat16, generator=gen)
    w1 = torch.randn(shape.experts, rows1, shape.hidden, **like) / shape.hidden**0.5
    w2 = torch.randn(shape.experts, shape.hidden, shape.intermediate, **like) / shape.intermediate**0.5
    weights = config.prepare_weights(w1, w2, activation=activation)
    del w1, w2
    executor = get_executor(config, weights, top_k=shape.top_k, activation=activation, local_expert_start=0)
    results = []
    for bucket in sorted(buckets):
        start = time.monotonic()
        before = entry_counts()
        try:
            executor.warmup(bucket)
            torch.cuda.synchronize()
            built, loaded = (a - b for a, b in zip(entry_counts(), before))
            results.append(BuildResult(shape, bucket, "built" if built else "disk", time.monotonic() - start,
                                       entries_built=built, entries_loaded=loaded))
        except Exception as exc:  # reported per bucket; the summary and exit code carry it
            results.append(BuildResult(shape, bucket, "failed", time.monotonic() - start, f"{type(exc).__name__}: {exc}"))
        progress.advance(f"{shape.name} bucket {bucket}")
    return results


@dataclass(frozen=True)
class TuneResult:
    """One (shape, low-latency weight format) tuned: {T: TuningResult} (the chosen engine and every candidate's
    median us), or the error that stopped it."""

    shape: LayerShape
    weight_format: str
    tactics: dict[int, TuningResult]
    error: str | None = None


def tune_layer(shape: LayerShape, weight_format: str, activation: Activation,
               max_tokens: int) -> dict[int, TuningResult]:
    """LowLatencyMoeConfig(max_tokens).tune of one layer shape on the current GPU, on stand-in weights of
    ``weight_format`` (cudnn_moe.low_latency.stand_in), for finalized calls with the format's usual tokens and
    BF16 output (FP16 for FP16 weights), T = 1..max_tokens; the choices go to the active cache."""
    import torch

    from .low_latency import LowLatencyMoeConfig
    from .low_latency.stand_in import stand_in_weights

    fmt = WeightFormat(weight_format)
    config = LowLatencyMoeConfig(max_tokens)
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = stand_in_weights(config, fmt, shape.experts, shape.hidden, shape.intermediate, gen, activation)
    out_dtype = torch.float16 if fmt is WeightFormat.FP16 else torch.bfloat16
    return config.tune(weights, top_k=shape.top_k, activation=activation, out_dtype=out_dtype)


def entry_counts() -> tuple[int, int]:
    """(persistent entries built, loaded from disk) in this process so far: cuDNN plans and kernels."""
    counts = stats()
    kinds = (KIND_CUDNN_PLAN, KIND_KERNEL)
    return sum(counts.get((k, "built"), 0) for k in kinds), sum(counts.get((k, "disk"), 0) for k in kinds)


def parse_cache_dir(text: str) -> Path:
    """--cache-dir: a non-empty path (an empty one would mean the current directory)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("the cache directory must not be empty (it would mean the current directory)")
    return Path(text)


def preset_summary() -> str:
    """'name (E.. H.. I.. top-k), ...' of the shipped presets, or why they cannot be read."""
    try:
        presets = load_presets(PRESETS_FILE)
    except ValueError as exc:
        return f"(none readable: {exc})"
    return ", ".join(f"{key} (E{p.experts} H{p.hidden} I{p.intermediate} top-{p.top_k})" for key, p in presets.items())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The prebuild subcommand's options."""
    what = parser.add_argument_group("what to build")
    what.add_argument("--preset", action="append", type=parse_preset, default=[], metavar="NAME|PATH",
                      help="a preset of graphs/presets.json, or a JSON file of the same format (repeatable); "
                           f"presets: {preset_summary()}")
    what.add_argument("--shape", action="append", type=parse_shape, default=[], metavar="E,H,I,TOPK",
                      help="a custom layer shape: experts, hidden size, intermediate size, top-k (repeatable)")
    what.add_argument("--buckets", type=parse_buckets, default=DEFAULT_BUCKETS, metavar="LIST|max=N",
                      help="token buckets, powers of two up to 4096: e.g. 1,2,4,8, or max=N for every power of "
                           "two below N and N rounded up to one (max=100: 1, ..., 64, 128; default: 1, 2, 4, ..., 4096)")
    what.add_argument("--activation", type=parse_gpu_activation, default=parse_activation("swiglu"),
                      help=f"the layer's activation: {', '.join(ACTIVATION_NAMES)} (default: swiglu)")
    what.add_argument("--engine", choices=engine_names(OP_FUSED), default="auto",
                      help="GEMM engine (default: auto, the first that runs the layer on this GPU)")
    what.add_argument("--low-latency", action="append", choices=LOW_LATENCY_FORMATS, default=[], metavar="FORMAT",
                      help="instead of the fused op's token buckets, measure which engine runs the low-latency op "
                           "fastest (LowLatencyMoeConfig.tune) for each shape with weights of FORMAT (repeatable; "
                           f"{', '.join(LOW_LATENCY_FORMATS)}): finalized calls, the format's usual tokens, BF16 "
                           "output (FP16 for fp16), the --activation")
    what.add_argument("--low-latency-tokens", type=parse_low_latency_tokens, default=MAX_LOW_LATENCY_TOKENS,
                      metavar="N", help=f"with --low-latency: tune T = 1..N (the config's max_num_tokens, at most "
                                        f"{MAX_LOW_LATENCY_TOKENS}; default {MAX_LOW_LATENCY_TOKENS})")
    store = parser.add_argument_group("cache")
    store.add_argument("--cache-dir", type=parse_cache_dir, default=None, metavar="DIR",
                       help=f"cache directory (default: ${ENV_VAR}, else $XDG_CACHE_HOME/cudnn_moe or ~/.cache/cudnn_moe)")
    store.add_argument("--list", action="store_true", help="list the cached entries: key, size, time")
    store.add_argument("--verify", action="store_true", help="read every entry and check its header, checksum and key")
    store.add_argument("--clear", action="store_true",
                       help="remove every entry (before building, if shapes are given); only the cache's own files "
                            "are removed, and a directory that is not a cudnn_moe cache is refused")
    parser.add_argument("--quiet", action="store_true", help="no progress bar (the summary still prints)")


def _environment_summary(key: Any) -> str:
    env = key.environment
    sm = "-" if env.compute_capability is None else "sm{}{}".format(*env.compute_capability)
    return f"{env.gpu_name or '-'} {sm} cuDNN {env.cudnn_backend or '-'} frontend {env.cudnn_frontend or '-'} package {env.package_version}"


def list_entries(disk: DiskCache, out: TextIO) -> int:
    entries = disk.entries()
    for entry in entries:
        key = entry.key
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(entry.mtime)) if entry.mtime else "-"
        head = f"{entry.path.name[:12]}  {entry.file_size:>10}  {stamp}"
        if key is None:
            out.write(f"{head}  unreadable: {entry.problem or 'bad key'}\n")
            continue
        out.write(f"{head}  {key.kind}  {key.name}\n")
        out.write(f"    fields {json.dumps(key.field_dict(), sort_keys=True)}\n    for {_environment_summary(key)}\n")
    total = sum(e.file_size for e in entries)
    out.write(f"{len(entries)} entries, {total} bytes in {disk.root}\n")
    return 0


def verify_entries(disk: DiskCache, out: TextIO) -> int:
    checks = disk.verify()
    bad = [c for c in checks if not c.ok]
    for check in checks:
        out.write(f"{'ok ' if check.ok else 'BAD'}  {check.path.name}{'' if check.ok else '  ' + str(check.problem)}\n")
    out.write(f"{len(checks) - len(bad)} ok, {len(bad)} bad in {disk.root}\n")
    if bad:
        out.write("bad entries are rebuilt and replaced on their next use; --clear removes every entry\n")
    return 1 if bad else 0


def load_entry(key: Any, payload: bytes, device: int) -> str:
    """Load one entry the way serving would on CUDA device ``device``: 'ok', 'skipped (...)', or raises.

    cuDNN plans are deserialized on the GPU, kernel binaries loaded with cuModuleLoadData; entries made
    for another GPU or software stack (their environment differs from this one) are skipped.
    """
    if key.kind == KIND_CUDNN_PLAN:
        from .engines.cudnn.plan_cache import CUDNN_SERIALIZER, gemm_key_of, plan_environment

        if key.environment != plan_environment(device):
            return "skipped (made for another GPU or cuDNN)"
        CUDNN_SERIALIZER.deserialize(gemm_key_of(key, device), payload)
        return "ok"
    if key.kind == KIND_TACTIC:
        from .low_latency.tactics import decode_choice

        decode_choice(payload)  # ValueError when it is not a tactic
        return "ok"
    if key.kind == KIND_KERNEL:
        import torch

        from .kernels import driver
        from .kernels.loader import _kernel_environment

        if key.environment != _kernel_environment(device):
            return "skipped (made for another GPU, compiler or driver)"
        with torch.cuda.device(device):
            driver.make_device_current(device)
            driver.module_unload(driver.module_load_data(payload))
        return "ok"
    return f"skipped (no loader for {key.kind} entries)"


def verify_loads(disk: DiskCache, out: TextIO) -> int:
    """With a GPU: load every valid entry as serving would (load_entry) and report; 1 if any failed."""
    import torch

    if not torch.cuda.is_available():
        out.write("no GPU: entries were checked, not loaded\n")
        return 0
    device = torch.cuda.current_device()
    failed = 0
    for check in disk.verify():
        if not check.ok:
            continue  # reported by the file check
        key = EntryKey.from_json(check.key_json)
        payload = disk.get(key)
        if payload is None:
            continue  # removed or replaced meanwhile
        try:
            verdict = load_entry(key, payload, device)
        except Exception as exc:  # noqa: BLE001 -- any failure to load is the finding
            verdict = f"FAILED to load: {type(exc).__name__}: {exc}"
            failed += 1
        out.write(f"load {check.path.name[:12]}  {key.kind}  {key.name}: {verdict}\n")
    return 1 if failed else 0


def summary_table(results: list[BuildResult], out: TextIO) -> None:
    """Per layer: buckets built / served from the cache / failed, seconds, and the persistent entries
    (cuDNN plans, kernel binaries) built and loaded from disk; then the total and each failure."""
    rows = [("layer", "buckets", "built", "loaded", "failed", "seconds", "entries_built", "entries_loaded")]
    layers: dict[LayerShape, list[BuildResult]] = {}
    for r in results:
        layers.setdefault(r.shape, []).append(r)

    def row(label: str, rs: list[BuildResult]) -> tuple[str, ...]:
        count = lambda s: str(sum(r.source == s for r in rs))  # noqa: E731
        return (label, str(len(rs)), count("built"), count("disk"), count("failed"), f"{sum(r.seconds for r in rs):.2f}",
                str(sum(r.entries_built for r in rs)), str(sum(r.entries_loaded for r in rs)))

    rows += [row(shape.describe(), rs) for shape, rs in layers.items()]
    rows.append(row("total", results))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        out.write("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip() + "\n")
    failures: dict[tuple[LayerShape, str], list[int]] = {}
    for r in results:
        if r.error:
            failures.setdefault((r.shape, r.error), []).append(r.bucket)
    for (shape, error), buckets in failures.items():
        out.write(f"failed: {shape.describe()} bucket{'s' if len(buckets) > 1 else ''} {', '.join(map(str, buckets))}: {error}\n")


def tune_table(results: list[TuneResult], out: TextIO) -> None:
    """Per (layer, format, T): the chosen engine and every candidate's median us; then each failure."""
    rows = [("layer", "format", "T", "engine", "times (us)")]
    for r in results:
        rows += [(r.shape.describe(), r.weight_format, str(t), tactic.engine,
                  ", ".join(f"{name} {us:.1f}" for name, us in tactic.times_us.items()))
                 for t, tactic in r.tactics.items()]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        out.write("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() + "\n")
    for r in results:
        if r.error:
            out.write(f"failed: {r.shape.describe()} {r.weight_format}: {r.error}\n")


def _gpu_problem(engine: str) -> str | None:
    """Why this machine cannot build with ``engine`` (no GPU, a GPU no engine serves, or a missing or old
    library the chosen engine needs), or None."""
    import torch

    if not torch.cuda.is_available():
        return NO_GPU
    from .arch import device_arch
    from .engines.base import NVFP4, Request
    from .engines.registry import choose

    try:
        chosen = choose(Request(OP_FUSED, device_arch(), NVFP4), engine)
    except ValueError as exc:
        return f"prebuild: {exc}"
    return chosen.environment_problem()


def _low_latency_gpu_problem() -> str | None:
    """Why this machine cannot tune low-latency layers (no GPU), or None; a format its GPU does not run fails
    that (shape, format) alone."""
    import torch

    return None if torch.cuda.is_available() else NO_GPU


def run_tuning(shapes: list[LayerShape], args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """--low-latency: tune_layer per (shape, format), then the table; 1 if any failed."""
    formats = list(dict.fromkeys(args.low_latency))
    progress = Progress(len(shapes) * len(formats), stream=err, enabled=not args.quiet)
    results: list[TuneResult] = []
    for shape in shapes:
        for fmt in formats:
            try:
                results.append(TuneResult(shape, fmt, tune_layer(shape, fmt, args.activation, args.low_latency_tokens)))
            except Exception as exc:  # reported per (shape, format); the table and exit code carry it
                results.append(TuneResult(shape, fmt, {}, f"{type(exc).__name__}: {exc}"))
            progress.advance(f"{shape.name} {fmt}")
    tune_table(results, out)
    return 1 if any(r.error for r in results) else 0


def run_prebuild(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """The prebuild subcommand; returns the exit code (0 ok, 1 failures or no GPU, 2 usage).

    out / err: where the report and the errors and progress go (default: sys.stdout / sys.stderr).
    """
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    shapes = list(dict.fromkeys([s for group in args.preset for s in group] + args.shape))
    manage = args.list or args.verify or args.clear
    if not shapes and not manage:
        err.write("cudnn-moe prebuild: error: nothing to do: give --preset or --shape to build, or --list/--verify/--clear\n")
        return 2
    if shapes:  # before anything touches the cache directory
        problem = _low_latency_gpu_problem() if args.low_latency else _gpu_problem(args.engine)
        if problem:
            err.write(f"cudnn-moe prebuild: error: {problem}\n")
            return 1
    try:
        root = cache_dir(args.cache_dir, create=bool(shapes))
    except (OSError, ValueError) as exc:
        err.write(f"cudnn-moe prebuild: error: --cache-dir: {exc}\n")
        return 2
    if not root.is_dir():  # only managing, and there is no cache yet
        out.write(f"no cache at {root}: 0 entries\n")
        return 0
    disk = DiskCache(root)
    status = 0
    if args.clear:
        try:
            out.write(f"removed {disk.clear()} files from {root}\n")
        except NotACacheError as exc:
            err.write(f"cudnn-moe prebuild: error: --clear: {exc}\n")
            return 1
    if args.list:
        status |= list_entries(disk, out)
    if args.verify:
        status |= verify_entries(disk, out)
        status |= verify_loads(disk, out)
    if not shapes:
        return status
    set_cache_dir(root)  # the engines' plans and kernels go through this directory
    os.environ[ENV_VAR] = str(root)  # and child processes see it too
    if args.low_latency:
        return status | run_tuning(shapes, args, out, err)
    progress = Progress(len(shapes) * len(args.buckets), stream=err, enabled=not args.quiet)
    results: list[BuildResult] = []
    for shape in shapes:
        try:
            results += build_layer(shape, args.buckets, disk, args.activation, args.engine, progress)
        except Exception as exc:  # the layer could not be prepared: every bucket fails with the reason
            reason = f"{type(exc).__name__}: {exc}"
            for bucket in args.buckets:
                results.append(BuildResult(shape, bucket, "failed", 0.0, reason))
                progress.advance(f"{shape.name} bucket {bucket} (failed)")
    summary_table(results, out)
    return 1 if status or any(r.source == "failed" for r in results) else 0
