"""The kinds of tokens the shared pipeline takes (cudnn_moe.pipeline.executor), and the tensors each passes to the
stage, sort and permute kernels."""

from __future__ import annotations

import enum

import torch

from ..weights.nvfp4 import Nvfp4Activations

Tokens = Nvfp4Activations | torch.Tensor


class TokenCode(enum.Enum):
    """What an executor's tokens are.

    NVFP4: an Nvfp4Activations pack, packed E2M1 codes uint8 [T, H/2] with E4M3 scales [T, H/16] (the fused and
    aligned ops, the NVFP4 pair); an engine reading BF16 token rows gets them decoded exactly.
    BF16: bfloat16 [T, H], taken as they are (the low-latency weight-only and BF16 layers).
    """

    NVFP4 = "nvfp4"
    BF16 = "bf16"


def token_code(tokens: Tokens) -> TokenCode:
    """The kind of ``tokens``."""
    return TokenCode.NVFP4 if isinstance(tokens, Nvfp4Activations) else TokenCode.BF16


def token_operands(tokens: Tokens) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(codes uint8 [T, H/2], E4M3 scales [T, H/16]) of NVFP4 tokens, or (bfloat16 [T, H], None) of BF16 tokens."""
    if isinstance(tokens, Nvfp4Activations):
        return tokens.packed, tokens.scales
    return tokens, None
