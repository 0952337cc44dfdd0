#!/usr/bin/env bash
# One command for a lent GPU machine (H100/H200), inside one 10-minute device call. The verdict comes first:
# fastgrpo against TRL's GRPOTrainer on the same work, three sides (fastgrpo, fastgrpo with grpo.shared_prefix=false,
# TRL), at Qwen2.5-0.5B shapes, with a 512-token shared prompt at those shapes and on the tiny model, and the tiny
# work, bf16, each side's update MFU counted on the tokens its trunk forwarded and on the sequences' tokens; then the
# correctness checks on CUDA (tests: the shared prefix's attention among them), the update alone against TRL's, our
# decode loop against transformers' generate at 64 sequences, the loss accuracy, then the kernel benchmarks. One
# summary table at the end: each comparison, its ratio, its target, met / not met / not run, the MFU, and every
# step's status (benchmarks/gpu_summary.py).
#
#   bash benchmarks/run_gpu.sh            (or: make bench-gpu)
#   SMOKE=1 bash benchmarks/run_gpu.sh    (or: SMOKE=1 make bench-gpu) a CPU: the same steps at tiny shapes, one run
#                                         per side, limits x4 within BUDGET_S 7200 (checks the script and the
#                                         summary, not a figure; ~3 min); PYTHON (default .venv/bin/python) runs them
#
# Results land in ${OUT:-benchmarks/results}/, at most 8 files (what a device call brings back): summary.md (the
# verdict), log.txt (everything printed), bench_trl.json, decode.log, pytest.xml, bench_kernels.csv,
# roofline_vs_measured.md, bench_learner.md. Copy the figures, with device, date and this command, into
# benchmarks/RESULTS.md.
#
# The GPU image has torch/transformers/triton/accelerate but not this project, TRL, datasets or Liger: this project is
# made importable without pip (benchmarks/gpu_env.sh), and pure-Python wheels carried in .whl/ are installed first.
# Fetch them beside the checkout before the call (and name .whl in the call's carry):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl trl==1.16.0 \
#     accelerate==1.15.0 datasets==4.7.0 dill==0.4.0 multiprocess==0.70.18 liger-kernel
# TRL and datasets for the verdict (step trl), liger-kernel for bench_kernels' Liger rows. BENCH_TRL_MODEL (a local
# model folder, e.g. Qwen2.5-0.5B-Instruct) adds a real model to the TRL pairs; BENCH_FASTGRPO_ATTN names fastgrpo's
# attention there (default auto: torch's varlen FlashAttention on CUDA); PYTEST_WORKERS (default 4, 0: none) sets
# the test step's pytest-xdist processes.
set -uo pipefail
cd "$(dirname "$0")/.."
SMOKE=${SMOKE:-0}
if [ "$SMOKE" = 1 ]; then
  PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
  LIMIT_SCALE=4  # a shared 2-core CPU: start-up alone takes a GPU step's time
else
  PY=${PYTHON:-python3}
  LIMIT_SCALE=1
  if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "run_gpu.sh: no CUDA device visible; the GPU checks and benchmarks need one (CPU: make test; the" \
         "script itself at tiny shapes: SMOKE=1)" >&2
    exit 2
  fi
fi
OUT_DIR=${OUT:-benchmarks/results}
mkdir -p "$OUT_DIR"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/fastgrpo-gpu.XXXXXX")  # every step's output; what is kept is copied to OUT_DIR
exec > >(tee "$OUT_DIR/log.txt") 2>&1
TEE_PID=$!
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

# The budget: everything, set-up included, ends inside BUDGET_S (default 570 s of a 600 s call). Each step runs under
# its own limit, cut to what is left before the summary's reserve; a step with under 20 s left is skipped and listed
# as such. Limits (s), in the order the steps run (priority order); expected times from an H100 run where known:
#   set-up        -    wheels, fastgrpo importable, device line (~10 s)
#   trl         300    bench_trl, three sides: the model folders first (the 0.5B one is built on the CPU, once for
#                      both 0.5B works), then one run of each side per work per round (0.5B shapes, 0.5B shapes with
#                      the 512-token prompt, the tiny model with it, tiny), up to 3 rounds, 2 warm-up + 5 timed
#                      steps per run; no round of a work starts that its previous round says would end past
#                      limit - 15 s. Runs took 20-45 s with 3 steps on an H100, mostly start-up: expect one round of
#                      each work (not yet run with three sides or the long prompt)
#   pytest      150    kernels, packing, losses, decode and the shared prefix's torch_varlen tests on CUDA, 4
#                      pytest-xdist workers (133 items took over 130 s in one process)
#   update      150    bench_trl --update-only: the update alone, TRL padded vs fastgrpo packed, 64 sequences
#   profile      80    bench_trl --profile at the 0.5B shapes, all sides: torch.profiler tables of one update, CPU and
#                      CUDA time, printed into log.txt (where the small-batch update's time goes on each side)
#   decode       90    bench_rollout --hf-vs-generate: 8 prompts x 8 samples = 64 sequences, 3 rounds (~40 s)
#   accuracy     30    kernel_accuracy, bf16 vs float64 (~15 s)
#   kernels      80    bench_kernels (shapes not started within limit - 25 s are listed as skipped)
#   roofline     20    the speed model next to the kernels' measurement (seconds)
#   learner     100    bench_learner, what is left (it has never finished on the GPU: last, so it costs nothing else)
#   summary      15    the reserve: gpu_summary.py's table, always written
# The update alone, decode and the kernels have H100 figures from earlier calls; when the verdict takes its full
# limits, the last steps are skipped (listed in the summary) after the correctness checks ran.
BUDGET_S=${BUDGET_S:-$([ "$SMOKE" = 1 ] && echo 7200 || echo 570)}
SUMMARY_RESERVE_S=15
DEADLINE=$((SECONDS + BUDGET_S - SUMMARY_RESERVE_S))
status=0

record() {  # record NAME STATUS SECONDS LIMIT [NOTE]: one line of steps.tsv (read by gpu_summary.py)
  printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "${5:-}" >> "$WORK/steps.tsv"
}
cap() {  # cap LIMIT_S: the step's own limit (x LIMIT_SCALE), or what is left of the budget when that is less
  local left=$((DEADLINE - SECONDS)) own=$(($1 * LIMIT_SCALE))
  echo $(( own < left ? own : left ))
}
step() {  # step NAME LIMIT_S command...: run it under LIMIT_S (from cap), its output also in $WORK/NAME.log
  local name=$1 limit=$2; shift 2
  echo; echo "=== [$name] $* (limit $limit s)"
  if [ "$limit" -lt 20 ]; then
    echo "!!! [$name] skipped: $limit s left of the budget"
    record "$name" skipped 0 "$limit" "time budget spent"; status=1; return
  fi
  local t0=$SECONDS rc
  timeout -k 5 "$limit" "$@" 2>&1 | tee "$WORK/$name.log"
  rc=${PIPESTATUS[0]}
  if [ "$rc" -eq 0 ]; then
    record "$name" ok $((SECONDS - t0)) "$limit"
  elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    echo "!!! [$name] timed out after $((SECONDS - t0)) s"; record "$name" timeout $((SECONDS - t0)) "$limit"; status=1
  else
    echo "!!! [$name] failed (exit $rc)"; record "$name" failed $((SECONDS - t0)) "$limit" "exit $rc"; status=1
  fi
}
unavailable() {  # unavailable NAME WHY: a step this machine cannot run
  echo; echo "=== [$1] not run: $2"; record "$1" unavailable 0 0 "$2"
}
keep() {  # keep FILE...: into OUT_DIR, right after the step (a call cut short still brings back what finished)
  local f; for f; do [ -f "$f" ] && cp "$f" "$OUT_DIR/"; done; return 0
}

# -- set-up ------------------------------------------------------------------------------------------------------
if [ "$SMOKE" = 1 ]; then  # this checkout's environment: nothing installed, nothing written outside OUT_DIR and WORK
  export FASTGRPO_CACHE=${FASTGRPO_CACHE:-$WORK/cache}
  "$PY" -c "import fastgrpo.kernels" || { echo "run_gpu.sh: fastgrpo is not importable by $PY" >&2; exit 2; }
else
  source benchmarks/gpu_env.sh || exit 2
fi
{
  date -u +"date: %Y-%m-%dT%H:%MZ"
  if [ "$SMOKE" = 1 ]; then
    echo "SMOKE=1: a CPU, tiny shapes; checks the script, measures nothing"
  else
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  fi
  "$PY" -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"
  echo "command: ${BUDGET_S:+BUDGET_S=$BUDGET_S }SMOKE=$SMOKE bash benchmarks/run_gpu.sh"
} | tee "$WORK/device.txt"

# Each step's arguments: the GPU's, or under SMOKE the same step at tiny shapes
if [ "$SMOKE" = 1 ]; then
  TRL_ARGS=(--works tiny,long-prompt --repeats 1 --steps 1 --warmup 1 --run-timeout-s 900)
  UPDATE_ARGS=(--shape tiny --sequences 8 --generations 4 --trl-micro-batch 4 --completion-mean 12
               --completion-cap 24 --repeats 1 --no-control)
  PROFILE_ARGS=(--works tiny --profile --steps 1 --warmup 1 --run-timeout-s 300)
  DECODE_ARGS=(--shape tiny-small --prompts 2 --n 4 --hf-batch-size 8 --prompt-len 11 --max-tokens 8 --rounds 1)
  ACCURACY_ARGS=(--n 256 --h 64 --v 1000 --chunk-size 64)
  TESTS=(tests/test_metrics.py tests/test_shared_prefix.py::test_torch_varlen_shared_rows_equal_unshared_on_gpu)
  KERNEL_ARGS=(--quick --reps 1 --warmup 1)
  LEARNER_ARGS=(--quick)
else
  TRL_ARGS=(--works qwen0.5b-shape,qwen0.5b-long-prompt,long-prompt,tiny --repeats 3 --steps 5 --warmup 2
            --run-timeout-s 120)
  UPDATE_ARGS=(--shape qwen2.5-0.5b --sequences 64 --repeats 3)
  PROFILE_ARGS=(--works qwen0.5b-shape --profile --steps 2 --warmup 1 --run-timeout-s 35)
  DECODE_ARGS=(--shape qwen2.5-0.5b --prompts 8 --n 8 --hf-batch-size 64 --prompt-len 64 --max-tokens 128 --rounds 3)
  ACCURACY_ARGS=(--n 4096 --h 1024 --v 32000 --chunk-size 1024)
  TESTS=(tests/test_packing.py tests/test_lean_decode.py tests/test_rollout_hf.py tests/test_one_gpu.py tests/kernels
         tests/test_losses.py tests/test_shared_prefix.py::test_torch_varlen_shared_rows_equal_unshared_on_gpu)
  KERNEL_ARGS=(--reps 3 --warmup 1)
  LEARNER_ARGS=()
fi

# -- 1. the verdict: fastgrpo (prompts shared, then unshared) vs TRL, the same GRPO work, alternated (bench_trl.py's
#    docstring); the update's MFU on both token counts is in its table (on CUDA)
if "$PY" -c "import trl, datasets" 2>/dev/null; then
  L=$(cap 300)
  step trl "$L" "$PY" benchmarks/bench_trl.py "${TRL_ARGS[@]}" --budget-s $((L - 15)) \
    ${BENCH_TRL_MODEL:+--model-path "$BENCH_TRL_MODEL"} \
    ${BENCH_FASTGRPO_ATTN:+--fastgrpo-attn "$BENCH_FASTGRPO_ATTN"} --out "$WORK/bench_trl"
  keep "$WORK/bench_trl.json"
else
  unavailable trl "trl or datasets is not importable (carry their wheels in .whl/, see the top)"
fi

# -- 2. correctness on CUDA: the tests (bf16 kernels vs fp64, memory bounds, packing exactness per attention backend,
#    torch_varlen included, the shared prefix's rows through torch_varlen against unshared rows, losses, the decode
#    step's CUDA graph). No -x: every failure is named (-rf, and in pytest.xml); a per-test limit (pytest-timeout)
#    keeps one hang from taking the whole step.
PYTEST_ARGS=(-q -rf --tb=short -p no:cacheprovider --junitxml="$WORK/pytest.xml")
if "$PY" -c "import pytest_timeout" 2>/dev/null; then PYTEST_ARGS+=(--timeout=60); fi
if [ "${PYTEST_WORKERS:-4}" != 0 ] && "$PY" -c "import xdist" 2>/dev/null; then
  PYTEST_ARGS+=(-n "${PYTEST_WORKERS:-4}")
fi
#    Two CPU-only tests are left to CI: the Triton interpreter cases (written for triton 3.9's interpreter; the GPU
#    runs the compiled kernels instead) and flex_attention compiled for the CPU (inductor's C++ build alone outlasts
#    the per-test limit there).
PYTEST_ARGS+=(--deselect tests/kernels/test_triton_interpret.py::test_triton_kernels_under_interpreter
              --deselect tests/test_packing.py::test_flex_attention_packed_logprobs_equal_unpadded)
step pytest "$(cap 150)" "$PY" -m pytest "${PYTEST_ARGS[@]}" "${TESTS[@]}"
keep "$WORK/pytest.xml"

# -- 3. the update alone on one fixed rollout batch of 64 Countdown-like sequences at 0.5B shapes: TRL's own
#    compute_loss + backward + AdamW on its padded layout against grpo_update packed, gradient parity first, then
#    alternated pairs and the one-length control (benchmarks/trl_update.py). Its table goes into summary.md. Then
#    the profile of one update at the 0.5B shapes, every side.
if "$PY" -c "import trl, datasets" 2>/dev/null; then
  L=$(cap 150)
  step update "$L" "$PY" benchmarks/bench_trl.py --update-only "${UPDATE_ARGS[@]}" \
    --budget-s $((L > 80 ? L - 40 : 40)) --out "$WORK/bench_trl_update"
  # bash -c: $0 the python, $1 the step folder, the rest bench_trl's arguments
  step profile "$(cap 80)" bash -c '"$0" benchmarks/bench_trl.py "${@:2}" --out "$1/p" && for f in "$1"/p-profile-*.txt
    do echo "== $f"; head -40 "$f"; sed -n "/by self CPU time/,\$p" "$f"; done' "$PY" "$WORK" "${PROFILE_ARGS[@]}"
else
  unavailable update "trl or datasets is not importable (carry their wheels in .whl/, see the top)"
fi

# -- 4. decode: our hf engine (graph-replayed lean step on CUDA) vs transformers' generate, 64 sequences ------------
#    Random Qwen2.5-0.5B shapes in bf16, no EOS (every sequence 128 new tokens on both sides), alternated rounds.
step decode "$(cap 90)" "$PY" benchmarks/bench_rollout.py --hf-vs-generate --no-eos "${DECODE_ARGS[@]}"
keep "$WORK/decode.log"

# -- 5. the accuracy of every loss path vs float64 in bf16 (seconds)
step accuracy "$(cap 30)" "$PY" benchmarks/kernel_accuracy.py "${ACCURACY_ARGS[@]}"

# -- 6. kernels: ours (cublas path) and ours_recompute (Triton) vs naive torch (TRL) vs Liger (if installed) vs the
#    3-matmul floor (shapes not started within --budget-s are listed as skipped, never guessed); then the roofline
#    model (benchmarks/roofline.py, a prediction made without a GPU) next to that measurement, shape by shape.
L=$(cap 80)
step kernels "$L" "$PY" benchmarks/bench_kernels.py "${KERNEL_ARGS[@]}" --budget-s $((L > 45 ? L - 25 : 20)) \
  --out "$WORK/bench_kernels.csv"
keep "$WORK/bench_kernels.csv"
if [ -f "$WORK/bench_kernels.csv" ]; then
  step roofline "$(cap 20)" "$PY" benchmarks/roofline.py --hopper-json benchmarks/hopper_sm90.json \
    --measured "$WORK/bench_kernels.csv" --out "$WORK/roofline_vs_measured.md"
  keep "$WORK/roofline_vs_measured.md"
else
  unavailable roofline "no bench_kernels.csv to compare with"
fi

# -- 7. learner: padded vs packed policy update on the Qwen2.5-0.5B shape (progress printed per step) ----------------
L=$(cap 100)
step learner "$L" "$PY" benchmarks/bench_learner.py "${LEARNER_ARGS[@]}" --budget-s $((L > 50 ? L - 30 : 20)) \
  --out "$WORK/bench_learner"
keep "$WORK/bench_learner.md"

# -- the summary: one table, printed and in OUT_DIR/summary.md ------------------------------------------------------
echo; echo "=== summary ($((SECONDS)) s since the start; steps and their outputs in $WORK)"
timeout $((20 * LIMIT_SCALE)) "$PY" benchmarks/gpu_summary.py --work "$WORK" --out "$OUT_DIR/summary.md" || status=1
exec >&- 2>&-  # let tee finish log.txt before the call collects it
wait "$TEE_PID" 2>/dev/null
exit $status
