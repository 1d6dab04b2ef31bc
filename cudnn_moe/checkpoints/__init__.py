"""Readers of quantized checkpoints: ``modelopt`` (ModelOpt NVFP4 experts, bit-exact, for every op)."""

from .modelopt import ModelOptExperts, load_modelopt_experts, read_quant_config

__all__ = ["ModelOptExperts", "load_modelopt_experts", "read_quant_config"]
