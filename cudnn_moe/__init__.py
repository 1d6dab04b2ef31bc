"""cudnn-moe: fused NVFP4 Mixture-of-Experts inference on NVIDIA GPUs (our SM90 kernels or cuDNN graphs).

Importing the package needs only torch and numpy; CuPy and the cuDNN frontend are loaded on
the first GPU call.
"""

from .activations import GELU, SiLU, SiTU, ReLU, ReLU2, GeGLU, GeGLUTanh, Identity, SwiGLU, SwiGLUStep
from .aligned import AlignedWeights, align_routing, aligned_moe, prepare_aligned_weights, reference_aligned_moe
from .config import Nvfp4Activations, Nvfp4MoeConfig, Nvfp4Weights
from .distributed import ExpertParallelMoe, expert_shard, shard_weights
from .executor import UnfinalizedOutput
from .low_latency import LowLatencyMoeConfig, low_latency_moe, reference_low_latency
from .ops import fused_moe, get_executor, unfinalized_row_count
from .reference import reference_moe
from .routing import Routing, pack_routing, unpack_routing
from .torch_op import MoeLayer

__version__ = "0.1.0"

__all__ = [
    "AlignedWeights",
    "ExpertParallelMoe",
    "GELU",
    "GeGLU",
    "GeGLUTanh",
    "Identity",
    "LowLatencyMoeConfig",
    "MoeLayer",
    "Nvfp4Activations",
    "Nvfp4MoeConfig",
    "Nvfp4Weights",
    "ReLU",
    "ReLU2",
    "Routing",
    "SiLU",
    "SiTU",
    "SwiGLU",
    "SwiGLUStep",
    "UnfinalizedOutput",
    "align_routing",
    "aligned_moe",
    "expert_shard",
    "fused_moe",
    "get_executor",
    "low_latency_moe",
    "pack_routing",
    "prepare_aligned_weights",
    "reference_aligned_moe",
    "reference_low_latency",
    "reference_moe",
    "shard_weights",
    "unfinalized_row_count",
    "unpack_routing",
]
