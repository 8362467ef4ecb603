#!/usr/bin/env bash
# Create .venv (if needed) and install padfree-plugins with everything the demo, benchmarks and tests need.
# CPU torch is pinned first so that pip never pulls a multi-GB CUDA build; GPU users override it:
#   PADFREE_TORCH_SPEC="torch==2.11.0" ./scripts/setup.sh      (or any spec / index options pip accepts)
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
"${PIP[@]}" install "$TORCH_SPEC"
"${PIP[@]}" install -c constraints.txt -e ".[dev]"
for plugin in plugins/*/; do
  "${PIP[@]}" install -c constraints.txt -e "$plugin" --no-deps
done
echo "$want" > "$stamp"
