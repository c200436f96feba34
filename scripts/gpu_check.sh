#!/usr/bin/env bash
# What a user does with lpf on a GPU, checked in one run of at most 6 minutes on a bare GPU machine
# (scripts/gpu_check.py says what each step measures). Needs:
#   - python3 with torch (a CUDA build), transformers, pyarrow and numpy: the machine's own, never
#     installed by this script;
#   - lpf's pure-Python dependencies, scripts/gpu_requirements.txt (pydantic, click, rich, plotly,
#     mambapy and theirs): when .gpu-wheels/ is here (`bash scripts/gpu_wheels.sh` downloads it on a
#     machine with internet; copy it along with the tree) they are installed from it, offline, with
#     `pip install --no-index --no-deps --target .gpu-site` (no dependency resolution: pip never pulls
#     torch; without pip the wheels are unzipped) and .gpu-site/ goes first on PYTHONPATH; without it,
#     this python must import them all (a venv with lpf installed: the dry run in the test suite).
# Usage: bash scripts/gpu_check.sh [gpu_check.py args]        (OUT=DIR: results in DIR/gpu_check.json)
#        bash scripts/gpu_check.sh --device cpu --small       (the dry run: every step, small, on a CPU)
# Env: PYTHON (default: python3, else python, whichever imports torch), GPU_WHEELS (default .gpu-wheels), GPU_CHECK_TIMEOUT (default 360 s).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then  # the machine's python that has torch
    for PYTHON in python3 python; do
        "$PYTHON" -c "import torch" >/dev/null 2>&1 && break
    done
fi
WHEELS="${GPU_WHEELS:-.gpu-wheels}"
SITE="$PWD/.gpu-site"
missing() {  # $1: the module names to look for; prints the missing ones
    PYTHONPATH="${EXTRA:-}" "$PYTHON" -c '
import importlib.util, sys
print(" ".join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))' $1
}
EXTRA=""
base=$(missing "torch transformers pyarrow numpy")
if [ -n "$base" ]; then
    echo "gpu_check: $PYTHON lacks $base: the machine's own torch (CUDA), transformers, pyarrow and numpy are needed" >&2
    exit 2
fi
MODULES="pydantic pydantic_core annotated_types typing_inspection typing_extensions click rich markdown_it mdurl pygments plotly narwhals mambapy"
if [ -d "$WHEELS" ]; then  # the pinned versions, whatever this python has (an old pydantic would not do)
    echo "gpu_check: installing scripts/gpu_requirements.txt from $WHEELS into $SITE (offline, no dependencies resolved)" >&2
    rm -rf "$SITE"
    if "$PYTHON" -m pip --version >/dev/null 2>&1; then
        "$PYTHON" -m pip install --quiet --disable-pip-version-check --no-index --no-deps \
            --find-links "$WHEELS" --target "$SITE" -r scripts/gpu_requirements.txt
    else  # no pip: a wheel is a zip laid out for site-packages
        "$PYTHON" scripts/gpu_unzip_wheels.py "$WHEELS" "$SITE" scripts/gpu_requirements.txt
    fi
    EXTRA="$SITE"
fi
need=$(missing "$MODULES")
if [ -n "$need" ]; then
    echo "gpu_check: $PYTHON lacks $need (scripts/gpu_requirements.txt): run 'bash scripts/gpu_wheels.sh' on a machine with internet and copy $WHEELS/ here" >&2
    exit 2
fi
export PYTHONPATH="$PWD/src${EXTRA:+:$EXTRA}${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1
export LPF_CACHE="${LPF_CACHE:-$(mktemp -d)}" TOKENIZERS_PARALLELISM=false
exec timeout "${GPU_CHECK_TIMEOUT:-360}" "$PYTHON" scripts/gpu_check.py "$@"
