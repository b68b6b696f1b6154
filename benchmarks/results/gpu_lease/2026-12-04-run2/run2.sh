set -u
PY=${PY:-$(command -v python3 || command -v python)}
SITE=$(mktemp -d)
$PY benchmarks/gpu_lease.py install --bundle .gpu-bundle --target "$SITE" > "$OUT/log2.txt" 2>&1
export PYTHONPATH="$SITE:$PWD" PYTHONUNBUFFERED=1
step() { local t=$1; shift; echo "== $* (box $t s)"; timeout -k 5 "$t" "$PY" benchmarks/gpu_lease.py step "$@" --rows "$OUT/rows2.jsonl" --device "${DEV:-cuda}" ${EXTRA:-} >> "$OUT/log2.txt" 2>&1; echo "rc $?"; }
echo "== flex check"; timeout -k 5 70 "$PY" benchmarks/studies/flex_gpu_check.py --device "${DEV:-cuda}" > "$OUT/flex_check.txt" 2>&1; grep -v -i warn "$OUT/flex_check.txt" | tail -6
step 80 decode
step 50 spread
step 140 correct-fp32 --kept-rules h2o,observed_attention,snapkv,knorm --inductor-rules snapkv,h2o
grep -h '"kind": "key"\|"kind": "check"\|"kind": "decode"\|"kind": "spread"' "$OUT/rows2.jsonl" | cut -c1-300
tail -5 "$OUT/log2.txt"
