#!/usr/bin/env bash
# kvpress's RULER leaderboard (NVIDIA/kvpress evaluation/leaderboard.sh) with fxbudget, on one GPU: RULER at 4096
# tokens (the 13 tasks), compression ratios 0.25 / 0.5 / 0.75 / 0.875, query-agnostic (kvpress's loop 1) and
# query-aware (its loop 2), bfloat16 on CUDA. docs/leaderboard.md explains every choice and what differs from kvpress.
#
#   FXBUDGET_RULER_DATA=/path/to/RULER/json bash benchmarks/leaderboard/reproduce.sh [MODEL]
#       MODEL: meta-llama/Llama-3.1-8B-Instruct (default) or Qwen/Qwen3-8B (hub ids; `embedded` = fxbudget's own)
#   DRY_RUN=1 bash benchmarks/leaderboard/reproduce.sh embedded   # check every command, load no weights, write nothing
#
# Environment: SAMPLES per task (default 500, kvpress's dataset), RATIOS (default "0.25 0.5 0.75 0.875"),
# LENGTH (4096), PARTS (default "1 2 3 4 5": which of the grids below; pr38, pr93: the
# cells of kvpress PRs #38 and #93), DEVICE (cuda), DTYPE (bfloat16),
# OUT (runs/leaderboard/<model>), PY (python), DRY_RUN=1 (adds --dry-run; without FXBUDGET_RULER_DATA it writes
# stand-in data files in a temporary folder so that the 13-task commands can be checked: never for a score).
# A rerun resumes each grid's folder; Ctrl-C prints the command that resumes.
set -euo pipefail
cd "$(dirname "$0")/../.."
MODEL=${1:-meta-llama/Llama-3.1-8B-Instruct}
SAMPLES=${SAMPLES:-500}
RATIOS=${RATIOS:-0.25 0.5 0.75 0.875}
LENGTH=${LENGTH:-4096}
PARTS=${PARTS:-1 2 3 4 5}
DEVICE=${DEVICE:-cuda}
DTYPE=${DTYPE:-bfloat16}
PY=${PY:-python}
OUT=${OUT:-runs/leaderboard/${MODEL//\//--}}

# kvpress's compression_ratio r evicts r of the context: it keeps int(context_tokens * (1 - r)) entries per layer and
# KV head (ScorerPress). fxbudget's budget is entries per layer and KV head; "p%" = floor(p/100 * context_tokens)
# of each sample's context, so ratio r is the budget (1 - r) x 100%: 0.25 -> 75%, 0.5 -> 50%, 0.75 -> 25%,
# 0.875 -> 12.5%.
BUDGETS=$("$PY" -c 'import sys; print(",".join(f"{(1 - float(r)) * 100:g}%" for r in sys.argv[1:]))' $RATIOS)

MODEL_ARGS=(--model "$MODEL")
if [ "$MODEL" = embedded ]; then MODEL_ARGS=(); fi
DRY=()
if [ "${DRY_RUN:-0}" = 1 ]; then
  DRY=(--dry-run)
  if [ -z "${FXBUDGET_RULER_DATA:-}" ]; then
    FXBUDGET_RULER_DATA=$(mktemp -d)
    trap 'rm -rf "$FXBUDGET_RULER_DATA"' EXIT
    "$PY" benchmarks/leaderboard/standin_data.py "$FXBUDGET_RULER_DATA"
    echo "[leaderboard] DRY_RUN: stand-in RULER files in $FXBUDGET_RULER_DATA (made-up text, for checking only)" >&2
  fi
fi
export FXBUDGET_RULER_DATA

# kvpress's SnapKVPress, PyramidKVPress and ChunkKVPress(SnapKVPress()) defaults: observation window 64, pooling
# kernel 5 (fxbudget's defaults are the papers': 32 / 7). The window is part of fxbudget's shared kernel, so the
# rules of one grid share one: the window-64 rules run in grids of their own, the others at the kernel's 32.
SNAP=(--param snapkv.window=64 --param snapkv.kernel=5)

grid() {  # grid NAME PROTOCOL RULES [--param ...]: one fxbudget comparison, its own results folder
  local name=$1 protocol=$2 rules=$3; shift 3
  echo "[leaderboard] $name: --protocol $protocol --rules $rules --budgets $BUDGETS" >&2
  "$PY" -m fxbudget.cli compare "${MODEL_ARGS[@]}" --device "$DEVICE" --dtype "$DTYPE" \
    --tasks ruler --lengths "$LENGTH" --samples "$SAMPLES" --seed 0 \
    --protocol "$protocol" --rules "$rules" --budgets "$BUDGETS" "$@" --quiet --out "$OUT/$name" "${DRY[@]}"
}

for part in $PARTS; do
  case $part in
    # kvpress loop 1 (query-agnostic: the question appended after compression): the rules without an observation
    # window of their own, and the unmodified model (kvpress's no_press).
    1) grid query-agnostic query-agnostic \
         full,random,knorm,streamingllm,tova,observed_attention,lagkv,keydiff,cur,kvzip ;;
    # kvpress loop 1, the window-64 rules.
    2) grid query-agnostic-w64 query-agnostic snapkv,pyramidkv \
         "${SNAP[@]}" --param pyramidkv.window=64 --param pyramidkv.kernel=5 ;;
    # kvpress loop 1, its head-adaptive presses: "expected_attention" is AdaKVPress(ExpectedAttentionPress(
    # epsilon=1e-2)) in kvpress's registry, "adakv_compactor" AdaKVPress(CompactorPress()). A grid of its own: a
    # head-adaptive rule puts every rule of its grid on the head-pooled cache layout.
    3) grid query-agnostic-adakv query-agnostic adakv:expected_attention,adakv:compactor \
         --param adakv:expected_attention.epsilon=0.01 ;;
    # kvpress loop 2 (--query_aware: the question compressed with the context). finch: kvpress's window is each
    # sample's question (found from a delimiter token); fxbudget's kernel has one window per grid, so finch runs at
    # the grid's 64 (the question plus the context's tail, or the question's last 64 tokens; docs/leaderboard.md).
    4) grid query-aware query-aware snapkv,chunkkv,finch "${SNAP[@]}" --param chunkkv.window=64 \
         --param chunkkv.kernel=5 --param finch.window=64 ;;
    5) grid query-aware-adakv query-aware adakv:snapkv --param adakv:snapkv.window=64 --param adakv:snapkv.kernel=5 ;;
    # The cells docs/leaderboard.md quotes. kvpress PR #38 (AdaKV, Llama-3.1-8B-Instruct, "25%"): SnapKV and
    # ExpectedAttention, uniform and AdaKV-allocated, query-agnostic (run with RATIOS=0.25). kvpress PR #93 (KVzip,
    # ratios 0.5 / 0.7 / 0.8 / 0.9 on Llama-3.1-8B RULER-4K): RATIOS="0.5 0.7 0.8 0.9" PARTS=pr93.
    pr38)
      grid pr38-snapkv query-agnostic full,snapkv "${SNAP[@]}"
      grid pr38-adakv-snapkv query-agnostic adakv:snapkv --param adakv:snapkv.window=64 --param adakv:snapkv.kernel=5
      grid pr38-expected-attention query-agnostic expected_attention
      grid pr38-adakv-expected-attention query-agnostic adakv:expected_attention ;;
    pr93) grid pr93-kvzip query-agnostic full,kvzip ;;
    *) echo "[leaderboard] PARTS: unknown part '$part' (1 to 5, pr38, pr93)" >&2; exit 2 ;;
  esac
done
