#!/usr/bin/env bash
# The reference rescorer on a GPU in under 5 minutes, on a bare GPU machine: its own python3 with
# torch, transformers, pyarrow and numpy is enough (no install, no network, no stored weights).
# Checks the CUDA reference against the stored CPU scores of tests/data/gpu-check-run, then measures
# bf16 throughput on a ~1.2B random Llama against a plain HF forward. See scripts/gpu_check.py.
# Usage: bash scripts/gpu_check.sh [extra gpu_check.py args]   (OUT=DIR also writes DIR/gpu_check.json)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
"$PYTHON" - <<'EOF'
import importlib.util, sys
missing = [m for m in ("torch", "transformers", "pyarrow", "numpy") if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"gpu_check: this python lacks {', '.join(missing)}")
EOF
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 LPF_CACHE="${LPF_CACHE:-$(mktemp -d)}"
exec timeout 290 "$PYTHON" scripts/gpu_check.py "$@"
