"""The ctypes driver binding of the kernel loader, on a machine without a GPU: a missing driver library is a
clear error, every call the loader makes has a declared signature, and loading the loader imports no CuPy."""

from __future__ import annotations

import ctypes
import subprocess
import sys

import pytest

from cudnn_moe import arch
from cudnn_moe.kernels import driver


def test_missing_driver_library_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    driver._library.cache_clear()

    def no_library(name: str) -> None:
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", no_library)
    try:
        with pytest.raises(driver.CudaDriverError, match="cannot load the CUDA driver library libcuda.so.1"):
            driver.driver_version()
    finally:
        driver._library.cache_clear()


def test_every_call_has_a_signature() -> None:
    import inspect

    source = inspect.getsource(driver)
    called = {name for name in driver._SIGNATURES if f".{name}(" in source}
    assert called == set(driver._SIGNATURES), set(driver._SIGNATURES) - called


def test_importing_the_loader_imports_no_cupy() -> None:
    code = ("import sys; import cudnn_moe, cudnn_moe.kernels.loader, cudnn_moe.cache.keys; "
            "sys.exit('cupy' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


_LAYOUT_PROBE = r"""
#include <cuda.h>
#include <stddef.h>
#include <stdio.h>
int main() {
  printf("%zu %zu %zu %zu %zu %zu %d\n", sizeof(CUlaunchAttribute), offsetof(CUlaunchAttribute, value),
         sizeof(CUlaunchConfig), offsetof(CUlaunchConfig, hStream), offsetof(CUlaunchConfig, attrs),
         offsetof(CUlaunchConfig, numAttrs), (int)CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION);
  return 0;
}
"""


def test_launch_structs_match_cuda_h(tmp_path) -> None:
    """The ctypes CUlaunchConfig / CUlaunchAttribute of the programmatic launch have cuda.h's layout."""
    from tests.support.kernel_sources import NVCC

    if NVCC is None:
        pytest.skip("nvcc not found (it brings cuda.h)")
    source, binary = tmp_path / "probe.cpp", tmp_path / "probe"
    source.write_text(_LAYOUT_PROBE)
    subprocess.run([NVCC, str(source), "-o", str(binary)], check=True, capture_output=True)
    fields = [int(v) for v in subprocess.run([str(binary)], check=True, capture_output=True, text=True).stdout.split()]
    config = driver._LaunchConfig
    assert fields == [ctypes.sizeof(driver._LaunchAttribute), driver._LaunchAttribute.value.offset,
                      ctypes.sizeof(config), config.stream.offset, config.attrs.offset, config.num_attrs.offset,
                      driver.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION]


def test_every_kernel_waits_for_its_predecessor_first() -> None:
    """Kernels launch with programmatic stream serialization on SM90+, so each must call grid_dependency_begin
    (griddepcontrol.wait) before anything else touches memory: it is the first statement of every kernel but the SM90
    decode kernel, whose statements before it touch no memory outside its documented SM90_EARLY block (macro
    definitions and register arithmetic only)."""
    import re

    from cudnn_moe.kernels import kernels_dir

    found = 0
    for path in sorted(kernels_dir().rglob("*.cu")):
        source = path.read_text()
        for match in re.finditer(r'extern "C" __global__', source):
            body = source[source.index("{", match.end()) + 1:]
            found += 1
            if body.lstrip().startswith("moe::grid_dependency_begin();"):
                continue
            name = re.search(r"\b(?!__launch_bounds__)(\w+)\(", source[match.end():]).group(1)
            assert name == "sm90_gemm_decode", f"{path.name}: {body[:80]!r}"
            before = body[: body.index("moe::grid_dependency_begin();")]
            before = re.sub(r"#ifdef SM90_EARLY\n.*?#endif\n", "", before, count=1, flags=re.S)  # the exception
            before = re.sub(r"#define .*?[^\\]\n", "", before, flags=re.S)  # macro bodies run later
            assert not re.search(r"ldg|__ld|cp_async|\[|early_", before), before
    assert found >= 15


def test_programmatic_launch_can_be_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from cudnn_moe.kernels import loader

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (9, 0))
    for value, expected in (("0", False), ("1", True), (None, True)):
        loader.programmatic_launch.cache_clear()
        if value is None:
            monkeypatch.delenv(loader.PDL_ENV_VAR, raising=False)
        else:
            monkeypatch.setenv(loader.PDL_ENV_VAR, value)
        assert loader.programmatic_launch(0) is expected
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (8, 0))
    loader.programmatic_launch.cache_clear()
    assert loader.programmatic_launch(0) is False
    loader.programmatic_launch.cache_clear()


@pytest.mark.parametrize("khz,bits,tbs", [(2_619_000, 5120, 3.352), (3_201_000, 6144, 4.917)])  # H100 SXM, H200
def test_peak_dram_bandwidth_from_the_memory_clock_and_bus_width(monkeypatch: pytest.MonkeyPatch, khz: int, bits: int,
                                                                 tbs: float) -> None:
    """peak_dram_tbs: two transfers a memory clock over the bus, from the driver's attributes of that device."""
    asked = []

    def attribute(device: int, which: int) -> int:
        asked.append((device, which))
        return {driver.CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE: khz,
                driver.CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH: bits}[which]

    monkeypatch.setattr(driver, "device_attribute", attribute)
    arch._peak_dram_tbs.cache_clear()
    try:
        assert arch.peak_dram_tbs(3) == pytest.approx(tbs, abs=1e-3)
        assert {device for device, _ in asked} == {3}
    finally:
        arch._peak_dram_tbs.cache_clear()
