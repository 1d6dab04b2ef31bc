"""ModelOpt NVFP4 expert checkpoints read as they are: codes and block scales bit-exact, never requantized.

How NVFP4 MoE models ship (``hf_quant_config.json`` or a config's ``quantization_config`` with ``quant_algo``
"NVFP4" and ``group_size`` 16): per expert and projection (gate_proj, up_proj, down_proj)

- ``.weight`` uint8 [out, in/2]: E2M1 codes, element 2i in the low nibble;
- ``.weight_scale`` float8_e4m3fn [out, in/16]: linear block scales;
- ``.weight_scale_2`` float32 scalar: the global, dequantized weight = e2m1 * block scale * global;
- ``.input_scale`` float32 scalar: the activation's calibrated scale (tokens are quantized from x / input_scale).

Names read (``prefix`` is the MoE block's experts, e.g. "model.layers.3.mlp.experts"):
per expert ``{prefix}.{e}.gate_proj.weight`` etc., or fused 3-D ``{prefix}.gate_up_proj.weight`` [E, 2I, H/2]
([gate; up] rows) and ``{prefix}.down_proj.weight`` [E, H, I/2] with ``.weight_scale`` of the same leading
shape and ``.weight_scale_2`` / ``.input_scale`` of [E] (or [E, 2] for gate and up of gate_up_proj).
Safetensors files are opened lazily: each tensor is read when it is needed, nothing else is.

The three ops take these payloads as follows:

- ``fused_weights``: the fused op's Nvfp4Weights; different gate and up globals stay separate (GEMM1's
  alphas [up | gate], split at I), never merged. Its tokens are quantized with global one, so the
  checkpoint's ``input_scale`` has no place there.
- ``aligned_operands``: the aligned op's raw tensors and its three output scales; tokens are expected
  quantized with global 1 / input_scale (``activation_global``), so output scales are input_scale x the
  weight globals for GEMM1 and the down global alone for GEMM2 (the op requantizes the intermediate with
  global one).
- ``low_latency_weights``: NVFP4 weight-only weights (BF16 tokens: no input_scale); that format has one
  GEMM1 global per expert, so experts whose gate and up globals differ are refused (ValueError naming
  the first such expert) instead of being merged.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..formats.nvfp4 import require_unsigned_scales
from ..validate import require_tensor

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
GROUP_SIZE = 16


def read_quant_config(source: str | os.PathLike[str] | Mapping[str, Any]) -> dict[str, Any]:
    """The NVFP4 quantization config of a checkpoint: a folder (its hf_quant_config.json, else config.json's
    quantization_config), a file, or an already parsed mapping. Raises ValueError unless it says NVFP4
    with group size 16."""
    if isinstance(source, Mapping):
        document: Any = dict(source)
    else:
        path = Path(source)
        if path.is_dir():
            candidates = [path / "hf_quant_config.json", path / "config.json"]
            path = next((p for p in candidates if p.is_file()), candidates[0])
        try:
            document = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot read a quantization config from {source}: {exc}") from exc
    config = document.get("quantization", document.get("quantization_config", document))
    algo = str(config.get("quant_algo", "")).upper()
    group = config.get("group_size", GROUP_SIZE)
    if algo != "NVFP4" or group != GROUP_SIZE:
        raise ValueError(f"the checkpoint is not ModelOpt NVFP4 with group size {GROUP_SIZE} "
                         f"(quant_algo={config.get('quant_algo')!r}, group_size={group!r})")
    return dict(config)


class _Tensors:
    """Name -> tensor from a state dict, safetensors files or a folder of them (with or without an index),
    read lazily."""

    def __init__(self, source: Mapping[str, torch.Tensor] | str | os.PathLike[str] | list) -> None:
        self._mapping: Mapping[str, torch.Tensor] | None = source if isinstance(source, Mapping) else None
        self._files: dict[str, Path] = {}
        if self._mapping is not None:
            return
        paths = [Path(p) for p in (source if isinstance(source, list) else [source])]
        files: list[Path] = []
        for path in paths:
            files += sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
        if not files:
            raise ValueError(f"no safetensors files in {source}")
        from safetensors import safe_open  # an optional extra: only readers of files need it

        self._open = safe_open
        for file in files:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():
                    self._files[name] = file

    def __contains__(self, name: str) -> bool:
        return name in (self._mapping if self._mapping is not None else self._files)

    def get(self, name: str) -> torch.Tensor:
        if self._mapping is not None:
            return self._mapping[name]
        with self._open(str(self._files[name]), framework="pt") as handle:
            return handle.get_tensor(name)


@dataclass(frozen=True)
class ModelOptExperts:
    """One MoE layer's experts as ModelOpt stores them, stacked over E experts (see the module docstring).

    codes: {"gate_proj", "up_proj", "down_proj"} -> uint8 [E, out, in/2]; scales: float8_e4m3fn
    [E, out, in/16]; globals: float32 [E] (weight_scale_2); input_scales: float32 [E] or None.
    """

    codes: dict[str, torch.Tensor]
    scales: dict[str, torch.Tensor]
    globals: dict[str, torch.Tensor]
    input_scales: dict[str, torch.Tensor | None]

    @property
    def num_experts(self) -> int:
        return self.codes["gate_proj"].shape[0]

    @property
    def hidden_size(self) -> int:
        return self.codes["gate_proj"].shape[2] * 2

    @property
    def intermediate_size(self) -> int:
        return self.codes["gate_proj"].shape[1]

    def gemm1(self, order: tuple[str, str]) -> tuple[torch.Tensor, torch.Tensor]:
        """GEMM1 codes [E, 2I, H/2] and scales [E, 2I, H/16] with the halves in ``order`` (projection names)."""
        return (torch.cat([self.codes[p] for p in order], dim=1), torch.cat([self.scales[p] for p in order], dim=1))

    def same_gate_up_globals(self) -> bool:
        return bool(torch.equal(self.globals["gate_proj"], self.globals["up_proj"]))

    def fused_weights(self, config: Any) -> Any:
        """The fused op's prepared weights for ``config`` (an Nvfp4MoeConfig), laid out for its engine: w1 rows
        [up; gate] with alphas [E] (equal gate and up globals) or [up | gate] split at I; codes and scales
        bit-exact (``canonical()`` gives them back)."""
        from ..engines.registry import engine_class_of
        from ..weights.nvfp4 import Nvfp4Weights

        hidden, inter, experts = self.hidden_size, self.intermediate_size, self.num_experts
        spec = config.engine_spec(hidden, inter, experts, True)
        engine = engine_class_of(spec)
        w1, w1_scales = engine.pack_weights_chunked(spec.arch, *self.gemm1(("up_proj", "gate_proj")))
        w2, w2_scales = engine.pack_weights_chunked(spec.arch, self.codes["down_proj"], self.scales["down_proj"])
        up, gate = self.globals["up_proj"], self.globals["gate_proj"]
        split = None if self.same_gate_up_globals() else inter
        alpha1 = up.clone() if split is None else torch.cat((up, gate))
        return Nvfp4Weights(w1, w1_scales, alpha1, w2, w2_scales, self.globals["down_proj"].clone(), spec, True, hidden,
                            inter, w1_alpha_split=split)

    def activation_global(self) -> float:
        """The global to quantize the aligned op's tokens with: 1 / the largest gate or up input_scale."""
        scales = [s for s in (self.input_scales["gate_proj"], self.input_scales["up_proj"]) if s is not None]
        if not scales:
            raise ValueError("the checkpoint has no input_scale for gate_proj / up_proj: the aligned op's tokens need one")
        return 1.0 / float(torch.cat(scales).max())

    def aligned_operands(self) -> tuple[torch.Tensor, ...]:
        """(gemm1_weights [E, N, K/2] [gate; up], gemm1_weights_scale, gemm2_weights, gemm2_weights_scale,
        output1_scale_gate_scalar, output1_scale_scalar, output2_scale_scalar) for tokens quantized with
        ``activation_global()``: the output scales are input_scale x the gate / up globals and the down global."""
        w1, w1_scales = self.gemm1(("gate_proj", "up_proj"))
        input_scale = 1.0 / self.activation_global()
        gate = (self.globals["gate_proj"] * input_scale).float()
        up = (self.globals["up_proj"] * input_scale).float()
        return (w1, w1_scales, self.codes["down_proj"], self.scales["down_proj"], gate, up,
                self.globals["down_proj"].float().clone())

    def low_latency_weights(self, config: Any) -> Any:
        """NVFP4 weight-only weights of ``config`` (a LowLatencyMoeConfig): payloads bit-exact, one GEMM1 global per
        expert, so differing gate and up globals raise ValueError."""
        if not self.same_gate_up_globals():
            differ = int(torch.nonzero(self.globals["gate_proj"] != self.globals["up_proj"])[0])
            raise ValueError(f"expert {differ} has different gate and up weight_scale_2: the low-latency NVFP4 format "
                             "has one GEMM1 global per expert; use fused_weights() or aligned_operands(), which keep both")
        w1, w1_scales = self.gemm1(("up_proj", "gate_proj"))
        return config.prepare_nvfp4_weight_only_weights(w1, w1_scales, self.globals["up_proj"], self.codes["down_proj"],
                                                self.scales["down_proj"], self.globals["down_proj"])


def load_modelopt_experts(
    source: Mapping[str, torch.Tensor] | str | os.PathLike[str] | list,
    prefix: str,
    *,
    num_experts: int | None = None,
) -> ModelOptExperts:
    """One MoE layer's ModelOpt NVFP4 experts from ``source`` (a state dict, safetensors files or a folder),
    under ``prefix`` (see the module docstring for the names). num_experts: required for per-expert names
    unless they are counted from the source. Raises ValueError naming the first missing or malformed tensor."""
    tensors = _Tensors(source)
    fused = f"{prefix}.gate_up_proj.weight" in tensors
    codes, scales, globals_, inputs = {}, {}, {}, {}
    if fused:
        for name, projections in (("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",))):
            c = _get(tensors, f"{prefix}.{name}.weight", torch.uint8)
            s = _get(tensors, f"{prefix}.{name}.weight_scale", torch.float8_e4m3fn)
            g = _get(tensors, f"{prefix}.{name}.weight_scale_2").float()
            i = _optional(tensors, f"{prefix}.{name}.input_scale")
            halves = len(projections)
            for index, p in enumerate(projections):
                codes[p], scales[p] = c.chunk(halves, dim=1)[index], s.chunk(halves, dim=1)[index]
                globals_[p] = g[:, index] if g.dim() == 2 else g.reshape(-1).expand(c.shape[0]).clone()
                inputs[p] = None if i is None else (i.float()[:, index] if i.dim() == 2
                                                    else i.float().reshape(-1).expand(c.shape[0]).clone())
    else:
        experts = num_experts if num_experts is not None else _count_experts(tensors, prefix)
        for p in PROJECTIONS:
            base = [f"{prefix}.{e}.{p}" for e in range(experts)]
            codes[p] = torch.stack([_get(tensors, f"{b}.weight", torch.uint8) for b in base])
            scales[p] = torch.stack([_get(tensors, f"{b}.weight_scale", torch.float8_e4m3fn) for b in base])
            globals_[p] = torch.stack([_get(tensors, f"{b}.weight_scale_2").float().reshape(()) for b in base])
            found = [_optional(tensors, f"{b}.input_scale") for b in base]
            inputs[p] = None if any(t is None for t in found) else torch.stack([t.float().reshape(()) for t in found])
    experts = _check(prefix, codes, scales, globals_)
    if num_experts is not None and experts != num_experts:
        raise ValueError(f"{prefix}: num_experts={num_experts} but the checkpoint holds {experts}")
    return ModelOptExperts(codes, scales, globals_, inputs)


def _get(tensors: _Tensors, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The tensor ``name`` (of ``dtype`` when given: TypeError naming it otherwise); ValueError when missing."""
    if name not in tensors:
        raise ValueError(f"the checkpoint has no tensor {name}")
    tensor = tensors.get(name)
    return tensor if dtype is None else require_tensor(name, tensor, dtype)


def _optional(tensors: _Tensors, name: str) -> torch.Tensor | None:
    return tensors.get(name) if name in tensors else None


def _count_experts(tensors: _Tensors, prefix: str) -> int:
    count = 0
    while f"{prefix}.{count}.gate_proj.weight" in tensors:
        count += 1
    if count == 0:
        raise ValueError(f"the checkpoint has no experts under {prefix} ({prefix}.0.gate_proj.weight or "
                         f"{prefix}.gate_up_proj.weight)")
    return count


def _check(prefix: str, codes: dict, scales: dict, globals_: dict) -> int:
    """The payloads' dtypes and shapes agree (gate and up [E, I, H/2], down [E, H, I/2]) and the block scales are
    unsigned (read: require_unsigned_scales); returns E."""
    for p in PROJECTIONS:
        require_tensor(f"{prefix} {p}.weight", codes[p], torch.uint8, rank=3)
        require_tensor(f"{prefix} {p}.weight_scale", scales[p], torch.float8_e4m3fn, rank=3)
    experts, inter, half_hidden = codes["gate_proj"].shape
    hidden = 2 * half_hidden
    want = {"gate_proj": (experts, inter, hidden // 2), "up_proj": (experts, inter, hidden // 2),
            "down_proj": (experts, hidden, inter // 2)}
    for p, shape in want.items():
        if tuple(codes[p].shape) != shape:
            raise ValueError(f"{prefix} {p}.weight must be {list(shape)} to match gate_proj, got {list(codes[p].shape)}")
        scale_shape = (*shape[:2], shape[2] * 2 // GROUP_SIZE)
        if tuple(scales[p].shape) != scale_shape:
            raise ValueError(f"{prefix} {p}.weight_scale must be {list(scale_shape)}, got {list(scales[p].shape)}")
        require_unsigned_scales(f"{prefix} {p}.weight_scale", scales[p])
        if tuple(globals_[p].shape) != (experts,) or not bool(torch.isfinite(globals_[p]).all()):
            raise ValueError(f"{prefix} {p}.weight_scale_2 must be finite, one per expert")
    return experts
