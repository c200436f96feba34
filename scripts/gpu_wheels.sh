#!/usr/bin/env bash
# Download, on a machine with internet, the wheels scripts/gpu_check.sh installs on a GPU machine without
# it: scripts/gpu_requirements.txt (exact pins, no dependencies: torch, transformers, pyarrow and numpy are
# the GPU machine's own), pure-Python wheels plus pydantic_core's manylinux x86_64 build for CPython
# 3.10..3.13, into .gpu-wheels/ (git-ignored; ~20 MiB: carry it to the GPU machine with the tree).
# Usage: bash scripts/gpu_wheels.sh [DIR]    (PYTHON=... picks the pip that downloads; PYVERS="3.11 3.12")
set -euo pipefail
cd "$(dirname "$0")/.."
DEST="${1:-.gpu-wheels}"
PYTHON="${PYTHON:-python3}"
mkdir -p "$DEST"
for v in ${PYVERS:-3.10 3.11 3.12 3.13}; do
    "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --dest "$DEST" \
        --python-version "$v" --implementation cp --abi "cp${v/./}" \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
        -r scripts/gpu_requirements.txt
done
if ls "$DEST" | grep -qi '^torch'; then
    echo "gpu_wheels: a torch wheel is in $DEST: remove it (the GPU machine's own CUDA torch must be used)" >&2
    exit 1
fi
du -sh "$DEST"
ls -la "$DEST"
