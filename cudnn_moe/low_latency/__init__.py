"""The low-latency MoE op (1-8 tokens per call, contract 004): configuration and preparation (``config``;
the formats' records are cudnn_moe.weights.low_latency), argument checks (``checks``), the fallback for calls
above max_num_tokens (``fallback``), the GPU op (``op``: an engine of the registry runs it, the CUDA-core
engine or, through ``grouped``, a grouped-GEMM engine on the shared pipeline), which engine (``tactics``: the
choice ``LowLatencyMoeConfig.tune`` measures, ``tuning``, kept in the persistent cache) and the float64
references stating every rounding point (``reference``). Preparation keeps the caller's payloads bit-exact.
"""

from ..weights.low_latency import (
    BlockScaledWeights,
    DeepSeekFp8Activations,
    DeepSeekFp8Weights,
    DenseWeights,
    Fp8PerTensorActivations,
    Fp8PerTensorWeights,
    Fp8WeightOnlyWeights,
    LowLatencyWeights,
    Mxfp4PairWeights,
    Mxfp4WeightOnlyWeights,
    Mxfp8Activations,
    Mxfp8PairWeights,
    Mxint4WeightOnlyWeights,
    Nvfp4PairWeights,
    Nvfp4WeightOnlyWeights,
    WeightFormat,
)
from .config import MAX_NUM_TOKENS, MAX_TOP_K, LowLatencyMoeConfig
from .fallback import LowLatencyFallback
from .op import RawOutput, low_latency_moe
from .tactics import TuningResult
from .reference import (
    DeepSeekFp8Intermediate,
    MxPairIntermediate,
    RawReference,
    combine_ordered_fp32,
    deepseek_fp8_intermediate,
    mx_pair_intermediate,
    reference_bf16,
    reference_deepseek_fp8,
    fp8_per_tensor_intermediate,
    reference_fp8_per_tensor,
    reference_fp8_weight_only,
    reference_fp16,
    reference_low_latency,
    reference_mxfp4_weight_only,
    reference_mx_pair,
    reference_mxint4_weight_only,
    reference_nvfp4_pair,
    reference_nvfp4_weight_only,
)

__all__ = [
    "MAX_NUM_TOKENS",
    "MAX_TOP_K",
    "BlockScaledWeights",
    "DeepSeekFp8Activations",
    "DeepSeekFp8Intermediate",
    "DeepSeekFp8Weights",
    "DenseWeights",
    "Fp8PerTensorActivations",
    "Fp8PerTensorWeights",
    "Fp8WeightOnlyWeights",
    "LowLatencyFallback",
    "LowLatencyMoeConfig",
    "LowLatencyWeights",
    "Mxfp4PairWeights",
    "Mxfp4WeightOnlyWeights",
    "Mxfp8Activations",
    "Mxfp8PairWeights",
    "MxPairIntermediate",
    "Mxint4WeightOnlyWeights",
    "Nvfp4PairWeights",
    "Nvfp4WeightOnlyWeights",
    "RawOutput",
    "RawReference",
    "TuningResult",
    "WeightFormat",
    "combine_ordered_fp32",
    "deepseek_fp8_intermediate",
    "low_latency_moe",
    "mx_pair_intermediate",
    "reference_bf16",
    "reference_deepseek_fp8",
    "fp8_per_tensor_intermediate",
    "reference_fp8_per_tensor",
    "reference_fp8_weight_only",
    "reference_fp16",
    "reference_low_latency",
    "reference_mxfp4_weight_only",
    "reference_mx_pair",
    "reference_mxint4_weight_only",
    "reference_nvfp4_pair",
    "reference_nvfp4_weight_only",
]
