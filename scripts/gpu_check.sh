#!/usr/bin/env bash
# The GPU check, run on a GPU machine in one call (see docs/benchmarks.md):
#   bash scripts/gpu_check.sh [HARNESS]
# HARNESS (optional): a folder holding a reference harness you pass in, run beside ours on the same GPU:
#   gpu_anchor.py (decoder: --bs N --out FILE) and/or gpu_anchor_encoder.py (encoder: --bs N --median M --out FILE).
#   Without it, only padfree-plugins' own tests and benchmarks run.
# Prepare what a machine without network needs with scripts/gpu_prepare.sh [HARNESS]:
# .whl: wheels the GPU image lacks or has older (transformers 5.23, sentence-transformers 6.2)
# .gpu: a copy of HARNESS, then: bash scripts/gpu_check.sh .gpu
# Writes everything under $OUT (or out/gpu when run by hand).
set -u -o pipefail
OUT="${OUT:-out/gpu}"; mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"   # PYTHON=.venv/bin/python SKIP_INSTALL=1 for a dry run on a CPU machine
log() { echo "== $*" | tee -a "$OUT/summary.txt"; }
HARNESS="${1:-}"
if [ -n "$HARNESS" ] && [ ! -f "$HARNESS/gpu_anchor.py" ] && [ ! -f "$HARNESS/gpu_anchor_encoder.py" ]; then
  echo "error: $HARNESS holds neither gpu_anchor.py nor gpu_anchor_encoder.py (the reference harness to run" \
       "beside ours); give its folder, or no argument to run ours alone" >&2
  exit 2
fi
anchor() {  # anchor NAME: whether the harness has script NAME (says so once when it does not)
  [ -n "$HARNESS" ] && [ -f "$HARNESS/$1" ] && return 0
  if [ -n "$HARNESS" ]; then log "reference $1 skipped: not in $HARNESS"
  else log "reference $1 skipped: no harness given (bash scripts/gpu_check.sh HARNESS runs one beside ours)"; fi
  return 1
}

if [ -z "${SKIP_INSTALL:-}" ]; then
  if ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
  fi
  $PY -m pip install -q --no-index --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 \
    || { tail -20 /tmp/pip.log; exit 1; }
  for plugin in plugins/*/; do  # a plugin that fails to install shows up as missing, nothing more
    $PY -m pip install -q --no-index --no-deps --no-build-isolation -e "$plugin" >> /tmp/pip.log 2>&1 \
      || echo "could not install $plugin" | tee -a "$OUT/summary.txt"
  done
fi
$PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__,
      torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA')" | tee -a "$OUT/summary.txt"

log "GPU tests"
timeout 180 $PY -m pytest -q -m gpu -p no:cacheprovider tests/test_attention.py tests/test_gpu.py \
  tests/test_trainer.py tests/test_bench_sft.py tests/test_bench_embedding.py 2>&1 | tail -15 | tee -a "$OUT/summary.txt"

if anchor gpu_anchor.py; then
  log "decoder reference ($HARNESS/gpu_anchor.py), 1.1B Llama shape, bf16"
  for bs in 16 4; do
    timeout 120 $PY "$HARNESS/gpu_anchor.py" --bs $bs ${ANCHOR_ARGS:-} --out "$OUT/anchor_bs$bs.json" 2>&1 \
      | grep -E "^(padded_sdpa|native_pf_sdpa|varlen_collator_kwargs|dense)" | cut -c1-240 \
      | tee -a "$OUT/summary.txt"
  done
fi

log "ours: padfree-plugins bench sft --device cuda --dtype bfloat16 --model-size 1b"
timeout 240 $PY -m padfree_plugins.cli.app bench sft --device cuda --dtype bfloat16 --model-size 1b \
  --laws lognormal --batch-sizes 4,16 --batches 6 --rounds 3 --warmup 3 --out "$OUT" 2>&1 \
  | grep -E "│|environment|[Ee]rror" | tee -a "$OUT/summary.txt"

if anchor gpu_anchor_encoder.py; then
  log "encoder reference ($HARNESS/gpu_anchor_encoder.py), BERT-base shape, bf16"
  for spec in "128 60" "32 120"; do set -- $spec
    timeout 90 $PY "$HARNESS/gpu_anchor_encoder.py" --bs $1 --median $2 ${ANCHOR_ARGS:-} \
      --out "$OUT/anchor_enc_bs$1.json" 2>&1 | grep -E "^(padded|varlen)" | cut -c1-240 | tee -a "$OUT/summary.txt"
  done
fi

log "ours: padfree-plugins bench embedding --device cuda"
timeout 180 $PY -m padfree_plugins.cli.app bench embedding --device cuda --batches 8 --rounds 3 2>&1 \
  | grep -E "│|memory|[Ee]rror" | tee -a "$OUT/summary.txt"
log "ours, fp32 (auto falls back to repad): padfree-plugins bench embedding --device cuda --dtype float32"
timeout 90 $PY -m padfree_plugins.cli.app bench embedding --device cuda --dtype float32 --batches 4 --rounds 2 2>&1 \
  | grep -E "│|memory|[Ee]rror" | tee -a "$OUT/summary.txt"
log "done"
