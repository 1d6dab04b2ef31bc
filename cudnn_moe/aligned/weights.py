"""Weights of the aligned-plan op, laid out once for the GEMM engine of their GPU."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..activations import SwiGLU
from ..arch import Arch, device_arch, parse_arch
from ..config import Nvfp4Weights, require_expert_count
from ..engines import GemmShape, choose_engine, engine_class
from ..formats import NVFP4_BLOCK
from ..validate import require_same_device, require_shape, require_tensor
from .checks import K_MULTIPLE

GATED = SwiGLU()  # the op's activation: silu(gate) * up, on the pipeline's [up; gate] rows
_CHUNK_BYTES = 1 << 28  # experts are repacked in chunks of about this many code bytes


def raw_signature(t: torch.Tensor) -> tuple:
    """What identifies a raw weight tensor's contents to the op: address, shape, strides, dtype,
    device and torch's version counter (bumped by every in-place torch write)."""
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device, t._version)


@dataclass(frozen=True, eq=False)
class AlignedWeights:
    """The aligned op's weights in the layout of one GEMM engine (``layer.spec``).

    layer: the pipeline's Nvfp4Weights view: w1 rows reordered to [up; gate] (the caller's
    [gate; up] halves swapped) and packed with w2 for the engine; w1_alpha float32 [2E] = [up
    scales | gate scales] with w1_alpha_split = N/2, and w2_alpha float32 [E]: scratch that each
    call fills from its output scales on the device (they are arguments of every call).
    sources: the raw tensors' signatures (address, shape, strides, dtype, device, version) at
    preparation; a call checks its raw tensors against them.
    """

    layer: Nvfp4Weights
    sources: tuple

    @property
    def num_experts(self) -> int:
        return self.layer.num_experts

    def canonical(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gemm1_weights [E, N, K/2] in [gate; up] order, its E4M3 scales [E, N, K/16], gemm2_weights
        [E, K, N/4], its scales [E, K, N/32]): the caller's tensors, unpacked from the engine layout."""
        w1, w1_scales, w2, w2_scales = self.layer.canonical()
        return _swap_halves(w1), _swap_halves(w1_scales), w2, w2_scales


def _swap_halves(t: torch.Tensor) -> torch.Tensor:
    """[E, N, X]: rows [a; b] -> [b; a] (gate/up order), a new tensor."""
    a, b = t.chunk(2, dim=1)
    return torch.cat((b, a), dim=1)


def _pack(engine: type, arch: Arch, codes: torch.Tensor, scales: torch.Tensor, swap: bool) -> tuple:
    """Pack [E, rows, K/2] codes and [E, rows, K/16] scales for ``engine``, a few experts at a time."""
    step = max(1, _CHUNK_BYTES // max(1, codes[0].numel()))
    parts = []
    for e in range(0, codes.shape[0], step):
        c, s = codes[e : e + step], scales[e : e + step]
        if swap:
            c, s = _swap_halves(c), _swap_halves(s)
        parts.append(engine.pack_weights(arch, c.contiguous(), s.contiguous()))
    data, packed_scales = zip(*parts)
    return torch.cat(data), torch.cat(packed_scales)


def prepare_aligned_weights(
    gemm1_weights: torch.Tensor,
    gemm1_weights_scale: torch.Tensor,
    gemm2_weights: torch.Tensor,
    gemm2_weights_scale: torch.Tensor,
    *,
    arch: str | int | tuple[int, int] | None = None,
    engine: str = "auto",
) -> AlignedWeights:
    """Lay the aligned op's weights out once for the GEMM engine of the GPU (pass the result as
    ``aligned_moe(..., prepared=...)``); the caller's tensors are only read.

    gemm1_weights uint8 [E, N, K/2] ([gate; up] rows), gemm1_weights_scale float8_e4m3fn [E, N, K/16],
    gemm2_weights uint8 [E, K, N/4], gemm2_weights_scale float8_e4m3fn [E, K, N/32] (linear scales,
    N and K multiples of 256), on one device. arch: the GPU the layout is for (default: the tensors'
    CUDA device; required for CPU tensors, e.g. 'sm90'). engine: 'auto', 'sm90' or 'cudnn', as for
    Nvfp4MoeConfig. The codes and scales are repacked bit-exactly (``canonical()`` gives them back).
    """
    w1 = require_tensor("gemm1_weights", gemm1_weights, torch.uint8, rank=3)
    w1s = require_tensor("gemm1_weights_scale", gemm1_weights_scale, torch.float8_e4m3fn, rank=3)
    w2 = require_tensor("gemm2_weights", gemm2_weights, torch.uint8, rank=3)
    w2s = require_tensor("gemm2_weights_scale", gemm2_weights_scale, torch.float8_e4m3fn, rank=3)
    device = require_same_device(gemm1_weights=w1, gemm1_weights_scale=w1s, gemm2_weights=w2, gemm2_weights_scale=w2s)
    experts, n, hidden = w1.shape[0], w1.shape[1], 2 * w1.shape[2]
    require_expert_count("gemm1_weights", experts)
    if n < K_MULTIPLE or n % K_MULTIPLE:
        raise ValueError(f"N = gemm1_weights.shape[1] must be a positive multiple of {K_MULTIPLE}, got {n}")
    if hidden < K_MULTIPLE or hidden % K_MULTIPLE:
        raise ValueError(f"K = 2 * gemm1_weights.shape[2] must be a positive multiple of {K_MULTIPLE}, got {hidden}")
    require_shape("gemm1_weights_scale", w1s, (experts, n, hidden // NVFP4_BLOCK))
    require_shape("gemm2_weights", w2, (experts, hidden, n // 4))
    require_shape("gemm2_weights_scale", w2s, (experts, hidden, n // (2 * NVFP4_BLOCK)))
    if arch is not None:
        target = parse_arch(arch)
    elif device.type == "cuda":
        target = device_arch(device)
    else:
        raise ValueError("arch is required for weights on the CPU (e.g. arch='sm90')")
    inter = n // 2
    shapes = (GemmShape(hidden, n, experts), GemmShape(inter, hidden, experts))
    spec = choose_engine(target, engine, shapes).spec(target)
    cls = engine_class(spec.engine)
    w1_data, w1_scales = _pack(cls, target, w1, w1s, swap=True)
    w2_data, w2_scales = _pack(cls, target, w2, w2s, swap=False)
    alpha1 = torch.ones(2 * experts, dtype=torch.float32, device=device)
    alpha2 = torch.ones(experts, dtype=torch.float32, device=device)
    layer = Nvfp4Weights(
        w1_data, w1_scales, alpha1, w2_data, w2_scales, alpha2, spec, GATED.gated, hidden, inter, w1_alpha_split=inter
    )
    return AlignedWeights(layer, tuple(raw_signature(t) for t in (w1, w1s, w2, w2s)))
