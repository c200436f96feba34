#!/usr/bin/env bash
# What a user does with lpf on a GPU, checked in one run of at most 6 minutes on a bare GPU machine
# (scripts/gpu_check.py says what each step measures). Needs:
#   - python3 with torch (a CUDA build), transformers, pyarrow and numpy: the machine's own, never
#     installed by this script;
#   - lpf's pure-Python dependencies, scripts/gpu_requirements.txt (pydantic, click, rich, plotly,
#     mambapy and theirs): used as they are when this python imports them all; otherwise installed,
#     offline, from the wheels `bash scripts/gpu_wheels.sh` downloaded (on a machine with internet) into
#     .gpu-wheels/, with `pip install --no-index --no-deps --target .gpu-site` (no dependency resolution:
#     pip never pulls torch); .gpu-site/ goes on PYTHONPATH. Copy .gpu-wheels/ along with the tree.
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
need=$(missing "$MODULES")
if [ -n "$need" ]; then
    EXTRA="$SITE"
    if [ -n "$(missing "$MODULES")" ]; then
        if [ ! -d "$WHEELS" ]; then
            echo "gpu_check: $PYTHON lacks $need (scripts/gpu_requirements.txt); run 'bash scripts/gpu_wheels.sh' on a machine with internet and copy $WHEELS/ here" >&2
            exit 2
        fi
        echo "gpu_check: installing $need from $WHEELS into $SITE (offline, no dependencies resolved)" >&2
        if "$PYTHON" -m pip --version >/dev/null 2>&1; then
            "$PYTHON" -m pip install --quiet --disable-pip-version-check --no-index --no-deps \
                --find-links "$WHEELS" --target "$SITE" -r scripts/gpu_requirements.txt
        else  # no pip: a wheel is a zip laid out for site-packages
            "$PYTHON" scripts/gpu_unzip_wheels.py "$WHEELS" "$SITE" scripts/gpu_requirements.txt
        fi
        still=$(missing "$MODULES")
        if [ -n "$still" ]; then
            echo "gpu_check: still missing after the install: $still" >&2
            exit 2
        fi
    fi
fi
export PYTHONPATH="$PWD/src${EXTRA:+:$EXTRA}${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1
export LPF_CACHE="${LPF_CACHE:-$(mktemp -d)}" TOKENIZERS_PARALLELISM=false
exec timeout "${GPU_CHECK_TIMEOUT:-360}" "$PYTHON" scripts/gpu_check.py "$@"
