"""Shared input construction and timing for the kernel benchmarks and tests (so baselines cannot drift); the
command-line boundary of the benchmarks that train (the CLI's one-line errors, argument and config checks before
any work, child processes that end with the benchmark).

Shapes: N tokens, H hidden size, V vocabulary size.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from fastgrpo.cli import EXIT_PREEMPTED, config_error, interrupted
from fastgrpo.config import ConfigError, TrainConfig, load_config, not_a_file
from fastgrpo.config.loader import check
from fastgrpo.runtime.procs import die_with_parent


@dataclass(frozen=True, kw_only=True)
class Shape:
    """One benchmark / test case."""

    n: int
    """tokens (rows of hidden)"""
    h: int
    """hidden size"""
    v: int
    """vocabulary size"""
    label: str = ""
    """free-form tag for tables (e.g. "liger B=4")"""


def make_inputs(shape: Shape, *, dtype=torch.bfloat16, device="cpu", seed=0, logit_scale=2.0,
                zero_weight_frac=0.0, requires_grad=True) -> dict:
    """Random lm_head inputs. Logits ``hidden @ weight.T`` have standard deviation ``logit_scale`` (about
    what a trained head gives: a few dominant tokens, a long tail).

    Returns a dict with ``hidden [N, H]``, ``weight [V, H]`` (leaf tensors, ``requires_grad``), ``targets [N]``,
    ``advantages [N]`` float32 and ``token_weights [N]`` float32 (DAPO-style ``1/N``; a ``zero_weight_frac``
    fraction of them set to 0 at random).
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*size, scale=1.0):
        return (torch.randn(*size, generator=gen) * scale).to(device=device, dtype=dtype)

    hidden = randn(shape.n, shape.h).requires_grad_(requires_grad)
    weight = randn(shape.v, shape.h, scale=logit_scale / shape.h**0.5).requires_grad_(requires_grad)
    targets = torch.randint(0, shape.v, (shape.n,), generator=gen).to(device)
    advantages = torch.randn(shape.n, generator=gen).to(device)
    token_weights = torch.full((shape.n,), 1.0 / shape.n)
    if zero_weight_frac > 0:
        token_weights[torch.rand(shape.n, generator=gen) < zero_weight_frac] = 0.0
    return dict(hidden=hidden, weight=weight, targets=targets, advantages=advantages,
                token_weights=token_weights.to(device))


def perturbed(logprobs: torch.Tensor, *, std: float, seed: int = 1) -> torch.Tensor:
    """``logprobs`` plus Gaussian noise (detached): stands in for old / ref log-probs so ratios spread
    around 1 and both clip branches are exercised."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    noise = torch.randn(logprobs.shape, generator=gen).to(logprobs.device)
    return (logprobs.detach().float() + std * noise).clamp(max=0.0)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``||actual - expected|| / ||expected||`` in float64 (0 when both are 0)."""
    a, e = actual.detach().double(), expected.detach().double()
    denom = e.norm().item()
    diff = (a - e).norm().item()
    return diff if denom == 0 else diff / denom


def time_fwd_bwd(fn, *, warmup: int = 2, reps: int = 5) -> tuple[float, float]:
    """Median milliseconds of ``fn()`` (which runs forward and backward) and the peak extra memory in MB
    (CUDA: ``max_memory_allocated`` above the level before the first call; CPU: NaN, not measured)."""
    cuda = torch.cuda.is_available()
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if cuda else float("nan")
    times.sort()
    return times[len(times) // 2], peak


def peak_cpu_alloc_mb(fn) -> float:
    """Peak MB held by torch's CPU allocator during ``fn()``, above the level at its start: the CPU counterpart
    of CUDA's ``max_memory_allocated``. Read from the profiler's allocation events, so it counts every tensor,
    an op's internal temporaries included (not MKL's own packing workspace); the profiler's overhead is a few
    microseconds per op, so time ``fn`` in a separate call."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()

    def walk(nodes):
        for node in nodes:
            yield node
            yield from walk(node.children)

    allocs = sorted((node.start_time_ns, node.extra_fields.alloc_size)
                    for node in walk(prof.profiler.kineto_results.experimental_event_tree())
                    if type(node.extra_fields).__name__ == "_ExtraFields_Allocation"
                    and node.extra_fields.device.type == "cpu")
    live = peak = 0
    for _, size in allocs:
        live += size
        peak = max(peak, live)
    return peak / 2**20


def peak_rss_mb(fn) -> float:
    """Peak resident memory of this process during ``fn()`` above its resident size at the start, in MB (Linux:
    the kernel's high-water mark, reset first; freed heap pages are handed back first so they are not reused
    unseen). NaN where /proc is not available."""
    import ctypes

    def kib(key):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(key))

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM
        base = kib("VmRSS")
    except OSError:
        fn()
        return float("nan")
    fn()
    return (kib("VmHWM") - base) / 1024


def time_alternating(fns: dict, *, reps: int, budget_s: float | None = None,
                     min_sample_s: float = 0.05) -> dict[str, list[float]]:
    """Seconds per call of each ``fns[name]()``, calls alternated (``a b c a b c ...``) so that load on a shared
    machine hits every method alike. Stops starting rounds once ``budget_s`` is spent (at least one round).

    Calls shorter than ``min_sample_s`` are repeated within a sample (the same count for every method, from one
    call of the first) so that the clock's resolution and a single scheduler hiccup do not decide the result."""
    first = next(iter(fns.values()), None)
    inner = 1
    if first is not None:
        t0 = time.perf_counter()
        first()
        inner = max(1, min(1000, math.ceil(min_sample_s / max(time.perf_counter() - t0, 1e-6))))
    times = {name: [] for name in fns}
    t_start = time.monotonic()
    for rep in range(reps):
        if rep and budget_s is not None and time.monotonic() - t_start > budget_s:
            break
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            times[name].append((time.perf_counter() - t0) / inner)
    return times


def clock_train_steps(trainer) -> list[float]:
    """Wrap ``trainer.train_step`` with a wall clock; the returned list fills with each step's seconds as the run
    goes (evaluations, which run between steps, are outside it)."""
    seconds: list[float] = []
    original = trainer.train_step

    def timed_step():
        t = time.perf_counter()
        result = original()
        seconds.append(time.perf_counter() - t)
        return result

    trainer.train_step = timed_step
    return seconds


# ---------------------------------------------------------------------------------------------------------------
# The command line of the benchmarks that train


class Terminated(Exception):
    """SIGTERM reached a benchmark: its children were stopped (see :class:`Children`)."""


def benchmark_main(prog: str, body: Callable[[], int | None]) -> int:
    """Run a benchmark's ``body`` behind the training CLI's error boundary: a bad argument, config or missing extra
    (ConfigError, ImportError; raised before any work) is one line and exit 2, Ctrl-C one line and exit 130, SIGTERM
    (its children stopped first) one line and exit 143. Returns the exit code (``body``'s, 0 for None)."""
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        return body() or 0
    except (ConfigError, ImportError) as e:
        return config_error(prog, e)
    except KeyboardInterrupt:
        return interrupted(prog)
    except Terminated:
        print(f"{prog}: stopped by SIGTERM; its runs were stopped too (each saved at the end of its step: the same "
              "command resumes them)", file=sys.stderr)
        return EXIT_PREEMPTED
    finally:
        signal.signal(signal.SIGTERM, previous)


def _raise_terminated(signum: int, frame) -> None:
    raise Terminated()


def check_at_least(value: int | float, least: int | float, arg: str) -> None:
    """ConfigError naming the argument ``arg`` (e.g. '--steps') unless ``value >= least``."""
    check(value >= least, arg, f"must be >= {least}, got {value}")


def check_out_dir(path: Path, arg: str = "--out") -> None:
    """``path`` is, or can be created as, a folder this process can write: a ConfigError naming ``arg`` else."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{arg}: {str(path)!r} {not_a_file(path)}; give a folder")
    existing = next(p for p in (path, *path.parents) if p.exists())
    check(existing.is_dir(), arg, f"{str(existing)!r} is a file, so {str(path)!r} cannot be created under it")
    check(os.access(existing, os.W_OK | os.X_OK), arg, f"cannot write to {str(existing)!r} (permission denied)")


def check_run_configs(config: Path | str | None, runs: dict[str, Sequence[str]], *, cls: type = TrainConfig) -> None:
    """Every run's config (``config`` with the run's overrides) loads and validates, before the first run starts;
    the ConfigError names the run."""
    for name, overrides in runs.items():
        try:
            load_config(config, list(overrides), cls=cls)
        except ConfigError as e:
            raise ConfigError(f"run {name!r}: {e}") from None


class Children:
    """A benchmark's training processes: each in its own process group (it and the reward workers it starts), sent
    SIGTERM when the benchmark exits while they run (SIGINT after Ctrl-C), and killed with their group when they
    outlive ``grace_s`` after it (a step of a real model on a CPU can take minutes: SIGTERM lets it finish and save).
    Each child also gets SIGTERM from the kernel if the benchmark dies without a word (SIGKILL)."""

    def __init__(self, grace_s: float = 600.0) -> None:
        self.procs: list[subprocess.Popen] = []
        self.grace_s = grace_s

    def __enter__(self) -> Children:
        return self

    def start(self, cmd: list[str], **kwargs) -> subprocess.Popen:
        proc = subprocess.Popen(cmd, start_new_session=True, preexec_fn=lambda: die_with_parent(signal.SIGTERM),
                                **kwargs)
        self.procs.append(proc)
        return proc

    def __exit__(self, exc_type, *exc) -> None:
        previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the wait short
        try:
            live = [p for p in self.procs if p.poll() is None]
            for proc in live:  # Ctrl-C (its own session keeps the terminal's SIGINT from the child): stop at once
                proc.send_signal(signal.SIGINT if exc_type is KeyboardInterrupt else signal.SIGTERM)
            deadline = time.monotonic() + self.grace_s
            for proc in live:
                try:
                    proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
            for proc in live:  # its group: the child if it outlived the grace, and whatever it left behind
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                proc.wait()
        finally:
            signal.signal(signal.SIGTERM, previous)
