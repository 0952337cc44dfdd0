"""Does a real pretrained model learn on a laptop CPU? A GRPO config over seeds and a sign-flipped control.

    python benchmarks/bench_real_model.py                          # 3 seeds + the control, side by side, 1 thread each
    python benchmarks/bench_real_model.py --seeds 0 --no-control max_steps=5   # a quick look
    python benchmarks/bench_real_model.py --report-only --out DIR  # the table of runs already in DIR
    python benchmarks/bench_real_model.py --config configs/smollm2-countdown.yaml \
        --sft configs/smollm2-countdown-sft.yaml --out benchmarks/out/countdown   # SFT once, then GRPO from it

``--config`` is the GRPO config (default configs/smollm2.yaml). With ``--sft CONFIG`` a supervised warm start runs
first (``python -m fastgrpo.sft --config CONFIG``, alone, with every thread of ``--parallel x --threads``; kept and
reused when OUT/sft/final already exists), and every GRPO run starts from its export (``model.name_or_path=
OUT/sft/final``): the accuracy before the first GRPO step is then the SFT start's, so the table's change is GRPO's own.

Each run is ``python -m fastgrpo.train --config <config> seed=<s>`` plus any extra ``key=value``
overrides, in its own process under --out; the control is seed 0 with the reward negated (``rewards.weights=[-1.0]``),
which flips the sign of every group advantage exactly: if accuracy rose there too, the gain would come from exposure
to the task, not from the policy gradient. The runs go side by side (``--parallel`` at a time, each with
``--threads`` torch threads, OMP_NUM_THREADS), since one 135M-parameter run does not keep two cores busy.

Reported per run, from its metrics.jsonl: held-out greedy accuracy before the first step (``eval.at_start``) and at
the end (the config evaluates the whole held-out split), and the wall time of a step split into rollout (generation,
rewards, advantages: ``time/rollout_s``) and update (forward, backward, optimizer: ``time/update_s``), median and
range over the steps, and their sum over the run. Writes OUT/learning.md and OUT/learning.json.

Arguments and every run's config are checked before the first run starts (one line, exit 2, as ``fastgrpo.train``
does); a run that fails is named with its log and the benchmark exits 1. SIGTERM stops the runs (each saves after its
step) before the benchmark exits 143; the same command then resumes them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # benchmarks.harness, also when run as a script

from fastgrpo.config import ConfigError, SFTConfig, load_config  # noqa: E402
from benchmarks.harness import Children, benchmark_main, check_at_least, check_out_dir, check_run_configs  # noqa: E402

PROG = "bench_real_model.py"
CONFIG = ROOT / "configs" / "smollm2.yaml"


def negated_weights(extra: list[str] = (), config: Path = CONFIG) -> str:
    """The control's ``rewards.weights`` override: every reward function of the config, negated."""
    funcs = load_config(str(config), list(extra)).rewards.funcs
    return "rewards.weights=[" + ",".join("-1.0" for _ in funcs) + "]"


def runs_of(seeds: list[int], control: bool, extra: list[str] = (), config: Path = CONFIG) -> dict[str, list[str]]:
    """Run name -> its overrides."""
    out = {f"seed{s}": [f"seed={s}"] for s in seeds}
    if control:
        out["control"] = [f"seed={seeds[0]}", negated_weights(extra, config)]
    return out


def run_overrides(name: str, overrides: list[str], extra: list[str], out: Path) -> list[str]:
    """The key=value overrides of run ``name`` (after ``--config CONFIG``)."""
    return [f"output_dir={out}", f"name={name}", "log.progress=false", *overrides, *extra]


def thread_env(threads: int) -> dict[str, str]:
    """This process's environment with ``threads`` torch (OpenMP, MKL) threads for a child run."""
    return dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))


def run_sft(config: Path, out: Path, threads: int) -> Path | None:
    """The supervised warm start, run alone; returns its export folder (OUT/sft/final), reused when it exists, or
    None (the failure printed, naming its log) when it failed."""
    final = out / "sft" / "final"
    if (final / "config.json").is_file():
        print(f"[sft] reusing {final}", file=sys.stderr, flush=True)
        return final
    env = thread_env(threads)
    cmd = [sys.executable, "-m", "fastgrpo.sft", "--config", str(config), f"output_dir={out}", "name=sft",
           "log.progress=false"]
    print(f"[sft] started: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    with Children() as children, (out / "sft.log").open("w") as log:
        rc = children.start(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT).wait()
    if rc != 0 or not (final / "config.json").is_file():
        print(f"{PROG}: error: the SFT warm start failed (exit {rc}); {out / 'sft.log'}: "
              f"{_last_line(out / 'sft.log')}", file=sys.stderr)
        return None
    return final


def launch(runs: dict[str, list[str]], extra: list[str], *, out: Path, parallel: int, threads: int,
           config: Path = CONFIG) -> dict[str, int]:
    """Run every run to its end, ``parallel`` at a time; each writes OUT/<name>/ and OUT/<name>.log. Returns each
    run's exit status. On SIGTERM (:class:`benchmarks.harness.Terminated`) the running ones are stopped first."""
    env = thread_env(threads)
    pending, live, status = list(runs.items()), [], {}
    with Children() as children:
        while pending or live:
            while pending and len(live) < parallel:
                name, overrides = pending.pop(0)
                log = (out / f"{name}.log").open("w")
                cmd = [sys.executable, "-m", "fastgrpo.train", "--config", str(config),
                       *run_overrides(name, overrides, extra, out)]
                live.append((name, children.start(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), log))
                print(f"[{name}] started (pid {live[-1][1].pid}): {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
            time.sleep(1)
            for item in [x for x in live if x[1].poll() is not None]:
                name, proc, log = item
                log.close()
                live.remove(item)
                status[name] = proc.returncode
                print(f"[{name}] exit {proc.returncode}", file=sys.stderr, flush=True)
    return status


def _last_line(path: Path) -> str:
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1][:200] if lines else ""


def summarize(folder: Path) -> dict:
    """Before/after greedy accuracy, the accuracy at every evaluation (``curve``: step -> accuracy) and per-step
    timings of one run folder."""
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [r for r in records if "eval/greedy_acc" in r]
    steps = [r for r in records if "time/rollout_s" in r]

    def spread(key: str) -> list[float]:
        values = [r[key] for r in steps]
        return [statistics.median(values), min(values), max(values), sum(values)] if values else []

    return {"before": evals[0]["eval/greedy_acc"] if evals and evals[0]["step"] == 0 else None,
            "after": evals[-1]["eval/greedy_acc"] if evals and evals[-1]["step"] > 0 else None,
            "curve": {int(r["step"]): r["eval/greedy_acc"] for r in evals},
            "steps": len(steps), "rollout_s": spread("time/rollout_s"), "update_s": spread("time/update_s"),
            "train_reward_first_last": [steps[0]["reward/mean"], steps[-1]["reward/mean"]] if steps else []}


def table(results: dict[str, dict]) -> str:
    lines = ["| run | held-out greedy before | after | change (points) | steps | rollout s/step, median (range) | "
             "update s/step, median (range) | rollout + update, whole run (min) | "
             "greedy at each evaluation (step: %) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        ro, up = r["rollout_s"], r["update_s"]
        done = r["before"] is not None and r["after"] is not None
        change = f"{100 * (r['after'] - r['before']):+.1f}" if done else "n/a"
        fmt = (lambda x: f"{x[0]:.1f} ({x[1]:.1f}-{x[2]:.1f})" if x else "n/a")
        curve = ", ".join(f"{step}: {100 * acc:.1f}" for step, acc in sorted(r["curve"].items()))
        lines.append(f"| {name} | {_pct(r['before'])} | {_pct(r['after'])} | {change} | {r['steps']} | {fmt(ro)} | "
                     f"{fmt(up)} | {(ro[3] + up[3]) / 60:.1f} | {curve} |" if ro and up else f"| {name} | n/a |")
    seeds = [r for n, r in results.items()
             if n.startswith("seed") and r["before"] is not None and r["after"] is not None]
    if len(seeds) > 1:
        gains = [100 * (r["after"] - r["before"]) for r in seeds]
        lines.append(f"\nseeds: after {100 * statistics.mean(r['after'] for r in seeds):.1f}% +- "
                     f"{100 * statistics.stdev(r['after'] for r in seeds):.1f} (mean +- sd), change "
                     f"{statistics.mean(gains):+.1f} points ({', '.join(f'{g:+.1f}' for g in gains)})")
    for step in sorted({k for r in seeds for k in r["curve"]} - {0}):
        at = [r["curve"][step] for r in seeds if step in r["curve"]]
        if len(at) == len(seeds) > 1:
            lines.append(f"seeds at step {step}: {100 * statistics.mean(at):.1f}% +- {100 * statistics.stdev(at):.1f}, "
                         f"change {100 * statistics.mean(a - r['before'] for a, r in zip(at, seeds)):+.1f} points")
    return "\n".join(lines)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def main(argv: list[str] | None = None) -> int:
    return benchmark_main(PROG, lambda: _main(argv))


def _main(argv: list[str] | None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--no-control", action="store_true", help="skip the sign-flipped control run")
    ap.add_argument("--parallel", type=int, default=4, help="runs at a time")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per run")
    ap.add_argument("--report-only", action="store_true", help="only read the runs already under --out")
    ap.add_argument("--out", default="benchmarks/out/real_model")
    ap.add_argument("--config", default=str(CONFIG), help="the GRPO config of every run")
    ap.add_argument("--sft", default=None, help="an SFT config run once first; the GRPO runs start from its export")
    ap.add_argument("overrides", nargs="*", help="extra key=value overrides of the GRPO config for every run")
    args = ap.parse_args(argv)
    check_at_least(args.parallel, 1, "--parallel")
    check_at_least(args.threads, 1, "--threads")
    out = Path(args.out).resolve()
    config = Path(args.config).resolve()
    sft_config = Path(args.sft).resolve() if args.sft else None
    if sft_config is not None:  # the GRPO runs start from the SFT's export
        args.overrides = [f"model.name_or_path={out / 'sft' / 'final'}", *args.overrides]
    runs = runs_of(args.seeds, not args.no_control, args.overrides, config)
    started = time.perf_counter()
    failed: dict[str, int] = {}
    if args.report_only:
        found = [name for name in runs if (out / name / "metrics.jsonl").is_file()]
        if not found:
            raise ConfigError(f"--out: {str(out)!r} holds none of the runs {', '.join(runs)} (no <run>/metrics.jsonl); "
                              "run without --report-only first, or give the folder they were written to")
    else:
        check_out_dir(out)
        if sft_config is not None:
            check_run_configs(sft_config, {"sft": [f"output_dir={out}", "name=sft"]}, cls=SFTConfig)
        check_run_configs(config, {n: run_overrides(n, o, args.overrides, out) for n, o in runs.items()})
        out.mkdir(parents=True, exist_ok=True)
        if sft_config is not None and run_sft(sft_config, out, args.parallel * args.threads) is None:
            return 1
        status = launch(runs, args.overrides, out=out, parallel=args.parallel, threads=args.threads, config=config)
        failed = {name: rc for name, rc in status.items() if rc != 0}
    results = {name: summarize(out / name) for name in runs
               if name not in failed and (out / name / "metrics.jsonl").is_file()}
    if failed:
        print(f"{PROG}: error: {len(failed)} of {len(runs)} runs failed: "
              + "; ".join(f"{n} (exit {rc}, {out / f'{n}.log'}: {_last_line(out / f'{n}.log')})"
                          for n, rc in failed.items()),
              file=sys.stderr)
        if not results:  # nothing to report: an empty table would read as a result
            return 1
    # Runs started with eval.at_start=false (to spare the CPU) share the others' start: greedy decoding of the same
    # model on the same held-out problems gives the same accuracy in every run.
    starts = {r["before"] for r in results.values() if r["before"] is not None}
    for r in results.values():
        if r["before"] is None and len(starts) == 1:
            r["before"] = next(iter(starts))
    text = (f"{datetime.date.today()}, `python benchmarks/bench_real_model.py {' '.join(argv or sys.argv[1:])}`, "
            f"{os.cpu_count()} CPUs, load average at the end {os.getloadavg()[0]:.1f}, wall "
            f"{(time.perf_counter() - started) / 60:.0f} min\n\n{table(results)}\n")
    (out / "learning.md").write_text(text)
    (out / "learning.json").write_text(json.dumps(results, indent=1))
    print(text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
