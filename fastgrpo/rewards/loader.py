"""The reward registry, loading users' reward plugins, and combining rewards into one scalar per completion.

Legend: N = B*G completions in the step, F reward functions.

A reward function has TRL's signature ``fn(completions, **kwargs) -> list[float | None]``. It is called with
keyword arguments only, as TRL calls it: ``completions``, ``prompts``, ``completion_ids`` and every dataset
column, each a list with one entry per completion. So a function written for TRL (or an ms-swift ORM class,
which is instantiated with no arguments) works unchanged.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib.util
import math
import sys
import warnings
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

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
    """Decorator: make ``name`` a valid ``rewards.funcs`` entry."""

    def deco(fn: RewardFunc) -> RewardFunc:
        REWARDS[name] = fn
        return fn

    return deco


def _load_plugin(spec: str) -> tuple[str, RewardFunc]:
    """``path/to/file.py:name`` -> (name, callable). rsplit so a Windows drive letter's colon survives."""
    path_str, _, attr = spec.rpartition(":")
    path = Path(path_str).expanduser().resolve()
    if not attr:
        raise ValueError(f"reward {spec!r}: write 'path/to/file.py:function_name'")
    if not path.is_file():
        raise ValueError(f"reward {spec!r}: plugin file {str(path)!r} does not exist")
    # One module per file, keyed by its absolute path, so loading two functions from a file runs it once
    # and two plugin files that are both called rewards.py do not clash.
    mod_name = "fastgrpo_reward_plugin_" + hashlib.sha1(str(path).encode()).hexdigest()[:12]
    module = sys.modules.get(mod_name)
    if module is None:
        loader_spec = importlib.util.spec_from_file_location(mod_name, path)
        if loader_spec is None or loader_spec.loader is None:
            raise ValueError(f"reward {spec!r}: cannot import {str(path)!r} as a Python module")
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[mod_name] = module
        try:
            loader_spec.loader.exec_module(module)
        except Exception as e:
            del sys.modules[mod_name]
            raise ValueError(f"reward {spec!r}: importing {str(path)!r} failed: {e!r}") from e
    if not hasattr(module, attr):
        found = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise ValueError(f"reward {spec!r}: {str(path)!r} defines no {attr!r}; its callables: {found}")
    fn = getattr(module, attr)
    if isinstance(fn, type):  # an ms-swift style ORM class: instantiate, then call the instance
        fn = fn()
    if not callable(fn):
        raise ValueError(f"reward {spec!r}: {attr!r} is not callable")
    return attr, fn


def load_reward_funcs(names: Sequence[str]) -> list[tuple[str, RewardFunc]]:
    """Resolve RewardConfig.funcs: registry names or ``path/to/file.py:function`` plugin specs."""
    funcs = []
    for name in names:
        if name in REWARDS:
            funcs.append((name, REWARDS[name]))
        elif ":" in name and name.rpartition(":")[0].endswith(".py"):
            funcs.append(_load_plugin(name))
        else:
            close = difflib.get_close_matches(name, list(REWARDS), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ValueError(
                f"unknown reward {name!r}: {hint}built-in rewards are {sorted(REWARDS)}; "
                "for your own function write 'path/to/file.py:function_name'"
            )
    return funcs


def _to_float(value: Any, name: str, i: int) -> float:
    if value is None:  # TRL's convention: None means "not applicable to this sample" -> NaN, skipped in the sum
        return math.nan
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"reward {name!r} returned {value!r} for completion {i}; expected a number or None")


def combine_rewards(
    funcs: Sequence[tuple[str, RewardFunc]],
    weights: Sequence[float] | None,
    completions: Sequence[Any],
    columns: Mapping[str, Sequence[Any]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run every reward function and combine: ``r[n] = nansum_f weights[f] * R[n, f]``.

    ``columns`` holds the keyword arguments besides ``completions`` (``prompts``, ``completion_ids``, dataset
    columns), each with N entries. Returns ``(R [N, F] float32, r [N] float32)``. As in TRL, a function may
    return None for a sample it does not apply to: that entry is NaN in R and counts as 0 in r.
    """
    n = len(completions)
    if weights is None:
        weights = [1.0] * len(funcs)
    if len(weights) != len(funcs):
        raise ValueError(f"got {len(weights)} reward weights for {len(funcs)} reward functions")
    for key, col in columns.items():
        if len(col) != n:
            raise ValueError(f"reward column {key!r} has {len(col)} entries for {n} completions")
    R_NF = torch.empty(n, len(funcs), dtype=torch.float32)  # [N, F]
    for f, (name, fn) in enumerate(funcs):
        out = fn(completions=list(completions), **{k: list(v) for k, v in columns.items()})
        if out is None or len(out) != n:
            got = "None" if out is None else f"{len(out)} values"
            raise ValueError(f"reward {name!r} returned {got} for {n} completions")
        R_NF[:, f] = torch.tensor([_to_float(v, name, i) for i, v in enumerate(out)], dtype=torch.float32)
    all_nan = torch.isnan(R_NF).all(dim=1)  # [N]
    if n and len(funcs) and bool(all_nan.any()):
        warnings.warn(
            f"every reward function returned None for {int(all_nan.sum())} completion(s); they get reward 0",
            stacklevel=2,
        )
    w_F = torch.tensor(list(weights), dtype=torch.float32)  # [F]
    r_N = (R_NF * w_F).nansum(dim=1)  # [N]
    return R_NF, r_N
