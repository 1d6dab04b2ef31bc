"""fused_moe as a torch custom op: torch.compile holds it without a graph break, and a caller's CUDA-graph
capture of a compiled model replays it; results equal the eager op bitwise and the float64 reference."""

from __future__ import annotations

import pytest
import torch

from cudnn_moe import MoeLayer, Nvfp4MoeConfig, Routing, SwiGLU, fused_moe
from cudnn_moe.fused.reference import reference_for_prepared
from tests.support.moe_checks import check_close

pytestmark = pytest.mark.gpu


class Block(torch.nn.Module):
    """A residual block around the MoE layer, as a model would hold it."""

    def __init__(self, moe: MoeLayer) -> None:
        super().__init__()
        self.moe = moe

    def forward(self, residual, act_packed, act_scales, ids, route_weights):
        return residual + 0.5 * self.moe(act_packed, act_scales, ids, route_weights)


def _layer(seed: int = 0, tokens: int = 24):
    gen = torch.Generator().manual_seed(seed)
    experts, hidden, inter, top_k = 8, 256, 256, 2
    w1 = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to("cuda", torch.bfloat16)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) / inter**0.5).to("cuda", torch.bfloat16)
    x = torch.randn(tokens, hidden, generator=gen).to("cuda", torch.bfloat16)
    ids = torch.rand(tokens, experts, generator=gen).argsort(1)[:, :top_k].to("cuda", torch.int32)
    route_weights = (torch.rand(tokens, top_k, generator=gen) + 0.1).cuda()
    config = Nvfp4MoeConfig(max_num_tokens=64)
    weights = config.prepare_weights(w1, w2)
    return config, weights, config.prepare_activations(x), ids, route_weights, x


def test_compiled_module_matches_eager_and_reference():
    config, weights, acts, ids, route_weights, x = _layer()
    block = Block(MoeLayer(config, weights))
    eager = fused_moe(config, acts, Routing.unpacked(ids, route_weights), weights)
    compiled = torch.compile(block, fullgraph=True)
    got = compiled(x, acts.packed, acts.scales, ids, route_weights)
    torch.cuda.synchronize()
    assert torch.equal(got, x + 0.5 * eager)
    check_close(block.moe(acts.packed, acts.scales, ids, route_weights),
                reference_for_prepared(acts, weights, Routing.unpacked(ids, route_weights), SwiGLU()))


def test_cuda_graph_capture_of_compiled_model():
    config, weights, acts, ids, route_weights, x = _layer(seed=1)
    moe = MoeLayer(config, weights)
    moe.warmup(top_k=ids.shape[1])
    compiled = torch.compile(Block(moe), fullgraph=True)
    want = compiled(x, acts.packed, acts.scales, ids, route_weights)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = compiled(x, acts.packed, acts.scales, ids, route_weights)
    got.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got, want)


def test_packed_routing_through_the_op():
    from cudnn_moe import pack_routing

    config, weights, acts, ids, route_weights, x = _layer(seed=2)
    packed = pack_routing(ids, route_weights)
    moe = MoeLayer(config, weights)
    got = moe(acts.packed, acts.scales, packed)
    want = fused_moe(config, acts, Routing.packed(packed), weights)
    assert torch.equal(got, want)
