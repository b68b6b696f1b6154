#!/usr/bin/env bash
# The prepared GPU run (issue 51): a thin wrapper over benchmarks/gpu/lease.py, which says what each step measures.
#
#     bash benchmarks/gpu/run.sh OUT_DIR [gpu/lease.py run options]   # on the GPU machine: install the bundle, run
#     bash benchmarks/gpu/run.sh OUT_DIR --dry-run                    # every step at tiny sizes on the CPU
#     bash benchmarks/gpu/run.sh --embedded                           # the older run on the embedded model's weights
#
# Make the bundle first, on a machine with PyPI: `python benchmarks/gpu/lease.py bundle --out .gpu-bundle`; carry
# `.gpu-bundle` with the tree. Its wheels the image lacks (or has too old) go into a throwaway folder on PYTHONPATH,
# with no network; fxbudget runs from this tree. PY names the Python (default python).
#
# --embedded keeps the steps that need the embedded model (compare at 8K/32K, layer-level overhead/fairness, the
# cross-device dumps against the committed CPU dumps, long context and compile time of the embedded model;
# GPU_STEPS selects among "tests compare long cross layer compile"); it writes benchmarks/results/gpu.md.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-python}
if [[ ${1:-} != --embedded ]]; then
  OUT=${1:?usage: bash benchmarks/gpu/run.sh OUT_DIR [options] (or --embedded)}; shift
  SITE=$(mktemp -d)
  if [[ -d .gpu-bundle && " $* " != *" --dry-run "* ]]; then
    "$PY" benchmarks/gpu/lease.py install --bundle .gpu-bundle --target "$SITE" || echo "bundle install failed" >&2
  fi
  PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}" exec "$PY" benchmarks/gpu/lease.py run --out "$OUT" "$@"
fi
shift
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
      if timeout 420 "$PY" -m fxbudget.cli compare --device cuda --dtype bfloat16 --backend inductor --tasks passkey \
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
  echo "Command: \`GPU_STEPS=\"$STEPS\" bash benchmarks/gpu/run.sh\`; total ${SECONDS} s. Sections below are the scripts' own outputs."
  for f in tests compare overhead cve fair cross long compile deploy; do
    if [[ -s "$TMP/$f.md" ]]; then echo; sed 's/^# /## /' "$TMP/$f.md"; fi
  done
} > "$OUT"
cat "$OUT"
