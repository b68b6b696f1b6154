# The fifth H200 run (issue 49): run 4 showed the transposed call wrong with the form's own block mask and exact with
# torch's create_block_mask of the same mask_mod: its block lists were strided views (argsort of a transposed
# tensor), read by the kernel with unit stride. Lists made contiguous; the signals and the eager prefill again.
#     run(command="PY=$(command -v python3) bash benchmarks/results/gpu_lease/2026-12-04-run5/run5.sh", carry=[".gpu-bundle"])
set -u
PY=${PY:-$(command -v python3 || command -v python)}
SITE=$(mktemp -d)
$PY benchmarks/gpu_lease.py install --bundle .gpu-bundle --target "$SITE" > "$OUT/log5.txt" 2>&1
export PYTHONPATH="$SITE:$PWD" PYTHONUNBUFFERED=1
step() { local t=$1; shift; echo "== $* (box $t s)"; timeout -k 5 "$t" "$PY" benchmarks/gpu_lease.py step "$@" --rows "$OUT/rows5.jsonl" --device "${DEV:-cuda}" ${EXTRA:-} >> "$OUT/log5.txt" 2>&1; echo "rc $?"; }
pick() { grep -v -i warn "$1" | grep -E "^(torch|raw|prefill|chunk|sliding|pool|worst)"; }
echo "== flex check"; timeout -k 5 110 "$PY" benchmarks/studies/flex_gpu_check.py --device "${DEV:-cuda}" > "$OUT/flex_check.txt" 2>&1; pick "$OUT/flex_check.txt"
step 60 prefill-eager --measure-forms flex
grep -h '"kind": "key"\|"kind": "prefill"' "$OUT/rows5.jsonl" | cut -c1-300
