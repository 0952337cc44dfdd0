"""Synchronous vs asynchronous rollout (``rollout.asynchronous``, docs/ASYNC.md) on the demo's Countdown (CPU).

    python benchmarks/bench_async.py                       # 3 seeds x {sync, async}, the demo's 150 steps
    python benchmarks/bench_async.py --seeds 0 --steps 4 --eval-every 2 --eval-prompts 16    # a quick check

Each run is ``configs/tiny.yaml`` with ``seed=<s>``, ``max_steps``, the evaluation settings and any ``--common``
overrides; the async run adds ``rollout.asynchronous=true``, ``rollout.importance_sampling_cap`` (--cap) and
``rollout.max_staleness`` (--staleness), and ``--async-extra``. The two modes are alternated: for each seed and
repeat, one runs right after the other, and the order flips from one pair to the next, so that a change in the
machine's load lands on both. Each run is its own process (its threads, memory and worker start clean).

Reported per run, from the run's own metrics and a clock around each training step (evaluations excluded, they are
the same code in both modes): steps per second over all steps and over the steps after the first (the first waits
for the worker's start), the held-out greedy accuracy at each evaluation, and the same accuracy against the seconds
of training that led to it (per second). The markdown table (mean ± sd over seeds per mode, the async/sync ratio of
steps per second per pair, then each run) is printed and written to ``--out``/bench_async.md with the per-run JSON.
Report the machine's load with the figures: the script records the 1-minute load average before and after each run.

Arguments and both modes' configs are checked before the first run (one line, exit 2, as ``fastgrpo.train`` does).
SIGTERM stops the run in progress (it saves after its step) before the benchmark exits 143.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # benchmarks.harness, also when run as a script

from benchmarks.harness import (Children, benchmark_main, check_at_least, check_out_dir,  # noqa: E402
                                check_run_configs)

PROG = "bench_async.py"
CONFIG = ROOT / "configs" / "tiny.yaml"


def run_one(spec: dict) -> dict:
    """One GRPO run in this process (``--one``): per-step wall seconds and the run's evaluations."""
    import fastgrpo.trainers.warm  # noqa: F401 (registers the warm model tiny:countdown)
    from benchmarks.harness import clock_train_steps
    from fastgrpo.config import load_config
    from fastgrpo.trainers.grpo import Trainer

    cfg = load_config(CONFIG, spec["overrides"])
    load_before = os.getloadavg()[0]
    trainer = Trainer(cfg)
    step_seconds = clock_train_steps(trainer)
    t0 = time.perf_counter()
    try:
        trainer.run()
    finally:
        trainer.close()
    wall = time.perf_counter() - t0
    records = [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [(int(r["step"]), r["eval/greedy_acc"]) for r in records if "eval/greedy_acc" in r]
    return {
        **spec, "step_seconds": step_seconds, "wall_s": wall, "load_before": load_before,
        "load_after": os.getloadavg()[0],
        # (step, greedy accuracy, seconds of training steps up to that step)
        "evals": [(s, acc, sum(step_seconds[:s])) for s, acc in evals],
        "staleness_mean": statistics.mean([r.get("rollout/staleness", 0.0) for r in records if "reward/mean" in r]
                                          or [0.0]),
    }


class RunFailed(Exception):
    """One run's process failed; the message names it and its log."""


def _launch(spec: dict, out: Path) -> dict:
    """Run ``spec`` in a fresh process (this script with --one, its output in OUT/<name>.log); its JSON result."""
    result, log_path = out / f"{spec['name']}.json", out / f"{spec['name']}.log"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--one", json.dumps(spec), "--result", str(result)]
    with open(log_path, "w") as log, Children() as children:
        proc = children.start(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        proc.wait()
    if proc.returncode != 0:
        lines = [ln for ln in log_path.read_text(errors="replace").splitlines() if ln.strip()]
        raise RunFailed(f"run {spec['name']} failed (exit {proc.returncode}; {log_path}): "
                        f"{lines[-1][:200] if lines else 'no output'}")
    return json.loads(result.read_text())


def steps_per_s(run: dict, skip_first: bool = False) -> float:
    seconds = run["step_seconds"][1:] if skip_first else run["step_seconds"]
    return len(seconds) / max(sum(seconds), 1e-9)


def _pm(values: list[float], digits: int = 3, scale: float = 1.0) -> str:
    mean = statistics.mean(values) * scale
    if len(values) < 2:
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {statistics.stdev(values) * scale:.{digits}f}"


def table(runs: list[dict]) -> str:
    """Per mode (mean ± sd over runs), the async/sync ratio per pair, then each run."""
    eval_steps = sorted({s for r in runs for s, _, _ in r["evals"]})
    head = ("| runs | steps/s | steps/s after step 1 | " + " | ".join(f"greedy @ step {s} (%)" for s in eval_steps)
            + " | training s to the last eval | greedy gain per training minute (points) | mean staleness | "
            "load (1 min) |")
    rows = [head, "|" + "---|" * (7 + len(eval_steps))]

    def line(label: str, rs: list[dict]) -> str:
        accs = [_pm([dict((s, a) for s, a, _ in r["evals"]).get(s, float("nan")) for r in rs], 1, 100)
                for s in eval_steps]
        last_s = [r["evals"][-1][2] if r["evals"] else float("nan") for r in rs]
        gain = [((r["evals"][-1][1] - r["evals"][0][1]) * 100 / max(r["evals"][-1][2] / 60, 1e-9))
                if len(r["evals"]) > 1 else float("nan") for r in rs]
        loads = [f"{r['load_before']:.1f}->{r['load_after']:.1f}" for r in rs]
        return (f"| {label} | {_pm([steps_per_s(r) for r in rs])} | {_pm([steps_per_s(r, True) for r in rs])} | "
                + " | ".join(accs) + f" | {_pm(last_s, 1)} | {_pm(gain, 2)} | "
                f"{_pm([r['staleness_mean'] for r in rs], 2)} | {', '.join(loads)} |")

    for mode in ("sync", "async"):
        rs = [r for r in runs if r["mode"] == mode]
        if rs:
            rows.append(line(f"**{mode}**, {len(rs)} runs (mean ± sd)", rs))
    for r in runs:
        rows.append(line(r["name"], [r]))
    pairs = {}
    for r in runs:
        pairs.setdefault((r["seed"], r["repeat"]), {})[r["mode"]] = r
    ratios = [steps_per_s(p["async"], True) / steps_per_s(p["sync"], True) for p in pairs.values()
              if {"sync", "async"} <= set(p)]
    text = "\n".join(rows) + "\n"
    if ratios:
        text += (f"\nasync / sync steps per second (after step 1), per pair: "
                 f"{', '.join(f'{x:.2f}' for x in ratios)}; mean {statistics.mean(ratios):.2f}\n")
    return text


def main(argv: list[str] | None = None) -> int:
    return benchmark_main(PROG, lambda: _main(argv))


def _main(argv: list[str] | None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--repeats", type=int, default=1, help="sync/async pairs per seed")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--eval-prompts", type=int, default=256)
    ap.add_argument("--cap", type=float, default=2.0, help="rollout.importance_sampling_cap of the async runs")
    ap.add_argument("--staleness", type=int, default=1, help="rollout.max_staleness of the async runs")
    ap.add_argument("--common", nargs="*", default=[], help="key=value overrides of both modes")
    ap.add_argument("--async-extra", nargs="*", default=[], help="key=value overrides of the async runs")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_async")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        args.result.write_text(json.dumps(run_one(json.loads(args.one))))
        return 0
    check_at_least(args.repeats, 1, "--repeats")
    check_at_least(args.steps, 1, "--steps")
    check_out_dir(args.out)
    base = [f"output_dir={args.out}", "checkpoint.resume=never", "checkpoint.overwrite=true", "log.progress=false",
            "checkpoint.export_hf=false", f"max_steps={args.steps}", f"eval.every={args.eval_every}",
            f"eval.num_prompts={args.eval_prompts}", "eval.at_start=true", *args.common]
    modes = {"sync": [], "async": ["rollout.asynchronous=true", f"rollout.importance_sampling_cap={args.cap}",
                                   f"rollout.max_staleness={args.staleness}", *args.async_extra]}
    # --cap, --staleness, --eval-* and the overrides are config keys: the config names what is wrong with them
    check_run_configs(CONFIG, {mode: [*base, f"name={mode}", *extra] for mode, extra in modes.items()})
    args.out.mkdir(parents=True, exist_ok=True)
    runs, pair = [], 0
    for seed in args.seeds:
        for repeat in range(args.repeats):
            order = ["sync", "async"] if pair % 2 == 0 else ["async", "sync"]
            pair += 1
            for mode in order:
                name = f"{mode}-seed{seed}-r{repeat}"
                spec = {"name": name, "mode": mode, "seed": seed, "repeat": repeat,
                        "overrides": [*base, f"name={name}", f"seed={seed}", *modes[mode]]}
                print(f">> {name}", flush=True)
                try:
                    runs.append(_launch(spec, args.out))
                except RunFailed as e:
                    print(f"{PROG}: error: {e}", file=sys.stderr)
                    return 1
                print(f"   {steps_per_s(runs[-1]):.3f} steps/s; greedy {runs[-1]['evals']}", flush=True)
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    header = (f"Sync vs async rollout, demo Countdown, {args.steps} steps, seeds {args.seeds}, {when}, "
              f"{platform.node()} ({os.cpu_count()} cores); command: python benchmarks/bench_async.py "
              + " ".join(sys.argv[1:] if argv is None else argv) + "\n\n")
    text = header + table(runs)
    print(text)
    (args.out / "bench_async.md").write_text(text)
    (args.out / "bench_async.json").write_text(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
