"""The ctypes driver binding of the kernel loader, on a machine without a GPU: a missing driver library is a
clear error, every call the loader makes has a declared signature, and loading the loader imports no CuPy."""

from __future__ import annotations

import ctypes
import subprocess
import sys

import pytest

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
