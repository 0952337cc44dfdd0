"""What the reward sandbox costs per step: one reward function scored in the trainer process vs in a worker.

    python benchmarks/bench_rewards.py [--completions 512] [--chars 2048] [--reps 7]

The function is the same cheap one in every variant (the first character is a digit), so the difference is the
cost of the calls themselves: in process, each plugin call's own copy of the arguments; sandboxed, pickling the
step's completions and columns to a worker and the scores back, plus (two async functions awaited together on
one worker) the second call's copy of the arguments there. The variants alternate within each repetition;
medians and the spread (min-max) are printed.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

from fastgrpo.rewards import RewardRunner

PLUGIN = ("def digit(completions, **kw):\n    return [float(c[:1].isdigit()) for c in completions]\n"
          "async def adigit(completions, **kw):\n    return digit(completions)\n"
          "async def adigit2(completions, **kw):\n    return digit(completions)\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--completions", type=int, default=512, help="completions per step on one rank (S = B*G)")
    ap.add_argument("--chars", type=int, default=2048, help="characters per completion (about 512 tokens)")
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    rng = random.Random(0)
    texts = ["".join(rng.choice("0123456789 abcdefxyz+-*/=<>") for _ in range(args.chars))
             for _ in range(args.completions)]
    columns = {"prompts": ["Using the numbers [1, 2, 3], make 6."] * args.completions,
               "completion_ids": [list(range(i, i + args.chars // 4)) for i in range(args.completions)],  # distinct
               "nums": [[1, 2, 3]] * args.completions, "target": [6] * args.completions}
    with tempfile.TemporaryDirectory() as tmp:
        plugin = Path(tmp) / "bench_plugin.py"
        plugin.write_text(PLUGIN)
        runners = {"in process (sandbox=false)": RewardRunner([f"{plugin}:digit"], sandbox=False),
                   "sandboxed (1 worker)": RewardRunner([f"{plugin}:digit"], num_workers=1),
                   "sandboxed, 2 async (1 worker)": RewardRunner([f"{plugin}:adigit", f"{plugin}:adigit2"],
                                                                 num_workers=1)}
        try:
            for r in runners.values():
                r.wait_ready()
                r(texts, columns)  # warm-up
            times: dict[str, list[float]] = {k: [] for k in runners}
            for _ in range(args.reps):
                for name, r in runners.items():
                    t0 = time.perf_counter()
                    r(texts, columns)
                    times[name].append(time.perf_counter() - t0)
        finally:
            for r in runners.values():
                r.close()
    print(f"{args.completions} completions x {args.chars} chars, {args.reps} reps (median, min-max):")
    base = statistics.median(times["in process (sandbox=false)"])
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"  {name:30s} {med * 1e3:8.1f} ms  ({min(ts) * 1e3:.1f}-{max(ts) * 1e3:.1f})  x{med / base:.1f}")


if __name__ == "__main__":
    main()
