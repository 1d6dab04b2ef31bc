"""The one place that chooses a GEMM engine, and the engine instances per device."""

from __future__ import annotations

import threading
from collections.abc import Iterable

import torch

from ..arch import Arch, arch_name
from .base import EngineSpec, GemmEngine, GemmShape
from .cudnn.engine import CudnnGemmEngine
from .sm90.engine import Sm90GemmEngine

ENGINES: tuple[type[GemmEngine], ...] = (Sm90GemmEngine, CudnnGemmEngine)  # "auto" takes the first that fits
ENGINE_NAMES: tuple[str, ...] = ("auto", *(engine.name for engine in ENGINES))

_instances: dict[tuple[str, int], GemmEngine] = {}
_lock = threading.Lock()


def engine_class(name: str) -> type[GemmEngine]:
    """The engine called ``name`` ('sm90' or 'cudnn')."""
    for engine in ENGINES:
        if engine.name == name:
            return engine
    raise ValueError(f"unknown engine {name!r}; choose one of {', '.join(ENGINE_NAMES)}")


def supported_archs() -> frozenset[Arch]:
    """Every architecture some engine runs on."""
    return frozenset().union(*(engine.archs for engine in ENGINES))


def choose_engine(arch: Arch, name: str = "auto", shapes: Iterable[GemmShape] = ()) -> type[GemmEngine]:
    """The engine for ``arch`` that runs every GEMM of ``shapes``: ``name``, or with 'auto' the first
    of ENGINES that can (the SM90 kernels before the cuDNN graphs). Raises ValueError saying why none fits."""
    shapes = tuple(shapes)
    candidates = ENGINES if name == "auto" else (engine_class(name),)
    reasons = []
    for engine in candidates:
        for shape in shapes or (None,):
            answer = engine.supports(arch, shape)
            if not answer:
                reasons.append(answer.reason)
                break
        else:
            return engine
    raise ValueError(f"no GEMM engine runs this layer on {arch_name(arch)}: " + "; ".join(reasons))


def engine_for(spec: EngineSpec, device: torch.device) -> GemmEngine:
    """The (shared) instance of ``spec``'s engine on ``device``."""
    key = (spec.engine, device.index if device.index is not None else torch.cuda.current_device())
    engine = _instances.get(key)
    if engine is None:
        with _lock:
            engine = _instances.get(key)
            if engine is None:
                engine = _instances[key] = engine_class(spec.engine)(torch.device("cuda", key[1]))
    if engine.layout != spec:
        raise ValueError(f"weights prepared for the {spec.describe()} cannot run on the {engine.layout.describe()}; "
                         "prepare them with a config for this GPU")
    return engine
