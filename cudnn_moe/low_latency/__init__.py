"""Low-latency MoE (1-8 tokens per call, contract 004): config, weight formats, float64 references and
the GPU call.

Preparation keeps the caller's payloads bit-exact (``config``, ``weights``); the references state every
rounding point (``reference``); ``low_latency_moe`` runs the layer on the GPU with the same rounding
points (``call``: checks and launches; ``kernels``: launch wrappers of kernels_cuda/low_latency/ll_moe.cu;
``workspace``: scratch buffers cached per weights).
"""

from .call import low_latency_moe
from .config import MAX_NUM_TOKENS, MAX_TOP_K, LowLatencyMoeConfig
from .reference import (
    RawReference,
    combine_ordered_fp32,
    reference_bf16,
    reference_fp16,
    reference_low_latency,
    reference_mxfp4_weight_only,
    reference_mxint4_weight_only,
    reference_nvfp4_pair,
    reference_nvfp4_weight_only,
)
from .weights import (
    BlockScaledWeights,
    DenseWeights,
    LowLatencyWeights,
    Mxfp4WeightOnlyWeights,
    Mxint4WeightOnlyWeights,
    Nvfp4PairWeights,
    Nvfp4WeightOnlyWeights,
    WeightFormat,
)

__all__ = [
    "MAX_NUM_TOKENS",
    "MAX_TOP_K",
    "BlockScaledWeights",
    "DenseWeights",
    "LowLatencyMoeConfig",
    "LowLatencyWeights",
    "Mxfp4WeightOnlyWeights",
    "Mxint4WeightOnlyWeights",
    "Nvfp4PairWeights",
    "Nvfp4WeightOnlyWeights",
    "RawReference",
    "WeightFormat",
    "combine_ordered_fp32",
    "low_latency_moe",
    "reference_bf16",
    "reference_fp16",
    "reference_low_latency",
    "reference_mxfp4_weight_only",
    "reference_mxint4_weight_only",
    "reference_nvfp4_pair",
    "reference_nvfp4_weight_only",
]
