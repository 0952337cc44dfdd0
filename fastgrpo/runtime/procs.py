"""Child processes that must not outlive their parent (no torch imported here: reward and tool workers use it)."""

from __future__ import annotations

import signal

__all__ = ["die_with_parent"]


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent exits (Linux ``PR_SET_PDEATHSIG``; a no-op
    where that call does not exist). Call it in the child: at its start-up, or as a subprocess ``preexec_fn``."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, sig)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
