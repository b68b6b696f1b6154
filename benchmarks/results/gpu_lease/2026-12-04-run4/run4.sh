# The fourth H200 run (issue 49): run 3 found the folded form's `attn` wrong when flex is compiled (exact where the
# calls fell back to flex's eager math past Dynamo's recompile limit). Which part of the transposed call goes wrong
# (benchmarks/studies/flex_transposed_check.py), the form's signals again with every case compiled, and its prefill
# time eager and compiled after two torch 2.11 compile failures of run 3 were fixed.
#     run(command="PY=$(command -v python3) bash benchmarks/results/gpu_lease/2026-12-04-run4/run4.sh", carry=[".gpu-bundle"])
set -u
PY=${PY:-$(command -v python3 || command -v python)}
SITE=$(mktemp -d)
$PY benchmarks/gpu_lease.py install --bundle .gpu-bundle --target "$SITE" > "$OUT/log4.txt" 2>&1
export PYTHONPATH="$SITE:$PWD" PYTHONUNBUFFERED=1 FXBUDGET_UNVERIFIED_FLEX=1
step() { local t=$1; shift; echo "== $* (box $t s)"; timeout -k 5 "$t" "$PY" benchmarks/gpu_lease.py step "$@" --rows "$OUT/rows4.jsonl" --device "${DEV:-cuda}" ${EXTRA:-} >> "$OUT/log4.txt" 2>&1; echo "rc $?"; }
pick() { grep -v -i warn "$1" | grep -E "^(torch|raw|first|ours|torchmask|nomod|dense|dynamic|prefill|chunk|sliding|pool|worst)"; }
echo "== transposed"; timeout -k 5 120 "$PY" benchmarks/studies/flex_transposed_check.py --device "${DEV:-cuda}" ${TEXTRA:-} > "$OUT/transposed.txt" 2>&1; pick "$OUT/transposed.txt"
echo "== flex check"; timeout -k 5 120 "$PY" benchmarks/studies/flex_gpu_check.py --device "${DEV:-cuda}" > "$OUT/flex_check.txt" 2>&1; pick "$OUT/flex_check.txt"
step 60 prefill-eager --measure-forms flex
step 90 prefill-compiled --measure-forms flex
grep -h '"kind": "key"\|"kind": "prefill"' "$OUT/rows4.jsonl" | cut -c1-300
grep -h "Error" "$OUT/log4.txt" | sort | uniq -c | head -8
