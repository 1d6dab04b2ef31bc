#!/usr/bin/env bash
# GPU check in one command: install the carried wheels, run the GPU tests, then the benchmark.
# Usage: OUT=/path/to/logs bash scripts/gpu_check.sh [pytest args...]
# Wheels the machine lacks (the cuDNN frontend) are expected in .whl/ (see README, "GPU runs").
# BENCH_ARGS passes options to benchmarks/bench_moe.py; SKIP_BENCH=1 / SKIP_TESTS=1 skip a step.
# Also runs `python3 -m cudnn_moe demo` (the demo job, with the fused op on the GPU).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/cudnn_moe_site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/cudnn_moe_site:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
status=0
python3 - <<'PY' 2>&1 | tee "$OUT/env.txt"
import torch, cupy, cudnn
print("gpu", torch.cuda.get_device_name(), "cc", torch.cuda.get_device_capability())
print("torch", torch.__version__, "cuda", torch.version.cuda, "cupy", cupy.__version__,
      "cudnn frontend", cudnn.__version__, "cudnn backend", cudnn.backend_version())
PY
python3 -m cudnn_moe demo 2>&1 | tee "$OUT/demo.log"
[ "${PIPESTATUS[0]}" = 0 ] || status=1
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  python3 -m pytest -m gpu -q -p no:cacheprovider "$@" 2>&1 | tee "$OUT/pytest_gpu.log"
  status=${PIPESTATUS[0]}
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  python3 benchmarks/bench_moe.py ${BENCH_ARGS:-} --markdown "$OUT/bench.md" 2>&1 | tee "$OUT/bench.log"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
  python3 benchmarks/bench_stages.py --markdown "$OUT/stages.md" 2>&1 | tee "$OUT/stages.log"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
exit $status
