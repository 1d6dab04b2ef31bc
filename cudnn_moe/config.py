"""The NVFP4 MoE configuration: prepares weights and activations in the layouts the GPU op reads."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .activations import Activation, SwiGLU, parse_activation
from .arch import SUPPORTED_ARCHS, Arch, device_arch, engine_scale_layout, parse_arch
from .formats import NVFP4_MAX, ScaleLayout, quantize_nvfp4, swizzle_128x4, unswizzle_128x4
from .validate import require_finite, require_multiple, require_same_device, require_tensor

SIZE_MULTIPLE = 128
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True, eq=False)
class Nvfp4Activations:
    """NVFP4 activation pack with global scale one.

    packed: uint8 [M, H/2], element 2i in the low nibble. scales: float8_e4m3fn [M, H/16], linear
    (token-major). Dequantized value = e2m1 * scale.
    """

    packed: torch.Tensor
    scales: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.packed.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.packed.shape[1] * 2


@dataclass(frozen=True, eq=False)
class Nvfp4Weights:
    """Per-expert NVFP4 weights of one MoE layer (E experts held by this rank).

    w1: uint8 [E, N1, H/2] with N1 = 2I rows [up; gate] for gated activations, else I.
    w2: uint8 [E, H, I/2]. Scales are float8_e4m3fn per 16 values along the last (reduction)
    dim; LINEAR: [E, rows, K/16], SWIZZLED_128X4: [E, rows * K/16] in 128x4 tiles per expert.
    w1_alpha / w2_alpha: float32 [E]; dequantized weight = e2m1 * block scale * alpha.
    ``executors`` caches the GPU executors built for these weights (see ops.get_executor); they
    are released with the weights.
    """

    w1: torch.Tensor
    w1_scales: torch.Tensor
    w1_alpha: torch.Tensor
    w2: torch.Tensor
    w2_scales: torch.Tensor
    w2_alpha: torch.Tensor
    scale_layout: ScaleLayout
    gated: bool
    executors: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_experts(self) -> int:
        return self.w1.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.w2.shape[1]

    @property
    def intermediate_size(self) -> int:
        return self.w2.shape[2] * 2

    @property
    def device(self) -> torch.device:
        return self.w1.device

    def linear_scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w1 scales [E, N1, H/16], w2 scales [E, H, I/16]) in the linear layout."""
        if self.scale_layout is ScaleLayout.LINEAR:
            return self.w1_scales, self.w2_scales
        return (
            unswizzle_128x4(self.w1_scales, self.w1.shape[1], self.hidden_size // 16),
            unswizzle_128x4(self.w2_scales, self.hidden_size, self.intermediate_size // 16),
        )


_CHUNK_ELEMENTS = 1 << 27  # experts are quantized in chunks of about this many values to bound temporaries


def _quantize_per_expert(w: torch.Tensor, layout: ScaleLayout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float [E, rows, K] -> (packed [E, rows, K/2], scales in ``layout``, alpha float32 [E])."""
    amax = w.abs().amax(dim=(1, 2)).float()
    alpha = torch.where(amax > 0, amax / NVFP4_MAX, torch.ones_like(amax))
    step = max(1, _CHUNK_ELEMENTS // w[0].numel())
    packed, scales = zip(*(quantize_nvfp4(w[e : e + step], 1.0 / alpha[e : e + step]) for e in range(0, w.shape[0], step)))
    scales = torch.cat(scales)
    if layout is ScaleLayout.SWIZZLED_128X4:
        scales = swizzle_128x4(scales)
    return torch.cat(packed), scales, alpha


class Nvfp4MoeConfig:
    """NVFP4 MoE on cuDNN grouped GEMMs: NVFP4 activations and weights, FP32 per-expert global scales.

    arch: the GPU the prepared weights are for ('sm90', 'sm100', (10, 0), ...); by default the
    current CUDA device, or linear scales (the SM90 layout) when there is none.
    max_num_tokens: the largest token count one call may pass (token buckets go up to it).
    """

    def __init__(self, arch: str | int | tuple[int, int] | None = None, max_num_tokens: int = 4096) -> None:
        if not isinstance(max_num_tokens, int) or max_num_tokens < 1:
            raise ValueError(f"max_num_tokens must be a positive int, got {max_num_tokens!r}")
        self.arch: Arch | None = None if arch is None else parse_arch(arch)
        self.max_num_tokens = max_num_tokens

    @staticmethod
    def supported(arch: str | int | tuple[int, int]) -> bool:
        """True for the architectures this config runs on: SM90 (Hopper) and SM100/SM103 (Blackwell)."""
        return parse_arch(arch) in SUPPORTED_ARCHS

    def scale_layout(self) -> ScaleLayout:
        """Weight-scale layout for this config's target GPU."""
        if self.arch is not None:
            return engine_scale_layout(self.arch)
        if torch.cuda.is_available():
            return engine_scale_layout(device_arch())
        return ScaleLayout.LINEAR

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
        Each expert gets global scale 2688 / amax so its largest block uses the full E4M3 range.
        """
        act = parse_activation(activation)
        w1 = require_tensor("w1_bf16", w1_bf16, _FLOAT_DTYPES, rank=3)
        w2 = require_tensor("w2_bf16", w2_bf16, _FLOAT_DTYPES, rank=3)
        require_same_device(w1_bf16=w1, w2_bf16=w2)
        experts, rows1, hidden = w1.shape
        if w2.shape[0] != experts:
            raise ValueError(f"w1_bf16 has {experts} experts but w2_bf16 has {w2.shape[0]}")
        if w2.shape[1] != hidden:
            raise ValueError(f"w2_bf16 must be [E, H, I] with H = {hidden} (from w1_bf16), got {tuple(w2.shape)}")
        intermediate = w2.shape[2]
        require_multiple("hidden size (w1_bf16.shape[2])", hidden, SIZE_MULTIPLE)
        require_multiple("intermediate size (w2_bf16.shape[2])", intermediate, SIZE_MULTIPLE)
        expected_rows = act.gemm1_columns(intermediate)
        if rows1 != expected_rows:
            kind = "gated" if act.gated else "non-gated"
            raise ValueError(
                f"w1_bf16 must have {expected_rows} rows per expert for the {kind} activation "
                f"{type(act).__name__} (intermediate size {intermediate}), got {rows1}"
            )
        require_finite("w1_bf16", w1)
        require_finite("w2_bf16", w2)
        layout = self.scale_layout()
        w1_packed, w1_scales, w1_alpha = _quantize_per_expert(w1, layout)
        w2_packed, w2_scales, w2_alpha = _quantize_per_expert(w2, layout)
        return Nvfp4Weights(w1_packed, w1_scales, w1_alpha, w2_packed, w2_scales, w2_alpha, layout, act.gated)

    def prepare_activations(self, hidden_states_bf16: torch.Tensor) -> Nvfp4Activations:
        """Quantize activations [M, H] (BF16/FP16/FP32, H a multiple of 128) to NVFP4, global scale one.

        With global scale one a 16-value block keeps magnitudes up to 6 * 448 = 2688 (larger
        values saturate) and is flushed to zero when its amax is below about 6 * 2^-10 = 0.0059
        (amax / 6 under half the smallest E4M3 subnormal, 2^-9).
        """
        x = require_tensor("hidden_states_bf16", hidden_states_bf16, _FLOAT_DTYPES, rank=2)
        require_multiple("hidden size (hidden_states_bf16.shape[1])", x.shape[1], SIZE_MULTIPLE)
        packed, scales = quantize_nvfp4(x)
        return Nvfp4Activations(packed, scales)
