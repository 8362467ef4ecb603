# The two commands a fresh machine needs (each sets up .venv itself):
#   make demo   the main job on an embedded default (tiny models, no downloads)
#   make test   the test suite
.PHONY: setup demo test
setup:
	./scripts/setup.sh

demo: setup
	HF_HUB_OFFLINE=1 .venv/bin/padfree-plugins demo

test: setup
	HF_HUB_OFFLINE=1 .venv/bin/python -m pytest -n 2 -q
