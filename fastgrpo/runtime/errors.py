"""Errors that end a run with a one-line message: ``fastgrpo.train`` prints them without a traceback.

Anything else that escapes the trainer is a bug and keeps its traceback.
"""

from __future__ import annotations

import errno


class RunError(RuntimeError):
    """The run cannot go on; the message says why and what to do."""


class RewardError(RunError):
    """A reward function failed and ``rewards.on_error`` is ``raise``."""


class NonFiniteError(RunError):
    """Too many optimizer steps in a row had a non-finite loss or gradient, or the rollout's sampler met non-finite
    logits."""


class Preempted(RunError):
    """SIGTERM stopped the run before max_steps; it saved a checkpoint, and the same command resumes it."""


class PluginError(RunError, ValueError):
    """User code that fastgrpo calls (an environment's ``reset``/``step``, its constructor) raised, exited or
    returned something it cannot use: the run stops with one line naming the class, the method and what it did.
    A ValueError too: before training starts it is bad input (exit 2), like any other."""


class ContextError(RunError, ValueError):
    """A rollout request does not fit the model's positions (a prompt that only exists at run time, e.g. an
    environment's first message): past ``max_position_embeddings`` a model runs on untrained positions."""


class DiskFullError(RunError):
    """A write failed for lack of space (or quota)."""


def is_disk_full(exc: BaseException) -> bool:
    """Whether ``exc``, or any exception it wraps, is ENOSPC / EDQUOT (torch.distributed.checkpoint wraps the
    OSError of a failed write in its own exception, sometimes as text only)."""
    seen: set[int] = set()
    stack = [exc]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(e) or "Disk quota exceeded" in str(e):
            return True
        stack += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)  # torch's CheckpointException: {rank: exception or traceback}
        if isinstance(failures, dict):
            stack += [f for f in failures.values() if isinstance(f, BaseException)]
            stack += [f[0] for f in failures.values() if isinstance(f, tuple) and f and isinstance(f[0], BaseException)]
    return False
