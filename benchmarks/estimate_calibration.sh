#!/bin/bash
# The calibrated start estimate (issue 42) against the run it estimates: a one-sample run of the quick start's grid
# records this machine's rate in a rates file of its own, then the quick start's grid (two samples) is estimated from
# it and run. Compare the second run's "estimated ... to the end" with its stages from the estimate line on (model
# load through report; `done in` minus start-up, checks, tokenizer and samples). Writes under $OUT (default
# /tmp/fxbudget_estimate); prints uptime before and after each run (the load it ran under).
#   bash benchmarks/estimate_calibration.sh
set -euo pipefail
OUT=${OUT:-/tmp/fxbudget_estimate}
export OMP_NUM_THREADS=1 FXBUDGET_RATES=$OUT/rates.jsonl
rm -rf "$OUT"; mkdir -p "$OUT"
GRID=(--tasks passkey --lengths 1000 --rules full,streamingllm,snapkv,tova --budgets 128 --protocol query-aware
      --threads 1 --quiet)
uptime
python -m fxbudget.cli compare "${GRID[@]}" --samples 1 --out "$OUT/first" 2>&1 | grep -E "estimated|done in"
uptime
python -m fxbudget.cli compare "${GRID[@]}" --samples 2 --out "$OUT/second" 2>&1 | grep -E "estimated|done in"
uptime
cat "$FXBUDGET_RATES"
