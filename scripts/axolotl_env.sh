#!/usr/bin/env bash
# Create (or reuse) the environment where tests/test_axolotl_train.py runs `axolotl train`: axolotl 0.21 pins its own
# transformers and datasets, so it cannot share .venv. `make test` runs this first.
#   scripts/axolotl_env.sh               set it up (seconds when it exists: only this clone's packages)
#   scripts/axolotl_env.sh --print-path  print where it is
# It is made from scripts/axolotl-lock.txt (every version fixed, installed with --no-deps: no resolve) and cached
# outside the clone, in ${XDG_CACHE_HOME:-~/.cache}/padfree-plugins/axolotl-env-<hash of the lock and torch>, so a
# fresh clone reuses it. Environment variables:
#   PADFREE_AXOLOTL_ENV  where it is instead
#   AXOLOTL_PYTHON       the Python to make it with (default python3; 3.11 or later)
#   PADFREE_TORCH_SPEC   the torch to install (default torch==2.13.0, as scripts/setup.sh: a CPU wheel where the
#                        machine's pip config provides one, as on CI for Python 3.11; from plain PyPI a CUDA build)
# It fails, saying why, when it cannot install (no network): `make test` then stops instead of skipping the test.
set -euo pipefail
cd "$(dirname "$0")/.."
LOCK=scripts/axolotl-lock.txt
TORCH_SPEC="${PADFREE_TORCH_SPEC:-torch==2.13.0}"
PYTHON="${AXOLOTL_PYTHON:-python3}"
version="$("$PYTHON" -c 'import sys; print(sys.version_info[:2])')"
key="$( (cat "$LOCK"; echo "$TORCH_SPEC $version") | sha256sum | cut -c1-12)"
ENV_DIR="${PADFREE_AXOLOTL_ENV:-${XDG_CACHE_HOME:-$HOME/.cache}/padfree-plugins/axolotl-env-$key}"
if [ "${1:-}" = "--print-path" ]; then
  echo "$ENV_DIR"
  exit 0
fi
stamp="$ENV_DIR/.padfree-axolotl-setup"
# this clone's padfree-plugins and plugin, installed editable: their entry points (axolotl.plugins, padfree_plugins)
want="$key $(cat pyproject.toml plugins/padfree-axolotl/pyproject.toml | sha256sum | cut -c1-12) $PWD"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0  # already set up for this lock and this clone
fi
mkdir -p "$(dirname "$ENV_DIR")"
exec 9>"$ENV_DIR.lock"  # one setup at a time (clones that share the cache)
flock 9
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0  # another setup made it meanwhile
fi
fail() { echo "scripts/axolotl_env.sh: $1 (the axolotl environment at $ENV_DIR is incomplete;" \
  "tests/test_axolotl_train.py needs it)" >&2; exit 1; }
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || fail "$PYTHON is older than Python 3.11"
PIP=("$ENV_DIR/bin/python" -m pip --disable-pip-version-check -q)
if [ ! -f "$ENV_DIR/.padfree-axolotl-lock" ] || [ "$(cat "$ENV_DIR/.padfree-axolotl-lock")" != "$key" ]; then
  echo "scripts/axolotl_env.sh: making the axolotl environment at $ENV_DIR (once; a few minutes)" >&2
  rm -rf "$ENV_DIR"
  "$PYTHON" -m venv "$ENV_DIR" || fail "could not make a venv with $PYTHON"
  read -r -a TORCH_ARGS <<< "$TORCH_SPEC"  # split into words (requirement + pip options), no globbing
  "${PIP[@]}" install "${TORCH_ARGS[@]}" || fail "pip could not install $TORCH_SPEC"
  # axolotl declares Python >= 3.12; its code runs on 3.11 (see the lock's header)
  "${PIP[@]}" install --no-deps --ignore-requires-python -r "$LOCK" || fail "pip could not install $LOCK"
  echo "$key" > "$ENV_DIR/.padfree-axolotl-lock"
fi
"${PIP[@]}" install --no-deps --no-build-isolation -e . -e plugins/padfree-axolotl \
  || fail "pip could not install padfree-plugins and plugins/padfree-axolotl"
echo "$want" > "$stamp"
