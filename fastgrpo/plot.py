"""Plot a run's metrics.jsonl into metrics.png:  python -m fastgrpo.plot runs/<name> [--keys a,b,...] [--out X.png].

One panel per quantity the run logged, and only series that vary: a metric that stayed constant (the demo's
``policy/clip_high_frac`` is 0 throughout) says nothing as a curve. Noisy per-step series get a smoothed line (an
exponential moving average) over the raw points. Panels: reward, each reward function when there are several,
held-out accuracy (greedy and best-of-n together; drawn even when flat: it is the result), completion length,
KL / entropy where the run has them, clip fractions, gradient norm, time per step (rollout / update) and
throughput. When the run evaluated more than once, the last line printed compares its first and last evaluation
(``make demo`` ends with it).

A last line cut short (a run killed mid-write, which the trainer tolerates on resume) is skipped with a note; a
broken line elsewhere is an error naming the file and line. The PNG is written atomically.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import sys
from pathlib import Path

from fastgrpo.runtime.files import write_atomic

_BEST_OF = "eval/best_of_"
# panel title -> the series it draws (prefix patterns end in "/"; "*" stands for a reward function's name)
PANELS: list[tuple[str, tuple[str, ...]]] = [
    ("reward", ("reward/mean",)),
    ("reward per function", ("reward/*/mean",)),
    ("held-out accuracy", ("eval/greedy_acc", _BEST_OF)),
    ("completion length", ("completion/len_mean",)),
    ("KL / entropy", ("policy/kl_mean", "policy/entropy")),
    ("clipped fraction", ("policy/clip_low_frac", "policy/clip_high_frac", "policy/cispo_clip_frac")),
    ("gradient norm", ("policy/grad_norm",)),
    ("seconds per step", ("time/rollout_s", "time/update_s")),
    ("tokens / s", ("perf/tokens_per_s",)),
]
_ALWAYS_DRAWN = ("eval/",)  # the held-out result is drawn even when it did not move
_SMOOTH_FROM = 10  # points; shorter series are drawn as they are


class PlotError(Exception):
    """A run folder or metrics file the plot cannot use; printed as one line."""


def read_metrics(run_dir: Path) -> list[dict]:
    """The records of ``run_dir/metrics.jsonl``. A torn last line is skipped (reported on stderr); any other line
    that is not a JSON object is a :class:`PlotError` naming the file and line."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise PlotError(f"{path} does not exist: is {run_dir} a fastgrpo run folder?")
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    rows = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, dict):
                raise ValueError("not a JSON object")
        except ValueError as e:
            if i == len(lines):
                print(f"fastgrpo.plot: skipping the last line of {path} (cut short: {e})", file=sys.stderr)
                continue
            raise PlotError(f"{path}:{i} is not a metrics record ({e})") from None
        if isinstance(row.get("step"), (int, float)):
            rows.append(row)
    return rows


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


def series(rows: list[dict], key: str) -> list[tuple[float, float]]:
    """(step, value) of every record with a finite number under ``key``."""
    return [(r["step"], float(r[key])) for r in rows
            if isinstance(r.get(key), (int, float)) and not isinstance(r[key], bool) and math.isfinite(r[key])]


def varies(points: list[tuple[float, float]]) -> bool:
    return len({v for _, v in points}) > 1


def _matching(rows: list[dict], pattern: str) -> list[str]:
    """The logged keys a panel pattern names, in first-seen order."""
    keys = dict.fromkeys(k for r in rows for k in r)
    if "*" in pattern:
        head, tail = pattern.split("*")
        return [k for k in keys if len(k) > len(head) + len(tail) and k.startswith(head) and k.endswith(tail)
                and "/" not in k[len(head):-len(tail)]]
    if pattern.endswith("_"):
        return [k for k in keys if k.startswith(pattern)]
    return [pattern] if pattern in keys else []


def choose_panels(rows: list[dict], keys: list[str] | None = None) -> list[tuple[str, list[str]]]:
    """(title, series keys) of each panel to draw. With ``keys``, one panel per key asked for that was logged
    (drawn even if constant: it was asked for); otherwise :data:`PANELS`, keeping series that vary."""
    if keys:
        return [(k, [k]) for k in keys if series(rows, k)]
    out = []
    for title, patterns in PANELS:
        found = [k for p in patterns for k in _matching(rows, p)]
        if title == "reward per function" and len(found) < 2:
            continue  # one function: the reward panel already is its curve
        drawn = [k for k in found if varies(series(rows, k)) or (k.startswith(_ALWAYS_DRAWN) and series(rows, k))]
        if drawn:
            out.append((title, drawn))
    return out


def smoothed(values: list[float], span: int) -> list[float]:
    """Exponential moving average with the weight 2 / (span + 1) of pandas' ``ewm(span=...)``, bias-corrected so
    that the first points are not pulled toward 0."""
    alpha, avg, weight, out = 2.0 / (span + 1), 0.0, 0.0, []
    for v in values:
        avg = (1 - alpha) * avg + alpha * v
        weight = (1 - alpha) * weight + alpha
        out.append(avg / weight)
    return out


def plot_run(run_dir: Path, keys: list[str] | None = None, out: Path | None = None,
             rows: list[dict] | None = None) -> Path:
    """Write ``out`` (default ``run_dir/metrics.png``) with the panels of :func:`choose_panels` over ``rows``
    (default: read from the run); return its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir) if rows is None else rows
    panels = choose_panels(rows, keys)
    if not panels:
        what = "none of the requested metrics" if keys else "no metric that varies"
        raise PlotError(f"{what} in {run_dir / 'metrics.jsonl'} ({len(rows)} records)")
    fig, axes = plt.subplots(len(panels), 1, figsize=(7, 2.2 * len(panels)), sharex=True, squeeze=False)
    for ax, (title, names) in zip(axes[:, 0], panels):
        for name in names:
            pts = series(rows, name)
            x, y = [p[0] for p in pts], [p[1] for p in pts]
            label = name.removeprefix("eval/").removeprefix("policy/").removeprefix("time/")
            if len(pts) >= _SMOOTH_FROM:
                raw = ax.plot(x, y, alpha=0.3, linewidth=0.8)[0]
                ax.plot(x, smoothed(y, max(3, len(pts) // 10)), color=raw.get_color(), label=f"{label} (smoothed)")
            else:
                ax.plot(x, y, marker=".", label=label)
        if len(names) > 1 or len(series(rows, names[0])) >= _SMOOTH_FROM:
            ax.legend(fontsize=7)
        ax.set_ylabel(title, fontsize=8)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("step")
    fig.suptitle(run_dir.resolve().name)
    fig.tight_layout()
    out = Path(out) if out is not None else run_dir / "metrics.png"
    png = io.BytesIO()
    try:
        fig.savefig(png, dpi=100, format="png")
        write_atomic(out, png.getvalue())
    except OSError as e:
        raise PlotError(f"cannot write {out}: {e.strerror or e}; pass --out to write the plot elsewhere") from None
    finally:
        plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="fastgrpo.plot", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", type=Path)
    p.add_argument("--keys", help="comma-separated metric names (one panel each, drawn even if constant)")
    p.add_argument("--out", type=Path, help="where to write the PNG (default: <run_dir>/metrics.png)")
    a = p.parse_args(argv)
    try:
        rows = read_metrics(a.run_dir)
        out = plot_run(a.run_dir, a.keys.split(",") if a.keys else None, a.out, rows=rows)
        summary = accuracy_summary(rows)
    except PlotError as e:
        print(f"fastgrpo.plot: {e}", file=sys.stderr)
        return 2
    print(out)
    if summary is not None:
        print(f"[fastgrpo] {a.run_dir}: {summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
