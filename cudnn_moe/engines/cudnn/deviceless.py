"""Checking the cuDNN engine's graphs for another GPU than the one present: cuDNN's deviceless
("ahead of time") device properties.

The SM100 graphs (F8_128x4 scales, E+1 offsets, 128-row segments) can only run on Blackwell, but
cuDNN can judge them anywhere: the graph is declared by the same ``declare_graph`` that builds it for
execution, with device properties whose compute capability says SM100 in place of a handle, and
cuDNN's operation-graph build, heuristics and support checks run as they would on that GPU. Building
the plans then needs the SM100 kernel itself, which a non-Blackwell card refuses with "no kernel
image is available"; on an SM100 card the plans build.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ...arch import Arch
from .grouped_gemm import GroupedGemmKey, declare_graph, dequant_dtypes
from .probe import MIN_BACKEND, NATIVE_NVFP4_MOE_BACKEND, require_cudnn

_VERSION_FIELD = "devicever"  # the compute-capability field of cuDNN's device-properties JSON (major * 100 + minor * 10)


def _set_device_version(node: Any, version: int) -> bool:
    """Set every compute-capability field of the JSON tree ``node`` to ``version``; whether one was found."""
    found = False
    if isinstance(node, dict):
        for name, value in node.items():
            if name.lower().replace("_", "") == _VERSION_FIELD and isinstance(value, int):
                node[name] = version
                found = True
            else:
                found |= _set_device_version(value, version)
    elif isinstance(node, list):
        for value in node:
            found |= _set_device_version(value, version)
    return found


def device_properties_for(arch: Arch, template_device: int = 0) -> Any:
    """cuDNN device properties of this machine's GPU ``template_device`` with the compute capability
    replaced by ``arch`` (SM counts, memory and clocks stay those of the template)."""
    cudnn = require_cudnn(NATIVE_NVFP4_MOE_BACKEND)
    data = json.loads(cudnn.create_device_properties(template_device).serialize())
    if not _set_device_version(data, arch[0] * 100 + arch[1] * 10):
        raise RuntimeError(f"no compute-capability field in cuDNN's device properties (keys: {sorted(data)})")
    return cudnn.create_device_properties(json.dumps(data))


@dataclass(frozen=True)
class SupportReport:
    """What cuDNN said of one graph declared for another GPU.

    supported: the operation graph built and some plan passed check_support. plans: execution plans
    cuDNN proposed (-1 where the frontend does not report the count). build: 'built', or the error text of build_plans (on a GPU without the
    target's kernels this is expected to say "no kernel image").
    """

    key: GroupedGemmKey
    dequant: str
    supported: bool
    plans: int
    build: str

    @property
    def only_missing_kernel_image(self) -> bool:
        """True when everything passed but loading the target GPU's kernel on this one."""
        return self.supported and (self.build == "built" or "no kernel image" in self.build.lower())


def check_graph_support(key: GroupedGemmKey, device_property: Any) -> list[SupportReport]:
    """Declare ``key``'s graph for ``device_property`` once per dequantize data type the engine tries,
    run cuDNN's support checks and try to build the plans."""
    cudnn = require_cudnn(NATIVE_NVFP4_MOE_BACKEND if key.swizzled else MIN_BACKEND)
    reports = []
    for name in dequant_dtypes(key.scale_layout):
        graph = declare_graph(cudnn, key, getattr(cudnn.data_type, name), device_property=device_property)
        supported, plans = False, 0
        try:
            graph.validate()
            graph.build_operation_graph()
            graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
            plans = int(graph.get_execution_plan_count()) if hasattr(graph, "get_execution_plan_count") else -1
            graph.check_support()
            supported = True
            graph.build_plans()
            build = "built"
        except Exception as exc:  # cuDNN reports declines as several exception types
            build = f"{type(exc).__name__}: {exc}"
        reports.append(SupportReport(key, name, supported, plans, build))
    return reports
