"""The worker sandbox: a pool of worker processes that run user code with a hard time bound.

User code (a reward function, a tool, or math-verify, whose sympy calls can run for minutes on adversarial input and
cannot be interrupted from another thread) may hang, which in the trainer process would hang the job, and with
several ranks every other rank too; an ``os._exit`` or a segfault would end it. So it runs here:

- each of ``size`` workers is a fresh interpreter (a module built on :func:`fastgrpo.runtime.worker.serve`) that
  imports the named functions once, then runs calls on request;
- every call has a deadline (``timeout_s``); a worker past it is SIGKILLed and replaced, and the call is a
  ``timeout`` failure. A worker that dies is replaced and the call is a ``crash`` failure;
- calls of different functions run on different workers at once; a job of several calls (async functions) goes to
  one worker, which awaits them concurrently on its event loop, each with the same time bound;
- every call carries an id, and only an answer with that id from the worker's own pid is its result (a function
  that forks leaves a second process on the worker's socket: it exits before answering, and nothing it could write
  becomes another call's result);
- :meth:`WorkerPool.interrupt` (the trainer's SIGTERM handler) abandons the calls in flight at once;
- :meth:`WorkerPool.close` (also at interpreter exit) kills every worker. A trainer killed with SIGKILL takes its
  workers with it (PR_SET_PDEATHSIG), so no worker outlives the run.

Workers are new processes (not forks): a fork of a process with CUDA, NCCL or gloo threads is not safe, and a
``spawn`` multiprocessing start would re-run a user's training script that lacks an ``if __name__`` guard.

A subclass names its worker module and how messages name what it runs: the reward pool
(:mod:`fastgrpo.rewards.sandbox`) and the tool pool (:mod:`fastgrpo.environments.tools`). This module imports no
torch.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from fastgrpo.runtime.errors import RunError

LOAD_TIMEOUT_S = 300.0
"""Most seconds a worker may take to start and import the functions (a plugin may import torch). The trainer's
first :meth:`WorkerPool.wait_ready` bounds the import of the functions themselves by the pool's ``timeout_s``
instead, counted from when the worker has started and begins it."""
ASYNC_GRACE_S = 5.0
"""Extra seconds past ``timeout_s`` before a worker awaiting async functions is killed: those calls time out
cooperatively first (asyncio), keeping the results of the others."""
_POLL_S = 0.2  # how often a wait checks for interrupt(): the latency of SIGTERM while user code runs


class CallFailure(Exception):
    """A whole call failed: ``kind`` (e.g. ``exception``, ``timeout``, ``crash``; the reward kinds are listed in
    :mod:`fastgrpo.rewards.calls`), a one-line ``message``, the traceback text."""

    def __init__(self, kind: str, message: str, tb: str = "") -> None:
        super().__init__(message)
        self.kind, self.message, self.tb = kind, message, tb


Call = tuple[int, Any, int]
"""One call: (function index, its arguments, a number the worker module gives meaning to: the completions of a
reward call, the output limit of a tool call)."""
Result = tuple[Any, list[tuple[int, str, str]]] | CallFailure
"""What a call gave: (value, failed entries), e.g. (values, bad) of :func:`fastgrpo.rewards.calls.to_values`, or a
failure."""


class Interrupted(Exception):
    """The pool was interrupted (SIGTERM) while calls were in flight."""


@dataclass
class _Worker:
    proc: subprocess.Popen
    conn: Connection
    state: str = "loading"  # loading -> idle <-> busy
    started: float = field(default_factory=time.monotonic)
    importing: float | None = None  # when it began to import the functions (its own start-up done)
    job: int = -1  # index of the job it runs
    call_id: int = -1  # the id its answer must carry (a stale or forked process's message carries another)
    deadline: float = 0.0


class WorkerPool:
    """``size`` workers that import ``specs`` (``path/to/file.py:name`` or ``module:qualname``, see
    :mod:`fastgrpo.runtime.plugins`). A subclass sets the four class attributes."""

    worker_module: str
    """The module each worker runs (``python -m``): one built on :func:`fastgrpo.runtime.worker.serve`."""
    what: str
    noun: str
    timeout_key: str
    """How the pool's messages name what its workers run (the config key, the word) and their time bound."""
    restart_error: type[RunError] = RunError
    """Raised when a replacement worker cannot import what the first ones did (the plugin file changed or broke)."""

    def __init__(self, specs: list[str], *, size: int, timeout_s: float) -> None:
        if size < 1:
            raise ValueError(f"a {self.noun} worker pool needs size >= 1, got {size}")
        self.specs, self.size, self.timeout_s = list(specs), size, timeout_s
        self.is_async: list[bool] | None = None  # per spec, known once a worker has loaded them
        self._interrupt = threading.Event()
        self.restarts = 0
        self._next_id = 0
        self._workers: list[_Worker] = []
        # Kills the workers on close(), when the pool is garbage (a Trainer whose construction failed), and at exit.
        self._finalizer = weakref.finalize(self, _kill_all, self._workers)
        for _ in range(size):
            self._workers.append(self._spawn())

    # -------------------------------------------------------------------------------------------- processes

    def _spawn(self) -> _Worker:
        parent, child = socket.socketpair()
        root = str(Path(__file__).resolve().parents[2])  # the folder holding the fastgrpo package
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", self.worker_module, str(child.fileno()), str(os.getpid())],
                pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL, env=env)
        finally:
            child.close()
        conn = Connection(parent.detach())
        conn.send(("load", self.specs))
        return _Worker(proc=proc, conn=conn)

    def _replace(self, w: _Worker) -> _Worker:
        _kill(w)
        self.restarts += 1
        new = self._spawn()
        self._workers[self._workers.index(w)] = new
        return new

    def _on_load_message(self, w: _Worker, msg: tuple) -> None:
        if msg[0] == "importing":
            w.importing = time.monotonic()
            return
        if msg[0] == "load_error":
            raise ValueError(msg[1])
        self.is_async = list(msg[1])
        w.state = "idle"

    def wait_ready(self, timeout_s: float | None = None) -> list[bool]:
        """Block until every worker has imported the functions; return which are async. A worker gets
        LOAD_TIMEOUT_S from its start, and with ``timeout_s`` (e.g. ``rewards.timeout_s``) that long for the import
        of the functions themselves (its interpreter's start-up, which CPU contention can slow, does not count).

        ValueError with the worker's message when an import fails (a missing file, an exception, a SystemExit or a
        KeyboardInterrupt at import time, a missing attribute), the process exits or the time runs out: the
        trainer calls this before any model loads.
        """
        def deadline(w: _Worker) -> float:
            if timeout_s is not None and w.importing is not None:
                return min(w.importing + timeout_s, w.started + LOAD_TIMEOUT_S)
            return w.started + LOAD_TIMEOUT_S

        while any(w.state == "loading" for w in self._workers):
            loading = {w.conn: w for w in self._workers if w.state == "loading"}
            late = [w for w in loading.values() if time.monotonic() >= deadline(w)]
            if late:
                self.close()
                bounded = timeout_s is not None and late[0].importing is not None
                bound = f"{timeout_s:g} s ({self.timeout_key})" if bounded else f"{LOAD_TIMEOUT_S:g} s"
                raise ValueError(f"{self.what}: importing {self.specs} took more than {bound} (does a {self.noun} "
                                 "file wait or loop at import?)")
            ready = wait(list(loading), timeout=max(0.0, min(map(deadline, loading.values())) - time.monotonic()))
            for conn in ready:
                w = loading[conn]
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    self.close()
                    raise ValueError(f"{self.what}: importing {self.specs} ended the process ({_exit_status(w)}): "
                                     f"a {self.noun} file must not exit at import; run the import by hand to see why") \
                        from None
                try:
                    self._on_load_message(w, msg)
                except ValueError as e:
                    self.close()
                    raise ValueError(f"{self.what}: {e}") from None
        assert self.is_async is not None
        return self.is_async

    # -------------------------------------------------------------------------------------------- calls

    def run(self, jobs: list[list[Call]], while_waiting: Any = None) -> list[list[Result]]:
        """Run each job (a list of calls: one sync call, or async calls awaited together) on some worker.

        ``while_waiting()`` runs in this thread once every job that can start has started (the trainer scores
        its in-process rewards meanwhile). Raises Interrupted once :meth:`interrupt` was called.
        """
        if not self._finalizer.alive:
            raise RuntimeError(f"the {self.noun} worker pool is closed")
        self.wait_ready()
        results: list[list[Result] | None] = [None] * len(jobs)
        pending = deque(range(len(jobs)))
        try:
            self._dispatch(jobs, pending)
            if while_waiting is not None:
                while_waiting()
            while pending or any(w.state == "busy" for w in self._workers):
                if self._interrupt.is_set():
                    raise Interrupted()
                self._dispatch(jobs, pending)
                self._collect(jobs, results)
        except BaseException:
            # Interrupted, or KeyboardInterrupt in this thread: nothing may stay in flight, or the next run would
            # read this one's answers.
            for w in list(self._workers):
                if w.state == "busy":
                    self._replace(w)
            raise
        return results  # type: ignore[return-value]

    def _dispatch(self, jobs: list[list[Call]], pending: deque) -> None:
        for w in list(self._workers):
            if not pending:
                return
            if w.state != "idle":
                continue
            j = pending[0]
            deadline = self.timeout_s + (ASYNC_GRACE_S if len(jobs[j]) > 1 or self.is_async[jobs[j][0][0]] else 0)
            self._next_id += 1
            try:
                w.conn.send(("call", jobs[j], self.timeout_s, self._next_id))
            except (BrokenPipeError, ConnectionError, OSError):  # it died while idle: replace it, the job waits
                self._replace(w)
                continue
            pending.popleft()
            w.state, w.job, w.call_id, w.deadline = "busy", j, self._next_id, time.monotonic() + deadline

    def _collect(self, jobs: list[list[Call]], results: list) -> None:
        waiting = {w.conn: w for w in self._workers if w.state in ("busy", "loading")}
        now = time.monotonic()
        next_deadline = min([w.deadline for w in waiting.values() if w.state == "busy"], default=now + _POLL_S)
        for conn in wait(list(waiting), timeout=max(0.0, min(next_deadline - now, _POLL_S))):
            w = waiting[conn]
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                if w.state == "busy":
                    results[w.job] = [CallFailure("crash", f"killed its worker process ({_exit_status(w)})")] * len(
                        jobs[w.job])
                    self._replace(w)
                else:
                    raise self.restart_error(f"a restarted {self.noun} worker died while importing {self.specs} "
                                      f"({_exit_status(w)})") from None
                continue
            if w.state == "loading":
                try:
                    self._on_load_message(w, msg)
                except ValueError as e:  # it imported at start, and fails now: the plugin file changed?
                    raise self.restart_error(f"a restarted {self.noun} worker could not import {self.specs}: {e}") from None
                continue
            if not _answers(msg, w):  # not this job's answer (a process the function forked wrote it): dropped
                continue
            results[w.job] = [CallFailure(r[1], r[2], r[3]) if r[0] == "fail" else (r[1], r[2]) for r in msg[1]]
            w.state = "idle"
        now = time.monotonic()
        for w in list(self._workers):
            if w.state == "busy" and now > w.deadline and results[w.job] is None:
                message = f"did not finish within {self.timeout_key}={self.timeout_s:g} s; its worker was killed"
                results[w.job] = [CallFailure("timeout", message)] * len(jobs[w.job])
                self._replace(w)
            if w.state == "loading" and now - w.started > LOAD_TIMEOUT_S:
                raise self.restart_error(f"a restarted {self.noun} worker took more than {LOAD_TIMEOUT_S:g} s to import "
                                  f"{self.specs}")

    # -------------------------------------------------------------------------------------------- control

    def interrupt(self) -> None:
        """Make the current (and any later) :meth:`run` raise Interrupted within a fraction of a second.
        Safe to call from a signal handler."""
        self._interrupt.set()

    @property
    def interrupted(self) -> bool:
        return self._interrupt.is_set()

    def pids(self) -> list[int]:
        """Process ids of the live workers (tests check that none outlives the pool)."""
        return [w.proc.pid for w in self._workers]

    def close(self) -> None:
        """Kill every worker; idempotent."""
        self._finalizer()

    @classmethod
    def import_first(cls, specs: list[str], *, timeout_s: float) -> None:
        """Import ``specs`` in a throwaway worker, before this process imports them: a file that exits, hangs or
        kills its process at import is a ValueError here (:meth:`wait_ready` says which), not the end of the run."""
        pool = cls(specs, size=1, timeout_s=timeout_s)
        try:
            pool.wait_ready(timeout_s)
        finally:
            pool.close()


def _answers(msg: Any, w: _Worker) -> bool:
    """Whether ``msg`` is the answer to the job worker ``w`` runs: ``("done", results, call id, pid)`` with that
    job's call id, from the worker's own process. A function that forks leaves a second process on the worker's
    socket; each call's id and the sender's pid keep whatever that process writes from becoming another job's
    result (the worker also ends such a process before it can answer, see :func:`fastgrpo.runtime.worker.answer`)."""
    return (isinstance(msg, tuple) and len(msg) == 4 and msg[0] == "done" and w.state == "busy"
            and msg[2] == w.call_id and msg[3] == w.proc.pid)


def _exit_status(w: _Worker) -> str:
    code = w.proc.wait()
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


def _kill(w: _Worker) -> None:
    try:
        w.proc.kill()  # SIGKILL: user code stuck in C (sympy, a regex) ignores anything gentler
    except OSError:
        pass
    w.proc.wait()
    w.conn.close()


def _kill_all(workers: list[_Worker]) -> None:
    for w in workers:
        _kill(w)
