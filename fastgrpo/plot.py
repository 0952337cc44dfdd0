"""Plot a run's metrics.jsonl into metrics.png:  python -m fastgrpo.plot runs/<name> [--keys a,b,...].

The held-out panel draws greedy accuracy and best-of-n together. When the run evaluated more than once, the last
line printed compares its first and last evaluation (``make demo`` ends with it).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DEFAULT_KEYS = ["reward/mean", "eval/greedy_acc", "completion/len_mean", "policy/clip_high_frac",
                "policy/grad_norm", "perf/tokens_per_s"]
_BEST_OF = "eval/best_of_"


def _best_of_key(rows: list[dict]) -> str | None:
    return next((k for r in rows for k in r if k.startswith(_BEST_OF)), None)


def accuracy_summary(rows: list[dict]) -> str | None:
    """'held-out greedy accuracy 12.5% -> 31.2%, best-of-8 43.0% -> 56.2% (step 0 -> 100)' from the first and the
    last record with an evaluation; None with fewer than two evaluations."""
    evals = [r for r in rows if "eval/greedy_acc" in r]
    if len(evals) < 2:
        return None
    a, b = evals[0], evals[-1]
    text = f"held-out greedy accuracy {a['eval/greedy_acc']:.1%} -> {b['eval/greedy_acc']:.1%}"
    best = _best_of_key(evals)
    if best is not None and best in a and best in b:
        text += f", best-of-{best[len(_BEST_OF):]} {a[best]:.1%} -> {b[best]:.1%}"
    return text + f" (step {a['step']} -> {b['step']})"


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: is {run_dir} a fastgrpo run folder?")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_run(run_dir: Path, keys: list[str] | None = None) -> Path:
    """Write run_dir/metrics.png with one panel per metric present in metrics.jsonl; return its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    keys = [k for k in (keys or DEFAULT_KEYS) if any(k in r for r in rows)]
    if not keys:
        raise ValueError(f"none of the requested metrics are in {run_dir / 'metrics.jsonl'}")
    fig, axes = plt.subplots(len(keys), 1, figsize=(7, 2.2 * len(keys)), sharex=True, squeeze=False)
    for ax, key in zip(axes[:, 0], keys):
        lines = [key]
        if key == "eval/greedy_acc" and _best_of_key(rows):  # held-out accuracy: greedy and best-of-n together
            lines.append(_best_of_key(rows))
        for k in lines:
            pts = [(r["step"], r[k]) for r in rows if k in r]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="." if len(pts) < 50 else None,
                    label=k.removeprefix("eval/"))
        if len(lines) > 1:
            ax.legend(fontsize=7)
        ax.set_ylabel("held-out accuracy" if len(lines) > 1 else key, fontsize=8)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("step")
    fig.suptitle(run_dir.name)
    fig.tight_layout()
    out = run_dir / "metrics.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="fastgrpo.plot", description=__doc__)
    p.add_argument("run_dir", type=Path)
    p.add_argument("--keys", help="comma-separated metric names")
    a = p.parse_args(argv)
    try:
        out = plot_run(a.run_dir, a.keys.split(",") if a.keys else None)
    except (FileNotFoundError, ValueError) as e:
        print(f"fastgrpo.plot: {e}", file=sys.stderr)
        return 2
    print(out)
    summary = accuracy_summary(read_metrics(a.run_dir))
    if summary is not None:
        print(f"[fastgrpo] {a.run_dir}: {summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
