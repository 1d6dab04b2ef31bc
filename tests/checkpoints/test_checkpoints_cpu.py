"""ModelOpt NVFP4 checkpoints (cudnn_moe.checkpoints) on the CPU: a tiny checkpoint of the tests' own exporter,
written with safetensors, is read by name (per-expert and fused 3-D layouts), lazily, and mapped to every op's
weights bit for bit; the refusals name what is wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cudnn_moe import LowLatencyMoeConfig, Nvfp4MoeConfig
from cudnn_moe.checkpoints import load_modelopt_experts, read_quant_config
from tests.support.modelopt_export import export_experts

safetensors_torch = pytest.importorskip("safetensors.torch")
E, H, I = 4, 256, 128
PREFIX = "model.layers.0.mlp.experts"


def weights(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(E, 2 * I, H, generator=gen) * H**-0.5, torch.randn(E, H, I, generator=gen) * I**-0.5


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def write_checkpoint(folder: Path, state: dict, *, quant_algo: str = "NVFP4") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    names = sorted(state)
    half = len(names) // 2  # two shards, as real checkpoints come
    safetensors_torch.save_file({n: state[n].contiguous() for n in names[:half]}, str(folder / "model-1.safetensors"))
    safetensors_torch.save_file({n: state[n].contiguous() for n in names[half:]}, str(folder / "model-2.safetensors"))
    (folder / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": quant_algo, "group_size": 16}}))
    return folder


@pytest.mark.parametrize("fused", [False, True], ids=["per-expert", "fused-3d"])
def test_payloads_are_read_bit_exactly_from_safetensors(tmp_path: Path, fused: bool) -> None:
    state, _ = export_experts(*weights(), PREFIX, fused=fused)
    folder = write_checkpoint(tmp_path / "ckpt", state)
    assert read_quant_config(folder)["quant_algo"] == "NVFP4"
    experts = load_modelopt_experts(folder, PREFIX)
    assert (experts.num_experts, experts.hidden_size, experts.intermediate_size) == (E, H, I)
    for p in ("gate_proj", "up_proj", "down_proj"):
        if fused:
            continue
        want = torch.stack([state[f"{PREFIX}.{e}.{p}.weight"] for e in range(E)])
        assert torch.equal(experts.codes[p], want)
        want_scales = torch.stack([state[f"{PREFIX}.{e}.{p}.weight_scale"] for e in range(E)])
        assert torch.equal(bits(experts.scales[p]), bits(want_scales))
        assert torch.equal(experts.globals[p], torch.stack([state[f"{PREFIX}.{e}.{p}.weight_scale_2"] for e in range(E)]))
    per_expert = load_modelopt_experts(export_experts(*weights(), PREFIX)[0], PREFIX)
    for p in ("gate_proj", "up_proj", "down_proj"):  # both layouts give the same payloads
        assert torch.equal(experts.codes[p], per_expert.codes[p]) and torch.equal(experts.globals[p], per_expert.globals[p])


def test_every_op_gets_the_payloads_without_requantizing() -> None:
    state, _ = export_experts(*weights(1), PREFIX)
    experts = load_modelopt_experts(state, PREFIX, num_experts=E)
    up_gate = experts.gemm1(("up_proj", "gate_proj"))
    fused = experts.fused_weights(Nvfp4MoeConfig(arch="sm90"))
    assert fused.spec.engine == "sm90" and fused.w1_alpha_split is None
    for got, want in zip(fused.canonical(), (*up_gate, experts.codes["down_proj"], experts.scales["down_proj"])):
        assert torch.equal(bits(got), bits(want))
    assert torch.equal(fused.w1_alpha, experts.globals["up_proj"]) and torch.equal(fused.w2_alpha, experts.globals["down_proj"])
    w1, w1s, w2, w2s, gate_scale, up_scale, down_scale = experts.aligned_operands()
    assert torch.equal(w1, torch.cat((experts.codes["gate_proj"], experts.codes["up_proj"]), dim=1))
    assert torch.equal(bits(w2s), bits(experts.scales["down_proj"])) and torch.equal(w2, experts.codes["down_proj"])
    assert experts.activation_global() == pytest.approx(1 / 0.05)
    assert torch.allclose(gate_scale, experts.globals["gate_proj"] * 0.05) and torch.equal(down_scale, experts.globals["down_proj"])
    ll = experts.low_latency_weights(LowLatencyMoeConfig(max_num_tokens=8, arch="sm90"))
    codes1, scales1, global1, codes2, scales2, global2 = ll.canonical()
    assert torch.equal(codes1, up_gate[0]) and torch.equal(bits(scales1), bits(up_gate[1]))
    assert torch.equal(codes2, experts.codes["down_proj"]) and torch.equal(global1, experts.globals["up_proj"])


def test_different_gate_and_up_globals_are_kept_apart_never_merged() -> None:
    state, _ = export_experts(*weights(2), PREFIX, split_gate_up_globals=True)
    experts = load_modelopt_experts(state, PREFIX)
    assert not experts.same_gate_up_globals()
    fused = experts.fused_weights(Nvfp4MoeConfig(arch="sm90"))
    assert fused.w1_alpha_split == I  # features [0, I) are up, [I, 2I) gate: each with its own global
    assert torch.equal(fused.w1_alpha, torch.cat((experts.globals["up_proj"], experts.globals["gate_proj"])))
    _, _, _, _, gate_scale, up_scale, _ = experts.aligned_operands()
    assert not torch.equal(gate_scale, up_scale)
    with pytest.raises(ValueError, match="expert 0 has different gate and up weight_scale_2"):
        experts.low_latency_weights(LowLatencyMoeConfig(max_num_tokens=8, arch="sm90"))


def test_refusals_name_what_is_wrong(tmp_path: Path) -> None:
    state, _ = export_experts(*weights(3), PREFIX)
    with pytest.raises(ValueError, match="not ModelOpt NVFP4"):
        read_quant_config({"quantization": {"quant_algo": "FP8"}})
    with pytest.raises(ValueError, match="not ModelOpt NVFP4"):
        read_quant_config(write_checkpoint(tmp_path / "fp8", state, quant_algo="FP8"))
    missing = {k: v for k, v in state.items() if k != f"{PREFIX}.2.up_proj.weight_scale"}
    with pytest.raises(ValueError, match=rf"no tensor {PREFIX}\.2\.up_proj\.weight_scale"):
        load_modelopt_experts(missing, PREFIX)
    with pytest.raises(ValueError, match="no experts under"):
        load_modelopt_experts(state, "model.layers.9.mlp.experts")
    wrong = dict(state, **{f"{PREFIX}.1.down_proj.weight_scale": state[f"{PREFIX}.1.down_proj.weight_scale"].float()})
    with pytest.raises(TypeError, match="down_proj.weight_scale must have dtype float8_e4m3fn"):
        load_modelopt_experts(wrong, PREFIX)
    with pytest.raises(ValueError, match=rf"no tensor {PREFIX}\.4\.gate_proj\.weight"):
        load_modelopt_experts(state, PREFIX, num_experts=5)
    for code, what in ((0x7F, "E4M3 NaN"), (0xB8, "negative")):  # NaN; -1.0: block scales are unsigned
        scale = state[f"{PREFIX}.2.up_proj.weight_scale"].clone()
        scale.view(torch.uint8)[3, 1] = code
        with pytest.raises(ValueError, match=rf"{PREFIX} up_proj.weight_scale holds {what}"):
            load_modelopt_experts(dict(state, **{f"{PREFIX}.2.up_proj.weight_scale": scale}), PREFIX)
    fused_state, _ = export_experts(*weights(3), PREFIX, fused=True)
    with pytest.raises(ValueError, match="num_experts=5 but the checkpoint holds 4"):
        load_modelopt_experts(fused_state, PREFIX, num_experts=5)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no safetensors files"):
        load_modelopt_experts(empty, PREFIX)


def test_safetensors_are_read_lazily(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state, _ = export_experts(*weights(4), PREFIX)
    state["model.embed_tokens.weight"] = torch.zeros(1000, 256)  # a tensor the reader must never load
    folder = write_checkpoint(tmp_path / "ckpt", state)
    import safetensors

    loaded: list[str] = []
    original = safetensors.safe_open

    class Spy:
        def __init__(self, *args, **kwargs):
            self.inner = original(*args, **kwargs)

        def __enter__(self):
            handle = self.inner.__enter__()

            class Handle:
                keys = handle.keys

                def get_tensor(self, name):
                    loaded.append(name)
                    return handle.get_tensor(name)

            return Handle()

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

    monkeypatch.setattr(safetensors, "safe_open", Spy)
    load_modelopt_experts(folder, PREFIX)
    assert "model.embed_tokens.weight" not in loaded and len(loaded) == len(state) - 1
