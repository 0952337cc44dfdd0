#!/usr/bin/env bash
# One device call: the policy update with bf16 compute weights + float32 masters, static
# shapes, compiled blocks and CUDA graphs, against the autocast default and against TRL 1.16's update.
#   (a) pytest on CUDA: tests/test_cuda_graphs.py (graphed = eager, eager fallback), test_compile_blocks.py,
#       test_master_weights.py, test_static_shapes.py (what skips or is CPU-only elsewhere runs here first)
#   (b) bench_update_variants.py: Qwen2.5-0.5B shapes (random weights), works s8 (8 x (272 + 32)), s64
#       (64 x (272 + 136)) and long (32 x (272 + 1024)); variants autocast, bf16-masters, +compile,
#       +compile+graphs (inductor's CUDA graphs), +graphs (eager blocks and the head loss graphed), +block-graphs
#       (the head eager); update s, MFU, peak GiB, graph breaks, graphs compiled
#   (c) bench_trl.py --update-only at 8 and 64 sequences and a long-completion batch (32 sequences, completions of
#       ~1024 tokens): TRL's padded update against grpo_update on one fixed rollout batch (Countdown-like prompt
#       lengths), fastgrpo in the graphed configuration (bf16 masters, buckets of an 8192-token budget, graphs)
#   (d) bench_rollout.py --lean-vs-transformers at 64 sequences: ms per decode step against the memory-bandwidth floor
#   (e) bench_trl.py --works qwen0.5b-shape: the whole trainer step in the graphed configuration against TRL's
#   Full mode order: (a), (c) at 8, (e), (c) at 64 and long, (d), then (b) with what is left.
#
#   bash benchmarks/gpu_update_variants.sh         # on the GPU machine; carry .whl/ (trl, accelerate, datasets, ...)
#   QUICK=1 bash benchmarks/gpu_update_variants.sh # ~270 s: (a), then (b) at s8 and s64 only, in two steps (one per
#                                                  # work), the most telling variants first, three of them profiled
#                                                  # (kernels launched, device busy vs wall, top kernels); no TRL
#   SMOKE=1 bash benchmarks/gpu_update_variants.sh # CPU: the same steps at tiny shapes (checks the script itself)
#   SMOKE=1 QUICK=1 bash benchmarks/gpu_update_variants.sh  # CPU: the QUICK steps at tiny shapes
#
# pytest runs without -x: every failing test shows, with its traceback. A failing variant is a row with its error,
# and its whole traceback is in the log.
#
# Results in ${OUT:-benchmarks/results}/: gpu_update_variants_log.txt, gpu_update_variants_steps.tsv (step, status,
# seconds, limit), gpu_update_variants_pytest.xml, update_variants*.{json,md}, bench_trl_update_{8,64,long}.{json,md},
# bench_trl_whole.{json,md}, decode.{md,csv}. BUDGET_S (default 540; QUICK 270) caps everything; each step runs
# under `timeout` with its own limit, cut to what is left; under 20 s left: skipped.
cd "$(dirname "$0")/.."
QUICK=${QUICK:-0}
TAG=gpu_update_variants BUDGET_DEFAULT=$([ "$QUICK" = 1 ] && echo 270 || echo 540)
source benchmarks/gpu_steps.sh
# QUICK: the variants in this order (the graphed ones first, then what they are compared with; +buckets: the padding
# alone), three of them profiled
QUICK_VARIANTS=autocast,bf16-masters+graphs,bf16-masters+block-graphs,bf16-masters+compile+graphs,bf16-masters,bf16-masters+compile,compile,bf16-masters+buckets
QUICK_PROFILE=autocast,bf16-masters+graphs,bf16-masters+compile+graphs

if [ "$SMOKE" = 1 ]; then
  VARIANT_ARGS=(--smoke)
  TRL_COMMON=(--shape tiny --completion-mean 20 --completion-cap 40 --repeats 1)
  TRL_WORKS=("8:--sequences 8" "long:--sequences 8 --completion-mean 40 --completion-cap 40")
  TESTS=(tests/test_cuda_graphs.py tests/test_master_weights.py)
  QUICK_WORKS=(tiny)
else
  if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "gpu_update_variants.sh: no CUDA device visible (SMOKE=1 runs the steps at tiny shapes on the CPU)" >&2
    exit 2
  fi
  source benchmarks/gpu_env.sh || exit 2  # the carried wheels (trl, ...) and this tree as fastgrpo
  VARIANT_ARGS=(--shape qwen2.5-0.5b --works "${WORKS:-s8,s64,long}" --warmup 3 --steps 5)
  TRL_COMMON=(--shape qwen2.5-0.5b --repeats 3)
  TRL_WORKS=("8:--sequences 8" "64:--sequences 64" "long:--sequences 32 --completion-mean 1024 --completion-cap 1024")
  TESTS=(tests/test_cuda_graphs.py tests/test_compile_blocks.py tests/test_master_weights.py tests/test_static_shapes.py
         tests/test_varlen_op.py)
  QUICK_WORKS=(s8 s64)
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
fi
date -u +"date: %Y-%m-%dT%H:%MZ"
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
echo "command: BUDGET_S=$BUDGET_S SMOKE=$SMOKE QUICK=$QUICK bash benchmarks/gpu_update_variants.sh"

step pytest "$(cap $([ "$QUICK" = 1 ] && echo 75 || echo 90))" "$PY" -m pytest -q -rfE "${TESTS[@]}" \
  --junitxml "$OUT_DIR/gpu_update_variants_pytest.xml" -p no:cacheprovider
if [ "$QUICK" = 1 ]; then
  # one step per work, each capped at its share of what is left, so that a slow compile at s8 leaves s64 its turn
  n=${#QUICK_WORKS[@]}
  for work in "${QUICK_WORKS[@]}"; do
    left=$((DEADLINE - SECONDS - 5))
    if [ "$SMOKE" = 1 ]; then  # no CUDA graphs on a CPU
      args=(--smoke --variants "$(echo "$QUICK_VARIANTS" | tr ',' '\n' | grep -v graphs | paste -sd,)")
    else
      args=(--shape qwen2.5-0.5b --works "$work" --variants "$QUICK_VARIANTS" --warmup 3 --steps 5)
    fi
    step "variants_$work" "$(cap $((left / n)))" "$PY" benchmarks/bench_update_variants.py "${args[@]}" \
      --profile "$QUICK_PROFILE" --profile-top 15 --out "$OUT_DIR/update_variants_$work"
    n=$((n - 1))
  done
  echo; echo "=== steps ($SECONDS s in all)"; cat "$STEPS"
  for f in "$OUT_DIR"/update_variants_*.md; do [ -f "$f" ] && { echo "== $f"; cat "$f"; }; done
  exec >&- 2>&-  # let tee finish the log before the call collects it
  wait "$TEE_PID" 2>/dev/null
  exit $status
fi
# The graphed configuration on fastgrpo's side of every TRL comparison (the default's figures against TRL: RESULTS,
# "The update alone"): bf16 weights + float32 masters, rows padded to the budget's buckets, CUDA
# graphs of the blocks and the head. SMOKE (a CPU): the same without the graphs (refused off CUDA).
if [ "$SMOKE" = 1 ]; then
  GRAPHED=(--fastgrpo-set parallel.master_weights=true --fastgrpo-set "parallel.token_buckets=[1024,2048,4096]"
           --fastgrpo-set grpo.max_tokens_per_microbatch=4096)
  WHOLE_ARGS=(--works tiny --repeats 1 --steps 1 --warmup 1)
else
  GRAPHED=(--fastgrpo-set parallel.master_weights=true --fastgrpo-set parallel.cuda_graphs=true
           --fastgrpo-set "parallel.token_buckets=[2048,4096,8192]" --fastgrpo-set grpo.max_tokens_per_microbatch=8192)
  WHOLE_ARGS=(--works qwen0.5b-shape --repeats 1)
fi
trl_step() {  # trl_step "NAME:ARGS": TRL's update against grpo_update (graphed) on one fixed batch
  local work=$1 name=${1%%:*} L
  L=$(cap 90)
  # shellcheck disable=SC2086  # the work's arguments are words
  step "trl_$name" "$L" "$PY" benchmarks/bench_trl.py --update-only "${TRL_COMMON[@]}" ${work#*:} "${GRAPHED[@]}" \
    --budget-s $((L > 60 ? L - 30 : 30)) --out "$OUT_DIR/bench_trl_update_$name"
}
HAVE_TRL=0; "$PY" -c "import trl" 2>/dev/null && HAVE_TRL=1
if [ "$HAVE_TRL" = 1 ]; then
  # (c) the small batch first (the host-bound case, where graphs help most), then (e) the whole trainer step with the
  # graphed configuration against TRL's (rollout from the bf16 weights, the graphed update, weight sync), then the
  # larger batches
  trl_step "${TRL_WORKS[0]}"
  L=$(cap 150)
  step whole "$L" "$PY" benchmarks/bench_trl.py "${WHOLE_ARGS[@]}" "${GRAPHED[@]}" \
    --budget-s $((L > 60 ? L - 30 : 30)) --out "$OUT_DIR/bench_trl_whole"
  for work in "${TRL_WORKS[@]:1}"; do
    trl_step "$work"
  done
else
  echo "trl is not importable: the TRL rows are not run (carry its wheels in .whl/, see benchmarks/run_gpu.sh)"
  printf 'trl\tunavailable\t0\t0\n' >> "$STEPS"
fi
# (d) decode at 64 sequences against its memory-bandwidth floor (weights + KV cache read once per step): the lean
#     step (CUDA graph) vs transformers' forward, 8 prompts x 8 of 272 tokens, 128 new tokens, no EOS
if [ "$SMOKE" = 1 ]; then
  DECODE_ARGS=(--shape tiny-small --prompts 2 --n 4 --prompt-len 11 --max-tokens 8 --rounds 1)
else
  DECODE_ARGS=(--shape qwen2.5-0.5b --prompts 8 --n 8 --prompt-len 272 --max-tokens 128 --hf-batch-size 64 --rounds 3)
fi
step decode "$(cap 90)" "$PY" benchmarks/bench_rollout.py --lean-vs-transformers --no-eos "${DECODE_ARGS[@]}" \
  --out "$OUT_DIR/decode"
# (b) the variants with what is left (QUICK=1 runs them first, at s8 and s64)
step variants "$(cap 300)" "$PY" benchmarks/bench_update_variants.py "${VARIANT_ARGS[@]}" --out "$OUT_DIR/update_variants"

echo; echo "=== steps ($SECONDS s in all)"; cat "$STEPS"
[ -f "$OUT_DIR/update_variants.md" ] && cat "$OUT_DIR/update_variants.md"
for f in "$OUT_DIR"/bench_trl_update_*.md "$OUT_DIR"/bench_trl_whole.md; do [ -f "$f" ] && { echo "== $f"; cat "$f"; }; done
exec >&- 2>&-  # let tee finish the log before the call collects it
wait "$TEE_PID" 2>/dev/null
exit $status
