"""Smoke test of an installed (non-editable) cudnn-moe wheel, run by scripts/check_wheel.sh with the Python of a
fresh virtual environment, from a folder outside the checkout:

    python scripts/wheel_smoke.py CHECKOUT

Checks that the package imports from that environment (not from CHECKOUT); that the kernel loader finds its
sources in the installed package and that every kernel file there equals the checkout's kernels_cuda/ (same set of
.cu / .cuh files, same bytes); that module_source, the loader's own reader, reads every .cu (and the header digest
it prefixes equals the checkout's); that every kernel file the installed code names ("x.cu" literals: launch,
load_module, kernel_function, SOURCE constants) and every #include resolve; that the graph presets are installed;
that the installed Python modules are the checkout's; and runs the CPU float reference on a tiny NVFP4 layer.
Exit status 0 when all hold; an AssertionError names the first that does not.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import time
from pathlib import Path

KERNEL_LITERAL = re.compile(r"""["']([\w./-]+\.cuh?)["']""")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def files(folder: Path, suffixes: tuple[str, ...]) -> dict[str, Path]:
    """Relative posix path -> file, for the files under ``folder`` with one of ``suffixes``."""
    return {p.relative_to(folder).as_posix(): p for p in sorted(folder.rglob("*"))
            if p.is_file() and p.suffix in suffixes and "__pycache__" not in p.parts}


def header_digest(folder: Path) -> str:
    """The digest module_source prefixes, computed independently over ``folder``'s headers."""
    digest = hashlib.sha256()
    for header in sorted(folder.rglob("*.cuh")):
        digest.update(header.relative_to(folder).as_posix().encode())
        digest.update(header.read_bytes())
    return digest.hexdigest()


def check_install(checkout: Path) -> Path:
    import cudnn_moe

    package = Path(cudnn_moe.__file__).resolve().parent
    assert checkout not in package.parents, f"cudnn_moe imported from the checkout ({package}), not the wheel"
    assert Path(sys.prefix).resolve() in package.parents, f"cudnn_moe at {package}, outside {sys.prefix}"
    assert not (package / "__editable__").exists() and "__editable__" not in str(package), package
    print(f"cudnn_moe {cudnn_moe.__version__} from {package}")
    return package


def check_python_modules(package: Path, checkout: Path) -> None:
    installed = set(files(package, (".py",))) - {n for n in files(package, (".py",)) if n.startswith("_kernels_cuda/")}
    wanted = set(files(checkout / "cudnn_moe", (".py",)))
    assert installed == wanted, f"modules missing {sorted(wanted - installed)}, extra {sorted(installed - wanted)}"
    print(f"python modules: {len(installed)}, as in the checkout")


def check_kernels(package: Path, checkout: Path) -> None:
    from cudnn_moe.kernels.loader import compile_options, kernels_dir, module_source

    root = kernels_dir()
    assert root == package / "_kernels_cuda", f"the loader reads kernels from {root}, not the installed package"
    assert f"-I{root}" in compile_options(), compile_options()
    installed = files(root, (".cu", ".cuh"))
    wanted = files(checkout / "kernels_cuda", (".cu", ".cuh"))
    assert set(installed) == set(wanted), (f"kernel files missing from the wheel {sorted(set(wanted) - set(installed))}, "
                                           f"extra {sorted(set(installed) - set(wanted))}")
    for name, path in installed.items():
        assert path.read_bytes() == wanted[name].read_bytes(), f"{name} differs from the checkout's"

    digest = header_digest(checkout / "kernels_cuda")
    sources = sorted(name for name in installed if name.endswith(".cu"))
    for name in sources:
        text = module_source(name)
        first, _, body = text.partition("\n")
        assert first == f"// headers sha256 {digest}", f"{name}: header digest {first!r}, checkout's {digest}"
        assert body == wanted[name].read_text(), f"module_source({name!r}) is not the file"

    named = {m for path in package.rglob("*.py") for m in KERNEL_LITERAL.findall(path.read_text())}
    for name in sorted(named):
        assert name in installed, f"the code names {name!r}, which the wheel lacks"
        if name.endswith(".cu"):
            module_source(name)
    for name, path in installed.items():
        for include in INCLUDE.findall(path.read_text()):
            beside = Path(os.path.normpath(Path(name).parent / include)).as_posix()
            assert beside in installed or include in installed, f"{name} includes {include!r}, not in the wheel"
    print(f"kernels: {len(installed)} files in {root}, {len(sources)} sources read by module_source, "
          f"{len(named)} names in the code resolved: {', '.join(sorted(named))}")


def check_presets(package: Path) -> None:
    from cudnn_moe.prebuild import PRESETS_FILE, load_presets

    assert PRESETS_FILE.resolve() == package / "_graphs" / "presets.json", PRESETS_FILE
    presets = json.loads(PRESETS_FILE.read_text())
    assert presets, "no presets"
    load_presets(PRESETS_FILE)
    print(f"presets: {len(presets)} in {PRESETS_FILE}")


def check_reference() -> None:
    import torch

    from cudnn_moe import Routing, reference_moe
    from cudnn_moe.formats import quantize_nvfp4

    experts, hidden, inter, top_k, tokens = 4, 64, 32, 2, 5
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=gen)
    w1 = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) / inter**0.5
    ids = torch.rand(tokens, experts, generator=gen).argsort(dim=1)[:, :top_k].to(torch.int32)
    weights = torch.softmax(torch.randn(tokens, top_k, generator=gen), dim=1)
    ones = torch.ones(experts)
    start = time.perf_counter()
    out = reference_moe(*quantize_nvfp4(x), *quantize_nvfp4(w1), ones, *quantize_nvfp4(w2), ones,
                        Routing.unpacked(ids, weights), "swiglu")
    assert out.shape == (tokens, hidden) and out.dtype == torch.float64, (out.shape, out.dtype)
    assert bool(out.isfinite().all()) and float(out.abs().max()) > 0
    print(f"reference_moe: E{experts} H{hidden} I{inter} top-{top_k} T{tokens} -> {tuple(out.shape)}, "
          f"rms {float(out.pow(2).mean().sqrt()):.4f}, {(time.perf_counter() - start) * 1e3:.0f} ms")


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    checkout = Path(sys.argv[1]).resolve()
    assert Path.cwd().resolve() != checkout and checkout not in Path.cwd().resolve().parents, \
        "run from outside the checkout, so that it is not importable"
    package = check_install(checkout)
    check_python_modules(package, checkout)
    check_kernels(package, checkout)
    check_presets(package)
    check_reference()
    print("wheel smoke test: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
