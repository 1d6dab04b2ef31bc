"""Small random-init transformers MoE models (two layers) for the integration tests, and the helpers that put
NVFP4-representable weights into their experts."""

from __future__ import annotations

import torch

from tests.support.modelopt_export import export_experts

VOCAB, HIDDEN, MOE_INTER = 512, 512, 256


def configs() -> dict:
    """Qwen3-MoE, Mixtral and DeepSeek-V3 configs whose every layer is an MoE layer (H=512, I=256).

    DeepSeek-V3 routes without expert groups here (n_group=1): with 2 groups of which 1 is chosen, a
    perturbation of the second layer's input as small as NVFP4's moves all four experts of a token to the
    other group, and whole-model logits then measure routing flips, not the experts (on the H200 with
    n_group=2: weight-only rel. L2 0.35% for one seed, 12.6% for another; W+A cosine 0.963). Its routed
    outputs are scaled by 1.0, not DeepSeek-V3's 2.5: at 2.5 the experts outweigh the residual stream of this
    random two-layer model and the logits' NVFP4 W+A cosine is the experts' own NVFP4 noise, 0.972-0.977 on the
    H200 (weight-only rel. L2 0.35-0.39%, 7x Qwen3-MoE's), below the 0.98 bound written for one MoE block."""
    from transformers import DeepseekV3Config, MixtralConfig, Qwen3MoeConfig

    return {
        "qwen3_moe": Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=1024,
                                    moe_intermediate_size=MOE_INTER, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=128, num_experts=16, num_experts_per_tok=4,
                                    decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True),
        "mixtral": MixtralConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=MOE_INTER, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2),
        "deepseek_v3": DeepseekV3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=1024,
                                        moe_intermediate_size=MOE_INTER, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=4, n_routed_experts=16, num_experts_per_tok=4, n_group=1,
                                        topk_group=1, first_k_dense_replace=0, n_shared_experts=1,
                                        routed_scaling_factor=1.0, kv_lora_rank=64, q_lora_rank=None,
                                        qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64),
    }


def build(name: str, device: str, seed: int = 0) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(configs()[name]).to(device).eval()
    model.set_experts_implementation("eager")
    return model


def experts_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if hasattr(m, "gate_up_proj") and hasattr(m, "down_proj")]


@torch.no_grad()
def load_nvfp4_representable(model: torch.nn.Module, *, split_gate_up_globals: bool = False) -> dict:
    """Quantize every experts module to ModelOpt NVFP4 and load the dequantized values back, so eager and the
    library see the same weights; returns the ModelOpt state dict of all layers."""
    state = {}
    for name, module in experts_modules(model):
        layer_state, dequantized = export_experts(module.gate_up_proj.float(), module.down_proj.float(), name,
                                                  split_gate_up_globals=split_gate_up_globals)
        module.gate_up_proj.copy_(dequantized["gate_up"])
        module.down_proj.copy_(dequantized["down"])
        state.update(layer_state)
    return state
