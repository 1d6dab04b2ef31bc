"""The aligned-plan NVFP4 MoE op of contract 002 (vLLM / SGLang routing plans): the plan builder,
the op's argument checks, its weight preparation, the GPU op (also the torch custom op
``torch.ops.cudnn_moe.aligned_moe_``) and its float64 reference."""

from .checks import AlignedDims, check_aligned_args
from .op import aligned_moe, clear_aligned_caches
from .plan import align_routing, plan_capacity
from .reference import reference_aligned_moe
from .torch_op import aligned_weights_handle
from .weights import AlignedWeights, prepare_aligned_weights

__all__ = [
    "AlignedDims",
    "AlignedWeights",
    "align_routing",
    "aligned_moe",
    "aligned_weights_handle",
    "check_aligned_args",
    "clear_aligned_caches",
    "plan_capacity",
    "prepare_aligned_weights",
    "reference_aligned_moe",
]
