#!/usr/bin/env bash
# The one-call long prefill (benchmarks/long_context.py) on this checkout and on an earlier kernel (a detached
# worktree at BASE), one after the other, each pinned to core CPU, on a quiet machine:
#   benchmarks/results/$NAME/after/long_context_inductor.md    full, eager and Inductor sides (this checkout)
#   benchmarks/results/$NAME/before/long_context_inductor.md   the sides in BEFORE_SIDES (BASE)
# The unmodified model's side does not depend on the kernel, so the before side may leave it out (ratios there are
# then read against the after file's `full` rows, which ran in the same session).
#
#   BASE=5fe3473 NAME=empty_slots bash benchmarks/studies/long_context_before_after.sh   # 2K-8K: about 25 min
set -euo pipefail
cd "$(dirname "$0")/.."
BASE=${BASE:?set BASE to the commit to compare with}
NAME=${NAME:?set NAME, the folder under benchmarks/results}
LENGTHS=${LENGTHS:-2048,4096,8192}
BEFORE_SIDES=${BEFORE_SIDES:-inductor}
CPU=${CPU:-0}
PY=${PY:-$PWD/.venv/bin/python}
OUT=$PWD/benchmarks/results/$NAME
export OMP_NUM_THREADS=1
wt=$(mktemp -d)/base
git worktree add --detach "$wt" "$BASE" >/dev/null
trap 'git worktree remove --force "$wt"' EXIT
mkdir -p "$OUT/before" "$OUT/after"
run() {  # run DIR ARGS...: long_context.py with that checkout's fxbudget, on one core
  local dir=$1; shift
  (cd "$dir" && PYTHONPATH="$dir" taskset -c "$CPU" "$PY" benchmarks/long_context.py --lengths "$LENGTHS" "$@")
}
run . --sides full,eager,inductor --out "$OUT/after/long_context_inductor.md"
run "$wt" --sides "$BEFORE_SIDES" --out "$OUT/before/long_context_inductor.md"
sed -i '/^Analysis (hand-written/d' "$OUT"/before/*.md "$OUT"/after/*.md
