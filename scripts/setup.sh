#!/usr/bin/env bash
# Create .venv (if needed) and install padfree-plugins with everything the demo, benchmarks and tests need.
# torch==2.13.0 is installed first: a CPU wheel where the machine's pip config provides one, as on CI (from plain
# PyPI on Linux it is a CUDA build). PADFREE_TORCH_SPEC replaces it with any pip requirement and options, e.g.
#   PADFREE_TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" ./scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${PADFREE_VENV:-.venv}"
TORCH_SPEC="${PADFREE_TORCH_SPEC:-torch==2.13.0}"
PYTHON="${PYTHON:-python3}"
stamp="$VENV/.padfree-setup"
want="$(cat pyproject.toml constraints.txt plugins/*/pyproject.toml 2>/dev/null | sha256sum | cut -c1-16) $TORCH_SPEC"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0  # already set up for these requirements
fi
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install --upgrade pip
read -r -a TORCH_ARGS <<< "$TORCH_SPEC"  # split into words (requirement + pip options), no globbing
"${PIP[@]}" install "${TORCH_ARGS[@]}"
"${PIP[@]}" install -c constraints.txt -e ".[dev]"
for plugin in plugins/*/; do
  "${PIP[@]}" install -c constraints.txt -e "$plugin" --no-deps
done
echo "$want" > "$stamp"
