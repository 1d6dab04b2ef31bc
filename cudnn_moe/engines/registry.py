"""The one registry of engines and the one choice of what runs a request.

``ENGINES`` lists every engine in order of preference; an op asks ``choose(request)`` (or names an engine)
and gets the first engine whose ``supports`` says yes, or a ValueError giving every engine's reason. What
runs where (architectures, weight formats, token limits) is declared by the engines themselves, so adding
an engine is one module and one line here.
"""

from __future__ import annotations

import threading

import torch

from ..arch import Arch, arch_name
from .base import NVFP4, Engine, EngineSpec, GemmEngine, Request
from .cuda_cores.engine import CudaCoresEngine
from .cudnn.engine import CudnnGemmEngine
from .ll_mma.engine import LlMmaEngine
from .sm90.engine import Sm90GemmEngine

# "auto": the first that fits. ll_mma (tensor cores, FP8 low-latency formats) after cuda_cores: a candidate to
# name or tune, not the untuned default.
ENGINES: tuple[type[Engine], ...] = (Sm90GemmEngine, CudnnGemmEngine, CudaCoresEngine, LlMmaEngine)
AUTO = "auto"

_instances: dict[tuple[str, int], GemmEngine] = {}
_lock = threading.Lock()


def engine_names(op: str) -> tuple[str, ...]:
    """The choices of an ``engine=`` argument: "auto" and the names of the engines that serve ``op`` (the choices of an ``engine=`` argument)."""
    return (AUTO, *(e.name for e in ENGINES if any(s.op == op for s in e.services)))


def engine_class(name: str) -> type[Engine]:
    """The engine called ``name``."""
    for engine in ENGINES:
        if engine.name == name:
            return engine
    raise ValueError(f"unknown engine {name!r}; the engines are {', '.join(e.name for e in ENGINES)}")


def engine_class_of(spec: EngineSpec) -> type[GemmEngine]:
    """The grouped-GEMM engine a weight layout ``spec`` belongs to."""
    cls = engine_class(spec.engine)
    if not issubclass(cls, GemmEngine):
        raise ValueError(f"the {spec.engine} engine runs whole layers, not grouped GEMMs")
    return cls


def served_archs(op: str, weight_format: str = NVFP4) -> frozenset[Arch]:
    """Every architecture some engine runs ``op``'s ``weight_format`` weights on."""
    return frozenset().union(*(e.archs(op, weight_format) for e in ENGINES))


def supporting(request: Request) -> tuple[type[Engine], ...]:
    """Every engine of ENGINES that serves ``request.op`` and supports ``request``, in ENGINES order (the
    candidates a measured choice picks among; "auto" without one takes the first)."""
    return tuple(e for e in ENGINES if any(s.op == request.op for s in e.services) and e.supports(request))


def choose(request: Request, name: str = AUTO) -> type[Engine]:
    """The engine that runs ``request``: ``name``, or with "auto" the first of ENGINES that supports it.
    Raises ValueError saying why each candidate cannot."""
    if name != AUTO and name not in engine_names(request.op):
        raise ValueError(f"engine must be one of {', '.join(engine_names(request.op))} for {request.op}, got {name!r}")
    candidates = [e for e in ENGINES if name in (AUTO, e.name) and any(s.op == request.op for s in e.services)]
    reasons = []
    for engine in candidates:
        answer = engine.supports(request)
        if answer:
            return engine
        reasons.append(answer.reason)
    raise ValueError(f"no engine runs this {request.op} layer on {arch_name(request.arch)}: " + "; ".join(reasons))


def engine_for(spec: EngineSpec, device: torch.device) -> GemmEngine:
    """The (shared) instance of ``spec``'s grouped-GEMM engine on ``device``."""
    key = (spec.engine, device.index if device.index is not None else torch.cuda.current_device())
    engine = _instances.get(key)
    if engine is None:
        with _lock:
            engine = _instances.get(key)
            if engine is None:
                engine = _instances[key] = engine_class_of(spec)(torch.device("cuda", key[1]))
    if engine.layout != spec:
        raise ValueError(f"weights prepared for the {spec.describe()} cannot run on the {engine.layout.describe()}; "
                         "prepare them with a config for this GPU")
    return engine
