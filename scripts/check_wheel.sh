#!/usr/bin/env bash
# Build the user wheel, install it (not editable) into a fresh virtual environment and smoke-test it from a folder
# outside the checkout (scripts/wheel_smoke.py: the kernel sources the loader can load, the presets, the modules,
# the CPU float reference; then the `cudnn-moe demo` console script). No GPU needed. Run by .ci/run after `make test`.
#
#   bash scripts/check_wheel.sh
#
# BUILD_PYTHON  builds the wheel with --no-build-isolation: its environment gets pyproject's [build-system] requires
#               (pip installs them only when missing). Default: .venv/bin/python (made by `make test`), else python3.
# PYTHON        makes the fresh environment (default python3). TORCH_CPU / TORCH_INDEX as in the Makefile: the CPU
#               torch installed there first (a local wheel where the machine has one; --no-compile: no .pyc, faster).
# KEEP_WHEEL=DIR  also copy the built wheel into DIR.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-python3}
BUILD_PYTHON=${BUILD_PYTHON:-$([ -x "$ROOT/.venv/bin/python" ] && echo "$ROOT/.venv/bin/python" || echo "$PYTHON")}
TORCH_CPU=${TORCH_CPU:-torch==2.13.0}
TORCH_INDEX=${TORCH_INDEX:-}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/cudnn-moe-wheel.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
START=$SECONDS

quiet_pip() {  # pip, less the warnings about configured index folders that do not hold a package
    "$@" 2>&1 | { grep -v "^WARNING: Location '.*' is ignored" || true; }
}

step() {  # step NAME COMMAND...: run it and print how long it took
    local name=$1 begin=$SECONDS
    shift
    echo "== wheel check: $name"
    "$@"
    echo "== wheel check: $name: $((SECONDS - begin)) s"
}

copy_sources() {  # the files git tracks or would track (no .venv, build/ or *.egg-info), so no stale output ships
    mkdir -p "$WORK/src"
    if git -C "$ROOT" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
        (cd "$ROOT" && git ls-files -z --cached --others --exclude-standard |
            while IFS= read -r -d '' path; do [ -f "$path" ] && printf '%s\0' "$path"; done |
            tar --null -T - -cf -) | tar -xf - -C "$WORK/src"
    else
        tar -C "$ROOT" --exclude=./.venv --exclude=./build --exclude='*.egg-info' -cf - . | tar -xf - -C "$WORK/src"
    fi
}

build_wheel() {
    local requires
    requires=$("$BUILD_PYTHON" -c '
import ast, re, sys
text = open(sys.argv[1]).read()
try:
    import tomllib
    requires = tomllib.loads(text)["build-system"]["requires"]
except ImportError:  # Python 3.10: the list of [build-system]
    requires = ast.literal_eval(re.search(r"\[build-system\][^\[]*?requires\s*=\s*(\[[^\]]*\])", text).group(1))
print("\n".join(requires))' "$WORK/src/pyproject.toml")
    mapfile -t requires <<<"$requires"
    quiet_pip "$BUILD_PYTHON" -m pip install -q "${requires[@]}"
    quiet_pip "$BUILD_PYTHON" -m pip wheel -q --no-deps --no-build-isolation -w "$WORK/dist" "$WORK/src"
    WHEEL=$(ls "$WORK"/dist/cudnn_moe-*.whl)
    "$BUILD_PYTHON" - "$WHEEL" <<'EOF'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
kernels = sorted(n.split("/", 2)[2] for n in names if n.startswith("cudnn_moe/_kernels_cuda/"))
graphs = sorted(n.split("/", 2)[2] for n in names if n.startswith("cudnn_moe/_graphs/"))
print(f"{sys.argv[1].rsplit('/', 1)[1]}: {len(names)} files; kernels: {' '.join(kernels)}; graphs: {' '.join(graphs)}")
EOF
    if [ -n "${KEEP_WHEEL:-}" ]; then mkdir -p "$KEEP_WHEEL" && cp "$WHEEL" "$KEEP_WHEEL/"; fi
}

install_wheel() {
    "$PYTHON" -m venv "$WORK/venv"
    quiet_pip "$WORK/venv/bin/python" -m pip install -q --no-compile "$TORCH_CPU" ${TORCH_INDEX:+--index-url "$TORCH_INDEX"}
    quiet_pip "$WORK/venv/bin/python" -m pip install -q --no-compile "$WHEEL"
    "$WORK/venv/bin/python" -m pip show -f cudnn-moe | grep -c "_kernels_cuda/" | sed 's/^/kernel files installed: /'
}

smoke() {  # from an empty folder: neither the checkout nor the script's folder is importable (-I)
    mkdir -p "$WORK/run"
    (cd "$WORK/run" && env -u PYTHONPATH "$WORK/venv/bin/python" -I "$ROOT/scripts/wheel_smoke.py" "$ROOT")
    (cd "$WORK/run" && env -u PYTHONPATH "$WORK/venv/bin/cudnn-moe" demo --experts 4 --hidden 128 --intermediate 128 --tokens 4)
}

step "copy the sources" copy_sources
step "build the wheel ($BUILD_PYTHON)" build_wheel
step "install it into a fresh venv ($PYTHON, $TORCH_CPU)" install_wheel
step "smoke test from $WORK/run" smoke
echo "== wheel check passed in $((SECONDS - START)) s"
