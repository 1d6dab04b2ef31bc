"""The typed activation family shared by the reference, the configs and the GPU kernels.

Gated activations read GEMM1's output row [..., 2I] as two halves: columns [0, I) are
"up" and columns [I, 2I) are "gate" (w1 rows are stacked [up; gate]); they return
``f(gate) * g(up)`` of shape [..., I]. Non-gated activations map [..., I] -> [..., I].
Every ``apply`` computes in its input's dtype (the reference passes float64).

``ActivationKind`` codes and the ``params()`` triple ``(a, b, limit)`` are what the CUDA
activation kernel receives; slots an activation does not use hold 0.0 (a, b) and inf (limit).
Parameters are checked at construction, as the kernel's float32 receives them: a parameter that is
not an int or float raises TypeError naming it (``SwiGLU.alpha must be a real number, got str``),
one that is not finite (or not positive, where a class says so) in float32 raises ValueError.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from .validate import to_float32


class ActivationKind(enum.IntEnum):
    """Activation codes; the CUDA kernel switches on these exact values."""

    IDENTITY = 0
    RELU = 1
    GELU = 2
    SILU = 3
    RELU2 = 4
    SWIGLU = 10
    GEGLU = 11
    GEGLU_TANH = 12
    SWIGLU_STEP = 13
    SITU = 14


class Activation:
    """Interface of every activation: ``kind``, ``gated``, ``params()``, ``apply()``."""

    kind: ClassVar[ActivationKind]
    gated: ClassVar[bool]

    def params(self) -> tuple[float, float, float]:
        """The kernel's scalar arguments (a, b, limit)."""
        return (0.0, 0.0, math.inf)

    def apply(self, up_or_x: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        """Non-gated: f(x). Gated: f(gate) * g(up), ``up`` and ``gate`` of one shape."""
        raise NotImplementedError

    def gemm1_columns(self, intermediate: int) -> int:
        """Width N1 of GEMM1's output (and rows of w1) for intermediate size I: 2I gated, else I."""
        return 2 * intermediate if self.gated else intermediate

    def apply_gemm1(self, h1: torch.Tensor) -> torch.Tensor:
        """GEMM1 output [..., N1] -> activation output [..., I] (splits [up | gate] when gated)."""
        if not self.gated:
            return self.apply(h1)
        if h1.shape[-1] % 2:
            raise ValueError(f"a gated activation needs an even GEMM1 width, got {h1.shape[-1]}")
        up, gate = h1.chunk(2, dim=-1)
        return self.apply(up, gate)


class _Elementwise(Activation):
    gated = False

    def apply(self, up_or_x: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        if gate is not None:
            raise ValueError(f"{type(self).__name__} is not gated: pass no gate tensor")
        return self._f(up_or_x)

    def _f(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class _Gated(Activation):
    gated = True

    def apply(self, up_or_x: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        if gate is None:
            raise ValueError(f"{type(self).__name__} is gated: pass both up and gate")
        if gate.shape != up_or_x.shape:
            raise ValueError(f"up {tuple(up_or_x.shape)} and gate {tuple(gate.shape)} must have one shape")
        return self._combine(up_or_x, gate)

    def _combine(self, up: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


def _check_real(owner: str, name: str, value: object) -> float:
    """A real number (int or float, not bool; TypeError otherwise) as the kernel's float32 receives it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{owner}.{name} must be a real number, got {type(value).__name__} {value!r}")
    return to_float32(float(value))


def _check_finite(owner: str, name: str, value: object) -> None:
    """Finite, also once rounded to float32 (the CUDA kernel's precision): 1e39 is refused."""
    if not math.isfinite(_check_real(owner, name, value)):
        raise ValueError(f"{owner}.{name} must be finite (in float32, the kernel's precision), got {value}")


def _check_positive(owner: str, name: str, value: object, allow_inf: bool = False) -> None:
    """Positive (and finite unless allow_inf), also once rounded to float32: 1e-50 (0 there) is refused."""
    single = _check_real(owner, name, value)
    if not (single > 0 and (allow_inf or math.isfinite(single))):
        bound = "positive (inf allowed)" if allow_inf else "positive and finite"
        raise ValueError(f"{owner}.{name} must be {bound} in float32 (the kernel's precision), got {value}")


@dataclass(frozen=True)
class Identity(_Elementwise):
    """y = x."""

    kind = ActivationKind.IDENTITY

    def _f(self, x: torch.Tensor) -> torch.Tensor:
        return x.clone()


@dataclass(frozen=True)
class ReLU(_Elementwise):
    """y = max(x, 0)."""

    kind = ActivationKind.RELU

    def _f(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x)


@dataclass(frozen=True)
class GELU(_Elementwise):
    """y = x * Phi(x), the exact (erf) form."""

    kind = ActivationKind.GELU

    def _f(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x)


@dataclass(frozen=True)
class SiLU(_Elementwise):
    """y = x * sigmoid(x)."""

    kind = ActivationKind.SILU

    def _f(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(x)


@dataclass(frozen=True)
class ReLU2(_Elementwise):
    """y = relu(x)^2."""

    kind = ActivationKind.RELU2

    def _f(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x).square()


@dataclass(frozen=True)
class SwiGLU(_Gated):
    """g = min(gate, limit); u = clamp(up, -limit, limit); y = g * sigmoid(alpha * g) * (u + beta).

    The defaults give plain SwiGLU, silu(gate) * up. params() = (alpha, beta, limit).
    """

    alpha: float = 1.0
    beta: float = 0.0
    limit: float = math.inf
    kind = ActivationKind.SWIGLU

    def __post_init__(self) -> None:
        _check_finite("SwiGLU", "alpha", self.alpha)
        _check_finite("SwiGLU", "beta", self.beta)
        _check_positive("SwiGLU", "limit", self.limit, allow_inf=True)

    def params(self) -> tuple[float, float, float]:
        return (float(self.alpha), float(self.beta), float(self.limit))

    def _combine(self, up: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        g = gate.clamp(max=self.limit)
        u = up.clamp(-self.limit, self.limit)
        return g * torch.sigmoid(self.alpha * g) * (u + self.beta)


@dataclass(frozen=True)
class GeGLU(_Gated):
    """y = gelu(gate) * up, erf GELU."""

    kind = ActivationKind.GEGLU

    def _combine(self, up: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return F.gelu(gate) * up


@dataclass(frozen=True)
class GeGLUTanh(_Gated):
    """y = gelu_tanh(gate) * up, with the tanh approximation of GELU."""

    kind = ActivationKind.GEGLU_TANH

    def _combine(self, up: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return F.gelu(gate, approximate="tanh") * up


@dataclass(frozen=True)
class SwiGLUStep(_Gated):
    """y = min(silu(gate), limit) * clamp(up, -limit, limit).

    Unlike SwiGLU's limit, the upper clamp acts on silu's output, not on the gate input
    (the "SwiGLU-step" of Step-3.5-Flash as served by vLLM). params() = (0, 0, limit).
    """

    limit: float = 7.0
    kind = ActivationKind.SWIGLU_STEP

    def __post_init__(self) -> None:
        _check_positive("SwiGLUStep", "limit", self.limit, allow_inf=True)

    def params(self) -> tuple[float, float, float]:
        return (0.0, 0.0, float(self.limit))

    def _combine(self, up: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return F.silu(gate).clamp(max=self.limit) * up.clamp(-self.limit, self.limit)


@dataclass(frozen=True)
class SiTU(_Gated):
    """Sigmoid-tanh unit GLU (Kimi K3): y = a tanh(gate / a) sigmoid(gate) * b tanh(up / b).

    Both factors are soft-capped, so |y| < a * b. params() = (a, b, inf).
    """

    a: float = 4.0
    b: float = 25.0
    kind = ActivationKind.SITU

    def __post_init__(self) -> None:
        _check_positive("SiTU", "a", self.a)
        _check_positive("SiTU", "b", self.b)

    def params(self) -> tuple[float, float, float]:
        return (float(self.a), float(self.b), math.inf)

    def _combine(self, up: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        soft_gate = self.a * torch.tanh(gate / self.a) * torch.sigmoid(gate)
        return soft_gate * (self.b * torch.tanh(up / self.b))


_BY_KIND: dict[ActivationKind, type[Activation]] = {
    cls.kind: cls for cls in (Identity, ReLU, GELU, SiLU, ReLU2, SwiGLU, GeGLU, GeGLUTanh, SwiGLUStep, SiTU)
}
ACTIVATION_NAMES: tuple[str, ...] = tuple(kind.name.lower() for kind in _BY_KIND)



def parse_activation(spec: Activation | ActivationKind | str) -> Activation:
    """An Activation object (returned as is), a kind, or a name such as "swiglu" / "GELU"
    (case-insensitive; see ACTIVATION_NAMES) -> an Activation with default parameters."""
    if isinstance(spec, Activation):
        return spec
    if isinstance(spec, ActivationKind):
        return _BY_KIND[spec]()
    if isinstance(spec, str):
        name = spec.strip().lower()
        if name not in ACTIVATION_NAMES:
            raise ValueError(f"unknown activation {spec!r}; valid names: {', '.join(ACTIVATION_NAMES)}")
        return _BY_KIND[ActivationKind[name.upper()]]()
    raise TypeError(f"activation must be an Activation, an ActivationKind or a name, got {type(spec).__name__}")


def require_gating(activation: Activation, gated: bool) -> None:
    """ValueError unless ``activation`` is gated exactly when the weights were prepared ``gated``."""
    if activation.gated != gated:
        def kind(g: bool) -> str:
            return "gated" if g else "non-gated"

        raise ValueError(f"activation {type(activation).__name__} is {kind(activation.gated)} but the weights were "
                         f"prepared for a {kind(gated)} activation")


def require_gemm1_rows(name: str, rows: int, activation: Activation, intermediate: int) -> None:
    """ValueError naming ``name`` unless it has the GEMM1 rows ``activation`` needs (2I gated, I otherwise)."""
    expected = activation.gemm1_columns(intermediate)
    if rows != expected:
        kind = "gated" if activation.gated else "non-gated"
        raise ValueError(f"{name} must have {expected} rows per expert for the {kind} activation "
                         f"{type(activation).__name__} (intermediate size {intermediate}), got {rows}")
