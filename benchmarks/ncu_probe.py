"""Eager fused_moe calls of one preset for ncu (temporary probe, not part of the suite)."""
import sys
import torch
from common import load_models, random_weights, random_batch
from cudnn_moe import Nvfp4MoeConfig, Routing, SwiGLU, fused_moe

model, tokens = sys.argv[1], [int(t) for t in sys.argv[2:]]
m = load_models()[model]
gen = torch.Generator(device="cuda").manual_seed(0)
w1, w2 = random_weights(m, gen)
config = Nvfp4MoeConfig(max_num_tokens=max(tokens), engine="sm90")
weights = config.prepare_weights(w1, w2, activation=SwiGLU())
del w1, w2
for t in tokens:
    x, ids, rw = random_batch(m, t, gen)
    acts, routing = config.prepare_activations(x), Routing.unpacked(ids, rw)
    out = torch.empty(t, m.hidden, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        fused_moe(config, acts, routing, weights, out=out, use_cuda_graph=False)
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push(f"T{t}")
    fused_moe(config, acts, routing, weights, out=out, use_cuda_graph=False)
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_pop()
print("done")
