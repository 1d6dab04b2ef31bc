#!/usr/bin/env bash
# GPU check in one command: install the carried wheels, run the GPU tests, then the benchmarks.
# Usage: OUT=/path/to/logs bash scripts/gpu_check.sh [pytest args...]
# Wheels the machine lacks (the cuDNN frontend) are expected in .whl/ (git-ignored; installed with --no-index); with
# FlagGems' wheels there too (flag-gems, sqlalchemy, greenlet: `pip download --no-deps`), bench_moe.py also times the
# Triton BF16 peer (benchmarks/triton_peer.py) and the INT4 W4A16 peer (benchmarks/int4_peer.py); without them their
# columns say why they did not run.
# BENCH_ARGS passes options to benchmarks/bench_moe.py, STAGES_ARGS to benchmarks/bench_stages.py, GLUE_ARGS to
# benchmarks/bench_glue.py; SKIP_BENCH=1 / SKIP_ALIGNED=1 / SKIP_LOW_LATENCY=1 / SKIP_STAGES=1 / SKIP_GLUE=1 / SKIP_CACHE=1 /
# SKIP_PROBE=1 / SKIP_TIMELINE=1 / SKIP_TESTS=1 skip a step; ALIGNED_ARGS
# and LOW_LATENCY_ARGS pass options to bench_aligned.py / bench_low_latency.py. Also runs `python3 -m cudnn_moe demo`.
# CUDNN_PRELOAD=.cudnn/assemble.sh runs everything on a newer cuDNN backend carried in parts
# (../shared/gpu/fetch-cudnn.sh says how): the script assembles it and preloads its libraries.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT"
if [ -n "${CUDNN_PRELOAD:-}" ]; then
  # shellcheck disable=SC1090
  source "$CUDNN_PRELOAD" || { echo "could not preload cuDNN from $CUDNN_PRELOAD"; exit 1; }
fi
source scripts/carried_wheels.sh || exit 1
status=0
step() {  # step NAME COMMAND...: run, tee into $OUT/NAME.log, remember a failure
  local name=$1
  shift
  echo "=== $name: $*"
  local start=$SECONDS
  "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc after $((SECONDS - start)) s"
  [ "$rc" = 0 ] || status=1
}
step env python3 -c '
import torch, cupy, cudnn
from cudnn_moe.arch import peak_dram_tbs
print("gpu", torch.cuda.get_device_name(), "cc", torch.cuda.get_device_capability(),
      "peak DRAM %.2f TB/s (the SM90 engine chooses by it)" % peak_dram_tbs())
print("torch", torch.__version__, "cuda", torch.version.cuda, "cupy", cupy.__version__,
      "cudnn frontend", cudnn.__version__, "cudnn backend", cudnn.backend_version())'
step demo python3 -m cudnn_moe demo
[ "${SKIP_TESTS:-0}" = 1 ] || step pytest_gpu python3 -m pytest -m gpu -q -p no:cacheprovider "$@"
[ "${SKIP_BENCH:-0}" = 1 ] || step bench python3 benchmarks/bench_moe.py ${BENCH_ARGS:-} --markdown "$OUT/bench.md"
[ "${SKIP_ALIGNED:-0}" = 1 ] || step aligned python3 benchmarks/bench_aligned.py ${ALIGNED_ARGS:-} --markdown "$OUT/aligned.md"
[ "${SKIP_LOW_LATENCY:-0}" = 1 ] || step low_latency python3 benchmarks/bench_low_latency.py ${LOW_LATENCY_ARGS:-} --markdown "$OUT/low_latency.md"
[ "${SKIP_STAGES:-0}" = 1 ] || step stages python3 benchmarks/bench_stages.py ${STAGES_ARGS:-} --markdown "$OUT/stages.md"
[ "${SKIP_GLUE:-0}" = 1 ] || step glue python3 benchmarks/bench_glue.py ${GLUE_ARGS:-} --markdown "$OUT/glue.md"
[ "${SKIP_CACHE:-0}" = 1 ] || step cache python3 benchmarks/bench_cache.py --profile 25 --markdown "$OUT/cache.md"
[ "${SKIP_PROBE:-0}" = 1 ] || step probe_pdl python3 benchmarks/probe_pdl.py
[ "${SKIP_TIMELINE:-0}" = 1 ] || step timeline python3 benchmarks/probe_timeline.py --markdown "$OUT/timeline.md"
exit $status
