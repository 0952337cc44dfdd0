"""Warm-started tiny models: the SFT recipe run once on first use, cached like the tiny model.

``model.name_or_path: tiny:countdown`` names the embedded Countdown model: the random ``tiny:medium`` model (~3.9M
parameters) after a short SFT (:mod:`fastgrpo.sft`) on Countdown solutions written by the exhaustive solver, as bare
equations (``sft.trace=answer``: an empty think block, then ``<answer>9*(9-8)</answer>``), each showing one of the
problem's solutions drawn at random (``sft.solution=random``). It is what ``make demo`` starts GRPO from: it has
learnt the answer format and the shape of a solution, solves about a tenth of the held-out problems greedily (a
third among 8 samples), and half of its greedy answers still use numbers other than the given ones, which the
reward teaches GRPO to fix within minutes on a laptop CPU. The choices, each measured against the others:
- bare equations rather than intermediate steps: with steps the model wrote arithmetic it could not do (a third of
  its steps were wrong, and it "computed" the target as the last step whatever the numbers gave), and every one of
  those tokens took a share of the GRPO gradient; the bare equation is the choice GRPO has to improve, at half the
  tokens per sample;
- a random solution rather than the solver's first: the warm model then spreads its samples over several right
  answers; from the first-solution warm start GRPO gained 8-10 points in 150-250 steps;
- ``tiny:medium`` rather than the 1M-parameter ``tiny:small``: GRPO from the small model plateaued near 30% greedy;
  from the medium one it goes on rising. A shorter SFT (200 steps) starts lower but ends lower too (+7 and +14
  points, one run each), no better than 300 steps;
- ``seed=1`` (the base model's initialisation and the SFT's order): the SFT's outcome varies a lot with its seed.
  The seed-0 build solves 24% greedily with its samples spread thin (12% sampled accuracy), and GRPO moved it by
  about 1 point; seeds 2 and 3 gained 11 and 6, the seed-1 build 19 (3 GRPO seeds). GRPO ends near 30% from all
  of them, so the gain is mostly how low the start is. The build is therefore pinned to 2 torch threads
  (``_BUILD_THREADS``), so that it is the same model on every machine with the same CPU kernels.
(benchmarks/RESULTS.md, "Countdown learning on the CPU").

A recipe is a list of ``fastgrpo.sft`` overrides (registry ``WARM_RECIPES``). The folder is
``<root>/tiny-<name>-<hash>``, the hash taken over the recipe's *resolved* config (every default included) and the
tiny model's recipe version, so a changed recipe or default builds a new folder instead of reusing a stale one.

The build runs ``python -m fastgrpo.sft`` in a child process: on the CPU with two torch threads (the same weights on
every machine with the same CPU kernels, and no GPU memory taken from a run that is starting), outside any torchrun
process group of the caller, with its progress bar on the caller's terminal. Concurrent callers (torchrun ranks,
test workers) take a file lock: the first builds, the others wait and then find the folder. The result is renamed
into place, so no caller ever sees a half-written folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from fastgrpo.tiny import tiny_cache_root

__all__ = ["WARM_RECIPES", "build_warm", "recipe_config", "warm_folder"]

# Bump when the SFT code changes in a way the resolved config does not show (e.g. the trace writer).
_WARM_VERSION = "w1"

# Torch threads of the build (see build_warm): 2, the demo machine's core count.
_BUILD_THREADS = 2

# The Countdown distribution the warm model is trained on and the demo trains and evaluates on (see configs/tiny.yaml):
# three numbers from 1..9 (the seeds' problems have 3-4 numbers from 1..99: too much arithmetic for a ~4M-parameter
# model trained for two minutes; benchmarks/bench_learning.py reports both).
COUNTDOWN_DATA = ["data.source=countdown", "data.template=compact", "data.min_numbers=3", "data.max_numbers=3",
                  "data.max_value=9", "data.seed=0", "data.num_eval=256"]

WARM_RECIPES: dict[str, list[str]] = {
    "countdown": [
        "model.name_or_path=tiny:medium", "model.dtype=float32", "device=cpu", "seed=1",
        *COUNTDOWN_DATA, "data.num_train=1800",
        "sft.trace=answer", "sft.solution=random", "sft.batch_size=64", "sft.max_tokens_per_microbatch=512",
        "sft.normalization=token",
        "max_steps=300", "optim.lr=2e-3", "optim.schedule=cosine", "optim.warmup_steps=20",
        "eval.every=-1", "checkpoint.every=100", "log.report_to=[jsonl]",
    ],
}
"""Warm model name (``tiny:<name>``) -> ``fastgrpo.sft`` overrides of its recipe."""


def recipe_config(name: str):
    """The resolved SFTConfig of recipe ``name`` (ValueError for an unknown name)."""
    from fastgrpo.config import load_config
    from fastgrpo.sft import SFTConfig

    if name not in WARM_RECIPES:
        raise ValueError(f"model.name_or_path: unknown warm tiny model 'tiny:{name}' (known: "
                         f"{', '.join('tiny:' + n for n in WARM_RECIPES)})")
    return load_config(None, WARM_RECIPES[name], cls=SFTConfig)


def warm_folder(name: str, cache_dir: str | Path | None = None) -> Path:
    """Where recipe ``name`` is cached: the hash covers the resolved config and the tiny model's version."""
    from fastgrpo.config import to_dict
    from fastgrpo.tiny import _RECIPE_VERSION

    resolved = to_dict(recipe_config(name))
    for key in ("name", "output_dir"):  # where the build runs does not change what it builds
        resolved.pop(key)
    blob = json.dumps({"sft": resolved, "tiny": _RECIPE_VERSION, "warm": _WARM_VERSION}, sort_keys=True)
    digest = hashlib.sha256(blob.encode()).hexdigest()[:12]
    return tiny_cache_root(cache_dir) / f"tiny-{name}-{digest}"


# torchrun's variables: the child must not join (or wait for) the caller's process group.
_DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR",
             "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS")


def build_warm(name: str, *, cache_dir: str | Path | None = None, overrides: list[str] = ()) -> Path:
    """Build (once; later calls return the cached folder) the warm model ``name`` and return its folder.

    ``overrides`` are appended to the recipe for the build only; they do not change the cache key, so they are
    for tests that need a fast, small stand-in (e.g. ``max_steps=2``) in a private ``cache_dir``.
    """
    import fcntl

    final = warm_folder(name, cache_dir)
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / f".{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        if (final / "config.json").is_file():  # built by whoever held the lock before us
            return final
        print(f"[fastgrpo] building the warm model tiny:{name} (first use only; about 1.5 minutes on 2 CPU cores) "
              f"-> {final}", file=sys.stderr, flush=True)
        work = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
        try:
            env = {k: v for k, v in os.environ.items() if k not in _DIST_ENV}
            # A fixed thread count: the CPU kernels' reduction order depends on it, and the SFT amplifies those
            # rounding differences into a different model (with a different GRPO gain), so every machine of the
            # same CPU family builds the same weights whatever its core count or the caller's OMP_NUM_THREADS.
            env.update(OMP_NUM_THREADS=str(_BUILD_THREADS), MKL_NUM_THREADS=str(_BUILD_THREADS))
            cmd = [sys.executable, "-m", "fastgrpo.sft", *WARM_RECIPES[name], *overrides,
                   f"output_dir={work}", "name=build", "checkpoint.resume=never", "checkpoint.export_hf=true"]
            done = subprocess.run(cmd, env=env)
            if done.returncode != 0:
                raise RuntimeError(f"building the warm model tiny:{name} failed (exit {done.returncode}); "
                                   f"command: {' '.join(cmd)}")
            os.chmod(work / "build" / "final", 0o755)
            os.rename(work / "build" / "final", final)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return final
