# The third H200 run (issue 49): the folded flex form's signals against the block form, its prefill time eager and
# compiled against the unmodified model, and the kept sets GPU vs CPU with `auto` (= flex on CUDA now).
#     run(command="PY=$(command -v python3) bash benchmarks/results/gpu_lease/2026-12-04-run3/run3.sh", carry=[".gpu-bundle"])
set -u
PY=${PY:-$(command -v python3 || command -v python)}
SITE=$(mktemp -d)
$PY benchmarks/gpu_lease.py install --bundle .gpu-bundle --target "$SITE" > "$OUT/log3.txt" 2>&1
export PYTHONPATH="$SITE:$PWD" PYTHONUNBUFFERED=1
step() { local t=$1; shift; echo "== $* (box $t s)"; timeout -k 5 "$t" "$PY" benchmarks/gpu_lease.py step "$@" --rows "$OUT/rows3.jsonl" --device "${DEV:-cuda}" ${EXTRA:-} >> "$OUT/log3.txt" 2>&1; echo "rc $?"; }
step 15 env
echo "== flex check"; timeout -k 5 150 "$PY" benchmarks/studies/flex_gpu_check.py --device "${DEV:-cuda}" > "$OUT/flex_check.txt" 2>&1; grep -v -i warn "$OUT/flex_check.txt" | grep -E "^(torch|raw|prefill|chunk|sliding|pool|worst)" 
step 25 prefill-full
step 60 prefill-eager --measure-forms flex
step 130 prefill-compiled --measure-forms flex
step 100 correct-fp32 --kept-rules h2o,observed_attention,snapkv,knorm --inductor-rules snapkv,h2o
grep -h '"kind": "key"\|"kind": "check"\|"kind": "prefill"' "$OUT/rows3.jsonl" | cut -c1-400
tail -5 "$OUT/log3.txt"
