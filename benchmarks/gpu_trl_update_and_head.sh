#!/usr/bin/env bash
# One device call: does packing's lead over TRL's update hold on a GPU, and where does TRL 1.16's own fused lm_head
# stand beside ours?
#   (a) bench_trl.py --update-only: TRL's GRPOTrainer update (its compute_loss + backward + optimizer step on its
#       padded layout) against fastgrpo's grpo_update (packed) on one fixed rollout batch, Qwen2.5-0.5B shapes
#       (random weights), 64 sequences of Countdown-like lengths, bf16 autocast over float32 weights on both sides;
#       gradient parity first, then alternated pairs, and the one-length control batch.
#   (b) bench_kernels.py at Qwen2.5-0.5B head shapes (H 896, V 151936): floor, ours, naive full logits, TRL's fused
#       head (`trl`), Liger's Triton op.
#
#   bash benchmarks/gpu_trl_update_and_head.sh          # on the GPU machine; carry .whl/ (trl, accelerate, ...)
#   SMOKE=1 bash benchmarks/gpu_trl_update_and_head.sh  # CPU: the same steps at tiny shapes (checks the script itself)
#
# Results in ${OUT:-benchmarks/results}/: gpu_trl_update_and_head_log.txt, gpu_trl_update_and_head_steps.tsv (step,
# status, seconds, limit), bench_trl_update.{json,md}, bench_kernels_head.csv. BUDGET_S (default 420) caps
# everything; each step runs under `timeout` with its own limit, cut to what is left of the budget; a step with
# under 20 s left is skipped.
cd "$(dirname "$0")/.."
TAG=gpu_trl_update_and_head BUDGET_DEFAULT=420
source benchmarks/gpu_steps.sh

if [ "$SMOKE" = 1 ]; then
  TRL_ARGS=(--shape tiny --sequences 16 --completion-mean 20 --completion-cap 40 --repeats 2)
  KERNEL_ARGS=(--quick --shape 256,32,509 --reps 1 --warmup 0)
  KERNEL_METHODS=floor,ours,naive,trl
else
  if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "gpu_trl_update_and_head.sh: no CUDA device visible (SMOKE=1 runs the steps at tiny shapes on the CPU)" >&2
    exit 2
  fi
  source benchmarks/gpu_env.sh || exit 2  # the carried wheels (trl, ...) and this tree as fastgrpo
  TRL_ARGS=(--shape qwen2.5-0.5b --sequences 64 --repeats 5)
  KERNEL_ARGS=(--shape 16384,896,151936 --shape 32768,896,151936 --reps 3 --warmup 1)
  KERNEL_METHODS=floor,ours,naive,trl,liger_triton
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
fi
date -u +"date: %Y-%m-%dT%H:%MZ"
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
"$PY" -c "import trl; print('trl', trl.__version__)" || echo "trl is not importable: the TRL side and row say so"
echo "command: BUDGET_S=$BUDGET_S SMOKE=$SMOKE bash benchmarks/gpu_trl_update_and_head.sh"

# (a) the update alone: TRL's padded update vs grpo_update, 0.5B shapes, 64 sequences (~60 s of model building on
#     the host, then each pair is a few seconds); no pair starts past the step's limit - 40 s.
L=$(cap 280)
step update "$L" "$PY" benchmarks/bench_trl.py --update-only "${TRL_ARGS[@]}" --budget-s $((L > 80 ? L - 40 : 40)) \
  --out "$OUT_DIR/bench_trl_update"

# (b) the heads alone at the 0.5B head's shapes, TRL's fused head among them.
L=$(cap 110)
step kernels "$L" "$PY" benchmarks/bench_kernels.py "${KERNEL_ARGS[@]}" --methods "$KERNEL_METHODS" \
  --budget-s $((L > 45 ? L - 30 : 15)) --out "$OUT_DIR/bench_kernels_head.csv"

echo; echo "=== steps ($SECONDS s in all)"; cat "$STEPS"
[ -f "$OUT_DIR/bench_trl_update.md" ] && cat "$OUT_DIR/bench_trl_update.md"
exec >&- 2>&-  # let tee finish the log before the call collects it
wait "$TEE_PID" 2>/dev/null
exit $status
