"""Time one decode step (a one-token forward, no KV cache) of a two-layer transformers MoE model with the
experts implementations "eager", "grouped_mm" and "cudnn_moe" (the library, NVFP4 weight-only).

The model has Qwen3-30B-A3B's layer shapes (H=2048, I=768, 128 experts, top-8; 32 query and 4 KV heads) and a
small vocabulary, in BF16. Each implementation gets one warm-up call, then ONE forward captured in a CUDA graph
where it can be captured (eager's expert loop reads the routing on the host, so it is timed eagerly), median of
``--iters`` runs with CUDA events and an L2 flush before each. Needs transformers >= 5 (optional extra).
Usage: python benchmarks/bench_transformers.py [--iters 20] [--markdown PATH]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from common import Report, Timer, capture, gpu_missing, header_line

IMPLEMENTATIONS = ("eager", "grouped_mm", "cudnn_moe")


def build_model() -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(vocab_size=4096, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                            num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                            num_experts=128, num_experts_per_tok=8, decoder_sparse_step=1, mlp_only_layers=[],
                            norm_topk_prob=True)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).cuda().eval()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=20, help="timed runs per median (default 20)")
    parser.add_argument("--markdown", type=Path, default=None, help="also write the report here")
    args = parser.parse_args(argv)
    if gpu_missing("bench_transformers"):
        return 2
    import cudnn_moe.integrations.transformers  # noqa: F401 -- registers "cudnn_moe"

    model, timer, report = build_model(), Timer(args.iters), Report()
    ids = torch.randint(0, 4096, (1, 1), device="cuda")
    report.emit(header_line("one-token forward of a two-layer Qwen3-30B-A3B-shaped model, BF16"))
    report.emit()
    report.table(["experts implementation", "us per decode step", "timed"])
    with torch.no_grad():
        for name in IMPLEMENTATIONS:
            model.set_experts_implementation(name)

            def step() -> object:
                return model(ids, use_cache=False).logits

            if name == "eager":  # its expert loop reads the routing on the host: no capture
                step()
                us, how = timer.median_us(step), "eagerly (not capturable)"
            else:
                graph = capture(step)
                us, how = timer.median_us(graph.replay), "one CUDA graph"
            report.emit(f"| {name} | {us:.1f} | {how} |")
    report.write(args.markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
