#!/usr/bin/env bash
# Prepare the two ignored folders scripts/gpu_check.sh needs on the GPU machine (run here, once):
#   .whl  wheels the GPU image lacks or has older (its python is 3.12; it has no network)
#   .gpu  copies of ../shared/bench/gpu_anchor*.py (the shared folder does not travel)
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl transformers==5.23.0 sentence-transformers==6.2.0
mkdir -p .gpu && cp ../shared/bench/gpu_anchor.py ../shared/bench/gpu_anchor_encoder.py .gpu/
ls -la .whl .gpu
echo 'then, on the GPU machine, with .whl and .gpu copied along: bash scripts/gpu_check.sh'
