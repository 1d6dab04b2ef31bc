"""Weights of the aligned-plan op for the GEMM engine of their GPU: the caller's raw tensors read in place where the
engine can (the sm90 engine), else laid out once in the engine's own layout (a copy), or that copy on request."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..activations import SwiGLU
from ..arch import device_arch, parse_arch
from ..engines.base import NVFP4, OP_ALIGNED, BlockCode, GemmShape, Request
from ..engines.registry import choose, engine_class_of
from ..formats import NVFP4_BLOCK
from ..formats.nvfp4 import require_unsigned_scales
from ..validate import require_same_device, require_shape, require_tensor
from ..weights.nvfp4 import Nvfp4Weights, require_expert_count, swap_row_halves
from .checks import K_MULTIPLE

GATED = SwiGLU()  # the op's activation: silu(gate) * up, on the pipeline's [up; gate] rows
IN_PLACE_ALIGNMENT = 16  # bytes: the sm90 kernels' weight loads (a tensor at another address is copied)


def raw_signature(t: torch.Tensor) -> tuple:
    """What identifies a raw weight tensor's contents to the op: address, shape, strides, dtype,
    device and torch's version counter (bumped by every in-place torch write)."""
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device, t._version)


def owner_of(t: torch.Tensor) -> torch.Tensor:
    """The tensor that owns t's memory: t's base for a view (a fresh view of one weight tensor each call
    is the same weights), else t."""
    return t._base if t._base is not None else t


@dataclass(frozen=True, eq=False)
class AlignedWeights:
    """The aligned op's weights for one GEMM engine (``layer.spec``).

    layer: the pipeline's Nvfp4Weights view, without alphas: each call's stage writes its output scales into the
    token bucket ([up scales | gate scales] with w1_alpha_split = N/2, and the down scales), so these weights are
    never written. Prepared in place, it holds the caller's raw tensors themselves (BlockCode.NVFP4_ROWS,
    w1_halves_swapped: the sm90 kernels read the [gate; up] halves as [up; gate]): no copy. Else w1's rows are
    reordered to [up; gate] and packed with w2 in the engine's layout (a copy).
    sources: the raw tensors' signatures (address, shape, strides, dtype, device, version) at
    preparation; owners: weak references to the tensors owning their memory. A call's raw tensors
    match when both agree (``same_tensors``): new tensors that reuse freed addresses do not.
    """

    layer: Nvfp4Weights
    sources: tuple
    owners: tuple[weakref.ref, ...]

    def same_tensors(self, raw: Sequence[torch.Tensor]) -> bool:
        """Whether ``raw`` (gemm1_weights, its scales, gemm2_weights, its scales) are the tensors these
        weights were prepared from, unwritten since."""
        return (all(ref() is owner_of(t) for ref, t in zip(self.owners, raw))
                and self.sources == tuple(raw_signature(t) for t in raw))

    @property
    def num_experts(self) -> int:
        return self.layer.num_experts

    def canonical(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gemm1_weights [E, N, K/2] in [gate; up] order, its E4M3 scales [E, N, K/16], gemm2_weights
        [E, K, N/4], its scales [E, K, N/32]): the caller's values (new tensors for w1, unpacked from the engine layout
        or with the halves swapped back; w2 and its scales are views of the caller's tensors when read in place)."""
        w1, w1_scales, w2, w2_scales = self.layer.canonical()
        return swap_row_halves(w1), swap_row_halves(w1_scales), w2, w2_scales

    @property
    def in_place(self) -> bool:
        """Whether the layer reads the caller's raw tensors themselves (no copy of the weights is held)."""
        return self.layer.code is BlockCode.NVFP4_ROWS


def _in_place_problem(engine: str, raw: dict[str, torch.Tensor]) -> str | None:
    """Why the engine cannot read these raw tensors in place (only the sm90 engine reads the raw layout), or None."""
    if engine != "sm90":
        return (f"in_place=True needs the sm90 engine (SM90 GPUs), which reads the raw layout; the {engine} engine "
                "reads its own")
    for name, t in raw.items():
        if not t.is_contiguous() or t.data_ptr() % IN_PLACE_ALIGNMENT:
            return (f"in_place=True reads {name} as it is: it must be contiguous and {IN_PLACE_ALIGNMENT}-byte aligned, "
                    f"got strides {t.stride()} at address {t.data_ptr():#x}")
    return None


def _reads_in_place(in_place: bool | None, engine: str, raw: dict[str, torch.Tensor]) -> bool:
    """Whether the prepared layer holds the raw tensors themselves: never for in_place=False; where the engine can
    read them for None; for True where it can, else ValueError naming what prevents it."""
    if in_place is False:
        return False
    problem = _in_place_problem(engine, raw)
    if in_place and problem is not None:
        raise ValueError(problem)
    return problem is None


def prepare_aligned_weights(
    gemm1_weights: torch.Tensor,
    gemm1_weights_scale: torch.Tensor,
    gemm2_weights: torch.Tensor,
    gemm2_weights_scale: torch.Tensor,
    *,
    arch: str | int | tuple[int, int] | None = None,
    engine: str = "auto",
    in_place: bool | None = None,
) -> AlignedWeights:
    """Prepare the aligned op's weights for the GEMM engine of the GPU (pass the result as
    ``aligned_moe(..., prepared=...)``); the caller's tensors are only read.

    gemm1_weights uint8 [E, N, K/2] ([gate; up] rows), gemm1_weights_scale float8_e4m3fn [E, N, K/16],
    gemm2_weights uint8 [E, K, N/4], gemm2_weights_scale float8_e4m3fn [E, K, N/32] (linear scales,
    N and K multiples of 256), on one device; the block scales are read and must be unsigned (E4M3 codes 0x00-0x7E,
    or 0x80 as zero: a NaN or negative scale is refused, as the tensor cores read them unsigned). arch: the GPU the
    layout is for (default: the tensors' CUDA device; required for CPU tensors, e.g. 'sm90'). engine: 'auto', 'sm90'
    or 'cudnn', as for Nvfp4MoeConfig. in_place:
    - None (default): no copy where the engine reads the raw layout. The sm90 engine's kernels read the caller's
      contiguous, 16-byte aligned tensors as they are, so the op holds nothing beside the tensors its contract has
      the caller keep. Else (the cudnn engine, or tensors the kernels cannot read as they are) the codes and scales
      are repacked bit-exactly into the engine's layout, a copy.
    - True: in place, or ValueError naming the tensor or the engine that prevents it.
    - False: the engine's layout, a copy (6.34 GB more per DeepSeek-V3 layer). On the H200 its kernels ran the whole
      op 1.1-1.5x faster than the in-place reads (benchmarks/RESULTS.md, twenty-fifth and twenty-sixth sessions).
    ``canonical()`` gives the caller's values back either way, and the result's ``in_place`` says which it holds.
    """
    if in_place is not None and not isinstance(in_place, bool):
        raise TypeError(f"in_place must be None, True or False, got {type(in_place).__name__}")
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
    spec = choose(Request(OP_ALIGNED, target, NVFP4, shapes, experts), engine).spec(target)
    require_unsigned_scales("gemm1_weights_scale", w1s)  # the first read of the data (a device sync)
    require_unsigned_scales("gemm2_weights_scale", w2s)
    raw = (w1, w1s, w2, w2s)
    names = ("gemm1_weights", "gemm1_weights_scale", "gemm2_weights", "gemm2_weights_scale")
    # no alphas: every call brings its output scales, staged into the token bucket
    if _reads_in_place(in_place, spec.engine, dict(zip(names, raw))):
        layer = Nvfp4Weights(
            w1.view(experts, -1), w1s.view(experts, -1), None, w2.view(experts, -1), w2s.view(experts, -1), None,
            spec, GATED.gated, hidden, inter, w1_alpha_split=inter, code=BlockCode.NVFP4_ROWS, w1_halves_swapped=True,
        )
    else:
        cls = engine_class_of(spec)
        w1_data, w1_scales = cls.pack_weights_chunked(target, w1, w1s, rows=swap_row_halves)
        w2_data, w2_scales = cls.pack_weights_chunked(target, w2, w2s)
        layer = Nvfp4Weights(
            w1_data, w1_scales, None, w2_data, w2_scales, None, spec, GATED.gated, hidden, inter, w1_alpha_split=inter
        )
    return AlignedWeights(layer, tuple(raw_signature(t) for t in raw), tuple(weakref.ref(owner_of(t)) for t in raw))
