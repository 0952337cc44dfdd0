"""Warm-started tiny models: an SFT recipe run once on first use, then cached like the tiny model.

``model.name_or_path: tiny:countdown`` names the embedded Countdown model that ``make demo`` starts GRPO from: the
random ``tiny:medium`` model (~3.9M parameters, ``seed=1``) after 300 SFT steps (:mod:`fastgrpo.sft`) on Countdown
problems of 3 numbers from 1..9, each shown with one of its solutions, drawn at random from the exhaustive solver's,
as a bare equation (``sft.trace=answer``: an empty think block, then ``<answer>9*(9-8)</answer>``). It has learnt the
answer format and solves some held-out problems; GRPO then improves it within minutes on a CPU.

``tiny:countdown-tools`` (``configs/tiny-tools.yaml``, multi-turn with a calculator tool) starts from
``tiny:countdown`` and adds 300 SFT steps on traces that call the calculator (``sft.trace=tool``).

A recipe is a list of ``fastgrpo.sft`` overrides (registry ``WARM_RECIPES``). Its folder is
``<root>/tiny-<name>-<hash>``, the hash taken over the recipe's *resolved* config (every default included), the tiny
model's recipe version and ``_WARM_VERSION``, so a changed recipe or default builds a new folder instead of reusing
a stale one. A recipe may start from another warm model (``model.name_or_path: tiny:<recipe>``, :func:`warm_base`):
that one is built first, in the same cache, and its folder's key joins the hash.

The build runs ``python -m fastgrpo.sft`` in a child process: on the CPU with ``_BUILD_THREADS`` (2) torch threads,
since the CPU kernels' rounding depends on the thread count and the SFT amplifies it into another model (pinned, the
build gives the same weights on every machine with the same CPU kernels, and takes no GPU memory from a run that is
starting); outside any torchrun process group of the caller; with its progress bar on the caller's terminal.
Concurrent callers (torchrun ranks, test workers) take a file lock: the first builds, the others wait and then find
the folder. The result is renamed into place, so no caller ever sees a half-written folder.

Why this recipe (bare equations, a random solution, ``tiny:medium``, 300 steps, seed 1, the thread pin), with the
measurements: benchmarks/RESULTS.md, "Learning: the CPU demo".
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from fastgrpo.config import SFTConfig, load_config, to_dict
from fastgrpo.models.loading import register_model_source
from fastgrpo.runtime.procs import die_with_parent
from fastgrpo.models.tiny import _RECIPE_VERSION, FOLDER_FILES, tiny_cache_root
from fastgrpo.runtime.files import folder_problem, publish_folder

__all__ = ["WARM_RECIPES", "build_warm", "recipe_config", "warm_base", "warm_folder"]

# Bump when the SFT code changes in a way the resolved config does not show (e.g. the trace writer).
_WARM_VERSION = "w2"  # w2: AdamW with foreach=True: other rounding than the per-parameter loop, so another model

# Torch threads of the build (see build_warm): 2, the demo machine's core count.
_BUILD_THREADS = 2

# The Countdown distribution the warm model is trained on and the demo trains and evaluates on (see configs/tiny.yaml):
# three numbers from 1..9 (the seeds' problems have 3-4 numbers from 1..99: too much arithmetic for a ~4M-parameter
# model trained for two minutes; benchmarks/bench_learning.py reports both).
COUNTDOWN_DATA = ["data.source=countdown", "data.template=compact", "data.min_numbers=3", "data.max_numbers=3",
                  "data.max_value=9", "data.seed=0", "data.num_eval=256"]

# What every Countdown warm recipe shares: CPU float32, the demo's problems, 300 SFT steps on a cosine schedule, and
# autograd's own saved activations (the lean forwards' gradients round differently: the cached models, and the demo
# that starts from them, stay the ones measured). (The cache key hashes the resolved recipe, not this list, so sharing
# it changes no key.)
_COUNTDOWN_SFT = ["model.dtype=float32", "device=cpu", "seed=1", *COUNTDOWN_DATA, "data.num_train=1800",
                  "sft.solution=random", "sft.normalization=token", "max_steps=300", "optim.schedule=cosine",
                  "optim.warmup_steps=20", "eval.every=-1", "checkpoint.every=100", "log.report_to=[jsonl]",
                  "parallel.lean_activations=false"]

WARM_RECIPES: dict[str, list[str]] = {
    "countdown": [
        "model.name_or_path=tiny:medium", *_COUNTDOWN_SFT,
        "sft.trace=answer", "sft.batch_size=64", "sft.max_tokens_per_microbatch=512", "optim.lr=2e-3",
    ],
    # tiny:countdown-tools (configs/tiny-tools.yaml): tiny:countdown (a staged start: it already writes equations from
    # the problem's numbers), then traces on the same problems that call the calculator tool (sft.trace=tool: sometimes
    # a miss first, then a solution, each with the tool's answer, then the equation). From tiny:medium, the same traces
    # taught the call syntax but not the numbers: benchmarks/RESULTS.md, "Multi-turn tools demo".
    "countdown-tools": [
        "model.name_or_path=tiny:countdown", *_COUNTDOWN_SFT,
        "sft.trace=tool", "sft.batch_size=32", "sft.max_tokens_per_microbatch=2048", "optim.lr=1e-3",
    ],
}
"""Warm model name (``tiny:<name>``) -> ``fastgrpo.sft`` overrides of its recipe."""


_LATER_KEYS = (("optim", "implementation", "auto"), ("model", "gguf_file", None), ("data", "digits", [2, 2]),
               ("data", "ops", ["+"]), ("parallel", "token_buckets", []), ("parallel", "master_weights", False),
               ("parallel", "cuda_graphs", False), ("parallel", "cuda_graphs_head", True),
               ("rollout", "asynchronous", False), ("rollout", "max_staleness", 1),
               ("rollout", "async_threads", None), ("rollout", "async_timeout_s", 600.0),
               ("parallel", "lean_activations", False))
"""(section, key, value): config keys added after warm models were first cached, whose value here reproduces what
the builds did before the key existed; left out of the cache key while they hold that value."""


def recipe_config(name: str):
    """The resolved SFTConfig of recipe ``name`` (ValueError for an unknown name)."""
    if name not in WARM_RECIPES:
        raise ValueError(f"model.name_or_path: unknown warm tiny model 'tiny:{name}' (known: "
                         f"{', '.join('tiny:' + n for n in WARM_RECIPES)})")
    return load_config(None, WARM_RECIPES[name], cls=SFTConfig)


def warm_base(name: str, _seen: tuple[str, ...] = ()) -> str | None:
    """The warm model recipe ``name`` starts from (``model.name_or_path: tiny:<other recipe>``), or None.

    Such a base is built first, in the same cache, and its folder's key joins this recipe's, so a changed base
    rebuilds what starts from it."""
    base = recipe_config(name).model.name_or_path
    if not base.startswith("tiny:") or base[len("tiny:"):] not in WARM_RECIPES:
        return None
    base = base[len("tiny:"):]
    if base == name or base in _seen:
        raise ValueError(f"warm recipe tiny:{name} starts from itself (through tiny:{base})")
    warm_base(base, (*_seen, name))  # a longer cycle raises too
    return base


def warm_folder(name: str, cache_dir: str | Path | None = None) -> Path:
    """Where recipe ``name`` is cached: the hash covers the resolved config, the tiny model's version and the key of
    the warm model it starts from, if any."""
    resolved = to_dict(recipe_config(name))
    for key in ("name", "output_dir"):  # where the build runs does not change what it builds
        resolved.pop(key)
    # nor does how AdamW runs: keys added later with the build's old behaviour as their value leave the key (and
    # every cached model) as it was; optim.implementation 'auto' is foreach on the build's CPU, as before it existed
    for section, key, old in _LATER_KEYS:
        if key in resolved.get(section, {}) and resolved[section][key] == old:  # (SFT has no rollout section)
            resolved[section].pop(key)
    key = {"sft": resolved, "tiny": _RECIPE_VERSION, "warm": _WARM_VERSION}
    base = warm_base(name)
    if base is not None:  # (only then: the keys of recipes from a plain tiny model stay as they were)
        key["base"] = warm_folder(base).name
    blob = json.dumps(key, sort_keys=True)
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
    final = warm_folder(name, cache_dir)
    if folder_problem(final, FOLDER_FILES) is None:
        return final
    base = warm_base(name)
    # the base first (its own lock), in the same cache; the child loads it from its folder
    start = [] if base is None else [f"model.name_or_path={build_warm(base, cache_dir=cache_dir)}"]
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / f".{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        problem = folder_problem(final, FOLDER_FILES)
        if problem is None:  # built by whoever held the lock before us
            return final
        steps = recipe_config(name).max_steps
        if final.exists():  # incomplete (a file deleted, a copy cut short): rebuilt, replacing it
            print(f"[fastgrpo] the cached warm model is incomplete ({problem}): rebuilding it", file=sys.stderr,
                  flush=True)
        print(f"[fastgrpo] building the warm model tiny:{name} (first use only: {steps} SFT steps, 2 to 10 minutes on "
              f"2 CPU cores) -> {final}", file=sys.stderr, flush=True)
        for stale in final.parent.glob(f".{final.name}.*"):  # a build killed before its cleanup (we hold the lock)
            if stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)
        work = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
        try:
            env = {k: v for k, v in os.environ.items() if k not in _DIST_ENV}
            # A fixed thread count: the CPU kernels' reduction order depends on it, and the SFT amplifies those
            # rounding differences into a different model (with a different GRPO gain), so every machine of the
            # same CPU family builds the same weights whatever its core count or the caller's OMP_NUM_THREADS.
            env.update(OMP_NUM_THREADS=str(_BUILD_THREADS), MKL_NUM_THREADS=str(_BUILD_THREADS))
            cmd = [sys.executable, "-m", "fastgrpo.sft", *WARM_RECIPES[name], *start, *overrides,
                   f"output_dir={work}", "name=build", "checkpoint.resume=never", "checkpoint.export_hf=true"]
            # the build dies with its caller (a killed run leaves no build running; its folder goes at the next one)
            done = subprocess.run(cmd, env=env, preexec_fn=die_with_parent if sys.platform == "linux" else None)
            if done.returncode != 0:
                raise RuntimeError(f"building the warm model tiny:{name} failed (exit {done.returncode}); "
                                   f"command: {' '.join(cmd)}")
            os.chmod(work / "build" / "final", 0o755)
            publish_folder(work / "build" / "final", final, FOLDER_FILES)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return final


# `model.name_or_path: tiny:<recipe>` loads the warm model (whatever the run's seed: the recipe fixes its own).
for _name in WARM_RECIPES:
    register_model_source(f"tiny:{_name}", lambda seed, name=_name: build_warm(name))
