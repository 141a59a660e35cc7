# The two commands of the README: `make demo` (the main job) and `make test` (the test suite).
# Both create or update .venv/ at the repo root by themselves; re-running them is cheap.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.kiln-installed

.PHONY: demo test venv bench-protocols

venv: $(STAMP)

# Reinstalls when pyproject.toml changes. torch==2.13.0 resolves to the CPU wheel on disk.
$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -qq --disable-pip-version-check -e .
	@touch $(STAMP)

# Two workers, one per CI core; tests/conftest.py says how tests are grouped onto them.
test: venv
	$(BIN)/python -m pytest -n 2

# A short training run with configs/default.yaml on CPU (the README gives its cold- and warm-cache
# times); the run directory (report.md, plots, metrics, episode dumps, the final model) is printed
# at the end.
demo: venv
	$(BIN)/kiln train --config configs/default.yaml

bench-protocols: venv
	$(BIN)/python -m launch.bench.protocols
