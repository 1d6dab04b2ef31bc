"""The kinds of tokens the shared pipeline takes (cudnn_moe.pipeline.executor), and the tensors each passes to the
stage, sort and permute kernels."""

from __future__ import annotations

import enum

import torch

from ..weights.low_latency import Mxfp8Activations
from ..weights.nvfp4 import Nvfp4Activations

Tokens = Nvfp4Activations | Mxfp8Activations | torch.Tensor


class TokenCode(enum.Enum):
    """What an executor's tokens are.

    NVFP4: an Nvfp4Activations pack, packed E2M1 codes uint8 [T, H/2] with E4M3 scales [T, H/16] (the fused and
    aligned ops, the NVFP4 pair); an engine reading BF16 token rows gets them decoded exactly.
    BF16: bfloat16 [T, H], taken as they are (the low-latency weight-only and BF16 layers).
    MXFP8: an Mxfp8Activations pack, E4M3 codes float8_e4m3fn [T, H] with E8M0 scales [T, H/32] (the MXFP4 pair),
    decoded into BF16 rows of their values (exact for block scales 2^-117 .. 2^119:
    cudnn_moe.kernels.codes.IntermediateCode.MXFP8 states the rule) by the sort + permute; no other launch reads
    them.
    """

    NVFP4 = "nvfp4"
    BF16 = "bf16"
    MXFP8 = "mxfp8"


def token_code(tokens: Tokens) -> TokenCode:
    """The kind of ``tokens``."""
    if isinstance(tokens, Nvfp4Activations):
        return TokenCode.NVFP4
    return TokenCode.MXFP8 if isinstance(tokens, Mxfp8Activations) else TokenCode.BF16


def token_operands(tokens: Tokens) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(codes uint8 [T, H/2], E4M3 scales [T, H/16]) of NVFP4 tokens, (codes float8_e4m3fn [T, H], E8M0 scales
    [T, H/32]) of MXFP8 tokens, or (bfloat16 [T, H], None) of BF16 tokens."""
    if isinstance(tokens, Nvfp4Activations):
        return tokens.packed, tokens.scales
    if isinstance(tokens, Mxfp8Activations):
        return tokens.codes, tokens.scales
    return tokens, None
