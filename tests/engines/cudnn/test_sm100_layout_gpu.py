"""The SM100 data path (128-row expert segments, 128x4-swizzled scales) run end to end on any GPU.

No SM100 GPU is available to this project, so this test swaps the GEMM engine for one that keeps
the SM100 contract on its inputs (row alignment 128, swizzled token and weight scales) and
unswizzles them before calling the linear-scale cuDNN GEMM. Everything else (sort with 128-row
padding, permute and activation writing 128x4 scales, finalize) is the code SM100 runs, checked
against the float64 reference.
"""

from __future__ import annotations

import pytest
import torch

from cudnn_moe import Nvfp4MoeConfig, Routing, SwiGLU, GELU
from dataclasses import replace

from cudnn_moe.arch import SM100
from cudnn_moe.engines.base import GemmOperands, TokenOperand, WeightLayout, WeightOperand
from cudnn_moe.engines.cudnn import CudnnGemmEngine
from cudnn_moe.pipeline.executor import MoeExecutor
from cudnn_moe.formats import swizzled_shape, unswizzle_128x4
from cudnn_moe.kernels import TokenLayout
from cudnn_moe.fused.reference import reference_for_prepared
from tests.support.moe_checks import check_close

pytestmark = pytest.mark.gpu


class SwizzledInputsEngine(CudnnGemmEngine):
    """The SM100 cuDNN engine's input contract (128-row segments, 128x4 token and weight scales),
    computed by unswizzling and calling the linear-scale cuDNN GEMM of this GPU."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.layout = CudnnGemmEngine.spec(SM100)

    def token_buffers(self, rows: int, k: int, num_experts: int) -> tuple[tuple[int, ...], torch.dtype, int]:
        padded_rows, padded_cols = swizzled_shape(rows, k // 16)
        return (rows, k // 2), torch.uint8, padded_rows * padded_cols

    def gemm(self, operands: GemmOperands) -> None:
        rows, n, cols = operands.rows, operands.shape.n, operands.shape.k // 16
        tokens = unswizzle_128x4(operands.tokens.scales.view(torch.uint8)[: swizzled_shape(rows, cols)[0] * swizzled_shape(rows, cols)[1]], rows, cols)
        weights = unswizzle_128x4(operands.weights.scales.view(torch.uint8), n, cols)
        super().gemm(replace(
            operands,
            tokens=TokenOperand(operands.tokens.data, tokens.contiguous().view(torch.float8_e4m3fn), TokenLayout.NVFP4_LINEAR),
            weights=WeightOperand(operands.weights.data, weights.contiguous().view(torch.float8_e4m3fn), operands.weights.alpha),
        ))


@pytest.mark.parametrize(
    "experts, top_k, tokens, activation, local",
    [(8, 2, 64, SwiGLU(), (0, 8)), (64, 8, 100, SwiGLU(), (0, 64)), (16, 4, 37, GELU(), (16, 64))],
)
def test_sm100_layout_pipeline_matches_reference(experts, top_k, tokens, activation, local):
    hidden, inter = 256, 256
    gen = torch.Generator().manual_seed(experts + tokens)
    rows1 = activation.gemm1_columns(inter)
    w1 = (torch.randn(experts, rows1, hidden, generator=gen) / hidden**0.5).to("cuda", torch.bfloat16)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) / inter**0.5).to("cuda", torch.bfloat16)
    x = torch.randn(tokens, hidden, generator=gen).to("cuda", torch.bfloat16)
    ids = torch.rand(tokens, local[1], generator=gen).argsort(1)[:, :top_k].to(torch.int32)
    routing = Routing.unpacked(ids.cuda(), (torch.rand(tokens, top_k, generator=gen) + 0.1).cuda())

    config = Nvfp4MoeConfig(arch="sm100", max_num_tokens=tokens)
    weights = config.prepare_weights(w1, w2, activation=activation)
    assert weights.spec.weight_layout is WeightLayout.SWIZZLED_128X4
    acts = config.prepare_activations(x)
    executor = MoeExecutor(weights, SwizzledInputsEngine(weights.device), top_k=top_k, activation=activation,
                           local_expert_start=local[0], max_num_tokens=tokens)
    out = torch.full((tokens, hidden), float("nan"), dtype=torch.bfloat16, device="cuda")
    executor.run(acts, routing, finalize=True, out=out, use_cuda_graph=False)
    offsets = executor.bucket(tokens).offsets.cpu()
    assert torch.all(offsets % 128 == 0), "SM100 segments must start on 128-row boundaries"

    ref = reference_for_prepared(acts, weights, routing, activation, local_expert_start=local[0])
    check_close(out, ref)
