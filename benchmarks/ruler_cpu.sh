#!/usr/bin/env bash
# The CPU RULER table (issue 32, item 2): the embedded model (the default of `fxbudget compare`) on five of RULER's
# six offline-capable tasks (no essay, SQuAD or HotpotQA file needed; fwe, the sixth, was cut for time: add
# ruler:fwe to --tasks) at 1024 tokens, five rules at 25% and 50% of each
# sample's context, the unmodified model as the reference row, query-agnostic (kvpress's leaderboard protocol).
# One process, one thread, one prefill per sample shared by the ten budgeted rows (the default; adakv:snapkv puts
# every rule on the head-pooled layout). The samples run in rounds of STEP per task (every task at the same count
# after each round), each round resuming the folder, so a run cut short between rounds leaves a balanced table; then
# `fxbudget report` rewrites the report from every row in the folder:
#   benchmarks/results/ruler_cpu/{results.jsonl,report.md,summary.csv,paired.csv,run.json,*.png}
#
#   bash benchmarks/ruler_cpu.sh [SAMPLES]      # SAMPLES per task (default 2, the committed run)
set -euo pipefail
cd "$(dirname "$0")/.."
SAMPLES=${1:-2}
STEP=${STEP:-2}
PY=${PY:-$PWD/.venv/bin/python}
OUT=${OUT:-benchmarks/results/ruler_cpu}
export OMP_NUM_THREADS=1
n=0
while [ "$n" -lt "$SAMPLES" ]; do
  n=$(( n + STEP < SAMPLES ? n + STEP : SAMPLES ))
  PYTHONPATH="$PWD" "$PY" -m fxbudget.cli compare \
    --tasks ruler:niah_single_1,ruler:niah_multikey_2,ruler:niah_multikey_3,ruler:vt,ruler:cwe \
    --lengths 1024 --samples "$n" --seed 0 \
    --rules full,snapkv,expected_attention,adakv:snapkv,streamingllm,knorm --budgets 25%,50% \
    --protocol query-agnostic --device cpu --dtype float32 --threads 1 --quiet --out "$OUT"
done
PYTHONPATH="$PWD" "$PY" -m fxbudget.cli report "$OUT"
