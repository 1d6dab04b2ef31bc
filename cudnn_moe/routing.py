"""Routing inputs: per-token expert ids and route weights, packed or unpacked.

Packed format (int32 [T, k]), defined here only: bits 31..16 hold the expert id as a
signed 16-bit integer (so -1 fits), bits 15..0 hold the BF16 bit pattern of the route
weight. Expert id 5 with weight 1.0 packs to 0x00053F80.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kernels import ROUTING_BF16, ROUTING_FP32, ROUTING_PACKED

_ID_MIN, _ID_MAX = -(1 << 15), (1 << 15) - 1
_INT32_MIN, _INT32_MAX = -(1 << 31), (1 << 31) - 1
_ID_DTYPES = (torch.int32, torch.int64)
_WEIGHT_DTYPES = (torch.float32, torch.bfloat16)


def pack_routing(ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """ids (integer [T, k], each in [-32768, 32767]) + weights (floating [T, k]) -> packed int32 [T, k].

    Weights are rounded to BF16 (nearest, ties to even) and must be finite after rounding (a
    weight above BF16's range, e.g. 1e39, would become inf). Both checks read the data (a
    device sync on CUDA). Raises TypeError / ValueError naming ``ids`` or ``weights``.
    """
    for name, value in (("ids", ids), ("weights", weights)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
        if value.dim() != 2:
            raise ValueError(f"{name} must be 2-D [num_tokens, top_k], got shape {tuple(value.shape)}")
    if ids.shape != weights.shape:
        raise ValueError(f"ids {tuple(ids.shape)} and weights {tuple(weights.shape)} must have one shape")
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise TypeError(f"ids must be an integer tensor, got {ids.dtype}")
    if not weights.is_floating_point():
        raise TypeError(f"weights must be a floating tensor, got {weights.dtype}")
    if ids.device != weights.device:
        raise ValueError(f"ids ({ids.device}) and weights ({weights.device}) must be on one device")
    if ids.numel() and (int(ids.min()) < _ID_MIN or int(ids.max()) > _ID_MAX):
        raise ValueError(f"expert ids must lie in [{_ID_MIN}, {_ID_MAX}] to fit the packed format")
    rounded = weights.to(torch.bfloat16)
    if not bool(torch.isfinite(rounded).all()):
        raise ValueError("weights must be finite and within BF16's range (|w| < 3.39e38); got NaN or Inf after rounding")
    weight_bits = rounded.view(torch.int16).to(torch.int32) & 0xFFFF
    return ids.to(torch.int32) * (1 << 16) + weight_bits


def unpack_routing(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """packed int32 [T, k] -> (ids int32 [T, k], weights float32 [T, k], BF16-exact)."""
    if not isinstance(packed, torch.Tensor):
        raise TypeError(f"packed routing must be a torch.Tensor, got {type(packed).__name__}")
    if packed.dtype != torch.int32:
        raise TypeError(f"packed routing must be int32, got {packed.dtype}")
    ids = packed >> 16  # arithmetic shift keeps the id's sign
    low = packed & 0xFFFF
    signed_bits = (low ^ 0x8000) - 0x8000  # the low half as a signed 16-bit value
    weights = signed_bits.to(torch.int16).view(torch.bfloat16).to(torch.float32)
    return ids, weights


def _require_tensor(value: object, name: str, dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.dtype not in dtypes:
        allowed = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{name} must be {allowed}, got {str(value.dtype).removeprefix('torch.')}")
    if value.dim() != 2:
        raise ValueError(f"{name} must be 2-D [num_tokens, top_k], got shape {tuple(value.shape)}")
    if value.shape[1] < 1:
        raise ValueError(f"{name} needs top_k >= 1, got shape {tuple(value.shape)}")
    if not value.is_contiguous():
        raise ValueError(f"{name} must be contiguous (row-major, the kernels index raw memory); call .contiguous() first")
    return value


@dataclass(frozen=True, eq=False)
class Routing:
    """One token -> experts assignment, held packed (int32 [T, k]) or as ids + weights.

    Build with ``Routing.packed(tensor)`` or ``Routing.unpacked(ids, weights)``; ids are
    int32/int64, weights float32/bfloat16, each a contiguous 2-D tensor. T may be 0; top_k must
    be at least 1. Construction checks types, shapes, devices and contiguity only (no data read).

    Expert ids that name no local expert (negative, or outside the weights' range) are unrouted.
    int64 ids outside the int32 range are unrouted on the GPU too (the stage kernel masks them
    without a data read); ``ids_and_weights()``, which the float reference and
    ``check_routing=True`` use, reads the ids and raises ValueError for them instead of wrapping.
    """

    packed_tensor: torch.Tensor | None = None
    ids: torch.Tensor | None = None
    weights: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.packed_tensor is not None:
            if self.ids is not None or self.weights is not None:
                raise ValueError("a Routing holds either a packed tensor or ids + weights, not both")
            _require_tensor(self.packed_tensor, "packed", (torch.int32,))
            return
        if self.ids is None or self.weights is None:
            raise ValueError("an unpacked Routing needs both ids and weights")
        ids = _require_tensor(self.ids, "ids", _ID_DTYPES)
        weights = _require_tensor(self.weights, "weights", _WEIGHT_DTYPES)
        if ids.shape != weights.shape:
            raise ValueError(f"ids {tuple(ids.shape)} and weights {tuple(weights.shape)} must have one shape")
        if ids.device != weights.device:
            raise ValueError(f"ids ({ids.device}) and weights ({weights.device}) must be on one device")

    @classmethod
    def packed(cls, tensor: torch.Tensor) -> Routing:
        """Routing from the packed int32 [T, k] format."""
        return cls(packed_tensor=tensor)

    @classmethod
    def unpacked(cls, ids: torch.Tensor, weights: torch.Tensor) -> Routing:
        """Routing from ids (int32/int64 [T, k]) and weights (float32/bfloat16 [T, k])."""
        return cls(ids=ids, weights=weights)

    @property
    def is_packed(self) -> bool:
        return self.packed_tensor is not None

    def device_tensor(self) -> torch.Tensor:
        """The [T, k] tensor that fixes the shape and device: the packed tensor, or the ids."""
        return self.packed_tensor if self.packed_tensor is not None else self.ids

    @property
    def num_tokens(self) -> int:
        return self.device_tensor().shape[0]

    @property
    def top_k(self) -> int:
        return self.device_tensor().shape[1]

    @property
    def device(self) -> torch.device:
        return self.device_tensor().device

    def kernel_operands(self) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        """(ids or packed tensor, weights or None, kernels.ROUTING_* code), as the staging kernel reads them."""
        if self.packed_tensor is not None:
            return self.packed_tensor, None, ROUTING_PACKED
        code = ROUTING_FP32 if self.weights.dtype == torch.float32 else ROUTING_BF16
        return self.ids, self.weights, code

    def ids_and_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids int32 [T, k], weights float32 [T, k]); packed weights are BF16-exact.

        int64 ids are range-checked before the cast (a data read, a device sync on CUDA): an id
        outside [-2^31, 2^31) raises ValueError rather than wrapping to another expert.
        """
        if self.packed_tensor is not None:
            return unpack_routing(self.packed_tensor)
        ids = self.ids
        if ids.dtype == torch.int64 and ids.numel() and (int(ids.min()) < _INT32_MIN or int(ids.max()) > _INT32_MAX):
            raise ValueError(f"ids must lie in the int32 range [{_INT32_MIN}, {_INT32_MAX}]; int64 ids outside it would wrap")
        return ids.to(torch.int32), self.weights.to(torch.float32)


def check_distinct_experts(ids: torch.Tensor) -> None:
    """Raise ValueError naming the first token whose ids [T, k] repeat an expert.

    Negative ids mark unrouted slots and may repeat. This reads the ids on the host (a
    device sync on CUDA), so the GPU op runs it only when asked to validate.
    """
    if ids.shape[0] == 0 or ids.shape[1] < 2:
        return
    ordered = ids.sort(dim=1).values
    repeated = (ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)
    bad_tokens = repeated.any(dim=1).nonzero()
    if bad_tokens.numel():
        token = int(bad_tokens[0])
        raise ValueError(f"token {token} names an expert more than once: ids {ids[token].tolist()}")


def local_mask(ids: torch.Tensor, local_start: int, num_local: int) -> torch.Tensor:
    """bool [T, k]: which slots route to a local expert (global id in [local_start, local_start + num_local))."""
    return (ids >= local_start) & (ids < local_start + num_local)
