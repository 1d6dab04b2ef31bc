#!/usr/bin/env bash
# Alternating A/B timing of package trees on one GPU, as benchmarks/RESULTS.md compares trees: timings are compared
# only within one lease, and the trees take turns so that a slow stretch of the GPU hits each of them alike. Each
# round runs one command once under each tree in turn; the package (cudnn_moe and its kernel sources) comes from the
# tree through PYTHONPATH, the command's scripts from this checkout.
# Usage: OUT=logs ROUNDS=2 LIMIT=300 bash scripts/ab_trees.sh TREE [TREE ...] -- COMMAND...
#   TREE     "." for this checkout, or a folder holding another revision's package, made with
#            mkdir -p .t/new && git archive REV cudnn_moe kernels_cuda graphs | tar -x -C .t/new
#   COMMAND  e.g. python3 benchmarks/bench_stages.py --engines sm90 --models qwen3-30b-a3b --tokens 8 --iters 20
# Writes $OUT/ab_ROUND_NAME.log (NAME: the tree's folder name, "checkout" for ".") and prints each run's table rows,
# clock line and header (which names the folder the package came from). Exit status 1 when any run failed or ran
# past LIMIT seconds (default 300).
set -uo pipefail
cd "$(dirname "$0")/.."
trees=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do trees+=("$1"); shift; done
if [ $# -lt 2 ] || [ ${#trees[@]} -eq 0 ]; then
  awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
  exit 2
fi
shift
roots=()  # the trees' absolute paths, for PYTHONPATH
for tree in "${trees[@]}"; do
  [ -d "$tree/cudnn_moe" ] || { echo "ab_trees: $tree holds no cudnn_moe package"; exit 2; }
  roots+=("$(cd "$tree" && pwd)")
done
OUT=${OUT:-out}
mkdir -p "$OUT"
source scripts/carried_wheels.sh || exit 1
status=0
for round in $(seq 1 "${ROUNDS:-2}"); do
  for i in "${!trees[@]}"; do
    tree=${trees[$i]} root=${roots[$i]}
    name=$(basename "$root")
    [ "$tree" = . ] && name=checkout
    log="$OUT/ab_${round}_${name}.log"
    PYTHONPATH="$root:$PYTHONPATH" timeout "${LIMIT:-300}" "$@" >"$log" 2>&1
    rc=$?
    echo "=== round $round, tree $tree: exit $rc"
    grep -E '^\||timed medians|cudnn_moe from' "$log"
    [ "$rc" = 0 ] || { status=1; tail -n 5 "$log"; }
  done
done
exit $status
