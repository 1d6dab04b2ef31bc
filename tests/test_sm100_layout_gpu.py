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
from cudnn_moe.executor import MoeExecutor
from cudnn_moe.formats import ScaleLayout, swizzled_shape, unswizzle_128x4
from cudnn_moe.reference import reference_for_prepared
from moe_checks import check_close

pytestmark = pytest.mark.gpu


class SwizzledInputsEngine:
    """GemmEngine with the SM100 input contract, computing through the linear cuDNN graph."""

    name = "sm100-layout-check"
    row_alignment = 128
    scale_layout = ScaleLayout.SWIZZLED_128X4

    def __init__(self, device: torch.device) -> None:
        from cudnn_moe.engines import CudnnGemmEngine

        self.inner = CudnnGemmEngine(device)

    def workspace_bytes(self, rows: int, k: int, n: int, num_experts: int) -> int:
        return self.inner.workspace_bytes(rows, k, n, num_experts)

    def token_scale_bytes(self, rows: int, k: int, num_experts: int) -> int:
        padded_rows, padded_cols = swizzled_shape(rows, k // 16)
        return padded_rows * padded_cols

    def gemm(self, rows, k, n, num_experts, token_packed, token_scales, weight_packed, weight_scales,
             offsets, out, workspace) -> None:
        cols = k // 16
        tokens_linear = unswizzle_128x4(token_scales.view(torch.uint8)[: rows * cols], rows, cols)
        weights_linear = unswizzle_128x4(weight_scales.view(torch.uint8), n, cols)
        self.inner.gemm(rows, k, n, num_experts, token_packed, tokens_linear.view(torch.float8_e4m3fn),
                        weight_packed, weights_linear.view(torch.float8_e4m3fn), offsets, out, workspace)


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
    assert weights.scale_layout is ScaleLayout.SWIZZLED_128X4
    acts = config.prepare_activations(x)
    executor = MoeExecutor(weights, SwizzledInputsEngine(weights.device), top_k=top_k, activation=activation,
                           local_expert_start=local[0], max_num_tokens=tokens)
    out = torch.full((tokens, hidden), float("nan"), dtype=torch.bfloat16, device="cuda")
    executor.run(acts, routing, finalize=True, out=out, use_cuda_graph=False)
    offsets = executor.bucket(tokens).offsets.cpu()
    assert torch.all(offsets % 128 == 0), "SM100 segments must start on 128-row boundaries"

    ref = reference_for_prepared(acts, weights, routing, activation, local_expert_start=local[0])
    check_close(out, ref)
