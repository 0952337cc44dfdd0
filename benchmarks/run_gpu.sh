#!/usr/bin/env bash
# One command for a lent GPU machine (H100/H200): verify the kernels in bf16, then run every benchmark.
# Budgeted to finish inside one 10-minute call. Results land in ${OUT:-benchmarks/results}/ (markdown + CSV);
# copy the figures, with device, date and this command, into benchmarks/RESULTS.md.
#
#   bash benchmarks/run_gpu.sh            (or: make bench-gpu)
#
# The GPU image has torch/transformers/triton but not this project installed: it is installed here without
# dependencies. Optional pure-Python wheels (e.g. liger-kernel) can travel in .whl/ and are installed first.
set -uo pipefail
cd "$(dirname "$0")/.."
if ! python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "run_gpu.sh: no CUDA device visible; the GPU checks and benchmarks need one (CPU: make test)" >&2
  exit 2
fi
# Liger rows of bench_kernels need liger-kernel (pure Python). Fetch it beside the checkout before the call:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl liger-kernel
# The side-by-side run against TRL (step 3b) needs TRL and accelerate there too (both pure Python):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl trl==1.16.0 accelerate==1.15.0
# and runs a real model folder as well when BENCH_TRL_MODEL names one (e.g. a local Qwen2.5-0.5B-Instruct).
OUT_DIR=${OUT:-benchmarks/results}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
source benchmarks/gpu_env.sh || exit 2
{
  date -u +"date: %Y-%m-%dT%H:%MZ"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"
} | tee "$OUT_DIR/device.txt"

status=0
# The whole script must return inside one 10-minute device call: each step gets at most its own limit and at
# most what is left of BUDGET_S (default 570 s); a step with under 20 s left is skipped and says so.
DEADLINE=$((SECONDS + ${BUDGET_S:-570}))
step() {  # step LIMIT_S command...
  local limit=$1; shift
  local left=$((DEADLINE - SECONDS))
  echo; echo "=== $* (limit $(( limit < left ? limit : left )) s)"
  if [ "$left" -lt 20 ]; then echo "!!! skipped (time budget spent): $*"; status=1; return; fi
  timeout $(( limit < left ? limit : left )) "$@" || { echo "!!! failed or timed out: $*"; status=1; }
}

# Measured on an H100 (2026-11-23): pytest ~110 s, kernel_accuracy ~15 s, bench_trl ~210 s for 3 tiny pairs and one
# 0.5B pair (runs of 20-45 s, mostly start-up), bench_rollout ~40 s. Steps run in priority order (correctness,
# kernels, TRL, learner, rollout) with limits that add up to about BUDGET_S when each takes its usual time; the
# last ones get what is left.

# 1. Correctness on the GPU: bf16 kernels vs fp64, memory bound, packing/attention backends (~2 min). No -x: every
#    failure is listed by name (-rf); a per-test limit (pytest-timeout, when installed) keeps one hang from
#    taking the whole step.
PYTEST_TIMEOUT=""
if python3 -c "import pytest_timeout" 2>/dev/null; then PYTEST_TIMEOUT="--timeout=120"; fi
step 140 python3 -m pytest -q -rf --tb=short $PYTEST_TIMEOUT tests/kernels tests/test_packing.py \
  tests/test_losses.py -p no:cacheprovider
# 1b. Accuracy of every loss path vs float64, bf16 on the GPU (seconds)
step 30 python3 benchmarks/kernel_accuracy.py --n 4096 --h 1024 --v 32000 --chunk-size 1024
# 2. Kernels: ours (cublas path) and ours_recompute (Triton) vs naive torch (TRL) vs Liger (if installed) vs the
#    3-matmul floor (shapes not started within --budget-s are listed as skipped, never guessed)
step 95 python3 benchmarks/bench_kernels.py --reps 3 --warmup 1 --budget-s 70 --out "$OUT_DIR/bench_kernels.csv"
# 2b. The roofline model (benchmarks/roofline.py, a prediction made without a GPU) next to that measurement, shape
#     by shape: the first GPU run tests the model (seconds; occupancy from the recorded sm_90 compile)
step 20 python3 benchmarks/roofline.py --hopper-json benchmarks/hopper_sm90.json \
  --measured "$OUT_DIR/bench_kernels.csv" --out "$OUT_DIR/roofline_vs_measured.md"
# 3. Same GRPO work in fastgrpo and TRL's GRPOTrainer, alternated pairs (bf16 compute on both sides; ~3.5 min:
#    no run starts after --budget-s, so the last one ends by about 195 + 25 s; runs not started are listed)
if python3 -c "import trl" 2>/dev/null; then
  step 225 python3 benchmarks/bench_trl.py --works tiny,qwen0.5b-shape --repeats 3 --budget-s 195 \
    --run-timeout-s 90 ${BENCH_TRL_MODEL:+--model-path "$BENCH_TRL_MODEL"} --out "$OUT_DIR/bench_trl"
else
  echo; echo "=== bench_trl skipped: trl is not importable (wheels of trl and accelerate in .whl/, see the top)"
fi
# 4. Learner: padded vs packed policy update, tokens/s and MFU on the Qwen2.5-0.5B shape (~1.5 min; progress
#    printed per step, tables written after each run, so a cut-short run keeps its finished rows)
step 100 python3 benchmarks/bench_learner.py --budget-s 70 --out "$OUT_DIR/bench_learner"
# 5. Rollout: transformers engine (vLLM only where installed) (~40 s)
if python3 -c "import vllm" 2>/dev/null; then
  step 60 python3 benchmarks/bench_rollout.py --shape qwen2.5-0.5b --out "$OUT_DIR/bench_rollout"
else  # no vLLM on this machine: our decode loop against transformers' generate, same model and prompts
  step 60 python3 benchmarks/bench_rollout.py --shape qwen2.5-0.5b --hf-vs-generate
fi
exit $status
