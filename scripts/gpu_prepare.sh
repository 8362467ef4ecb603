#!/usr/bin/env bash
# Prepare the ignored folders scripts/gpu_check.sh needs on a GPU machine without network (run here, once):
#   scripts/gpu_prepare.sh [HARNESS]
#   .whl  wheels the GPU image lacks or has older (its python is 3.12; it has no network)
#   .gpu  a copy of HARNESS, a reference harness you pass in (gpu_anchor.py, gpu_anchor_encoder.py), if given
set -euo pipefail
HARNESS="${1:+$(cd "$1" && pwd)}"  # absolute, before leaving the caller's directory
if [ -n "$HARNESS" ] && ! ls "$HARNESS"/gpu_anchor*.py >/dev/null 2>&1; then
  echo "error: $HARNESS holds no gpu_anchor*.py (the reference harness); give its folder, or no argument" >&2
  exit 2
fi
cd "$(dirname "$0")/.."  # .whl and .gpu are ignored (.gitignore)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl transformers==5.23.0 sentence-transformers==6.2.0
if [ -n "$HARNESS" ]; then
  rm -rf .gpu && mkdir -p .gpu && cp "$HARNESS"/gpu_anchor*.py .gpu/
  ls -la .whl .gpu
  echo 'then, on the GPU machine with .whl and .gpu: bash scripts/gpu_check.sh .gpu'
else
  ls -la .whl
  echo 'then, on the GPU machine with .whl: bash scripts/gpu_check.sh (no reference harness given)'
fi
