"""Grouped-GEMM engines behind one seam (base), the one place that picks one (select), and the
engines themselves: sm90 (our NVFP4 kernels for Hopper) and cudnn (cuDNN frontend graphs)."""

from .base import (
    EngineSpec,
    GemmEngine,
    GemmOperands,
    GemmShape,
    Support,
    TokenOperand,
    WeightLayout,
    WeightOperand,
)
from .select import ENGINE_NAMES, ENGINES, choose_engine, engine_class, engine_for, supported_archs

__all__ = [
    "ENGINES",
    "ENGINE_NAMES",
    "EngineSpec",
    "GemmEngine",
    "GemmOperands",
    "GemmShape",
    "Support",
    "TokenOperand",
    "WeightLayout",
    "WeightOperand",
    "choose_engine",
    "engine_class",
    "engine_for",
    "supported_archs",
]
