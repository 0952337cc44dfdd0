"""PPO (a learned critic, GAE) against GRPO on the CPU tasks: steps and wall time to a given accuracy, over seeds.

    python benchmarks/bench_ppo.py                                   # the toy task, seeds 0 1 2, both algorithms
    python benchmarks/bench_ppo.py --task countdown --seeds 0        # the demo's Countdown (configs/tiny.yaml)
    python benchmarks/bench_ppo.py --ppo ppo.critic_lr=3e-4          # overrides for the PPO runs only

Each run is ``fastgrpo.trainers.grpo.Trainer`` with a shipped config (toy: ``configs/tiny-toy.yaml`` for GRPO,
``configs/tiny-ppo.yaml`` for PPO; countdown: ``configs/tiny.yaml`` for both, PPO adding ``algorithm=ppo`` and
the ``--ppo`` overrides) at ``seed=<s>``, for ``--steps`` steps. The accuracy is the training reward (``reward/mean``:
both tasks' rewards are 1 for a correct completion, else 0) averaged over a trailing window of ``--window`` steps;
"steps to target" is the first step at which that average reaches ``--target``, its wall time the sum of the
steps' rollout and update times up to there (evaluations excluded). Also reported: the last window's reward, the
held-out greedy accuracy of the run's last evaluation (when it has one), and the seconds per step. Prints a markdown
table and writes it, with each run's figures, under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONFIGS = {"toy": {"grpo": "tiny-toy.yaml", "ppo": "tiny-ppo.yaml"},
           "countdown": {"grpo": "tiny.yaml", "ppo": "tiny.yaml"}}


def run_one(task: str, algorithm: str, seed: int, *, steps: int, extra: list[str], out: Path) -> dict:
    """One training run; returns its per-step rewards and step times and its last evaluation."""
    import fastgrpo.trainers.warm  # noqa: F401  (registers tiny:countdown)
    from fastgrpo.config import load_config
    from fastgrpo.trainers.grpo import Trainer

    name = f"{task}-{algorithm}-seed{seed}"
    overrides = [f"output_dir={out}", f"name={name}", f"seed={seed}", f"max_steps={steps}", "checkpoint.resume=never",
                 "checkpoint.overwrite=true", "checkpoint.export_hf=false", "log.progress=false", *extra]
    if task == "countdown" and algorithm == "ppo":
        overrides = ["algorithm=ppo", "grpo.dynamic_sampling=false", *overrides]
    cfg = load_config(ROOT / "configs" / CONFIGS[task][algorithm], overrides)
    t0 = time.perf_counter()
    Trainer(cfg).run()
    wall = time.perf_counter() - t0
    rows = [json.loads(x) for x in (out / name / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "reward/mean" in r]
    evals = [r for r in rows if "eval/greedy_acc" in r]
    result = {"name": name, "rewards": [r["reward/mean"] for r in train],
              "step_s": [r.get("time/rollout_s", 0.0) + r.get("time/update_s", 0.0) for r in train],
              "last_eval_greedy": evals[-1]["eval/greedy_acc"] if evals else None, "wall_s": wall}
    (out / f"{name}.json").write_text(json.dumps(result))  # each run's figures as soon as it ends
    return result


def to_target(run: dict, *, target: float, window: int) -> tuple[int | None, float | None]:
    """(step, seconds of training up to it) at which the trailing ``window``-step mean reward first reaches
    ``target``; (None, None) if it never does."""
    r = run["rewards"]
    for s in range(window, len(r) + 1):
        if sum(r[s - window:s]) / window >= target:
            return s, sum(run["step_s"][:s])
    return None, None


def _fmt(xs: list[float | None], digits: int = 1) -> str:
    if any(x is None for x in xs):
        reached = [x for x in xs if x is not None]
        return f"{len(reached)}/{len(xs)} reached" + (f" ({statistics.mean(reached):.{digits}f})" if reached else "")
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{statistics.mean(xs):.{digits}f} ± {sd:.{digits}f}"


def table(runs: dict[str, list[dict]], *, target: float, window: int) -> str:
    head = (f"| algorithm | steps to reward {target} ({window}-step mean) | train s to it | last {window} steps' "
            f"reward | held-out greedy (last eval) | s per step | per seed: steps to target |\n"
            "|---|---|---|---|---|---|---|\n")
    lines = []
    for algo, rs in runs.items():
        reached = [to_target(r, target=target, window=window) for r in rs]
        last = [sum(r["rewards"][-window:]) / window for r in rs]
        evals = [r["last_eval_greedy"] for r in rs]
        per_step = [sum(r["step_s"]) / len(r["step_s"]) for r in rs]
        lines.append(f"| {algo} | {_fmt([s for s, _ in reached])} | {_fmt([t for _, t in reached])} | "
                     f"{_fmt(last, 3)} | {_fmt(evals, 3) if all(e is not None for e in evals) else 'n/a'} | "
                     f"{_fmt(per_step, 2)} | {', '.join(str(s) for s, _ in reached)} |")
    return head + "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--task", choices=sorted(CONFIGS), default="toy")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=None, help="default: toy 20, countdown 150 (the demo's)")
    ap.add_argument("--target", type=float, default=None, help="default: toy 0.8, countdown 0.4")
    ap.add_argument("--window", type=int, default=3)
    ap.add_argument("--algorithms", nargs="+", default=["grpo", "ppo"], choices=["grpo", "ppo"])
    ap.add_argument("--ppo", nargs="*", default=[], help="key=value overrides for the PPO runs")
    ap.add_argument("--grpo", nargs="*", default=[], help="key=value overrides for the GRPO runs")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out" / "ppo")
    args = ap.parse_args(argv)
    steps = args.steps or {"toy": 20, "countdown": 150}[args.task]
    target = args.target if args.target is not None else {"toy": 0.8, "countdown": 0.4}[args.task]
    args.out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict]] = {}
    for algo in args.algorithms:
        extra = args.ppo if algo == "ppo" else args.grpo
        runs[algo] = [run_one(args.task, algo, s, steps=steps, extra=extra, out=args.out) for s in args.seeds]
    text = table(runs, target=target, window=args.window)
    print(text)
    (args.out / f"{args.task}.md").write_text(text)
    (args.out / f"{args.task}.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                            "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
