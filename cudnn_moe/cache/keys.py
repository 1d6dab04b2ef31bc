"""Cache keys: what an entry is (kind, name, key fields) and the environment it is valid in.

An entry is valid only for the GPU model, compute capability, cuDNN backend and frontend,
kernel compiler and package version that produced it; all of them are part of the key, so a
new driver stack or package version misses the cache instead of loading a stale entry. The
key's canonical JSON (sorted keys, no spaces, ASCII) is stored in the entry and its sha256
names the file.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Union

import torch

from ..version import __version__

KIND_CUDNN_PLAN = "cudnn-plan"  # a serialized cuDNN execution plan
KIND_KERNEL = "kernel"  # a compiled kernel binary (cubin)
KIND_TACTIC = "tactic"  # a measured engine choice (cudnn_moe.low_latency.tactics), JSON

Scalar = Union[str, int, float, bool, None]
FieldValue = Union[Scalar, tuple["FieldValue", ...]]


def _freeze(name: str, value: object) -> FieldValue:
    """A key field value as hashable JSON: scalars, and lists / tuples of them (as tuples)."""
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(name, v) for v in value)
    if value is None or isinstance(value, (str, int, float, bool)):
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"key field {name!r} must be finite, got {value!r}")
        return value
    raise TypeError(f"key field {name!r} must be a str, int, float, bool, None or a list of them; got {type(value).__name__}")


@dataclass(frozen=True)
class Environment:
    """What must match for a cached entry to be loaded (None: not applicable or unknown)."""

    gpu_name: str | None = None
    compute_capability: tuple[int, int] | None = None
    cudnn_backend: int | None = None  # e.g. 91900 for cuDNN 9.19.0
    cudnn_frontend: str | None = None  # nvidia-cudnn-frontend version string
    compiler: str | None = None  # kernel compiler and driver, e.g. "cupy 14.2.0, driver 13000"
    package_version: str = __version__

    def __post_init__(self) -> None:
        if self.compute_capability is not None:
            object.__setattr__(self, "compute_capability", tuple(int(v) for v in self.compute_capability))


def _cudnn_versions() -> tuple[int | None, str | None]:
    try:
        cudnn = importlib.import_module("cudnn")
    except Exception:  # not installed, or its library fails to load
        return None, None
    frontend = getattr(cudnn, "__version__", None)
    try:
        backend = int(cudnn.backend_version())
    except Exception:
        backend = None
    return backend, None if frontend is None else str(frontend)


def current_environment(device: torch.device | int | None = None, *, cudnn: bool = True) -> Environment:
    """The Environment of CUDA ``device`` (the current one by default) in this process.

    cudnn: fill in the cuDNN backend / frontend versions (for plan entries); the kernel loader fills in
    ``compiler`` itself (cudnn_moe.kernels.loader). cuDNN is imported here, never at import time; a
    missing GPU or cuDNN leaves its fields None.
    """
    gpu_name = capability = None
    if torch.cuda.is_available():
        index = device.index if isinstance(device, torch.device) else device
        index = torch.cuda.current_device() if index is None else index
        gpu_name = torch.cuda.get_device_name(index)
        capability = tuple(torch.cuda.get_device_capability(index))
    backend, frontend = _cudnn_versions() if cudnn else (None, None)
    return Environment(
        gpu_name=gpu_name,
        compute_capability=capability,
        cudnn_backend=backend,
        cudnn_frontend=frontend,
    )


@dataclass(frozen=True, eq=False)
class EntryKey:
    """One cache entry's identity.

    kind: KIND_CUDNN_PLAN, KIND_KERNEL or another short tag. name: a readable
    description ("gemm1 E128 H2048 N1536 bucket 64"). fields: the graph / kernel key (a mapping
    of str to JSON scalars or lists; held as sorted pairs). environment: where it is valid.
    """

    kind: str
    name: str
    fields: Mapping[str, Any] | tuple[tuple[str, FieldValue], ...]
    environment: Environment

    def __post_init__(self) -> None:
        for attr in ("kind", "name"):
            value = getattr(self, attr)
            if not isinstance(value, str) or not value:
                raise ValueError(f"EntryKey.{attr} must be a non-empty str, got {value!r}")
        if not isinstance(self.environment, Environment):
            raise TypeError(f"EntryKey.environment must be an Environment, got {type(self.environment).__name__}")
        items = self.fields.items() if isinstance(self.fields, Mapping) else self.fields
        frozen = tuple(sorted((str(k), _freeze(str(k), v)) for k, v in items))
        object.__setattr__(self, "fields", frozen)
        document = {"kind": self.kind, "name": self.name, "fields": dict(frozen), "environment": asdict(self.environment)}
        text = json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
        object.__setattr__(self, "_json", text)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, EntryKey) and self._json == other._json

    def __hash__(self) -> int:
        return hash(self._json)

    def field_dict(self) -> dict[str, Any]:
        return dict(self.fields)

    def to_json(self) -> str:
        """Canonical JSON (sorted keys, no spaces, ASCII): equal keys give equal strings."""
        return self._json

    def digest(self) -> str:
        """sha256 hex of the canonical JSON; names the entry's file."""
        return hashlib.sha256(self.to_json().encode("ascii")).hexdigest()

    @classmethod
    def from_json(cls, text: str) -> EntryKey:
        """Inverse of to_json; ValueError when ``text`` is not a key."""
        try:
            document = json.loads(text)
            environment = Environment(**document["environment"])
            return cls(document["kind"], document["name"], document["fields"], environment)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"not a cache key: {exc}") from exc
