"""Calling one reward function and checking what it returns; the same code in the trainer and in reward workers.

A reward function returns one number (or None: "not applicable", TRL's convention) per completion. Anything
else is a *failure* of a named kind, which the caller scores ``rewards.on_error_value`` (or raises on):

==============  =================================================================================
``exception``   the call raised (SystemExit included: a reward function never ends the run)
``bad_output``  not a list of N values: a float, None, a generator, a dict, the wrong length
``non_number``  one value is not a number (a string, a list, ...)
``non_finite``  one value is NaN or +-inf, or too large for float32
``timeout``     (sandbox) the call ran past ``rewards.timeout_s``; its worker was killed
``crash``       (sandbox) the worker process died during the call
``too_large``   one value, times the function's weight, could make the advantages overflow (see
                :mod:`fastgrpo.rewards.scoring`)
``no_column``   the completion's dataset row has no value (None) in a column the function requires
==============  =================================================================================

The first four kinds are found here; ``timeout`` and ``crash`` by the worker sandbox (:mod:`fastgrpo.runtime.sandbox`),
the last two by :mod:`fastgrpo.rewards.scoring`.

Every call gets its own arguments (:func:`own_copy`): a function that changes its ``completions`` or a column in
place changes neither what the next function scores nor the trainer's data.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import math
import numbers
import traceback
from typing import Any, Callable

from fastgrpo.runtime.sandbox import CallFailure  # a whole call failed: its kind (above), message, traceback

FLOAT32_MAX = 3.4028234663852886e38

KINDS = ("exception", "bad_output", "non_number", "non_finite", "timeout", "crash", "too_large", "no_column")

_IMMUTABLE = frozenset({str, bytes, int, float, complex, bool, type(None)})


def own_copy(kwargs: dict[str, Any]) -> dict[str, Any]:
    """A call's keyword arguments sharing nothing mutable with ``kwargs``: new lists, and a copy of every value
    that is not an immutable atom (a token id list, a ``nums`` list, chat messages).

    Several times cheaper than ``copy.deepcopy`` on a step's columns (a list of atoms is checked and copied by C
    calls): a few ms per 100k token ids.
    """
    return {k: _fresh(v) for k, v in kwargs.items()}


def _fresh(value: Any) -> Any:
    kind = type(value)
    if kind in _IMMUTABLE:
        return value
    if kind is list or kind is tuple:
        if _IMMUTABLE.issuperset(map(type, value)):
            return list(value) if kind is list else value
        items = [_fresh(v) for v in value]
        return items if kind is list else tuple(items)
    return copy.deepcopy(value)


Bad = tuple[int, str, str]
"""One failed value: (completion index, kind, message)."""


def is_async(fn: Callable) -> bool:
    """An ``async def`` function, or an object whose ``__call__`` is one (an ms-swift style class instance)."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


def _describe(out: Any) -> str:
    text = repr(out)
    return f"{type(out).__name__} {text[:60] + '...' if len(text) > 60 else text}"


def to_values(out: Any, n: int) -> tuple[list[float], list[Bad]]:
    """A reward function's output -> (N floats, the failed entries). None is NaN ("not applicable").

    Raises CallFailure('bad_output') when ``out`` is not a sequence of N values. A failed entry is NaN in the
    returned list and listed in the second element; the caller replaces it.
    """
    if hasattr(out, "tolist") and not isinstance(out, (str, bytes)):  # numpy arrays, torch tensors
        out = out.tolist()
    if inspect.isgenerator(out) or inspect.isasyncgen(out):
        raise CallFailure("bad_output", "returned a generator; return a list with one number per completion")
    if not isinstance(out, (list, tuple)):
        raise CallFailure("bad_output", f"returned {_describe(out)}; expected a list with one number (or None) "
                                        f"per completion ({n})")
    if len(out) != n:
        raise CallFailure("bad_output", f"returned {len(out)} values for {n} completions")
    values, bad = [], []
    for i, v in enumerate(out):
        if v is None:
            values.append(math.nan)
            continue
        if isinstance(v, (str, bytes)) or not (isinstance(v, numbers.Real) or hasattr(v, "__float__")):
            bad.append((i, "non_number", f"returned {_describe(v)} for completion {i}; expected a number or None"))
            values.append(math.nan)
            continue
        try:
            f = float(v)
        except (TypeError, ValueError, OverflowError) as e:  # an int beyond float range, a multi-element array
            bad.append((i, "non_number" if not isinstance(e, OverflowError) else "non_finite",
                        f"returned {_describe(v)} for completion {i}: {e}"))
            values.append(math.nan)
            continue
        if not math.isfinite(f) or abs(f) > FLOAT32_MAX:
            bad.append((i, "non_finite", f"returned {f!r} for completion {i}; rewards must be finite"))
            values.append(math.nan)
            continue
        values.append(f)
    return values, bad


def call(fn: Callable, kwargs: dict[str, Any], n: int, *,
         catch: tuple[type[BaseException], ...] = (Exception, SystemExit),
         loop: asyncio.AbstractEventLoop | None = None) -> tuple[list[float], list[Bad]]:
    """Call ``fn(**kwargs)`` (awaiting it on ``loop`` if it is async) and check its output; see :func:`to_values`.

    ``catch`` is what counts as the function failing: the trainer process lets KeyboardInterrupt through (a
    SystemExit is caught: a reward function never ends the run), a worker (which ignores SIGINT) catches
    everything.
    """
    try:
        out = fn(**kwargs)
        if inspect.isawaitable(out):
            if loop is None:
                out = asyncio.run(_await(out))
            else:
                out = loop.run_until_complete(_await(out))
    except catch as e:
        raise CallFailure("exception", f"raised {type(e).__name__}: {e}", traceback.format_exc()) from None
    return to_values(out, n)


async def _await(awaitable: Any) -> Any:
    return await awaitable


async def gather(calls: list[tuple[Callable, dict[str, Any], int]], timeout_s: float | None,
                 catch: tuple[type[BaseException], ...] = (Exception, SystemExit)) -> list[Any]:
    """Await several async reward calls concurrently, each bounded by ``timeout_s``.

    Returns one entry per call: ``(values, bad)`` or a CallFailure. A coroutine that blocks the event loop is not
    stopped by this bound; the sandbox's hard deadline (killing the worker) is.
    """

    async def one(fn: Callable, kwargs: dict[str, Any], n: int) -> Any:
        try:
            out = await asyncio.wait_for(_await(fn(**kwargs)), timeout_s)
        except asyncio.TimeoutError:
            return CallFailure("timeout", f"did not finish within rewards.timeout_s={timeout_s:g} s")
        except catch as e:
            return CallFailure("exception", f"raised {type(e).__name__}: {e}", traceback.format_exc())
        try:
            return to_values(out, n)
        except CallFailure as f:
            return f

    return list(await asyncio.gather(*(one(*c) for c in calls)))
