"""Scoring a step's completions with every reward function, safely, and combining them into one reward each.

Legend: N completions in the call, F reward functions.

:class:`RewardRunner` is what the trainer holds. Built-ins with a tested time bound (``loader.IN_PROCESS``) run in
this process; every other function runs in the sandbox's worker processes (``rewards.sandbox``, default on). A
failure of any kind (see :mod:`fastgrpo.rewards.calls`) gives the affected completions ``rewards.on_error_value``,
is counted per function (``RewardScores.errors``, logged as ``reward/<name>/errors``), and its first occurrence per
function and kind is logged with its traceback; ``rewards.on_error: raise`` raises :class:`RewardError` instead.
So whatever a reward function does, every reward the policy update sees is a finite number.

Two more failures are found here, per completion:

- ``too_large``: a value whose product with the function's weight exceeds ``FLOAT32_MAX / (2 F)``. Within that
  bound the weighted sum over F functions stays within half of float32's range, so a completion's distance to its
  group's mean, and with it every advantage, is finite whatever ``grpo.scale_rewards`` is. The sum is taken in
  float64 (``RewardScores.total``), so rewards near the bound lose nothing to float32 rounding or overflow.
- ``no_column``: the completion's dataset row has None in a column the function requires (see
  :mod:`fastgrpo.rewards.columns`); the function is still called, and that completion scores the error value.

Each call gets its own copy of the arguments (:func:`fastgrpo.rewards.calls.own_copy`; a sandboxed call gets one
by being pickled to its worker), except the built-ins of ``loader.IN_PROCESS``, which only read them
(tests/test_rewards.py checks it). Plugin files are imported by a worker process before this process imports
them (:meth:`RewardRunner.from_config`): a plugin that exits, hangs or raises KeyboardInterrupt at import is a
ValueError naming it, within ``rewards.timeout_s``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from fastgrpo.runtime.errors import RewardError
from fastgrpo.rewards import loader
from fastgrpo.rewards.calls import FLOAT32_MAX, CallFailure, call, gather, is_async, own_copy
from fastgrpo.rewards.columns import configure_rewards, required_columns
from fastgrpo.rewards.sandbox import Interrupted, RewardPool, import_in_worker

log = logging.getLogger("fastgrpo.rewards")


@dataclass
class RewardScores:
    """One call's scores. Tensors are float32 on the CPU."""

    per_func: Any
    """[N, F] each function's score; NaN where a function returned None ("not applicable")."""
    total: Any
    """[N] float64: ``nansum_f weights[f] * per_func[:, f]``, summed in float64."""
    errors: Any
    """[F] completions that got ``rewards.on_error_value`` from each function (a failed call counts all of its N)."""
    interrupted: bool = False
    """SIGTERM arrived while sandboxed calls ran: the scores are incomplete and must not train the policy."""


class RewardRunner:
    """Runs reward functions in process or in the sandbox, with RewardConfig's error policy.

    ``funcs`` holds RewardConfig.funcs entries (registry names, plugin specs) or already loaded ``(name, fn)``
    pairs, which run in this process. Construction checks every name and starts the workers without waiting;
    :meth:`wait_ready` waits for them to import the functions (so that a plugin's import error is reported before
    any model loads). A plugin file that runs in this process (``sandbox=False``) is imported by a throwaway worker
    first, within ``timeout_s``.
    """

    def __init__(self, funcs: Sequence[str | tuple[str, Callable]], *, weights: Sequence[float] | None = None, sandbox: bool = True,
                 num_workers: int = 2, timeout_s: float = 60.0, on_error: str = "value",
                 on_error_value: float = 0.0, params: Sequence[Mapping[str, Any]] | None = None) -> None:
        if on_error not in ("value", "raise"):
            raise ValueError(f"rewards.on_error must be value or raise, got {on_error!r}")
        self.names = [loader.display_name(n) if isinstance(n, str) else n[0] for n in funcs]
        # keyword parameters bound to each function (rewards.kwargs): added to its call's keyword arguments, so a
        # sandboxed function gets them in its worker as well
        self.params = [dict(p or {}) for p in params] if params is not None else [{} for _ in funcs]
        if len(self.params) != len(funcs):
            raise ValueError(f"got {len(self.params)} parameter sets for {len(funcs)} reward functions")
        self.funcs: list[tuple[str, Callable]] = []  # (name, function with its parameters bound), set by from_config
        # dataset columns each function requires (set by from_config; a None there is a no_column failure)
        self.required = [required_columns(n[1]) if not isinstance(n, str) else () for n in funcs]
        self.weights = [1.0] * len(funcs) if weights is None else [float(w) for w in weights]
        if len(self.weights) != len(funcs):
            raise ValueError(f"got {len(self.weights)} reward weights for {len(funcs)} reward functions")
        self.on_error, self.on_error_value, self.timeout_s = on_error, float(on_error_value), timeout_s
        self._logged: set[tuple[int, str]] = set()
        self._local: dict[int, Callable] = {}  # function index -> callable run in this process
        self._remote: dict[int, int] = {}  # function index -> index into the pool's specs
        self._trusted: set[int] = set()  # built-ins that only read their arguments: they need no copy
        specs, local_plugins = [], {}
        for f, name in enumerate(funcs):
            if not isinstance(name, str):
                self._local[f] = name[1]
                continue
            fn = loader.lookup(name)
            if fn in loader.IN_PROCESS:
                self._local[f] = fn
                self._trusted.add(f)
            elif not sandbox and fn is not None:
                self._local[f] = fn
            elif not sandbox:  # a plugin file
                local_plugins[f] = name
            else:
                self._remote[f] = len(specs)
                specs.append(loader.worker_spec(name, fn))
        self.pool = RewardPool(specs, size=min(num_workers, len(specs)), timeout_s=timeout_s) if specs else None
        self._loop: asyncio.AbstractEventLoop | None = None
        if local_plugins:
            try:
                import_in_worker(list(local_plugins.values()), timeout_s=timeout_s)
                for f, name in local_plugins.items():
                    self._local[f] = loader.load_plugin(name)
            except BaseException:
                self.close()
                raise

    @classmethod
    def from_config(cls, cfg: Any, *, max_completion_length: int | None = None) -> "RewardRunner":
        """From a :class:`fastgrpo.config.RewardConfig`. Once the workers have imported the plugin files, this
        process imports them too, and ``rewards.kwargs`` are checked against each function's parameters and bound
        (:func:`fastgrpo.rewards.columns.configure_rewards`); the bound functions are kept in ``funcs`` for the
        dataset-column check."""
        runner = cls(cfg.funcs, weights=cfg.weights, sandbox=cfg.sandbox, num_workers=cfg.num_workers,
                     timeout_s=cfg.timeout_s, on_error=cfg.on_error, on_error_value=cfg.on_error_value)
        try:
            # A plugin file runs in this process only once a worker has imported it within rewards.timeout_s: one
            # that calls os._exit, hangs or raises KeyboardInterrupt at import is then a ValueError naming it.
            runner.wait_ready(timeout_s=cfg.timeout_s)
            bound = configure_rewards(loader.load_reward_funcs(cfg.funcs), cfg.kwargs,
                                      max_completion_length=max_completion_length, specs=cfg.funcs)
        except BaseException:
            runner.close()
            raise
        runner.params = [dict(fn.keywords) if isinstance(fn, functools.partial) else {} for _, fn in bound]
        runner.funcs = bound
        runner.required = [required_columns(fn) for _, fn in bound]
        return runner

    def wait_ready(self, timeout_s: float | None = None) -> None:
        """Wait for the workers to import the sandboxed functions (at most ``timeout_s``, default
        ``sandbox.LOAD_TIMEOUT_S``); ValueError naming the functions when they cannot."""
        if self.pool is not None:
            self.pool.wait_ready(timeout_s)

    def interrupt(self) -> None:
        """Abandon sandboxed calls in flight (SIGTERM); safe in a signal handler."""
        if self.pool is not None:
            self.pool.interrupt()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
        if self._loop is not None:
            self._loop.close()
            self._loop = None

    # -------------------------------------------------------------------------------------------- scoring

    def __call__(self, completions: Sequence[Any], columns: Mapping[str, Sequence[Any]],
                 only: Sequence[int] | None = None) -> RewardScores:
        """Score ``completions`` with every function (or those in ``only``); ``columns`` are the other keyword
        arguments (``prompts``, ``completion_ids``, dataset columns), each with N entries."""
        import torch

        n = len(completions)
        for key, col in columns.items():
            if len(col) != n:
                raise ValueError(f"reward column {key!r} has {len(col)} entries for {n} completions")
        kwargs = {"completions": list(completions), **{k: list(v) for k, v in columns.items()}}
        funcs = list(range(len(self.names))) if only is None else list(only)
        results: dict[int, Any] = {}
        remote = [f for f in funcs if f in self._remote]
        interrupted = False
        if remote:
            assert self.pool is not None
            is_async_spec = self.pool.wait_ready()
            sync = [f for f in remote if not is_async_spec[self._remote[f]]]
            jobs = [[(self._remote[f], {**kwargs, **self.params[f]}, n)] for f in sync]
            async_ = [f for f in remote if is_async_spec[self._remote[f]]]
            if async_:
                jobs.append([(self._remote[f], {**kwargs, **self.params[f]}, n) for f in async_])
            try:
                out = self.pool.run(jobs, while_waiting=lambda: self._run_local(funcs, kwargs, n, results))
                for f, r in zip(sync + async_, [r for job in out for r in job]):
                    results[f] = r
            except Interrupted:
                interrupted = True
        else:
            self._run_local(funcs, kwargs, n, results)

        R_NF = torch.full((n, len(funcs)), math.nan, dtype=torch.float64)  # [N, F]
        errors_F = torch.zeros(len(funcs), dtype=torch.float32)  # [F]
        for j, f in enumerate(funcs):
            if interrupted and f not in results:
                R_NF[:, j] = self.on_error_value
                continue
            values, n_bad = self._settle(f, results[f], n, kwargs)
            R_NF[:, j] = torch.tensor(values, dtype=torch.float64)
            errors_F[j] = n_bad
        all_nan = torch.isnan(R_NF).all(dim=1)  # [N]
        if n and funcs and bool(all_nan.any()):
            warnings.warn(f"every reward function returned None for {int(all_nan.sum())} completion(s); they get "
                          "reward 0", stacklevel=2)
        w_F = torch.tensor([self.weights[f] for f in funcs], dtype=torch.float64)  # [F]
        r_N = (R_NF * w_F).nansum(dim=1)  # [N] float64
        return RewardScores(per_func=R_NF.float(), total=r_N, errors=errors_F, interrupted=interrupted)

    def reward_fn(self, f: int) -> Callable[..., list[float]]:
        """Function ``f`` alone with TRL's signature (for evaluation), with the same sandbox and error policy."""

        def fn(completions: Sequence[Any], **columns: Sequence[Any]) -> list[float]:
            return self(completions, columns, only=[f]).per_func[:, 0].tolist()

        return fn

    def _arguments(self, f: int, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Function ``f``'s keyword arguments in this process: its own copy, unless it is a trusted built-in."""
        own = {**kwargs, **self.params[f]}
        return own if f in self._trusted else own_copy(own)

    def _run_local(self, funcs: list[int], kwargs: dict[str, Any], n: int, results: dict[int, Any]) -> None:
        local = [f for f in funcs if f in self._local]
        for f in local:
            if not is_async(self._local[f]):
                try:
                    results[f] = call(self._local[f], self._arguments(f, kwargs), n, loop=self._event_loop())
                except CallFailure as e:
                    results[f] = e
        async_ = [f for f in local if is_async(self._local[f])]
        if async_:
            calls = [(self._local[f], self._arguments(f, kwargs), n) for f in async_]
            for f, r in zip(async_, self._event_loop().run_until_complete(gather(calls, self.timeout_s))):
                results[f] = r

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        return self._loop

    def _settle(self, f: int, result: Any, n: int, kwargs: dict[str, Any]) -> tuple[list[float], int]:
        """Apply the error policy to one function's result: (N values, number of completions that failed)."""
        failed = {}  # completion -> (kind, message) of its first failure
        for column in self.required[f]:
            for i, v in enumerate(kwargs.get(column, ())):
                if v is None and i not in failed:
                    failed[i] = ("no_column", f"got None in its required column {column!r} for completion {i} "
                                              "(the dataset row has no value there)")
        if isinstance(result, CallFailure):
            for kind, message in list(failed.values())[:1]:  # the likely cause, first
                self._report(f, kind, message, "")
            self._report(f, result.kind, result.message, result.tb)
            return [self.on_error_value] * n, n
        values, bad = result
        for i, kind, message in bad:
            failed.setdefault(i, (kind, message))
        w, limit = self.weights[f], FLOAT32_MAX / (2 * len(self.names))
        for i, v in enumerate(values):
            if i not in failed and abs(v * w) > limit:
                failed[i] = ("too_large", f"returned {v:.4g} for completion {i}, which times its weight {w:g} is "
                                          f"beyond +-{limit:.4g} (float32's range / (2 x {len(self.names)} reward "
                                          "functions)): advantages could overflow")
        for i, (kind, message) in sorted(failed.items()):
            self._report(f, kind, message, "")
            values[i] = self.on_error_value
        return values, len(failed)

    def _report(self, f: int, kind: str, message: str, tb: str) -> None:
        name = self.names[f]
        if self.on_error == "raise":
            if tb:
                log.error("reward %r failed (%s):\n%s", name, kind, tb.rstrip())
            raise RewardError(f"reward {name!r} {message} (rewards.on_error=raise; on_error=value scores such "
                              "completions rewards.on_error_value and counts them)")
        if (f, kind) in self._logged:
            return
        self._logged.add((f, kind))
        detail = f"\n{tb.rstrip()}" if tb else ""
        log.warning("reward %r %s; such completions score rewards.on_error_value=%g. This is the first %s failure "
                    "of %r: later ones are only counted, in reward/%s/errors.%s", name, message,
                    self.on_error_value, kind, name, name, detail)


def combine_rewards(funcs: Sequence[tuple[str, Callable]], weights: Sequence[float] | None,
                    completions: Sequence[Any], columns: Mapping[str, Sequence[Any]]) -> tuple[Any, Any]:
    """Score with already loaded functions, in this process and strictly (any failure raises RewardError):
    ``(R [N, F], r [N])``. A convenience for library use; the trainer holds a :class:`RewardRunner`."""
    runner = RewardRunner(funcs, weights=weights, on_error="raise")
    try:
        scores = runner(completions, columns)
    finally:
        runner.close()
    return scores.per_func, scores.total
