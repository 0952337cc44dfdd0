"""What a reward function needs from the data, and its parameters from the config.

A reward function is called with keyword arguments: ``completions``, ``prompts``, ``completion_ids`` and every
dataset column (TRL's convention). Two things are read from the function itself, before any model loads:

- **Required columns.** A function may declare them as an attribute ``required_columns`` (a tuple of names, or a
  callable ``bound_kwargs -> tuple`` when they depend on its parameters, as ``cosine``'s depend on its accuracy
  reward). Otherwise they are its named parameters without a default (``def f(completions, answer, **kw)``
  needs ``answer``), besides the three the trainer always passes. A column the data lacks is an error naming both.
- **Parameters.** ``rewards.kwargs: {name: {param: value}}`` binds keyword parameters of the function named
  ``name`` (a registry name, a plugin spec, or a plugin's function name). A parameter the function does not
  take is an error naming it. A parameter called ``max_completion_length`` that the config does not set is
  bound to ``rollout.max_completion_length`` (length-shaping rewards default to it, as in ms-swift).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Iterable, Mapping, Sequence

ALWAYS_PASSED = frozenset({"completions", "prompts", "completion_ids"})
"""Keyword arguments every reward call gets, whatever the data."""

_CONTEXT_PARAMS = ("max_completion_length",)


def _parameters(fn: Callable) -> dict[str, inspect.Parameter]:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have no signature: nothing can be read from it
        return {}
    return {n: p for n, p in sig.parameters.items()
            if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)}


def _base(fn: Callable) -> tuple[Callable, dict[str, Any]]:
    """(the unbound function, the keywords bound to it by :func:`bind_reward`)."""
    if isinstance(fn, functools.partial):
        return fn.func, dict(fn.keywords)
    return fn, {}


def required_columns(fn: Callable) -> tuple[str, ...]:
    """Dataset columns ``fn`` needs (see the module docstring)."""
    base, bound = _base(fn)
    declared = getattr(base, "required_columns", None)
    if declared is not None:
        return tuple(declared(bound) if callable(declared) else declared)
    return tuple(n for n, p in _parameters(base).items()
                 if p.default is inspect.Parameter.empty and n not in ALWAYS_PASSED and n not in bound)


def bind_reward(name: str, fn: Callable, params: Mapping[str, Any] | None, *,
                max_completion_length: int | None = None) -> Callable:
    """``fn`` with ``params`` (and the context parameters it takes) bound as keywords; ``fn`` when none apply."""
    params = dict(params or {})
    named = _parameters(fn)
    for key in params:
        if key not in named:
            takes = sorted(n for n, p in named.items() if p.default is not inspect.Parameter.empty)
            raise ValueError(f"rewards.kwargs.{name}.{key}: reward {name!r} has no parameter {key!r} "
                             f"(its parameters: {takes})")
    context = {"max_completion_length": max_completion_length}
    for key in _CONTEXT_PARAMS:
        if key in named and key not in params and context[key] is not None:
            params[key] = context[key]
    return functools.partial(fn, **params) if params else fn


def configure_rewards(funcs: Sequence[tuple[str, Callable]], kwargs: Mapping[str, Mapping[str, Any]], *,
                      max_completion_length: int | None = None,
                      specs: Sequence[str] | None = None) -> list[tuple[str, Callable]]:
    """Bind ``rewards.kwargs`` to the loaded reward functions. ``specs``: RewardConfig.funcs as written (a plugin's
    kwargs may be keyed by its spec or its function name)."""
    specs = list(specs) if specs is not None else [n for n, _ in funcs]
    known = set(specs) | {n for n, _ in funcs}
    for key in kwargs:
        if key not in known:
            raise ValueError(f"rewards.kwargs.{key}: no reward of that name in rewards.funcs {specs}")
    out = []
    for spec, (name, fn) in zip(specs, funcs):
        params = {**(kwargs.get(name) or {}), **(kwargs.get(spec) or {})} if spec != name else kwargs.get(name)
        out.append((name, bind_reward(name, fn, params, max_completion_length=max_completion_length)))
    return out


def check_reward_columns(funcs: Sequence[tuple[str, Callable]], columns: Iterable[str], *, source: str) -> None:
    """Raise ValueError naming the reward and the column when a reward needs a column the data lacks."""
    have = set(columns) | ALWAYS_PASSED
    for name, fn in funcs:
        missing = [c for c in required_columns(fn) if c not in have]
        if missing:
            raise ValueError(f"reward {name!r} needs the dataset column(s) {missing}, which data.source {source!r} "
                             f"lacks (its columns: {sorted(set(columns))})")


__all__ = ["ALWAYS_PASSED", "bind_reward", "check_reward_columns", "configure_rewards", "required_columns"]
