"""The fused op's configuration: prepares NVFP4 weights and activations in the layouts its engine reads."""

from __future__ import annotations

import torch

from ..activations import Activation, SwiGLU, parse_activation, require_gemm1_rows
from ..arch import Arch, arch_name, parse_arch, target_arch
from ..engines.base import NVFP4, OP_FUSED, EngineSpec, GemmShape, Request
from ..engines.registry import choose, engine_class_of, engine_names, served_archs
from ..formats import quantize_nvfp4
from ..validate import require_finite, require_multiple, require_same_device, require_tensor
from ..weights.nvfp4 import Nvfp4Activations, Nvfp4Weights, quantize_experts, require_expert_count

SIZE_MULTIPLE = 128
# Largest max_num_tokens: the stage/sort/permute kernels index slots (bucket * top_k) and sorted rows
# with int32. The biggest bucket of 2^20 tokens keeps slots plus padding rows inside int32 for any
# top_k up to 2^10 (get_executor checks the exact row count for the call's top_k).
MAX_NUM_TOKENS = 1 << 20
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class Nvfp4MoeConfig:
    """NVFP4 MoE: NVFP4 activations and weights, FP32 per-expert global scales.

    arch: the GPU the prepared weights are for ('sm90', 'sm100', (10, 0), ...); by default the
    current CUDA device, or SM90 when there is none.
    max_num_tokens: the largest token count one call may pass (token buckets go up to it), an int in
    1 .. MAX_NUM_TOKENS (2^20; the kernels' slot and row indices are int32).
    engine: the grouped-GEMM engine: 'auto' (the SM90 kernels on Hopper, cuDNN graphs on
    Blackwell or where the kernels do not fit the shape), 'sm90' or 'cudnn'.
    """

    def __init__(
        self, arch: str | int | tuple[int, int] | None = None, max_num_tokens: int = 4096, engine: str = "auto"
    ) -> None:
        if not isinstance(max_num_tokens, int) or isinstance(max_num_tokens, bool) or max_num_tokens < 1:
            raise ValueError(f"max_num_tokens must be a positive int, got {max_num_tokens!r}")
        if max_num_tokens > MAX_NUM_TOKENS:
            raise ValueError(f"max_num_tokens must be <= MAX_NUM_TOKENS = {MAX_NUM_TOKENS} (the kernels index "
                             f"slots and rows with int32), got {max_num_tokens}")
        if engine not in engine_names(OP_FUSED):
            raise ValueError(f"engine must be one of {', '.join(engine_names(OP_FUSED))}, got {engine!r}")
        self.arch: Arch | None = None if arch is None else parse_arch(arch)
        if self.arch is not None and not self.supported(self.arch):
            raise ValueError(f"arch {arch!r} ({arch_name(self.arch)}) is not supported; the NVFP4 config runs on "
                             + ", ".join(sorted(arch_name(a) for a in served_archs(OP_FUSED))))
        self.max_num_tokens = max_num_tokens
        self.engine = engine

    @staticmethod
    def supported(arch: str | int | tuple[int, int]) -> bool:
        """True for the architectures some engine runs this config on (cudnn_moe.engines.registry)."""
        return parse_arch(arch) in served_archs(OP_FUSED)

    def target_arch(self) -> Arch:
        """The architecture weights are prepared for: ``arch``, else the current GPU, else SM90."""
        return target_arch(self.arch)

    def engine_spec(self, hidden: int, intermediate: int, num_experts: int, gated: bool) -> EngineSpec:
        """The engine (and its layouts) this config picks for a layer of that shape on ``target_arch()``."""
        arch = self.target_arch()
        n1 = 2 * intermediate if gated else intermediate
        shapes = (GemmShape(hidden, n1, num_experts), GemmShape(intermediate, hidden, num_experts))
        return choose(Request(OP_FUSED, arch, NVFP4, shapes, num_experts), self.engine).spec(arch)

    def prepare_weights(
        self,
        w1_bf16: torch.Tensor,
        w2_bf16: torch.Tensor,
        *,
        activation: Activation | str = SwiGLU(),
    ) -> Nvfp4Weights:
        """Quantize float weights to per-expert NVFP4.

        w1_bf16: [E, N1, H] (N1 = 2I rows [up; gate] for gated activations, I otherwise).
        w2_bf16: [E, H, I]. BF16, FP16 or FP32; H and I multiples of 128; finite.
        Each expert gets global scale 2688 / amax so its largest block uses the full E4M3 range; the
        result is laid out for the engine ``engine_spec`` picks.
        """
        act = parse_activation(activation)
        w1 = require_tensor("w1_bf16", w1_bf16, _FLOAT_DTYPES, rank=3)
        w2 = require_tensor("w2_bf16", w2_bf16, _FLOAT_DTYPES, rank=3)
        require_same_device(w1_bf16=w1, w2_bf16=w2)
        experts, rows1, hidden = w1.shape
        if w2.shape[0] != experts:
            raise ValueError(f"w1_bf16 has {experts} experts but w2_bf16 has {w2.shape[0]}")
        require_expert_count("w1_bf16", experts)
        if w2.shape[1] != hidden:
            raise ValueError(f"w2_bf16 must be [E, H, I] with H = {hidden} (from w1_bf16), got {tuple(w2.shape)}")
        intermediate = w2.shape[2]
        require_multiple("hidden size (w1_bf16.shape[2])", hidden, SIZE_MULTIPLE)
        require_multiple("intermediate size (w2_bf16.shape[2])", intermediate, SIZE_MULTIPLE)
        require_gemm1_rows("w1_bf16", rows1, act, intermediate)
        require_finite("w1_bf16", w1)
        require_finite("w2_bf16", w2)
        spec = self.engine_spec(hidden, intermediate, experts, act.gated)
        engine = engine_class_of(spec)

        def pack(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return engine.pack_weights(spec.arch, codes, scales)

        w1_data, w1_scales, w1_alpha = quantize_experts("w1_bf16", w1, pack)
        w2_data, w2_scales, w2_alpha = quantize_experts("w2_bf16", w2, pack)
        return Nvfp4Weights(
            w1_data, w1_scales, w1_alpha, w2_data, w2_scales, w2_alpha, spec, act.gated, hidden, intermediate
        )

    def prepare_activations(self, hidden_states_bf16: torch.Tensor) -> Nvfp4Activations:
        """Quantize activations [M, H] (BF16/FP16/FP32, H a multiple of 128) to NVFP4, global scale one.

        With global scale one a 16-value block keeps magnitudes up to 6 * 448 = 2688 (larger
        values saturate) and is flushed to zero when its amax is below about 6 * 2^-10 = 0.0059
        (amax / 6 under half the smallest E4M3 subnormal, 2^-9).
        The values are not read on the host (no device sync: this runs on the serving path): a NaN in
        a block gives that block a NaN scale, and the token's outputs become NaN.
        """
        x = require_tensor("hidden_states_bf16", hidden_states_bf16, _FLOAT_DTYPES, rank=2)
        require_multiple("hidden size (hidden_states_bf16.shape[1])", x.shape[1], SIZE_MULTIPLE)
        packed, scales = quantize_nvfp4(x, check_finite=False)
        return Nvfp4Activations(packed, scales)
