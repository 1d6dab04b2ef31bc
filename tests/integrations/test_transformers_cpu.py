"""The transformers integration on the CPU: "cudnn_moe" is in transformers' experts registry after importing the
integration (and only then), models accept it as their experts implementation, and what the library cannot run
is refused with an error naming the module, before anything is prepared."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
from tests.support.hf_models import build, experts_modules  # noqa: E402

from cudnn_moe.integrations import transformers as integration  # noqa: E402


def test_import_cudnn_moe_does_not_import_transformers() -> None:
    code = "import sys, cudnn_moe, cudnn_moe.checkpoints; sys.exit('transformers' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_registered_in_the_experts_registry() -> None:
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    assert ALL_EXPERTS_FUNCTIONS["cudnn_moe"] is integration.experts_forward
    model = build("qwen3_moe", "cpu")
    model.set_experts_implementation("cudnn_moe")
    assert model.config._experts_implementation == "cudnn_moe"
    with pytest.raises(ValueError, match="mode must be one of weight_only, nvfp4"):
        integration.register(mode="fp8")


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_a_cpu_model_is_refused_naming_its_experts_module(name: str) -> None:
    model = build(name, "cpu")
    model.set_experts_implementation("cudnn_moe")
    module_class = type(experts_modules(model)[0][1]).__name__
    with pytest.raises(ValueError, match=rf"{module_class}: cudnn_moe runs on a CUDA device"):
        model(torch.randint(0, 512, (1, 4)))


class _Experts(torch.nn.Module):
    """Stands in for a transformers experts module (the attributes use_experts_implementation sets)."""

    def __init__(self, hidden: int = 256, inter: int = 128, act: str = "silu", **flags: object) -> None:
        super().__init__()
        self.gate_up_proj = torch.nn.Parameter(torch.zeros(4, 2 * inter, hidden))
        self.down_proj = torch.nn.Parameter(torch.zeros(4, hidden, inter))
        self.config = type("Config", (), {"hidden_act": act})()
        self.has_bias, self.has_gate, self.is_transposed, self.is_concatenated = False, True, False, True
        for key, value in flags.items():
            setattr(self, key, value)


@pytest.mark.parametrize("module, match", [
    (_Experts(has_bias=True), "without biases"),
    (_Experts(has_gate=False), "has no gate"),
    (_Experts(is_transposed=True), "not transposed"),
    (_Experts(is_concatenated=False), "not interleaved"),
    (_Experts(act="relu"), "not hidden_act='relu'"),
    (_Experts(hidden=200), "hidden size 200 is not a multiple of 128"),
    (_Experts(inter=96), "intermediate size 96 is not a multiple of 128"),
    (_Experts(), "runs on a CUDA device"),
], ids=["bias", "no-gate", "transposed", "interleaved", "relu", "hidden", "intermediate", "cpu"])
def test_what_cannot_run_is_refused(module: torch.nn.Module, match: str) -> None:
    with pytest.raises(ValueError, match=rf"_Experts: .*{match}"):
        integration.check_module(module)
    assert not hasattr(module, "_cudnn_moe")
