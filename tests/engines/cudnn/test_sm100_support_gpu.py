"""cuDNN itself checks the SM100 graphs of every preset (issue: the SM100 path is never run here).

Each preset's GEMM1 and GEMM2, at 128 rows, 32768 rows and the row capacity of a 4096-token bucket, is
declared through the engine's own graph code (``declare_graph``) for cuDNN device properties that say
SM100, with each dequantize data type the engine tries. cuDNN's operation-graph build and support
checks must pass; building the plans may fail only because this card has no SM100 kernel image (on a
Blackwell card the plans must build). Needs cuDNN >= 9.21 (the native NVFP4 MoE engines).
"""

from __future__ import annotations

import json

import pytest
import torch

from cudnn_moe.arch import SM100, device_arch, is_blackwell
from cudnn_moe.engines.cudnn import CudnnGemmEngine, GroupedGemmKey, ScaleLayout
from cudnn_moe.pipeline.executor import row_capacity
from tests.support import REPO

pytestmark = pytest.mark.gpu

PRESETS = json.loads((REPO / "graphs" / "presets.json").read_text())
ALIGN = CudnnGemmEngine.spec(SM100).row_alignment


def _backend() -> int:
    from cudnn_moe.engines.cudnn.probe import NATIVE_NVFP4_MOE_BACKEND, backend_version, format_version

    backend = backend_version()
    if backend < NATIVE_NVFP4_MOE_BACKEND:
        pytest.skip(f"cuDNN {format_version(backend)} is loaded; the SM100 NVFP4 MoE graphs need >= 9.21")
    return backend


def _keys(preset: dict, backend: int) -> list[GroupedGemmKey]:
    experts, hidden, inter = preset["experts"], preset["hidden"], preset["intermediate"]
    rows = sorted({128, 32768, row_capacity(4096, preset["top_k"], experts, ALIGN)})
    return [
        GroupedGemmKey(rows=r, k=k, n=n, num_experts=experts, scale_layout=ScaleLayout.SWIZZLED_128X4,
                       offsets_len=experts + 1, device=torch.cuda.current_device(), arch=SM100, backend=backend)
        for r in rows
        for k, n in ((hidden, 2 * inter), (inter, hidden))
    ]


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_sm100_graphs_pass_cudnn_support_checks(name):
    from cudnn_moe.engines.cudnn.deviceless import check_graph_support, device_properties_for

    backend = _backend()
    properties = device_properties_for(SM100)
    on_blackwell = is_blackwell(device_arch())
    failures = []
    for key in _keys(PRESETS[name], backend):
        for report in check_graph_support(key, properties):
            ok = report.build == "built" if on_blackwell else report.only_missing_kernel_image
            print(f"{key.describe()} dequant {report.dequant}: supported={report.supported} plans={report.plans} "
                  f"build={report.build[:120]}")
            if not ok:
                failures.append(f"{key.describe()} ({report.dequant}): {report.build}")
    assert not failures, "\n".join(failures)
