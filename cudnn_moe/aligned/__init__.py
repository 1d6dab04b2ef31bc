"""The aligned-plan NVFP4 MoE op of contract 002 (vLLM / SGLang routing plans), CPU groundwork:
the plan builder, the op's argument checks and its float64 reference."""

from .checks import AlignedDims, check_aligned_args
from .plan import align_routing, plan_capacity
from .reference import reference_aligned_moe

__all__ = ["AlignedDims", "align_routing", "check_aligned_args", "plan_capacity", "reference_aligned_moe"]
