# One virtual environment per checkout. torch is pinned to the local CPU wheel through
# constraints.txt, so no install step here can pull CUDA builds.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: install run test lint docs fidelity clean

$(STAMP): pyproject.toml benchmarks/pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q -c constraints.txt torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e ".[test,docs,dev]"
	# The benchmarks, a distribution of their own (benchmarks/pyproject.toml). compat mode: a plain
	# path entry for benchmarks/, so no import hook named after them lands in sys.modules.
	$(BIN)/pip install -q -c constraints.txt -e ./benchmarks --config-settings editable_mode=compat
	touch $(STAMP)

install: $(STAMP)

run: install
	$(BIN)/lightning-dvi fit --config recipes/toy_heteroscedastic.yaml

fidelity: install
	$(BIN)/python recipes/moment_fidelity.py

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check lightning_dvi benchmarks/lightning_dvi_benchmarks
	$(BIN)/mypy

test: install
	$(BIN)/ruff check .
	$(BIN)/mypy
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict  # no -q: it hides the warnings --strict counts
	$(BIN)/python -m pytest -q -n 2 --dist worksteal tests lightning_dvi benchmarks/lightning_dvi_benchmarks --doctest-modules --durations=25

docs: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

clean:
	rm -rf $(VENV) site .pytest_cache .ruff_cache .mypy_cache
