"""Distinct problems from a seeded generator, and train / held-out splits that share none: what every generated data
source (arithmetic, countdown) needs besides its own ``generate_problem`` and ``problem_key``."""

from __future__ import annotations

import random
from typing import Any, Callable, Hashable, Iterable

Row = dict[str, Any]


def distinct_problems(n: int, *, seed: int | str, draw: Callable[[random.Random], Row], key: Callable[[Row], Hashable],
                      exclude: Iterable[Hashable] = (), too_few: Callable[[int], str]) -> list[Row]:
    """``n`` rows of ``draw(rng)`` with distinct ``key``, none of them in ``exclude``; deterministic given ``seed``.

    ``draw`` gets at most ``50 * n + 1000`` tries: a problem space too small for ``n`` ends in ValueError with
    ``too_few(found)``, the source's own advice (which config keys widen it).
    """
    rng, seen, rows = random.Random(seed), set(exclude), []
    for _ in range(50 * n + 1000):
        if len(rows) == n:
            break
        row = draw(rng)
        k = key(row)
        if k not in seen:
            seen.add(k)
            rows.append(row)
    if len(rows) < n:
        raise ValueError(too_few(len(rows)))
    return rows


def held_out_splits(name: str, *, num_train: int, num_eval: int, seed: int,
                    problems: Callable[..., list[Row]], key: Callable[[Row], Hashable]) -> tuple[list[Row], list[Row]]:
    """(train, eval) lists from ``problems(n, seed=, exclude=)`` that share no ``key``.

    The held-out split is drawn first from its own stream (``<name>-eval-<seed>``), so it does not change when
    num_train does; the training split (``<name>-train-<seed>``) leaves out every held-out key.
    """
    eval_rows = problems(num_eval, seed=f"{name}-eval-{seed}")
    train_rows = problems(num_train, seed=f"{name}-train-{seed}", exclude=[key(r) for r in eval_rows])
    return train_rows, eval_rows
