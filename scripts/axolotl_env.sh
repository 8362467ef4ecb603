#!/usr/bin/env bash
# Create (or reuse) the Python 3.12 environment where tests/test_axolotl_train.py runs `axolotl train`: axolotl 0.21
# needs Python >= 3.12, so it cannot share .venv. Reused while its stamp matches the requirements below.
#   PADFREE_AXOLOTL_ENV  where (default .axolotl-env)
#   AXOLOTL_PYTHON       the Python 3.12 to create it with (default: python3.12, else pyenv's 3.12.1)
# torch 2.13.0 is the oldest release axolotl 0.21 accepts (torch>=2.13,<2.15); from PyPI on Linux x86_64 it is a
# CUDA build (it runs on the CPU). The whole environment is about 7 GB on disk (see docs/launchers.md).
set -euo pipefail
cd "$(dirname "$0")/.."
ENV_DIR="${PADFREE_AXOLOTL_ENV:-.axolotl-env}"
SPEC="axolotl==0.21.* torch==2.13.0"
PYTHON="${AXOLOTL_PYTHON:-$(command -v python3.12 || echo "$HOME/.pyenv/versions/3.12.1/bin/python")}"
stamp="$ENV_DIR/.padfree-axolotl-setup"
want="$(cat pyproject.toml plugins/padfree-axolotl/pyproject.toml | sha256sum | cut -c1-16) $SPEC"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0  # already set up for these requirements
fi
[ -x "$PYTHON" ] || { echo "axolotl 0.21 needs Python >= 3.12: set AXOLOTL_PYTHON to one" >&2; exit 1; }
[ -x "$ENV_DIR/bin/python" ] || "$PYTHON" -m venv "$ENV_DIR"
PIP=("$ENV_DIR/bin/python" -m pip --disable-pip-version-check -q)
read -r -a SPEC_ARGS <<< "$SPEC"
"${PIP[@]}" install "${SPEC_ARGS[@]}"
# padfree-plugins and the plugin, editable; axolotl's pins (transformers, TRL, datasets) stay as axolotl wants them
"${PIP[@]}" install -e . -e plugins/padfree-axolotl "${SPEC_ARGS[@]}"
echo "$want" > "$stamp"
