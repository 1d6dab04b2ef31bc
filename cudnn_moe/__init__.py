"""cudnn-moe: fused NVFP4 Mixture-of-Experts inference on NVIDIA GPUs (our SM90 kernels or cuDNN graphs).

Importing the package needs only torch and numpy; CuPy loads only to compile a kernel the persistent
cache lacks, and the cuDNN frontend on the first call that runs the cuDNN engine.

Three ops, each a package (``fused``, ``aligned``, ``low_latency``), on one pipeline (``pipeline``) and one
registry of engines (``engines``); see the README's architecture section.
"""

from .activations import GELU, GeGLU, GeGLUTanh, Identity, ReLU, ReLU2, SiLU, SiTU, SwiGLU, SwiGLUStep
from .aligned import AlignedWeights, align_routing, aligned_moe, prepare_aligned_weights, reference_aligned_moe
from .distributed import ExpertParallelMoe, expert_shard, shard_weights
from .fused import MoeLayer, Nvfp4MoeConfig, fused_moe, get_executor, reference_moe, unfinalized_row_count
from .low_latency import LowLatencyMoeConfig, low_latency_moe, reference_low_latency
from .pipeline.executor import UnfinalizedOutput
from .pipeline.lifetime import release_deferred
from .routing import Routing, pack_routing, unpack_routing
from .version import __version__
from .weights.nvfp4 import Nvfp4Activations, Nvfp4Weights

__all__ = [
    "__version__",
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
    "release_deferred",
    "shard_weights",
    "unfinalized_row_count",
    "unpack_routing",
]
