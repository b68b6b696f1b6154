#!/usr/bin/env bash
# bf16 against fp32 on this CPU (issue 50, item 3): what a bf16 row buys on a CPU with native bf16 (avx512_bf16,
# amx_bf16), and where its time goes. Expected to take 4-6 minutes on an idle 2-core Xeon with AMX (not yet timed; model
# already converted, else ~100 s more once). Run it alone on the machine, from the repository root:
#
#   bash benchmarks/bf16_vs_fp32.sh [OUT]     (default OUT: benchmarks/results/bf16_vs_fp32; THREADS=n sets the
#                                              torch threads, default: every core; PY=python sets the interpreter)
#
# Steps, each in both dtypes: (1) README's quick start grid (`fxbudget compare`, 8 rows, 2 samples; the rows'
# accuracy and likelihood compared cell by cell) under /usr/bin/time -v; (2) one prefill of ~1000 tokens and 32
# decode steps, unmodified and snapkv at B=128, and a profile of the budgeted run (`benchmarks/bf16_vs_fp32.py step`).
# It writes OUT/cpu.txt (lscpu's model and flags, the bf16 flags, threads, versions, commit, the load average before
# each step), OUT/quick_<dtype>/ (the grid's rows and report), OUT/quick_<dtype>.time, OUT/step.json, and the page to
# commit, OUT.md (`bf16_vs_fp32.py summary`). Commit OUT.md and OUT/ (its PNG plots may be left out).
# SMOKE=1 checks the pipeline (tiny grid, 2 steps: its numbers mean nothing; OUT defaults to /tmp/bf16_vs_fp32_smoke).
set -euo pipefail
SMOKE=${SMOKE:-0}
OUT=${1:-$([ "$SMOKE" = 1 ] && echo /tmp/bf16_vs_fp32_smoke || echo benchmarks/results/bf16_vs_fp32)}
PY=${PY:-python}
THREADS=${THREADS:-$(getconf _NPROCESSORS_ONLN)}
export OMP_NUM_THREADS=$THREADS
rm -rf "$OUT" && mkdir -p "$OUT"
if [ "$SMOKE" = 1 ]; then
  GRID=(--tasks passkey --lengths 300 --rules full,snapkv --budgets 32 --samples 1 --max-new-tokens 2)
  STEP=(--length 300 --steps 2)
else
  GRID=(--tasks passkey --lengths 1000 --rules full,streamingllm,snapkv,tova --budgets 128 --samples 2
        --protocol query-aware)
  STEP=(--length 1000 --steps 32)
fi
{
  lscpu | grep -E '^(Model name|CPU\(s\)|Thread\(s\) per core|Core\(s\) per socket|Socket\(s\)|Flags):'
  echo "bf16 flags: $(grep -o -w -E 'avx512_bf16|amx_bf16|amx_tile|avx512f' /proc/cpuinfo | sort -u | tr '\n' ' ')"
  echo "threads: OMP_NUM_THREADS=$OMP_NUM_THREADS, --threads $THREADS, $(getconf _NPROCESSORS_ONLN) CPUs"
  $PY -c 'import platform, torch, transformers; print("python", platform.python_version(), "torch", torch.__version__, "transformers", transformers.__version__, "capability", torch.backends.cpu.get_cpu_capability(), "torch threads", torch.get_num_threads())'
  echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (with uncommitted changes)')"
  echo "command: THREADS=$THREADS bash benchmarks/bf16_vs_fp32.sh $*"
} > "$OUT/cpu.txt"
cat "$OUT/cpu.txt"
# The rates these runs record stay in OUT (the estimate of later runs is not calibrated on them).
export FXBUDGET_RATES="$OUT/rates.jsonl"
for dtype in float32 bfloat16; do
  echo "load before the quick grid in $dtype: $(cat /proc/loadavg)" >> "$OUT/cpu.txt"
  /usr/bin/time -v -o "$OUT/quick_$dtype.time" $PY -m fxbudget.cli compare "${GRID[@]}" --dtype "$dtype" \
    --threads "$THREADS" --quiet --out "$OUT/quick_$dtype" > "$OUT/quick_$dtype.out" 2> "$OUT/quick_$dtype.err"
  grep '^\[fxbudget\] done in' "$OUT/quick_$dtype.err" || true
done
echo "load before the prefill and decode steps: $(cat /proc/loadavg)" >> "$OUT/cpu.txt"
$PY benchmarks/bf16_vs_fp32.py step --out "$OUT" "${STEP[@]}"
echo "load after: $(cat /proc/loadavg)" >> "$OUT/cpu.txt"
$PY benchmarks/bf16_vs_fp32.py summary "$OUT" --md "$OUT.md"
