"""The worker side of the sandbox (:mod:`fastgrpo.runtime.sandbox` starts the processes): its start-up and loop.

A worker module (the reward worker, the tool worker) runs ``python -m <module> FD PARENT_PID`` and calls
:func:`serve` with what its functions need; the messages, pickled over the socket FD
(``multiprocessing.connection`` framing), are:

- ``("load", specs)`` -> ``("importing",)`` (the worker's own start-up is done: the import's time bound starts),
  then ``("loaded", [is_async, ...])`` or ``("load_error", message)``: import each named function
  (``path/file.py:name`` plugin or ``module:qualname``) once;
- ``("call", [(i, arguments, n), ...], timeout_s, call_id)`` -> ``("done", [result, ...], call_id, pid)``: a result
  is ``("ok", value, bad)`` or ``("fail", kind, message, traceback)``. The answer carries the call's id and this
  process's pid, and a process that a function forked exits instead of answering (:func:`answer`), so a fork's
  return can never become another call's result.

A worker never ends the run: its module catches everything user code raises (SystemExit included), and it ignores
SIGINT and SIGTERM (the pool decides when it stops). It dies with the trainer (PR_SET_PDEATHSIG on Linux, and a
watchdog thread elsewhere), so a killed trainer leaves no orphan. This module imports no torch: starting or
restarting a worker costs an interpreter start and the plugin's own imports.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from multiprocessing.connection import Connection
from typing import Any, Callable

from fastgrpo.runtime.procs import die_with_parent
from fastgrpo.runtime.sandbox import CallFailure

__all__ = ["answer", "serve", "start_worker"]

Load = Callable[[list[str]], list[bool]]
"""Import the named functions; return which are async. A ValueError is the ``load_error`` message."""
Run = Callable[[list[tuple[int, Any, int]], float], list[Any]]
"""Run one job's calls with the time bound; one result per call: a ``(value, bad)`` pair or a CallFailure."""


def _die_with(parent_pid: int) -> None:
    die_with_parent()  # Linux: the kernel SIGKILLs us when the parent exits, even while user code holds the GIL in C
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(0)

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent_pid:
                os._exit(0)

    threading.Thread(target=watch, daemon=True, name="fastgrpo-worker-watchdog").start()


def start_worker(argv: list[str]) -> Connection:
    """A worker's start-up: ignore SIGINT/SIGTERM (the pool ends its workers), die with the parent, and return the
    pipe to it (``argv``: its file descriptor, the parent's pid)."""
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


def serve(argv: list[str], handlers: Callable[[], tuple[Load, Run]]) -> None:
    """A worker's whole life: start up (:func:`start_worker`), then answer the pool's messages until it closes the
    socket. ``handlers()`` returns the worker module's (load, run) functions; it is called after the watchdog
    starts, so that a parent killed while the module's own imports load still takes this process with it."""
    conn = start_worker(argv)
    me = os.getpid()
    load, run = handlers()
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg[0] == "load":
            conn.send(("importing",))
            try:
                flags = load(msg[1])
            except ValueError as e:
                conn.send(("load_error", str(e)))
                continue
            conn.send(("loaded", flags))
        elif msg[0] == "call":
            _, calls, timeout_s, call_id = msg
            results = run(calls, timeout_s)
            out = [("fail", r.kind, r.message, r.tb) if isinstance(r, CallFailure) else ("ok", *r) for r in results]
            try:
                answer(conn, out, call_id, me)
            except (BrokenPipeError, OSError):
                return
            except Exception as e:  # an output that does not pickle: never leave the parent waiting
                answer(conn, [("fail", "exception", f"could not send the result: {e!r}", "")] * len(calls), call_id,
                       me)
