#!/usr/bin/env bash
# One prepared GPU run of the layer-level benchmarks (issue 5, item 7): compiled vs eager, fairness spread and
# overhead on CUDA at larger sizes, with CUDA graphs for decode; and the long-context prefill (issue 9) at 32K-128K.
# Needs torch with CUDA and this checkout (no network).
#
#     bash benchmarks/gpu.sh            # ~10-14 min on one GPU (cold Inductor compiles dominate); writes results/gpu.md
#     PY=/path/to/python bash benchmarks/gpu.sh
#
# CUDA graphs: `torch.compile(mode="reduce-overhead")` cannot be combined with a custom backend, so fxbudget's
# backend takes `make_backend(rule, cudagraphs=True)`, which compiles with Inductor's `triton.cudagraphs` option (what
# reduce-overhead sets). The budget kernel mutates the cache tensors in place, so the benchmark marks them with
# `torch._dynamo.mark_static_address` (as transformers' StaticCache does); otherwise Inductor skips CUDA graphs. The
# static-cache SDPA baseline is compiled with `mode="reduce-overhead"`. Prefill chunks run without CUDA graphs.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python}
OUT=benchmarks/results/gpu.md
TMP=$(mktemp -d)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$TMP/inductor}
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(0))"
SECONDS=0
# 1. Overhead, decode with CUDA graphs (both sides) and prefill chunks of 1024, budgets up to 16k.
timeout 240 "$PY" benchmarks/overhead.py --device cuda --cudagraphs --budgets 1024,4096,16384 --chunk 1024 \
    --reps 200 --out "$TMP/overhead.md" || echo "overhead.py failed or timed out" > "$TMP/overhead.md"
# 2. Compiled (CUDA graphs off: eager has none) vs eager kernel.
timeout 150 "$PY" benchmarks/compiled_vs_eager.py --device cuda --budgets 1024,16384 --chunk 1024 --reps 100 \
    --out "$TMP/cve.md" || echo "compiled_vs_eager.py failed or timed out" > "$TMP/cve.md"
# 3. Fairness spread, decode only with CUDA graphs (one cold compile per rule).
timeout 180 "$PY" benchmarks/fairness_spread.py --device cuda --cudagraphs --budget 4096 --chunk 0 --reps 100 \
    --out "$TMP/fair.md" || echo "fairness_spread.py failed or timed out" > "$TMP/fair.md"
# 4. Long context (issue 9): one-call prefill of the embedded model in bf16 at 32K-128K, fxbudget's eager kernel and
#    Inductor against the unmodified model (SDPA picks its flash / memory-efficient backend). One process per cell.
timeout 420 "$PY" benchmarks/long_context.py --device cuda --dtype bfloat16 --lengths 32768,65536,131072 \
    --sides full,eager,inductor --out "$TMP/long.md" || echo "long_context.py failed or timed out" > "$TMP/long.md"
{
  echo "# GPU run (layer level)"
  echo
  echo "Command: \`bash benchmarks/gpu.sh\`; total ${SECONDS} s. Sections below are the three scripts' own outputs."
  for f in overhead cve fair long; do echo; sed 's/^# /## /' "$TMP/$f.md"; done
} > "$OUT"
cat "$OUT"
