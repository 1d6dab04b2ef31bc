"""Child process of tests/kernels/test_programmatic_launch_gpu.py: runs a few layers of every op family with the
launch mode its environment sets ($CUDNN_MOE_PDL) and saves the outputs. Usage: python -m tests.support.launch_modes PATH"""

from __future__ import annotations

import sys

import torch

from cudnn_moe import Routing, fused_moe
from cudnn_moe.engines.base import WeightFormat
from cudnn_moe.kernels.loader import programmatic_launch
from cudnn_moe.low_latency import LowLatencyMoeConfig, low_latency_moe
from tests.support.low_latency import make_inputs, make_layer, make_routing, nan_out, random_ids
from tests.support.serving import layer


def outputs() -> dict[str, torch.Tensor]:
    """Outputs (on the CPU) of fused_moe on both engines, eager and graph-replayed, at 1, 5 and 16 tokens, and of
    the low-latency op on CUDA cores (BF16 weights) and on the sm90 engine (NVFP4 weight-only), each written into
    an output poisoned with NaN."""
    results = {}
    for engine in ("sm90", "cudnn"):
        for tokens in (1, 5, 16):
            config, weights, acts, ids, route = layer(engine, tokens=tokens, seed=tokens)
            for graph in (False, True):
                out = torch.full((tokens, 256), float("nan"), dtype=torch.bfloat16, device="cuda")
                for _ in range(3 if graph else 1):  # with a graph: usual path, capture, replay
                    fused_moe(config, acts, Routing.unpacked(ids, route), weights, out=out, use_cuda_graph=graph)
                results[f"fused {engine} T={tokens} graph={graph}"] = out
    for fmt, engine in ((WeightFormat.BF16, "cuda_cores"), (WeightFormat.NVFP4_WEIGHT_ONLY, "auto")):
        _, weights = make_layer(fmt, gated=True)
        config = LowLatencyMoeConfig(8, engine=engine)
        for tokens in (1, 8):
            x = make_inputs(config, fmt, torch.bfloat16, tokens, weights.hidden_size)
            routing = make_routing(random_ids(tokens, 4, weights.num_experts, seed=tokens), "fp32")
            out = nan_out((tokens, weights.hidden_size), torch.bfloat16)
            low_latency_moe(config, x, weights, routing, out=out)
            results[f"low latency {fmt.value} {engine} T={tokens}"] = out
    torch.cuda.synchronize()
    return {name: t.cpu() for name, t in results.items()}


if __name__ == "__main__":
    torch.save({"programmatic": programmatic_launch(0), "outputs": outputs()}, sys.argv[1])
