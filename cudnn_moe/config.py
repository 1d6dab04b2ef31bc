"""The NVFP4 MoE configuration: prepares weights and activations in the layouts the GPU op reads."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .activations import Activation, SwiGLU, parse_activation
from .arch import SM90, Arch, arch_name, device_arch, parse_arch
from .engines import ENGINE_NAMES, EngineSpec, GemmShape, choose_engine, engine_class, supported_archs
from .formats import NVFP4_MAX, quantize_nvfp4
from .kernels.codes import SORT_MAX_EXPERTS
from .validate import require_finite, require_multiple, require_same_device, require_tensor

SIZE_MULTIPLE = 128
# Largest max_num_tokens: the stage/sort/permute kernels index slots (bucket * top_k) and sorted rows
# with int32. The biggest bucket of 2^20 tokens keeps slots plus padding rows inside int32 for any
# top_k up to 2^10 (get_executor checks the exact row count for the call's top_k).
MAX_NUM_TOKENS = 1 << 20
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
    """Per-expert NVFP4 weights of one MoE layer (E experts held by this rank), in the layout of the
    GEMM engine they were prepared for (``spec``).

    Canonical form (``canonical()``): w1 codes uint8 [E, N1, H/2] with N1 = 2I rows [up; gate] for
    gated activations, else I; w2 codes uint8 [E, H, I/2]; float8_e4m3fn scales per 16 values along
    the reduction dim, linear [E, rows, K/16]. ``w1``/``w1_scales``/``w2``/``w2_scales`` hold them in
    ``spec.weight_layout`` (see ``cudnn_moe.engines.WeightLayout``).
    w1_alpha / w2_alpha: float32 [E]; dequantized weight = e2m1 * block scale * alpha.
    w1_alpha_split: None, or (the aligned-plan op's weights) I: w1_alpha is then [2E] and GEMM1
    output features f >= I (the gate half) take w1_alpha[E + e].
    The GPU executors built for these weights live in cudnn_moe.pipeline.lifetime's cache and are
    released (outside any CUDA-graph capture) after the weights object is dropped.
    """

    w1: torch.Tensor
    w1_scales: torch.Tensor
    w1_alpha: torch.Tensor
    w2: torch.Tensor
    w2_scales: torch.Tensor
    w2_alpha: torch.Tensor
    spec: EngineSpec
    gated: bool
    hidden_size: int
    intermediate_size: int
    w1_alpha_split: int | None = None

    @property
    def num_experts(self) -> int:
        return self.w1.shape[0]

    @property
    def gemm1_rows(self) -> int:
        """N1: rows of w1 per expert (2I gated, I otherwise)."""
        return 2 * self.intermediate_size if self.gated else self.intermediate_size

    @property
    def device(self) -> torch.device:
        return self.w1.device

    def canonical(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(w1 codes [E, N1, H/2], w1 scales [E, N1, H/16], w2 codes [E, H, I/2], w2 scales [E, H, I/16]),
        scales linear float8_e4m3fn (derived from the engine layout; a copy for repacked layouts)."""
        engine = engine_class(self.spec.engine)
        w1, w1_scales = engine.unpack_weights(self.spec.arch, self.w1, self.w1_scales, self.gemm1_rows, self.hidden_size)
        w2, w2_scales = engine.unpack_weights(
            self.spec.arch, self.w2, self.w2_scales, self.hidden_size, self.intermediate_size
        )
        return w1, w1_scales, w2, w2_scales


def require_expert_count(name: str, experts: int) -> None:
    """One layer (or rank) holds 1 .. SORT_MAX_EXPERTS experts: the sort kernel groups slots by expert in one
    block's shared memory."""
    if not 1 <= experts <= SORT_MAX_EXPERTS:
        raise ValueError(f"{name} holds {experts} experts; a layer (or a rank's shard) holds 1 to {SORT_MAX_EXPERTS}")


_CHUNK_ELEMENTS = 1 << 26  # experts are quantized in chunks of about this many values to bound temporaries


def _quantize_per_expert(w: torch.Tensor, spec: EngineSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float [E, rows, K] -> (data, scales) in ``spec``'s weight layout and alpha float32 [E].

    Each expert gets global scale 2688 / amax so its largest block uses the full E4M3 range.
    """
    engine = engine_class(spec.engine)
    amax = w.abs().amax(dim=(1, 2)).float()
    alpha = torch.where(amax > 0, amax / NVFP4_MAX, torch.ones_like(amax))
    step = max(1, _CHUNK_ELEMENTS // w[0].numel())
    data, scales = zip(
        *(
            engine.pack_weights(spec.arch, *quantize_nvfp4(w[e : e + step], 1.0 / alpha[e : e + step], check_finite=False))
            for e in range(0, w.shape[0], step)
        )
    )
    return torch.cat(data), torch.cat(scales), alpha


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
        if engine not in ENGINE_NAMES:
            raise ValueError(f"engine must be one of {', '.join(ENGINE_NAMES)}, got {engine!r}")
        self.arch: Arch | None = None if arch is None else parse_arch(arch)
        if self.arch is not None and not self.supported(self.arch):
            raise ValueError(f"arch {arch!r} ({arch_name(self.arch)}) is not supported; the NVFP4 config runs on "
                             + ", ".join(sorted(arch_name(a) for a in supported_archs())))
        self.max_num_tokens = max_num_tokens
        self.engine = engine

    @staticmethod
    def supported(arch: str | int | tuple[int, int]) -> bool:
        """True for the architectures some engine runs this config on: SM90 (Hopper), SM100/SM103 (Blackwell)."""
        return parse_arch(arch) in supported_archs()

    def target_arch(self) -> Arch:
        """The architecture weights are prepared for: ``arch``, else the current GPU, else SM90."""
        if self.arch is not None:
            return self.arch
        return device_arch() if torch.cuda.is_available() else SM90

    def engine_spec(self, hidden: int, intermediate: int, num_experts: int, gated: bool) -> EngineSpec:
        """The engine (and its layouts) this config picks for a layer of that shape on ``target_arch()``."""
        arch = self.target_arch()
        n1 = 2 * intermediate if gated else intermediate
        shapes = (GemmShape(hidden, n1, num_experts), GemmShape(intermediate, hidden, num_experts))
        return choose_engine(arch, self.engine, shapes).spec(arch)

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
        expected_rows = act.gemm1_columns(intermediate)
        if rows1 != expected_rows:
            kind = "gated" if act.gated else "non-gated"
            raise ValueError(
                f"w1_bf16 must have {expected_rows} rows per expert for the {kind} activation "
                f"{type(act).__name__} (intermediate size {intermediate}), got {rows1}"
            )
        require_finite("w1_bf16", w1)
        require_finite("w2_bf16", w2)
        spec = self.engine_spec(hidden, intermediate, experts, act.gated)
        w1_data, w1_scales, w1_alpha = _quantize_per_expert(w1, spec)
        w2_data, w2_scales, w2_alpha = _quantize_per_expert(w2, spec)
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
