"""The small fused NVFP4 layer of the serving tests (tests/pipeline/test_serving_gpu.py), also built by their child
processes (which must not import CuPy through it: only torch and cudnn_moe are imported here)."""

from __future__ import annotations

import torch

from cudnn_moe import Nvfp4MoeConfig


def layer(engine: str = "auto", tokens: int = 3, seed: int = 0):
    """(config, prepared weights, prepared activations, ids int32 [T, 2], routing weights fp32 [T, 2]) of a random
    8-expert layer (H = I = 256, top-2, SwiGLU) on the GPU, for ``engine``."""
    gen = torch.Generator().manual_seed(seed)
    e, h, i, k = 8, 256, 256, 2
    w1 = (torch.randn(e, 2 * i, h, generator=gen) / h**0.5).to("cuda", torch.bfloat16)
    w2 = (torch.randn(e, h, i, generator=gen) / i**0.5).to("cuda", torch.bfloat16)
    x = torch.randn(tokens, h, generator=gen).to("cuda", torch.bfloat16)
    ids = torch.rand(tokens, e, generator=gen).argsort(1)[:, :k].to("cuda", torch.int32)
    route = (torch.rand(tokens, k, generator=gen) + 0.1).cuda()
    config = Nvfp4MoeConfig(max_num_tokens=16, engine=engine)
    weights = config.prepare_weights(w1, w2)
    return config, weights, config.prepare_activations(x), ids, route
