"""Update-time A/B of memory settings on one rollout batch, alternated in one process (Linux, glibc).

    python benchmarks/mem_ab.py --config run.yaml --variants 'a:mmap=32M,mb=4096' 'b:mmap=1M,mb=1024' --rounds 3

One Trainer, one rollout; then each round runs ``Trainer.policy_update`` (forward, backward, clip, AdamW step) once
per variant, in rotated order, and reports the median wall and process-CPU seconds per variant with the range and
each round's ratio to the first variant (CPU time is the steadier figure on a shared machine). A variant sets glibc's
mmap threshold (``mmap=``: bytes, with K/M suffix; mallopt M_MMAP_THRESHOLD, process-wide, for the allocations that
follow; glibc's rising default cannot be restored once set, and 32M is its ceiling, where it settles during
training), the micro-batch token budget (``mb=``) and AdamW's ``foreach`` (``foreach=0|1``). Peak memory is not
measured here (one process holds every variant's history): use ``mem_profile.py``, one process per setting.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

_M_MMAP_THRESHOLD = -3


def _size(text: str) -> int:
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1].upper(), 1)
    return int(text[:-1] if mult > 1 else text) * mult


def parse_variant(text: str) -> tuple[str, dict]:
    name, _, spec = text.partition(":")
    out = {}
    for item in filter(None, spec.split(",")):
        key, _, value = item.partition("=")
        out[key] = _size(value) if key == "mmap" else int(value)
    return name, out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True)
    p.add_argument("--variants", nargs="+", required=True)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    variants = [parse_variant(v) for v in args.variants]

    from fastgrpo.distributed import groups as fdist
    from fastgrpo.config import TrainConfig, load_config
    from fastgrpo.runtime.metrics import StepMetrics
    from fastgrpo.trainers.grpo import Trainer

    libc = ctypes.CDLL("libc.so.6")
    cfg = load_config(args.config, ["checkpoint.overwrite=true", *args.overrides], cls=TrainConfig)
    fdist.init_distributed(cfg.device)
    t = Trainer(cfg)
    try:
        ep = t.rollout()
        t.policy_update(ep, StepMetrics())  # warm-up: creates the optimizer state
        times: dict[str, list[float]] = {name: [] for name, _ in variants}
        cpu: dict[str, list[float]] = {name: [] for name, _ in variants}  # process CPU time: robust to a shared machine
        for r in range(args.rounds):
            order = variants[r % len(variants):] + variants[:r % len(variants)]
            for name, v in order:
                if "mmap" in v:
                    libc.mallopt(_M_MMAP_THRESHOLD, v["mmap"])
                if "mb" in v:
                    t.cfg.grpo.max_tokens_per_microbatch = v["mb"]
                if "foreach" in v:
                    for g in t.optimizer.param_groups:
                        g["foreach"] = bool(v["foreach"])
                libc.malloc_trim(0)
                t0, c0 = time.perf_counter(), time.process_time()
                t.policy_update(ep, StepMetrics())
                times[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
                print(f"round {r} {name}: {times[name][-1]:.2f} s wall, {cpu[name][-1]:.2f} s CPU", flush=True)
    finally:
        t.close()
        fdist.destroy_distributed()
    first = variants[0][0]
    for what, table in (("wall", times), ("CPU", cpu)):
        for name, _ in variants:
            ts = table[name]
            ratios = [a / b for a, b in zip(ts, table[first])]
            print(f"{what} {name}: median {statistics.median(ts):.2f} s (range {min(ts):.2f}-{max(ts):.2f}); "
                  f"/ {first} per round: {', '.join(f'{x:.3f}' for x in ratios)} "
                  f"(median {statistics.median(ratios):.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
