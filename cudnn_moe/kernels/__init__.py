"""The CUDA glue kernels of the pipeline, one module per stage, in data-path order:

stage (caller's tokens and routing -> bucket buffers; aligned_stage for the aligned-plan op), sort (slots -> expert segments), permute
(tokens -> expert-sorted rows in the engine's token layout; for an engine that gathers them, natural BF16 rows decoded
in the sort's launch), [GEMM1: the engine], activate
(activation + NVFP4 requantize), [GEMM2: the engine], finalize (weighted sum or per-slot rows).
Sources live in kernels_cuda/ and compile with CuPy (NVRTC) on first use (loader); constants shared
with CUDA are in codes.
"""

from .activate import activate_quantize
from .aligned_stage import plan_routes, stage_aligned
from .codes import (
    ROW_THREADS,
    SORT_MAX_EXPERTS,
    SORT_THREADS,
    SORT_WARP_SLOTS,
    IntermediateCode,
    RoutingFormat,
    TokenLayout,
    cuda_defines,
)
from .finalize import SOURCE as _FINALIZE_SOURCE
from .finalize import finalize, unfinalized_rows
from .loader import compile_options, kernel_function, kernels_dir, launch, load_module, module_source, ptr
from .permute import SOURCE as _PERMUTE_SOURCE
from .permute import permute_bf16_tokens, permute_tokens
from .sort import SORT_PERMUTE_MAX_SLOTS, SortBuffers, sort_permute_bf16, sort_routing, stage_sort_permute_bf16
from .stage import SOURCE as _STAGE_SOURCE
from .stage import stage_inputs


def load_call_kernels(device: int) -> None:
    """Compile, or load from the persistent cache, the kernels every fused_moe call launches around the
    bucket pipeline (stage, finalize, and the stage folded into the decode chain's sort + permute), so that warming
    up a layer leaves nothing to build on its first call (with and without L2 warming)."""
    for source in (_STAGE_SOURCE, _FINALIZE_SOURCE):
        load_module(source, device)
    for tokens in ("", "_tokens", "_mxfp8"):
        for form in ("", "_warp"):
            for warm in ("", "_warm"):
                kernel_function(_PERMUTE_SOURCE, f"moe_stage_sort_permute_bf16{tokens}{form}{warm}", device)


ROUTING_PACKED = RoutingFormat.PACKED
ROUTING_FP32 = RoutingFormat.FP32
ROUTING_BF16 = RoutingFormat.BF16

__all__ = [
    "ROUTING_BF16",
    "ROUTING_FP32",
    "ROUTING_PACKED",
    "ROW_THREADS",
    "SORT_MAX_EXPERTS",
    "SORT_PERMUTE_MAX_SLOTS",
    "SORT_THREADS",
    "SORT_WARP_SLOTS",
    "SortBuffers",
    "RoutingFormat",
    "IntermediateCode",
    "TokenLayout",
    "activate_quantize",
    "compile_options",
    "cuda_defines",
    "finalize",
    "kernels_dir",
    "launch",
    "load_call_kernels",
    "load_module",
    "module_source",
    "permute_bf16_tokens",
    "permute_tokens",
    "plan_routes",
    "ptr",
    "sort_permute_bf16",
    "sort_routing",
    "stage_aligned",
    "stage_inputs",
    "stage_sort_permute_bf16",
    "unfinalized_rows",
]
