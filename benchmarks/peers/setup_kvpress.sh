#!/usr/bin/env bash
# Builds the peer venv for benchmarks/peers/vs_kvpress.py: kvpress 0.5.5 on transformers 5.2.0 and the CPU torch
# 2.13.0. This venv is NEVER a dependency of fxbudget; only the comparison script's kvpress side runs in it.
# Usage: bash benchmarks/peers/setup_kvpress.sh [VENV_DIR]   (default benchmarks/peers/.venv-kvpress)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="${1:-$here/.venv-kvpress}"
python="${PYTHON:-python3}"
if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi
"$venv/bin/python" -m pip install --quiet --upgrade pip
# torch pinned to the CPU build (an unpinned torch would pull a multi-GB CUDA build); kvpress 0.5.5 needs
# transformers < 5.3.
# (On the project machines pip's find-links holds the 2.13.0+cpu wheel, which wins over PyPI's 2.13.0.)
"$venv/bin/python" -m pip install --quiet "torch==2.13.0" "transformers==5.2.0" "kvpress==0.5.5" safetensors
"$venv/bin/python" - <<'PY'
import kvpress, torch, transformers
from importlib.metadata import version
print("peer venv ok: kvpress", version("kvpress"), "transformers", transformers.__version__, "torch", torch.__version__)
PY
