"""The fused NVFP4 MoE op (contract 000): its configuration and weight preparation (``config``), argument
checks (``checks``), the GPU op on the shared pipeline (``op``), the torch custom op and module
(``torch_op``) and the float64 reference with the rounding contract every engine follows (``reference``)."""

from .checks import unfinalized_row_count
from .config import MAX_NUM_TOKENS, SIZE_MULTIPLE, Nvfp4MoeConfig
from .op import clear_checked_signatures, fused_moe, get_executor
from .reference import reference_moe
from .torch_op import MoeLayer

__all__ = [
    "MAX_NUM_TOKENS",
    "SIZE_MULTIPLE",
    "MoeLayer",
    "Nvfp4MoeConfig",
    "clear_checked_signatures",
    "fused_moe",
    "get_executor",
    "reference_moe",
    "unfinalized_row_count",
]
