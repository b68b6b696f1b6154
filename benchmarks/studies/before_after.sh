#!/usr/bin/env bash
# Before vs after a kernel change, side by side on one machine in one session (issue 20: "no figure worse by more
# than 5% than today's files"). The committed files of an earlier day came from another machine, so their seconds
# do not compare; this reruns the same benchmarks on the old kernel (a detached worktree at BASE) and on this
# checkout, one after the other, each pinned to core 0 (CPU=0; other work may use the other core), and writes
#   benchmarks/studies/results/before_after/<side>/...   each benchmark's own results files
#   benchmarks/studies/results/kernel_before_after.md     after / before per cell (benchmarks/studies/rerun_compare.py)
# The after side's compile_time, overhead and long_context files are this checkout's committed results files.
#
#   bash benchmarks/studies/before_after.sh            # BASE=5d5224f (the kernel before issue 20), about 75 min on 2 cores
set -euo pipefail
cd "$(dirname "$0")/.."
BASE=${BASE:-5d5224f}
CPU=${CPU:-0}
PY=${PY:-$PWD/.venv/bin/python}
OUT=benchmarks/studies/results/before_after
export OMP_NUM_THREADS=1
wt=$(mktemp -d)/base
git worktree add --detach "$wt" "$BASE" >/dev/null
trap 'git worktree remove --force "$wt"' EXIT
cp benchmarks/studies/scan_prefill.py "$wt/benchmarks/"  # newer than BASE; it only calls fxbudget.compile
mkdir -p "$OUT/before" "$OUT/after"
run() {  # run SIDE_DIR SCRIPT ARGS...: the benchmark with that checkout's fxbudget, on one core
  local dir=$1; shift
  (cd "$dir" && PYTHONPATH="$dir" taskset -c "$CPU" "$PY" "$@")
}
B=$PWD/$OUT/before A=$PWD/$OUT/after

run . benchmarks/compile_time.py
run "$wt" benchmarks/compile_time.py --out "$B/compile_time.md"
run "$wt" benchmarks/overhead.py --json "$B/overhead.json" --out "$B/overhead.md"
run . benchmarks/overhead.py --json benchmarks/results/overhead.json --before "$B/overhead.json" \
    --before-label "wave-2 kernel $BASE"
run . benchmarks/long_context.py --lengths 2048,4096,8192 --sides full,eager,inductor \
    --out benchmarks/results/long_context_inductor.md
run "$wt" benchmarks/long_context.py --lengths 2048,4096,8192 --sides eager,inductor \
    --out "$B/long_context_inductor.md"
# One attention layer at 8K (the scan alone), alternated; JSON lines.
for i in 1 2; do
  run "$wt" benchmarks/studies/scan_prefill.py --tokens 8192 --backends inductor | grep '^{' >> "$B/scan_prefill.jsonl"
  run . benchmarks/studies/scan_prefill.py --tokens 8192 --backends inductor | grep '^{' >> "$A/scan_prefill.jsonl"
done
# Cold compile time is one sample per route: three more alternated runs of the route that ships.
for i in 1 2 3; do
  run "$wt" benchmarks/compile_time.py --routes regional --out "$B/compile_time_regional_$i.md"
  run . benchmarks/compile_time.py --routes regional --out "$A/compile_time_regional_$i.md"
done
for i in 2 3; do
  run "$wt" benchmarks/overhead.py --json "$B/overhead_$i.json" --out "$B/overhead_$i.md"
  run . benchmarks/overhead.py --json "$A/overhead_$i.json" --before "$B/overhead_$i.json" \
      --before-label "wave-2 kernel $BASE" --out "$A/overhead_$i.md"
done
# The copies' links to hand-written analyses (which sit beside the committed files only) would be broken pages.
sed -i '/^Analysis (hand-written/d' "$B"/*.md "$A"/*.md
r() { local IFS=,; echo "$*"; }
run . benchmarks/studies/rerun_compare.py --out benchmarks/studies/results/kernel_before_after.md \
  --pair "$B/long_context_inductor.md" benchmarks/results/long_context_inductor.md 2 \
  --pair "$(r "$B"/compile_time_regional_{1,2,3}.md)" "$(r "$A"/compile_time_regional_{1,2,3}.md)" 2 \
  --pair "$B/compile_time.md" benchmarks/results/compile_time.md 2 \
  --pair "$(r "$B"/overhead{,_2,_3}.md)" "$(r benchmarks/results/overhead.md "$A"/overhead_{2,3}.md)" 2
