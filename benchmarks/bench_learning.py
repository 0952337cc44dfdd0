"""Does GRPO learn Countdown on a laptop CPU? The demo's recipe over several seeds, with a sign-flipped control.

    python benchmarks/bench_learning.py                    # 3 seeds + the control, the demo's settings
    python benchmarks/bench_learning.py --seeds 0 --no-control --steps 20 grpo.prompts_per_step=8   # a quick look

For each seed, GRPO runs from the embedded warm model (``tiny:countdown``, built first if it is not cached) with
``configs/tiny.yaml`` plus ``seed=<s>`` and any extra ``key=value`` overrides. The control is seed 0 with the
rewards negated (``rewards.weights=[-1.0]``), which flips the sign of every group advantage exactly: if accuracy
rose there too, the gain would come from further exposure to the task rather than from the policy gradient.

Reported per run: held-out greedy accuracy and best-of-n before the first step and at the end,
- on the demo's distribution (the run's own evaluations: ``eval.num_prompts`` held-out problems, never trained on
  by the SFT recipe nor by GRPO; checked here), and
- on the seeds' distribution (3-4 numbers from 1..99, ``--seeds-eval`` problems), evaluated here with the same
  evaluation code;
and the GRPO wall time (the steps alone, and with the evaluations). Prints a markdown table (mean and spread over
the seeds) and writes it with the per-run JSON under --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_rollout import device_name  # noqa: E402
from benchmarks.harness import clock_train_steps  # noqa: E402

SEEDS_DIST = dict(min_numbers=3, max_numbers=4, max_value=99)
"""The seeds' Countdown problems (Countdown-Tasks-3to4): 3-4 numbers from 1..99."""


def _eval_on(model, tokenizer, rows, *, best_of_n: int, max_tokens: int, seed: int) -> dict[str, float]:
    """Greedy accuracy and best-of-n of ``model`` on Countdown ``rows``, rendered with the demo's template."""
    from fastgrpo.data import render_prompt
    from fastgrpo.trainers.evaluate import evaluate
    from fastgrpo.rewards import REWARDS
    from fastgrpo.rollout.hf import HFEngine

    texts = [render_prompt(r, template="compact", task="countdown") for r in rows]
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    return evaluate(HFEngine(model, tokenizer, batch_size=256), rows, texts, ids, reward_fn=REWARDS["countdown"],
                    best_of_n=best_of_n, temperature=1.0, max_tokens=max_tokens, seed=seed)


def run_one(name: str, overrides: list[str], *, out: Path, seeds_rows: list[dict], n: int) -> dict:
    """One GRPO run with the demo config; returns its before/after figures and timings."""
    import torch

    from fastgrpo.config import load_config
    from fastgrpo.data import problem_key
    from fastgrpo.trainers.grpo import Trainer
    from fastgrpo.trainers.warm import WARM_RECIPES, recipe_config
    from fastgrpo.data.countdown import countdown_splits

    cfg = load_config(ROOT / "configs" / "tiny.yaml", [f"output_dir={out}", f"name={name}",
                                                       "checkpoint.resume=never", "log.progress=false", *overrides])
    trainer = Trainer(cfg)
    # The held-out problems must be unseen by GRPO and by the warm model's SFT.
    seen = list(trainer.train_rows)
    warm = cfg.model.name_or_path.partition(":")[2]
    if cfg.model.name_or_path.startswith("tiny:") and warm in WARM_RECIPES:
        d = recipe_config(warm).data
        seen += countdown_splits(num_train=d.num_train, num_eval=d.num_eval, seed=d.seed, min_numbers=d.min_numbers,
                                 max_numbers=d.max_numbers, max_value=d.max_value)[0]
    assert {problem_key(r) for r in trainer.eval_rows}.isdisjoint(problem_key(r) for r in seen), "held-out overlap"

    max_tokens = cfg.rollout.max_completion_length
    before_seeds = _eval_on(trainer.model, trainer.tokenizer, seeds_rows, best_of_n=n, max_tokens=max_tokens,
                            seed=cfg.seed)
    step_seconds = clock_train_steps(trainer)
    t0 = time.perf_counter()
    trainer.run()
    wall = time.perf_counter() - t0
    after_seeds = _eval_on(trainer.model, trainer.tokenizer, seeds_rows, best_of_n=n, max_tokens=max_tokens,
                           seed=cfg.seed)
    trainer.close()
    records = [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval/greedy_acc" in r]
    best = f"eval/best_of_{cfg.eval.best_of_n}"
    torch.set_grad_enabled(True)
    return {
        "name": name, "overrides": overrides, "steps": cfg.max_steps,
        "greedy_before": evals[0]["eval/greedy_acc"], "greedy_after": evals[-1]["eval/greedy_acc"],
        "best_before": evals[0][best], "best_after": evals[-1][best],
        "seeds_greedy_before": before_seeds["greedy_acc"], "seeds_greedy_after": after_seeds["greedy_acc"],
        "seeds_best_before": before_seeds[f"best_of_{n}"], "seeds_best_after": after_seeds[f"best_of_{n}"],
        "grpo_steps_s": sum(step_seconds), "grpo_wall_s": wall, "num_eval": cfg.eval.num_prompts,
        "reward_first5": statistics.mean(r["reward/mean"] for r in records if "reward/mean" in r and r["step"] <= 5),
        "reward_last5": statistics.mean(r["reward/mean"] for r in records
                                        if "reward/mean" in r and r["step"] > cfg.max_steps - 5),
    }


def _pm(values: list[float], pct: bool = True, digits: int = 1) -> str:
    scale = 100 if pct else 1
    mean = statistics.mean(values) * scale
    if len(values) < 2:
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {statistics.stdev(values) * scale:.{digits}f}"


def table(runs: list[dict], control: dict | None, n: int) -> str:
    rows = ["| runs | greedy before -> after (demo dist.) | gain | best-of-{n} before -> after | greedy before -> "
            "after (seeds' dist.) | best-of-{n} (seeds' dist.) | train reward first 5 -> last 5 steps | "
            "GRPO steps s | GRPO wall s (with evals) |".format(n=n),
            "|---|---|---|---|---|---|---|---|---|"]

    def line(label: str, rs: list[dict]) -> str:
        col = lambda k: [r[k] for r in rs]  # noqa: E731
        gain = [r["greedy_after"] - r["greedy_before"] for r in rs]
        return (f"| {label} | {_pm(col('greedy_before'))} -> {_pm(col('greedy_after'))} | {_pm(gain)} | "
                f"{_pm(col('best_before'))} -> {_pm(col('best_after'))} | {_pm(col('seeds_greedy_before'))} -> "
                f"{_pm(col('seeds_greedy_after'))} | {_pm(col('seeds_best_before'))} -> "
                f"{_pm(col('seeds_best_after'))} | {_pm(col('reward_first5'), False, 3)} -> "
                f"{_pm(col('reward_last5'), False, 3)} | {_pm(col('grpo_steps_s'), False)} | "
                f"{_pm(col('grpo_wall_s'), False)} |")

    rows.append(line(f"GRPO, {len(runs)} seeds (mean ± sd, %)", runs))
    for r in runs:
        rows.append(line(r["name"], [r]))
    if control is not None:
        rows.append(line(f"control: {control['name']} (advantages negated)", [control]))
    return "\n".join(rows) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--no-control", action="store_true", help="skip the sign-flipped control run")
    ap.add_argument("--seeds-eval", type=int, default=128, help="problems of the seeds' distribution to evaluate")
    ap.add_argument("--out", default="benchmarks/out/learning")
    ap.add_argument("overrides", nargs="*", help="extra key=value overrides of configs/tiny.yaml for every run")
    args = ap.parse_args()

    from fastgrpo.config import load_config
    from fastgrpo.data.countdown import generate_problems
    from fastgrpo.models.loading import resolve_model_path

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = load_config(ROOT / "configs" / "tiny.yaml", args.overrides)
    t = time.perf_counter()
    resolve_model_path(cfg.model)  # builds the warm model on first use (its own progress bar)
    print(f"[bench_learning] warm model ready in {time.perf_counter() - t:.0f} s", flush=True)
    seeds_rows = generate_problems(args.seeds_eval, seed="bench-learning-seeds-dist", **SEEDS_DIST)
    n = cfg.eval.best_of_n

    runs = []
    for s in args.seeds:
        print(f"[bench_learning] seed {s} ...", flush=True)
        runs.append(run_one(f"seed{s}", [f"seed={s}", *args.overrides], out=out, seeds_rows=seeds_rows, n=n))
        print(json.dumps(runs[-1]), flush=True)
    control = None
    if not args.no_control:
        print("[bench_learning] control (rewards negated) ...", flush=True)
        control = run_one("control-seed0", ["seed=0", "rewards.weights=[-1.0]", *args.overrides], out=out,
                          seeds_rows=seeds_rows, n=n)
        print(json.dumps(control), flush=True)

    import torch
    import transformers

    header = (f"{datetime.date.today()}, {device_name()}, torch {torch.__version__}, transformers "
              f"{transformers.__version__}; command: python benchmarks/bench_learning.py {' '.join(sys.argv[1:])}\n\n")
    text = header + table(runs, control, n)
    print(text)
    (out / "learning.md").write_text(text)
    (out / "learning.json").write_text(json.dumps({"runs": runs, "control": control}, indent=2))


if __name__ == "__main__":
    main()
