"""The constants shared by Python and CUDA have one source (cudnn_moe.kernels.codes): every such name a
CUDA source uses is passed as a -D option, no source defines one itself, and the values are the Python ones."""

from __future__ import annotations

import re

from cudnn_moe.activations import ActivationKind
from cudnn_moe.kernels import cuda_defines, kernels_dir
from cudnn_moe.kernels.codes import RoutingFormat, TokenLayout

SHARED_NAME = re.compile(r"\b((?:ACT|ROUTING|TOKENS)_[A-Z0-9_]+|SORT_THREADS|SORT_MAX_EXPERTS)\b")


def _defines() -> dict[str, int]:
    return {name: int(value) for name, value in (option[2:].split("=") for option in cuda_defines())}


def _sources() -> dict[str, str]:
    root = kernels_dir()
    return {path.relative_to(root).as_posix(): path.read_text() for path in root.rglob("*.cu*")}


def test_every_shared_name_used_in_cuda_is_defined_by_python() -> None:
    defines = _defines()
    used = {name for text in _sources().values() for name in SHARED_NAME.findall(text)}
    assert used, "the scan found no shared names"
    assert used <= set(defines), sorted(used - set(defines))


def test_no_source_defines_a_shared_name() -> None:
    for path, text in _sources().items():
        redefined = re.findall(r"#\s*define\s+" + SHARED_NAME.pattern, text)
        assert not redefined, f"{path} defines {redefined}"


def test_values_are_the_python_enums() -> None:
    defines = _defines()
    assert {k: v for k, v in defines.items() if k.startswith("ACT_")} == {f"ACT_{a.name}": int(a) for a in ActivationKind}
    assert defines["ROUTING_PACKED"] == RoutingFormat.PACKED and defines["TOKENS_BF16_FRAGMENTS"] == TokenLayout.BF16_FRAGMENTS
    assert defines["SORT_THREADS"] % 32 == 0 and defines["SORT_MAX_EXPERTS"] <= defines["SORT_THREADS"]
