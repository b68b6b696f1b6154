#!/usr/bin/env bash
# bf16 vs fp32 on this CPU, side by side (issue 41, item 3): the demo grid (`make demo`'s, on the embedded model)
# and the one-call prefill at 8K (long_context.py: unmodified model, eager kernel, Inductor), each in both dtypes.
# UNRUN as committed: written on an AMD EPYC with AVX2 only (no avx512_bf16, no AMX), where bf16 is emulated and
# slow, and under a load of 7 engineers on 2 cores, where timings are worthless. Run it on an idle machine whose CPU
# has native bf16 (the header line below says whether it has), then commit OUT.
#
#   bash benchmarks/bf16_vs_fp32.sh [OUT]          (default OUT: benchmarks/results/bf16_vs_fp32)
#
# What it writes: OUT/cpu.txt (CPU model, bf16 flags, load average before each run), OUT/demo_<dtype>/ (the grid's
# rows, report and tables: speed per row, accuracy cells and likelihoods, to compare cell by cell), OUT/demo_<dtype>.time
# (/usr/bin/time -v: wall time and peak RSS), OUT/prefill8k_<dtype>.md (long_context.py's table: time and memory
# per side).
set -euo pipefail
OUT=${1:-benchmarks/results/bf16_vs_fp32}
PY=${PY:-python}
mkdir -p "$OUT"
{
  lscpu | grep -E 'Model name|^CPU\(s\)'
  echo "bf16 flags: $(grep -o -w -E 'avx512_bf16|amx_bf16|amx_tile' /proc/cpuinfo | sort -u | tr '\n' ' ')"
  $PY -c 'import torch; print("torch", torch.__version__, "capability", torch.backends.cpu.get_cpu_capability())'
} > "$OUT/cpu.txt"
cat "$OUT/cpu.txt"
for dtype in float32 bfloat16; do
  echo "load before demo $dtype: $(cat /proc/loadavg)" >> "$OUT/cpu.txt"
  /usr/bin/time -v -o "$OUT/demo_$dtype.time" $PY -m fxbudget.demo --dtype "$dtype" --out "$OUT/demo_$dtype" --quiet
  echo "load before prefill 8K $dtype: $(cat /proc/loadavg)" >> "$OUT/cpu.txt"
  $PY benchmarks/long_context.py --lengths 8192 --dtype "$dtype" --out "$OUT/prefill8k_$dtype.md"
done
