"""Which engine runs a low-latency call (its tactic): the measured choice kept in the persistent cache, looked
up on the call path; the measuring itself is ``cudnn_moe.low_latency.tuning`` (``LowLatencyMoeConfig.tune``).

With ``engine="auto"`` a call runs on the engine stored for its layer and token count, when one is stored and
still supports the call, else on the registry's first engine that supports it (its fixed rule, the choice
before any tuning). An explicit engine name always wins. Every engine of the registry that supports a call is
a candidate: nothing here names one.

Key of a choice (an entry of the persistent cache, kind KIND_TACTIC): the environment (GPU name, compute
capability, package version: ``Environment`` without the cuDNN and compiler fields, so a new driver keeps
the choice; tune again, or ``prebuild --clear``, to drop it), TACTIC_SCHEMA, the architecture, the weight format, H, I and its padded size Ip, E,
gated, top_k, the token count, the dtypes of the token values and of the output, finalize, and the names of
the candidate engines: a new or removed engine, a new package version or another GPU misses instead of
reusing a choice made without it. The activation is not part of it (only its gatedness): in every engine it
costs little beside streaming the weights, so one choice serves all activations of a layer.
Payload: JSON ``{"engine": name, "times_us": {name: median us}, "iters": n}``. An entry the cache finds
corrupt is reported and removed by the cache (cudnn_moe.cache.store); a payload that is not such JSON, or
that names an engine which is not a candidate of its key, is reported once (CacheWarning) and ignored: the
fixed rule runs the call.

The call path (``select``) resolves each key once per process into an in-memory table (a dict: the stored
tactic, else the fixed rule; the first look at a key reads one small file, host-only: no GPU work, no
synchronization, so it is safe inside a CUDA-graph capture); later calls are a dict lookup. ``store`` (the
tuner) writes the cache and that table together. Choices another process stores later are seen by a new
process.
"""

from __future__ import annotations

import functools
import json
import threading
from typing import NamedTuple

import torch

from ..arch import Arch
from ..cache import KIND_TACTIC, EntryKey, Environment, active_cache, current_environment
from ..cache.store import report_once
from ..engines.base import OP_LOW_LATENCY, Engine, GemmShape, Request, WeightFormat
from ..engines.registry import AUTO, choose, supporting
from ..weights.low_latency import LowLatencyWeights, Mxfp4WeightOnlyWeights

# Bumped when the key fields, the payload or what an engine runs change meaning (2: SM90 tiles; 3: MXFP4's own tiles).
TACTIC_SCHEMA = 3


class TacticKey(NamedTuple):
    """What one tactic is chosen for: the call's ``request`` (``layer_request``), ``top_k`` slots a token, the
    weights' gatedness, the dtype of the token values it passes, and its CUDA device's index."""

    request: Request
    top_k: int
    gated: bool
    x_dtype: torch.dtype
    device: int | None


_table: dict[TacticKey, type[Engine]] = {}  # the engine of each key seen: its stored tactic, or the fixed rule
_lock = threading.Lock()


class TuningResult(NamedTuple):
    """The measured tactic of one token count: the fastest engine's name and each candidate's median time (us),
    in registry order."""

    engine: str
    times_us: dict[str, float]


def layer_request(
    weights: LowLatencyWeights, arch: Arch, tokens: int, token_dtype: torch.dtype | None, out_dtype: torch.dtype,
    finalize: bool,
) -> Request:
    """What a call of ``tokens`` tokens with these weights asks of the engines: GEMM1 K = H -> N = N1 (2I gated,
    else I), GEMM2 K = Ip -> N = H, over E experts; token_dtype: the 16-bit (or per-tensor FP8) tokens' dtype,
    None for tokens given as codes with scales (the NVFP4 pair, prequantized DeepSeek FP8); for MXFP4 weights
    (weight-only, or the pair's), why they have no exact shifted form (``Mxfp4WeightOnlyWeights.nvfp4_problem``);
    whether the weights are stored as SM90 tiles (``tiled``)."""
    shapes = (GemmShape(weights.hidden_size, weights.gemm1_rows, weights.num_experts),
              GemmShape(weights.padded_intermediate, weights.hidden_size, weights.num_experts))
    problem = weights.nvfp4_problem if isinstance(weights, Mxfp4WeightOnlyWeights) else None
    return Request(OP_LOW_LATENCY, arch, weights.format.value, shapes, weights.num_experts, token_dtype, out_dtype,
                   finalize, tokens, problem, weights.tiled)


def _dtype_name(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")


def entry_key(key: TacticKey, environment: Environment) -> EntryKey:
    """The persistent cache's key of the tactic of ``key``, valid in ``environment`` (the module docstring lists
    the fields)."""
    request = key.request
    gemm1, gemm2 = request.shapes
    name = (f"low-latency tactic {request.weight_format} E{request.num_experts} H{gemm1.k} Ip{gemm2.k} "
            f"{'gated' if key.gated else 'non-gated'} top-{key.top_k} T{request.tokens} {_dtype_name(key.x_dtype)} -> "
            f"{_dtype_name(request.out_dtype)} {'finalized' if request.finalize else 'raw'}")
    return EntryKey(KIND_TACTIC, name, {
        "schema": TACTIC_SCHEMA,
        "arch": list(request.arch),
        "format": request.weight_format,
        "hidden": gemm1.k,
        "intermediate": gemm1.n // 2 if key.gated else gemm1.n,
        "padded_intermediate": gemm2.k,
        "experts": request.num_experts,
        "gated": key.gated,
        "top_k": key.top_k,
        "tokens": request.tokens,
        "x_dtype": _dtype_name(key.x_dtype),
        "out_dtype": _dtype_name(request.out_dtype),
        "finalize": request.finalize,
        "engines": [e.name for e in supporting(request)],
    }, environment)


@functools.cache
def tactic_environment(device: int | None) -> Environment:
    """The environment a tactic measured on CUDA device ``device`` is valid in (GPU, compute capability, package)."""
    return current_environment(device, cudnn=False)


def encode_choice(result: TuningResult, iters: int) -> bytes:
    """The payload of a stored tactic."""
    return json.dumps({"engine": result.engine, "times_us": result.times_us, "iters": iters},
                      sort_keys=True).encode("ascii")


def decode_choice(payload: bytes) -> TuningResult:
    """Inverse of encode_choice; ValueError when ``payload`` is not one."""
    try:
        document = json.loads(payload.decode("ascii"))
        engine, times = document["engine"], document["times_us"]
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ValueError(f"not a tactic payload ({type(exc).__name__}: {exc})") from exc
    if not isinstance(engine, str) or not isinstance(times, dict) or not all(
            isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) for k, v in times.items()):
        raise ValueError("not a tactic payload (engine must be a name, times_us a map of names to numbers)")
    return TuningResult(engine, {k: float(v) for k, v in times.items()})


def _stored_engine(entry: EntryKey, request: Request) -> type[Engine] | None:
    """The candidate engine ``entry`` names in the persistent cache, or None (absent, unreadable, or stale:
    reported once)."""
    disk = active_cache(create=False)
    payload = disk.get(entry) if disk is not None else None
    if payload is None:
        return None
    try:
        name = decode_choice(payload).engine
    except ValueError as exc:
        report_once(str(disk.path_for(entry)), f"ignoring the tactic {entry.name}: {exc}; the fixed rule runs it")
        return None
    engine = next((e for e in supporting(request) if e.name == name), None)
    if engine is None:
        report_once(str(disk.path_for(entry)), f"ignoring the tactic {entry.name}: engine {name!r} does not run it "
                                               "(any more); the fixed rule runs it")
    return engine


def select(name: str, key: TacticKey) -> type[Engine]:
    """The engine that runs the low-latency call of ``key``: the engine called ``name`` unless it is "auto"; else
    the stored tactic if it still supports the call, else the registry's first engine that does. Raises
    ValueError (registry.choose) when none can."""
    if name != AUTO:
        return choose(key.request, name)
    engine = _table.get(key)
    if engine is None:
        with _lock:
            engine = _table.get(key)
            if engine is None:
                stored = _stored_engine(entry_key(key, tactic_environment(key.device)), key.request)
                engine = _table[key] = stored or choose(key.request)
    return engine


def store(key: TacticKey, result: TuningResult, iters: int) -> None:
    """Keep ``result`` (measured over ``iters`` replays) as the tactic of ``key``: in the persistent cache (when
    there is one; an unwritable directory is reported once by the cache) and in this process's table.
    ValueError when result.engine does not run the call."""
    candidates = supporting(key.request)
    engine = next((e for e in candidates if e.name == result.engine), None)
    if engine is None:
        raise ValueError(f"result.engine {result.engine!r} does not run this call; the engines that do: "
                         f"{', '.join(e.name for e in candidates) or 'none'}")
    disk = active_cache()
    if disk is not None:
        disk.put_or_report(entry_key(key, tactic_environment(key.device)), encode_choice(result, iters))
    with _lock:
        _table[key] = engine
