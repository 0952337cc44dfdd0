"""The reward registry and loading of users' reward plugins.

A reward function has TRL's signature ``fn(completions, **kwargs) -> list[float | None]``. It is called with
keyword arguments only, as TRL calls it: ``completions``, ``prompts``, ``completion_ids`` and every dataset
column, each a list with one entry per completion. So a function written for TRL (or an ms-swift ORM class,
which is instantiated with no arguments) works unchanged. :mod:`fastgrpo.rewards.scoring` calls them and combines
their scores; :mod:`fastgrpo.rewards.sandbox` runs the ones without a proven time bound in worker processes.

This module imports no torch: reward workers import it.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Callable, Sequence

from fastgrpo.runtime import plugins
from fastgrpo.runtime.plugins import is_plugin_spec
from fastgrpo.rewards.countdown import countdown_reward
from fastgrpo.rewards.format import format_reward
from fastgrpo.rewards.math_answer import gsm8k_reward, math_verify_reward
from fastgrpo.rewards.toy import toy_digit_reward

RewardFunc = Callable[..., Sequence[Any]]

REWARDS: dict[str, RewardFunc] = {
    "countdown": countdown_reward,
    "format": format_reward,
    "gsm8k": gsm8k_reward,
    "math": math_verify_reward,
    "toy_digit": toy_digit_reward,
}
"""Rewards by name (the choices of RewardConfig.funcs besides plugin files): the built-ins and registered ones."""


def register_reward(name: str) -> Callable[[RewardFunc], RewardFunc]:
    """Decorator: make ``name`` a valid ``rewards.funcs`` entry. It runs in the reward sandbox's workers, which
    import it by module and name (:func:`worker_spec`): register module-level functions."""

    def deco(fn: RewardFunc) -> RewardFunc:
        REWARDS[name] = fn
        return fn

    return deco


IN_PROCESS: frozenset[Callable] = frozenset({countdown_reward, format_reward, gsm8k_reward, toy_digit_reward})
"""Built-ins scored in the trainer process: pure Python with a tested time bound (< 10 ms on any 64 KB
completion, tests/test_rewards.py and tests/test_math_reward.py), so a worker would only add latency. Every other
reward function (plugin files, ``math`` with math-verify, anything registered at run time) runs in the sandbox."""


def check_plugin_spec(spec: str) -> tuple[Path, str]:
    """(absolute file, function name) of a reward plugin spec, checked without importing it."""
    return plugins.plugin_path(spec, what=f"reward {spec!r}")


def load_plugin(spec: str, catch: tuple[type[BaseException], ...] = plugins.PLUGIN_FAILURES) -> RewardFunc:
    """The reward function ``path/to/file.py:name`` names, imported in this process."""
    return _instantiate(spec, plugins.load_plugin(spec, what=f"reward {spec!r}", catch=catch), catch)


def _instantiate(spec: str, fn: Any, catch: tuple[type[BaseException], ...]) -> RewardFunc:
    if isinstance(fn, type):  # an ms-swift style ORM class: instantiate, then call the instance
        try:
            fn = fn()
        except catch as e:
            raise ValueError(f"reward {spec!r}: creating an instance of {fn.__name__} failed: {e!r}") from None
    if not callable(fn):
        raise ValueError(f"reward {spec!r}: {spec.rpartition(':')[2]!r} is not callable")
    return fn


def lookup(name: str) -> RewardFunc | None:
    """A registry name -> its function; a plugin spec -> None after checking that its file exists (not imported
    here: a sandboxed plugin is imported only in worker processes); anything else -> ValueError naming the
    closest registry name."""
    if name in REWARDS:
        return REWARDS[name]
    if is_plugin_spec(name):
        check_plugin_spec(name)
        return None
    close = difflib.get_close_matches(name, list(REWARDS), n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise ValueError(
        f"unknown reward {name!r}: {hint}built-in rewards are {sorted(REWARDS)}; "
        "for your own function write 'path/to/file.py:function_name'"
    )


def display_name(name: str) -> str:
    """The name of a reward in metrics and logs: the registry name, or a plugin's function name."""
    return name.rpartition(":")[2] if is_plugin_spec(name) else name


def load_reward_funcs(names: Sequence[str]) -> list[tuple[str, RewardFunc]]:
    """Resolve RewardConfig.funcs in this process: registry names or ``path/to/file.py:function`` plugin specs
    (imported here, named by their function's name)."""
    funcs = []
    for name in names:
        fn = lookup(name)
        funcs.append((name, fn) if fn is not None else (display_name(name), load_plugin(name)))
    return funcs


def worker_spec(name: str, fn: RewardFunc) -> str:
    """How a reward worker finds ``fn``: the plugin spec itself, or ``module:qualname`` of a registered function.

    A function that is not importable by that name (a lambda, a closure, a ``__main__`` function) cannot run in a
    worker: ValueError naming it, and the way out (``rewards.sandbox=false``).
    """
    if is_plugin_spec(name):
        return name
    spec = plugins.importable_name(fn)
    if spec is None:
        raise ValueError(f"reward {name!r} ({fn!r}) cannot be imported by a reward worker process; define it in a "
                         "module or a plugin file ('path/to/file.py:function'), or set rewards.sandbox=false")
    return spec


def resolve_spec(spec: str, *, catch: tuple[type[BaseException], ...] = plugins.PLUGIN_FAILURES) -> RewardFunc:
    """The callable a :func:`worker_spec` names (in a worker process)."""
    return _instantiate(spec, plugins.resolve(spec, what=f"reward {spec!r}", catch=catch), catch)
