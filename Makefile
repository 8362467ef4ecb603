# The two commands a fresh machine needs (each sets up .venv itself):
#   make bench  the main job: every benchmark on embedded defaults (tiny models and the shipped MiniLM, no downloads)
#   make test   the test suite (and first the environment of its `axolotl train` test: scripts/axolotl_env.sh)
.PHONY: setup axolotl-env bench demo train test docs
setup:
	./scripts/setup.sh

# axolotl's own environment, cached outside the clone (minutes once, then seconds); a failed install stops `make test`
axolotl-env:
	./scripts/axolotl_env.sh

bench: setup
	HF_HUB_OFFLINE=1 .venv/bin/padfree-plugins bench

demo: setup
	HF_HUB_OFFLINE=1 .venv/bin/padfree-plugins demo

train: setup
	HF_HUB_OFFLINE=1 .venv/bin/padfree-plugins train --acceleration_config configs/padfree.yaml

test: setup axolotl-env
	HF_HUB_OFFLINE=1 PADFREE_REQUIRE_AXOLOTL=1 .venv/bin/python -m pytest -n 2 -q

docs: setup
	NO_MKDOCS_2_WARNING=1 .venv/bin/python -m mkdocs build --strict
