"""The reward sandbox: reward functions without a proven time bound run in worker processes.

A reward function is user code (or math-verify, whose sympy calls can run for minutes on adversarial input): it
runs in a :class:`RewardPool`, the worker sandbox of :mod:`fastgrpo.runtime.sandbox` (deadlines, restarts,
interrupts, no orphan workers) running :mod:`fastgrpo.rewards._worker`, with ``rewards.timeout_s`` per call.
"""

from __future__ import annotations

from fastgrpo.runtime.errors import RewardError
from fastgrpo.runtime.sandbox import LOAD_TIMEOUT_S, CallFailure, Interrupted, WorkerPool

__all__ = ["LOAD_TIMEOUT_S", "CallFailure", "Interrupted", "RewardPool", "import_in_worker"]


class RewardPool(WorkerPool):
    """``size`` reward workers that import ``specs`` (see :func:`fastgrpo.rewards.loader.worker_spec`)."""

    worker_module = "fastgrpo.rewards._worker"
    what, noun, timeout_key = "rewards.funcs", "reward", "rewards.timeout_s"
    restart_error = RewardError


def import_in_worker(specs: list[str], *, timeout_s: float) -> None:
    """Import the reward plugins ``specs`` in a throwaway worker first, before this process imports them
    (:meth:`~fastgrpo.runtime.sandbox.WorkerPool.wait_ready` says how that fails)."""
    RewardPool.import_first(specs, timeout_s=timeout_s)
