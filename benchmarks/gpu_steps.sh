# Shared by the one-call GPU scripts (gpu_trl_update_and_head.sh, gpu_update_variants.sh), sourced from the
# repository root after setting TAG (the results' prefix) and BUDGET_DEFAULT (seconds): the output folder, a log of everything, the budget,
# and `step NAME LIMIT_S command...`, which runs one step under `timeout` and writes one line of ${TAG}_steps.tsv.
set -uo pipefail
OUT_DIR=${OUT:-benchmarks/results}
BUDGET_S=${BUDGET_S:-$BUDGET_DEFAULT}
SMOKE=${SMOKE:-0}
PY=${PYTHON:-python3}
mkdir -p "$OUT_DIR"
STEPS="$OUT_DIR/${TAG}_steps.tsv"
: > "$STEPS"
exec > >(tee "$OUT_DIR/${TAG}_log.txt") 2>&1
TEE_PID=$!
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
DEADLINE=$((SECONDS + BUDGET_S))
status=0

cap() {  # cap LIMIT_S: the step's own limit, or what is left of the budget when that is less
  local left=$((DEADLINE - SECONDS))
  echo $(( $1 < left ? $1 : left ))
}
step() {  # step NAME LIMIT_S command...: run under `timeout LIMIT_S`, one line in ${TAG}_steps.tsv
  local name=$1 limit=$2 t0=$SECONDS rc; shift 2
  echo; echo "=== [$name] $* (limit $limit s)"
  if [ "$limit" -lt 20 ]; then
    echo "!!! [$name] skipped: $limit s left of the budget"; printf '%s\tskipped\t0\t%s\n' "$name" "$limit" >> "$STEPS"
    status=1; return
  fi
  timeout -k 5 "$limit" "$@"
  rc=$?
  local what=ok
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then what=timeout; elif [ "$rc" -ne 0 ]; then what="failed (exit $rc)"; fi
  [ "$what" = ok ] || status=1
  echo "=== [$name] $what after $((SECONDS - t0)) s"
  printf '%s\t%s\t%s\t%s\n' "$name" "$what" $((SECONDS - t0)) "$limit" >> "$STEPS"
}
