"""Where a fastgrpo training run's peak resident memory is set: the peak RSS of each phase of each step (Linux).

    python benchmarks/mem_profile.py --config run.yaml [key=value ...] [--json out.json]

Runs ``fastgrpo.train``'s Trainer in this process with the phases wrapped (rollout, trunk forward, head, backward,
grad clip, optimizer step, checkpoint save). A thread samples ``/proc/self/status`` (VmRSS) and glibc's
``mallinfo2`` (bytes malloc hands out vs bytes it holds free) every few milliseconds and keeps, per phase and step,
the largest RSS and what malloc said at that moment. The table printed at the end names the phase that set VmHWM.

Columns: ``rss_max`` the phase's largest sampled RSS; ``heap_used`` the malloc arena bytes in use at that sample
(small and medium allocations: below glibc's mmap threshold); ``heap_free`` arena bytes malloc holds but has
not returned to the system (freed memory kept by the allocator); ``mmap`` bytes of allocations served by mmap
(large tensors, returned at free). RSS - heap_used - heap_free - mmap is the rest: shared libraries, code, Python,
stacks. Only the first step shows the optimizer state being created; later steps show the steady state.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import threading
import time
from collections import defaultdict
from functools import wraps
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GB = 1e9


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]


def _mallinfo():
    """(heap in use, heap held free, mmapped) bytes from glibc, or Nones off glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
    except (OSError, AttributeError):
        return lambda: (None, None, None)

    def read():
        m = libc.mallinfo2()
        return m.uordblks, m.fordblks, m.hblkhd
    return read


def _rss() -> tuple[int, int]:
    """(VmRSS, VmHWM) of this process in bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            out[line[:5]] = int(line.split()[1]) * 1024
    return out["VmRSS"], out["VmHWM"]


class PhaseSampler:
    """Samples RSS and malloc's counters every ``interval_s``; attributes each sample to the current phase."""

    def __init__(self, interval_s: float = 0.005):
        self.interval_s, self.phase, self.step = interval_s, "setup", 0
        self.peaks: dict[tuple[int, str], dict] = {}
        self.seconds: dict[tuple[int, str], float] = defaultdict(float)
        self._mall = _mallinfo()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self):
        self._thread.start()
        return self

    def stop(self):
        self._stop.set()
        self._thread.join()

    def sample(self):
        rss, hwm = _rss()
        key = (self.step, self.phase)
        if key not in self.peaks or rss > self.peaks[key]["rss_max"]:
            used, free, mmapped = self._mall()
            self.peaks[key] = {"rss_max": rss, "hwm": hwm, "heap_used": used, "heap_free": free, "mmap": mmapped}

    def _run(self):
        while not self._stop.is_set():
            self.sample()
            time.sleep(self.interval_s)

    def wrap(self, fn, phase):
        @wraps(fn)
        def inner(*args, **kwargs):
            outer, t0 = self.phase, time.perf_counter()
            self.sample()
            self.phase = phase
            try:
                return fn(*args, **kwargs)
            finally:
                self.sample()
                self.seconds[(self.step, phase)] += time.perf_counter() - t0
                self.phase = outer
        return inner


def instrument(sampler: PhaseSampler) -> None:
    """Wrap the phases of fastgrpo's step (module attributes, so every caller goes through the wrappers)."""
    import torch

    from fastgrpo.trainers import loop

    from fastgrpo.trainers import grpo as trainer

    from fastgrpo.algorithms import tokens as update

    T = trainer.Trainer
    T.rollout = sampler.wrap(T.rollout, "rollout")
    step_fn = T.train_step

    def train_step(self):
        sampler.step += 1
        return step_fn(self)
    T.train_step = train_step
    update.fused_grpo_loss = sampler.wrap(update.fused_grpo_loss, "head (forward)")
    torch.Tensor.backward = sampler.wrap(torch.Tensor.backward, "backward")
    torch.nn.utils.clip_grad_norm_ = sampler.wrap(torch.nn.utils.clip_grad_norm_, "grad clip")
    loop.TrainingLoop._save = sampler.wrap(loop.TrainingLoop._save, "checkpoint save")
    init_model = loop.TrainingLoop._init_model

    def _init_model(self, *a, **k):
        init_model(self, *a, **k)
        self.optimizer.step = sampler.wrap(self.optimizer.step, "optimizer step")
        self.runner.packed_forward = sampler.wrap(self.runner.packed_forward, "trunk forward")
    loop.TrainingLoop._init_model = _init_model
    T.policy_update = sampler.wrap(T.policy_update, "update (other)")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True)
    p.add_argument("--json", help="write the per-phase figures here")
    p.add_argument("--interval-ms", type=float, default=5.0)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()

    from fastgrpo.distributed import groups as fdist
    from fastgrpo.config import TrainConfig, load_config

    sampler = PhaseSampler(args.interval_ms / 1000).start()
    instrument(sampler)
    from fastgrpo.trainers.grpo import Trainer

    cfg = load_config(args.config, args.overrides, cls=TrainConfig)
    fdist.init_distributed(cfg.device)
    sampler.phase = "setup"
    t = Trainer(cfg)
    try:
        sampler.phase = "between phases"
        t.run()
    finally:
        t.close()
        sampler.stop()
        fdist.destroy_distributed()
    rows = [{"step": s, "phase": ph, "seconds": round(sampler.seconds.get((s, ph), 0.0), 2),
             **{k: v for k, v in d.items()}} for (s, ph), d in sampler.peaks.items()]
    hwm = max(r["hwm"] for r in rows)
    print(f"{'step':>4} {'phase':<16} {'s':>6} {'rss_max':>8} {'heap_used':>9} {'heap_free':>9} {'mmap':>6}  (GB)")
    for r in rows:
        mark = "  <- VmHWM" if r["rss_max"] == hwm else ""
        f = lambda v: f"{v / GB:.2f}" if v is not None else "-"  # noqa: E731
        print(f"{r['step']:>4} {r['phase']:<16} {r['seconds']:>6} {f(r['rss_max']):>8} {f(r['heap_used']):>9} "
              f"{f(r['heap_free']):>9} {f(r['mmap']):>6}{mark}")
    print(f"VmHWM {hwm / GB:.3f} GB; env MALLOC_ARENA_MAX={os.environ.get('MALLOC_ARENA_MAX')} "
          f"MALLOC_TRIM_THRESHOLD_={os.environ.get('MALLOC_TRIM_THRESHOLD_')} "
          f"MALLOC_MMAP_THRESHOLD_={os.environ.get('MALLOC_MMAP_THRESHOLD_')}")
    if args.json:
        Path(args.json).write_text(json.dumps({"vm_hwm": hwm, "rows": rows, "argv": sys.argv}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
