"""A reward worker process (see :mod:`fastgrpo.rewards.sandbox`, which starts it).

    python -m fastgrpo.rewards._worker FD PARENT_PID

Talks to the trainer over the socket FD with pickled messages (``multiprocessing.connection`` framing):

- ``("load", specs)`` -> ``("importing",)`` (the worker's own start-up is done: the import's time bound starts),
  then ``("loaded", [is_async, ...])`` or ``("load_error", message)``: import each reward function
  (``path/file.py:name`` plugin or ``module:qualname``) once;
- ``("call", [(i, kwargs, n), ...], timeout_s, call_id)`` -> ``("done", [result, ...], call_id, pid)``: a result
  is ``("ok", values, bad)`` or ``("fail", kind, message, traceback)``. A list of several calls holds async
  functions only, awaited concurrently on this worker's event loop. The answer carries the call's id and this
  process's pid, and a process that a function forked exits instead of answering (:func:`answer`), so a fork's
  return can never become another call's result.

The worker never ends the run: it catches everything a reward function raises (SystemExit included) and ignores
SIGINT and SIGTERM (the trainer decides when it stops). It dies with the trainer (PR_SET_PDEATHSIG on Linux, and a
watchdog thread elsewhere), so a killed trainer leaves no orphan. This module imports no torch: starting or
restarting a worker costs an interpreter start and the plugin's own imports.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection

from fastgrpo.runtime.procs import die_with_parent


def _die_with(parent_pid: int) -> None:
    die_with_parent()  # Linux: the kernel SIGKILLs us when the parent exits, even while a reward holds the GIL in C
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(0)

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent_pid:
                os._exit(0)

    threading.Thread(target=watch, daemon=True, name="fastgrpo-reward-watchdog").start()


def start_worker(argv: list[str]) -> Connection:
    """A pool worker's start-up (this one's and the tool worker's): ignore SIGINT/SIGTERM (the pool ends its
    workers), die with the parent, and return the pipe to it (``argv``: its file descriptor, the parent's pid)."""
    fd, parent_pid = int(argv[0]), int(argv[1])
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _die_with(parent_pid)
    return Connection(fd)


def answer(conn: Connection, results: list, call_id: int, worker_pid: int) -> None:
    """Send a call's results, tagged with its id and this process's pid. A process the function forked returns
    here too (its pid is not ``worker_pid``): it ends at once, before it could answer or read the next call."""
    if os.getpid() != worker_pid:
        os._exit(0)
    conn.send(("done", results, call_id, worker_pid))


def main(argv: list[str]) -> None:
    conn = start_worker(argv)
    me = os.getpid()
    # Imported after the watchdog starts: a parent killed while they load must still take this process with it.
    from fastgrpo.rewards.calls import CallFailure, call, gather, is_async, own_copy
    from fastgrpo.rewards.loader import resolve_spec

    loop = asyncio.new_event_loop()
    funcs = []
    everything = (BaseException,)
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg[0] == "load":
            conn.send(("importing",))
            try:
                funcs = [resolve_spec(s, catch=everything) for s in msg[1]]
            except ValueError as e:
                conn.send(("load_error", str(e)))
                continue
            conn.send(("loaded", [is_async(f) for f in funcs]))
        elif msg[0] == "call":
            _, calls, timeout_s, call_id = msg
            if len(calls) == 1 and not is_async(funcs[calls[0][0]]):
                i, kwargs, n = calls[0]
                try:
                    results = [call(funcs[i], kwargs, n, catch=everything, loop=loop)]
                except CallFailure as f:
                    results = [f]
            else:  # the calls' arguments were pickled together and share their lists: all but the first get a copy
                results = loop.run_until_complete(gather(
                    [(funcs[i], kwargs if j == 0 else own_copy(kwargs), n) for j, (i, kwargs, n) in enumerate(calls)],
                    timeout_s, catch=everything))
            out = [("fail", r.kind, r.message, r.tb) if isinstance(r, CallFailure) else ("ok", *r) for r in results]
            try:
                answer(conn, out, call_id, me)
            except (BrokenPipeError, OSError):
                return
            except Exception as e:  # unpicklable output cannot happen (values are floats), but never hang the parent
                answer(conn, [("fail", "exception", f"could not send the result: {e!r}", "")] * len(calls), call_id,
                       me)


if __name__ == "__main__":
    main(sys.argv[1:])
