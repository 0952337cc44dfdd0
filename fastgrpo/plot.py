"""Plot a run's metrics.jsonl into metrics.png:  python -m fastgrpo.plot runs/<name> [--keys a,b,...]."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DEFAULT_KEYS = ["reward/mean", "completion/len_mean", "policy/clip_high_frac", "policy/grad_norm",
                "perf/tokens_per_s", "eval/greedy_acc"]


def plot_run(run_dir: Path, keys: list[str] | None = None) -> Path:
    """Write run_dir/metrics.png with one panel per metric present in metrics.jsonl; return its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: is {run_dir} a fastgrpo run folder?")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    keys = [k for k in (keys or DEFAULT_KEYS) if any(k in r for r in rows)]
    if not keys:
        raise ValueError(f"none of the requested metrics are in {path}")
    fig, axes = plt.subplots(len(keys), 1, figsize=(7, 2.2 * len(keys)), sharex=True, squeeze=False)
    for ax, key in zip(axes[:, 0], keys):
        pts = [(r["step"], r[key]) for r in rows if key in r]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="." if len(pts) < 50 else None)
        ax.set_ylabel(key, fontsize=8)
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
