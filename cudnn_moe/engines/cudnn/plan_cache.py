"""Persistent cuDNN execution plans: a built grouped-GEMM graph serialized with the frontend's
``graph.serialize()`` and stored in the package's disk cache (``cudnn_moe.cache``).

Key: every GroupedGemmKey field but the device ordinal (rows, k, n, experts, scale layout, offsets
length, compute capability, backend version) plus the environment (GPU name and compute capability,
cuDNN backend and frontend versions, package version), so one entry serves every identical GPU of
the machine and a new driver stack misses instead of loading a stale plan.

Load: ``cudnn.pygraph(handle=...)`` + ``graph.deserialize(handle, list(payload))`` on the key's
device (a handle for an identical GPU is what the frontend requires). A payload that does not
deserialize is reported once (CacheWarning) and replaced by a fresh build. A plan the backend
cannot serialize (cuDNN serializes runtime-compiled engines only) is reported once and built in
every process.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Protocol

import torch

from ...cache import KIND_CUDNN_PLAN, DiskCache, EntryKey, Environment, active_cache, current_environment, record
from ...cache.store import report_once
from ...formats import ScaleLayout
from .grouped_gemm import GroupedFp4Gemm, GroupedGemmKey, build_grouped_fp4_gemm


class PlanSerializer(Protocol):
    """Turns a built plan into bytes and back."""

    def serialize(self, gemm: GroupedFp4Gemm) -> bytes: ...

    def deserialize(self, key: GroupedGemmKey, payload: bytes) -> GroupedFp4Gemm: ...


class CudnnPlanSerializer:
    """The cuDNN frontend's graph serialization (see the module docstring)."""

    def serialize(self, gemm: GroupedFp4Gemm) -> bytes:
        return bytes(gemm.graph.serialize())

    def deserialize(self, key: GroupedGemmKey, payload: bytes) -> GroupedFp4Gemm:
        from .handles import using_handle
        from .probe import MIN_BACKEND, NATIVE_NVFP4_MOE_BACKEND, require_cudnn

        cudnn = require_cudnn(NATIVE_NVFP4_MOE_BACKEND if key.swizzled else MIN_BACKEND)
        data = list(payload)  # the binding takes a sequence of ints, not bytes
        with torch.cuda.device(key.device), using_handle(key.device, torch.cuda.current_stream(key.device).cuda_stream) as handle:
            graph = cudnn.pygraph(handle=handle, is_cuda_graph_replay_expected=True)
            try:
                graph.deserialize(handle, data)
            except TypeError:  # a frontend whose deserialize takes the data alone (the graph's handle)
                graph.deserialize(data)
            return GroupedFp4Gemm(key, graph, int(graph.get_workspace_size()))


CUDNN_SERIALIZER = CudnnPlanSerializer()


@functools.cache
def plan_environment(device: int) -> Environment:
    """The environment a plan built on CUDA device ``device`` is valid in."""
    return current_environment(device, cudnn=True)


def plan_entry_key(key: GroupedGemmKey, environment: Environment) -> EntryKey:
    """The disk-cache key of ``key``'s plan (the device ordinal left out: see the module docstring)."""
    return EntryKey(
        KIND_CUDNN_PLAN,
        f"grouped gemm rows={key.rows} k={key.k} n={key.n} experts={key.num_experts} scales={key.scale_layout.value}",
        {
            "rows": key.rows,
            "k": key.k,
            "n": key.n,
            "num_experts": key.num_experts,
            "scale_layout": key.scale_layout.value,
            "offsets_len": key.offsets_len,
            "arch": list(key.arch),
            "backend": key.backend,
        },
        environment,
    )


def gemm_key_of(entry: EntryKey, device: int) -> GroupedGemmKey:
    """Inverse of plan_entry_key for a plan entry, bound to CUDA device ``device``."""
    if entry.kind != KIND_CUDNN_PLAN:
        raise ValueError(f"{entry.name!r} is a {entry.kind} entry, not a cuDNN plan")
    f = entry.field_dict()
    return GroupedGemmKey(
        rows=f["rows"], k=f["k"], n=f["n"], num_experts=f["num_experts"], scale_layout=ScaleLayout(f["scale_layout"]),
        offsets_len=f["offsets_len"], device=device, arch=tuple(f["arch"]), backend=f["backend"],
    )


def load_or_build(
    key: GroupedGemmKey,
    build: Callable[[GroupedGemmKey], GroupedFp4Gemm],
    disk: DiskCache | None,
    serializer: PlanSerializer = CUDNN_SERIALIZER,
    environment: Environment | None = None,
) -> tuple[GroupedFp4Gemm, str]:
    """(plan, 'disk' or 'built') for ``key``: deserialized from ``disk``, else built and stored.

    A stored payload that fails to deserialize is reported once and replaced by the fresh build;
    a plan that cannot be serialized or a cache that cannot be written is reported once and the
    built plan returned. Errors of ``build`` propagate.
    """
    if disk is None:
        return build(key), "built"
    entry = plan_entry_key(key, plan_environment(key.device) if environment is None else environment)
    payload = disk.get(entry)
    if payload is not None:
        try:
            return serializer.deserialize(key, payload), "disk"
        except Exception as exc:  # the frontend reports a bad payload as several exception types
            report_once(str(disk.path_for(entry)),
                        f"cannot deserialize the cached plan {entry.name} ({type(exc).__name__}: {exc}); rebuilding it")
    gemm = build(key)
    try:
        data = serializer.serialize(gemm)
    except Exception as exc:
        report_once(f"serialize {entry.name}",
                    f"the plan {entry.name} cannot be serialized ({type(exc).__name__}: {exc}); it is built in every process")
        return gemm, "built"
    disk.put_or_report(entry, data)
    return gemm, "built"


_cache: dict[GroupedGemmKey, GroupedFp4Gemm] = {}
_cache_lock = threading.Lock()


def graph_for(key: GroupedGemmKey) -> GroupedFp4Gemm:
    """The built graph for ``key``: from the in-process cache, else the persistent cache
    (``cudnn_moe.cache.active_cache()``, load_or_build), else built now and stored (outside the lock)."""
    with _cache_lock:
        gemm = _cache.get(key)
    if gemm is not None:
        return gemm
    gemm, source = load_or_build(key, build_grouped_fp4_gemm, active_cache())
    record(KIND_CUDNN_PLAN, source)
    with _cache_lock:
        return _cache.setdefault(key, gemm)  # a racing thread's plan wins; ours is dropped
