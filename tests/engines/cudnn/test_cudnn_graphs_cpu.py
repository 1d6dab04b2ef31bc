"""CPU checks of the cuDNN graph layer: keys, per-arch choices, buffer sizes, the import probe,
and (where the frontend is installed) the graph declaration itself."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest

from cudnn_moe.engines.base import WeightLayout
from cudnn_moe.engines.cudnn import (
    CudnnGemmEngine,
    GroupedGemmKey,
    ScaleLayout,
    offsets_len_for,
    probe,
    segmented_scale_rows,
    token_scale_bytes,
    weight_scale_shape,
)

SM90, SM100, SM103 = (9, 0), (10, 0), (10, 3)


def make_key(**overrides) -> GroupedGemmKey:
    fields = dict(
        rows=256,
        k=2048,
        n=1536,
        num_experts=8,
        scale_layout=ScaleLayout.LINEAR,
        offsets_len=8,
        device=0,
        arch=SM90,
        backend=91900,
    )
    fields.update(overrides)
    return GroupedGemmKey(**fields)


def test_key_equality_and_hash():
    assert make_key() == make_key()
    assert hash(make_key()) == hash(make_key())
    cache = {make_key(): "built"}
    assert cache[make_key()] == "built"
    for change in (dict(rows=512), dict(n=768), dict(device=1), dict(backend=92800), dict(offsets_len=9), dict(arch=(9, 1))):
        assert make_key(**change) != make_key()
        assert make_key(**change) not in cache


@pytest.mark.parametrize(
    "overrides",
    [
        dict(k=2040),  # not a multiple of 16
        dict(rows=0),
        dict(offsets_len=7),
        dict(num_experts=1, offsets_len=1),  # one expert needs explicit boundaries
        dict(scale_layout=ScaleLayout.SWIZZLED_128X4, rows=200, offsets_len=9, arch=SM100, backend=92100),
    ],
)
def test_key_rejects_bad_shapes(overrides):
    with pytest.raises(ValueError):
        make_key(**overrides)


def test_key_is_frozen():
    with pytest.raises(AttributeError):
        make_key().rows = 128  # type: ignore[misc]


@pytest.mark.parametrize(
    "arch, backend, experts, expected",
    [
        (SM90, 91900, 8, 8),  # 9.19 rejects E+1 on SM90: segment starts only
        (SM90, 92700, 8, 8),
        (SM90, 92800, 8, 9),  # 9.28 takes explicit boundaries
        (SM100, 92100, 8, 9),
        (SM103, 92100, 128, 129),
        (SM90, 91900, 1, 2),  # a single expert is explicit-only
    ],
)
def test_offsets_len(arch, backend, experts, expected):
    assert offsets_len_for(experts, arch, backend) == expected


@pytest.mark.parametrize("arch, alignment, layout", [(SM90, 8, WeightLayout.LINEAR), (SM100, 128, WeightLayout.SWIZZLED_128X4), (SM103, 128, WeightLayout.SWIZZLED_128X4)])
def test_arch_choices(arch, alignment, layout):
    spec = CudnnGemmEngine.spec(arch)
    assert spec.row_alignment == alignment
    assert spec.weight_layout is layout


def test_segmented_scale_rows():
    assert segmented_scale_rows(256, 1) == 256
    assert segmented_scale_rows(256, 2) == 3 * 128  # e.g. 1 + 255 rows: one atom + two atoms
    assert segmented_scale_rows(130, 2) == 3 * 128
    assert segmented_scale_rows(128, 128) == 128 * 128  # every one of 128 groups may hold one row
    assert segmented_scale_rows(4096, 256) == 128 * (256 + 3840 // 128)


def test_scale_buffer_sizes():
    assert token_scale_bytes(96, 2048, ScaleLayout.LINEAR, 8) == 96 * 128
    assert weight_scale_shape(8, 1536, 2048, ScaleLayout.LINEAR) == (8, 1536, 128)
    # swizzled: rows to 128, K/16 columns to 4, token rows to the per-segment worst case
    assert weight_scale_shape(8, 2880, 2880, ScaleLayout.SWIZZLED_128X4) == (8, 2944, 180)
    assert weight_scale_shape(4, 256, 160, ScaleLayout.SWIZZLED_128X4) == (4, 256, 12)
    assert token_scale_bytes(256, 160, ScaleLayout.SWIZZLED_128X4, 1) == 256 * 12
    assert token_scale_bytes(256, 2048, ScaleLayout.SWIZZLED_128X4, 8) == segmented_scale_rows(256, 8) * 128


@pytest.fixture
def fake_cudnn(monkeypatch):
    """Install a stand-in `cudnn` module; tests set its version attributes."""
    module = types.ModuleType("cudnn")
    module.__version__ = "1.32.0"
    module.backend_version = lambda: 91900
    monkeypatch.setitem(sys.modules, "cudnn", module)
    return module


def test_probe_without_cudnn(monkeypatch):
    monkeypatch.setitem(sys.modules, "cudnn", None)  # makes `import cudnn` raise ImportError
    with pytest.raises(RuntimeError, match=r"cudnn-moe\[cu12\].*cudnn-moe\[cu13\]"):
        probe.require_cudnn()
    with pytest.raises(RuntimeError, match="nvidia-cudnn-frontend>=1.32"):
        probe.backend_version()


def test_probe_versions(fake_cudnn):
    assert probe.backend_version() == 91900
    assert probe.require_cudnn() is fake_cudnn
    with pytest.raises(RuntimeError, match=r"cuDNN 9\.19\.0 is loaded but this needs cuDNN >= 9\.21\.0"):
        probe.require_cudnn(probe.NATIVE_NVFP4_MOE_BACKEND)
    fake_cudnn.__version__ = "1.31.2"
    with pytest.raises(RuntimeError, match="too old"):
        probe.require_cudnn()


def test_probe_library_missing(fake_cudnn):
    def missing():
        raise RuntimeError("Unable to find symbol cudnnGetVersion")

    fake_cudnn.backend_version = missing
    with pytest.raises(RuntimeError, match="could not be loaded.*nvidia-cudnn-cu12"):
        probe.require_cudnn()


def test_import_does_not_need_cudnn():
    code = "import sys; sys.modules['cudnn'] = None; import cudnn_moe.engines, cudnn_moe.engines.cudnn, cudnn_moe"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("layout, arch, backend", [(ScaleLayout.LINEAR, SM90, 91900), (ScaleLayout.SWIZZLED_128X4, SM100, 92100)])
def test_graph_declaration(layout, arch, backend):
    """The declared graph, checked by the frontend's own python validators (no GPU, no libcudnn)."""
    cudnn = pytest.importorskip("cudnn")
    from cudnn._gemm_validate import validate_graph

    from cudnn_moe.engines.cudnn.grouped_gemm import UID, declare_graph, dequant_dtypes

    key = make_key(rows=256, k=160, n=200, num_experts=4, scale_layout=layout, offsets_len=offsets_len_for(4, arch, backend), arch=arch, backend=backend)
    dequant = getattr(cudnn.data_type, dequant_dtypes(layout)[0])
    graph = declare_graph(cudnn, key, dequant)
    assert validate_graph(graph)
    tensors = {t.uid: t for t in graph.get_inputs()}
    assert sorted(tensors) == sorted(int(u) for u in UID if u is not UID.OUTPUT)
    assert tensors[UID.TOKEN].dim == [1, 256, 160] and tensors[UID.TOKEN].data_type == cudnn.data_type.FP4_E2M1
    assert tensors[UID.WEIGHT].stride == [160 * 200, 1, 160]
    token_scale, weight_scale = tensors[UID.TOKEN_SCALE], tensors[UID.WEIGHT_SCALE]
    if layout is ScaleLayout.SWIZZLED_128X4:
        assert token_scale.dim == [1, 256, 12] and weight_scale.dim == [4, 12, 256]
        assert token_scale.reordering_type == weight_scale.reordering_type == cudnn.tensor_reordering.F8_128x4
    else:
        assert token_scale.dim == [1, 256, 10] and weight_scale.dim == [4, 10, 200]
        assert token_scale.reordering_type is None
    assert weight_scale.stride == [weight_scale.dim[1] * weight_scale.dim[2], 1, weight_scale.dim[1]]
    assert tensors[UID.FIRST_TOKEN_OFFSET].dim == [key.offsets_len, 1, 1]
    (out,) = graph.get_outputs()
    assert (out.uid, out.dim, out.data_type) == (UID.OUTPUT, [1, 256, 200], cudnn.data_type.FLOAT)
    dequants = [node for node in graph.nodes if node.outputs["OUT_0"].is_virtual]
    assert [node.params["block_size"] for node in dequants] == [[1, 16], [16, 1]]
    assert all(node.outputs["OUT_0"].data_type == dequant for node in dequants)
