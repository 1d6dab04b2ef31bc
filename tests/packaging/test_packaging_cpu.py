"""CPU checks of the wheel's contents as pyproject.toml declares them (no build): the package-data globs,
expanded the way setuptools' build_py expands them (glob(recursive=True), files only), match every file of
kernels_cuda/ and graphs/; every Python package under cudnn_moe/ is listed; every kernel file the code
names is shipped. scripts/check_wheel.sh builds and installs the real wheel and checks it the same way."""

from __future__ import annotations

import glob
import os
import re
from pathlib import Path

import pytest

from tests.support import REPO as ROOT

tomllib = pytest.importorskip("tomllib")

SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
KERNELS_PACKAGE, GRAPHS_PACKAGE = "cudnn_moe._kernels_cuda", "cudnn_moe._graphs"
# A kernel file named in the code: a string literal such as "sort.cu" or "low_latency/ll_moe.cu".
KERNEL_LITERAL = re.compile(r"""["']([\w./-]+\.cuh?)["']""")


def source_dir(package: str) -> Path:
    """The folder setuptools takes ``package`` from (package-dir, else the dotted path)."""
    mapped = SETUPTOOLS.get("package-dir", {}).get(package)
    return ROOT / (mapped if mapped is not None else package.replace(".", "/"))


def shipped(package: str) -> set[str]:
    """Files of ``package``'s folder that its package-data patterns match, relative, as build_py finds them."""
    folder = source_dir(package)
    found = set()
    for pattern in SETUPTOOLS.get("package-data", {}).get(package, []):
        for match in glob.glob(os.path.join(glob.escape(str(folder)), pattern), recursive=True):
            if os.path.isfile(match):
                found.add(Path(match).relative_to(folder).as_posix())
    return found


def tree(folder: Path) -> set[str]:
    """Every file under ``folder``, relative (caches of tools left out)."""
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"}


@pytest.mark.parametrize("package", [KERNELS_PACKAGE, GRAPHS_PACKAGE])
def test_package_data_ships_every_file(package: str) -> None:
    files = tree(source_dir(package))
    assert files, f"{source_dir(package)} is empty"
    missing = sorted(files - shipped(package))
    assert not missing, (f"pyproject.toml [tool.setuptools.package-data] {package!r} leaves out {missing}: the wheel "
                         "would lack them (add a pattern; a new header extension also needs the loader's digest)")


def test_kernel_sources_sit_in_subfolders_too() -> None:
    """The case the recursive globs are for: sources below the top folder (sm90/, low_latency/) are shipped."""
    nested = {f for f in tree(source_dir(KERNELS_PACKAGE)) if "/" in f}
    assert {"sm90/grouped_gemm.cu", "low_latency/ll_moe.cu", "low_latency/decode.cuh"} <= nested
    assert nested <= shipped(KERNELS_PACKAGE)


def test_every_python_package_is_listed() -> None:
    found = {p.parent.relative_to(ROOT).as_posix().replace("/", ".") for p in (ROOT / "cudnn_moe").rglob("__init__.py")}
    listed = set(SETUPTOOLS["packages"]) - {KERNELS_PACKAGE, GRAPHS_PACKAGE}
    assert found == listed, f"not in pyproject's packages: {sorted(found - listed)}; listed, absent: {sorted(listed - found)}"


def test_every_kernel_file_the_code_names_is_shipped() -> None:
    """Every "x.cu" literal in cudnn_moe/ (launch, load_module, kernel_function, SOURCE constants) is a shipped file."""
    named = {name for path in (ROOT / "cudnn_moe").rglob("*.py") for name in KERNEL_LITERAL.findall(path.read_text())}
    assert {"sort.cu", "sm90/grouped_gemm.cu", "low_latency/ll_moe.cu"} <= named
    assert named <= shipped(KERNELS_PACKAGE), sorted(named - shipped(KERNELS_PACKAGE))


def test_every_kernel_include_is_shipped() -> None:
    """Each #include "..." of a shipped source resolves, next to the file or on the loader's -I path, to a shipped file."""
    folder, files = source_dir(KERNELS_PACKAGE), shipped(KERNELS_PACKAGE)
    for name in files:
        for include in re.findall(r'^\s*#\s*include\s+"([^"]+)"', (folder / name).read_text(), re.M):
            beside = Path(os.path.normpath(Path(name).parent / include)).as_posix()
            assert beside in files or include in files, f"{name} includes {include!r}, which the wheel lacks"
