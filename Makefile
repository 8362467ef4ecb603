# The two commands a fresh machine needs (each sets up .venv itself):
#   make bench  the main job: every benchmark on embedded defaults (tiny models and the shipped MiniLM, no downloads)
#   make test   the test suite
.PHONY: setup bench demo train test docs
setup:
	./scripts/setup.sh

bench: setup
	HF_HUB_OFFLINE=1 .venv/bin/padfree-plugins bench

demo: setup
	HF_HUB_OFFLINE=1 .venv/bin/padfree-plugins demo

train: setup
	HF_HUB_OFFLINE=1 .venv/bin/padfree-plugins train --acceleration_config configs/padfree.yaml

test: setup
	HF_HUB_OFFLINE=1 .venv/bin/python -m pytest -n 2 -q

docs: setup
	NO_MKDOCS_2_WARNING=1 .venv/bin/python -m mkdocs build --strict
