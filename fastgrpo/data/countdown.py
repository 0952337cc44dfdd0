"""Countdown problems: a seeded generator, an exhaustive solver, and train/held-out splits.

A problem is a row ``{"nums": [int, ...], "target": int}``: reach ``target`` with ``+ - * /`` using every
number exactly once (the rules the ``countdown`` reward checks).

Generation, like the public Countdown-Tasks-3to4 sets: draw min_numbers..max_numbers numbers uniformly from
1..max_value (repeats allowed), then combine them in a random order with random operations, keeping every
intermediate a positive integer (Countdown's rules: no zero, negatives or fractions along the way), until
all are used. The final value is the target; it is kept when it lies in 1..max_target (default 100), else
another expression (and, after a few tries, another draw) is tried. So every target is reachable by
construction; :func:`solve` is the independent check (tests run it on every generated problem). The
solver searches over all rational intermediates, a superset of what the generator uses.
"""

from __future__ import annotations

import itertools
import random
from fractions import Fraction
from typing import Any, Hashable, Iterable, Iterator

from fastgrpo.data.distinct import distinct_problems, held_out_splits

MAX_TARGET = 100
"""Generated targets lie in 1..MAX_TARGET (like Countdown-Tasks-3to4's)."""
_TRIES_PER_DRAW = 8


def problem_key(row: dict[str, Any]) -> Hashable:
    """Canonical identity of a problem: the same numbers in any order with the same target are one problem."""
    return tuple(sorted(int(n) for n in row["nums"])), int(row["target"])


def _random_value(rng: random.Random, nums: list[int]) -> int:
    """Fold ``nums`` with random operations, keeping intermediates positive integers."""
    pool = list(nums)
    while len(pool) > 1:
        a = pool.pop(rng.randrange(len(pool)))
        b = pool.pop(rng.randrange(len(pool)))
        hi, lo = max(a, b), min(a, b)
        options = [hi + lo, hi * lo]
        if hi != lo:
            options.append(hi - lo)
        if hi % lo == 0:
            options.append(hi // lo)
        pool.append(rng.choice(options))
    return pool[0]


def generate_problem(
    rng: random.Random, *, min_numbers: int = 3, max_numbers: int = 4, max_value: int = 99,
    max_target: int = MAX_TARGET,
) -> dict[str, Any]:
    """One solvable problem drawn from ``rng`` (see the module docstring for the distribution)."""
    while True:
        nums = [rng.randint(1, max_value) for _ in range(rng.randint(min_numbers, max_numbers))]
        for _ in range(_TRIES_PER_DRAW):
            target = _random_value(rng, nums)
            if 1 <= target <= max_target:
                return {"nums": nums, "target": target}


def generate_problems(
    n: int, *, seed: int | str, exclude: Iterable[Hashable] = (), min_numbers: int = 3, max_numbers: int = 4,
    max_value: int = 99, max_target: int = MAX_TARGET,
) -> list[dict[str, Any]]:
    """``n`` distinct problems (by :func:`problem_key`), none of whose keys is in ``exclude``.

    Deterministic given ``seed`` and the other arguments. Raises ValueError when the problem space is too
    small to yield ``n`` distinct problems (e.g. max_value=2).
    """
    def draw(rng: random.Random) -> dict[str, Any]:
        return generate_problem(rng, min_numbers=min_numbers, max_numbers=max_numbers, max_value=max_value,
                                max_target=max_target)

    return distinct_problems(
        n, seed=seed, exclude=exclude, key=problem_key, draw=draw,
        too_few=lambda found: f"countdown: found only {found} distinct problems of the {n} asked for; widen "
                              "data.max_value or the data.min_numbers..data.max_numbers range, or ask for fewer")


def countdown_splits(
    *, num_train: int, num_eval: int, seed: int, min_numbers: int = 3, max_numbers: int = 4, max_value: int = 99,
    max_target: int = MAX_TARGET,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train, eval) problem lists that share no :func:`problem_key` (see
    :func:`fastgrpo.data.distinct.held_out_splits`)."""
    kw = dict(min_numbers=min_numbers, max_numbers=max_numbers, max_value=max_value, max_target=max_target)
    return held_out_splits("countdown", num_train=num_train, num_eval=num_eval, seed=seed, key=problem_key,
                           problems=lambda n, **seeds: generate_problems(n, **seeds, **kw))


def solve(nums: Iterable[int], target: int) -> str | None:
    """An expression using each of ``nums`` once that equals ``target`` exactly, or None if none exists.

    Exhaustive search: repeatedly replace two values by their sum, product, either difference or either
    quotient (rational arithmetic). A multiset of values already proven unable to reach the target is
    remembered, which keeps 4 numbers to a few milliseconds and makes 5-6 feasible.
    """
    goal = Fraction(target)
    dead: set[tuple[Fraction, ...]] = set()

    def search(items: list[tuple[Fraction, str]]) -> str | None:
        if len(items) == 1:
            return items[0][1] if items[0][0] == goal else None
        key = tuple(sorted(v for v, _ in items))
        if key in dead:
            return None
        for i in range(len(items)):
            for j in range(i + 1, len(items)):
                (a, ea), (b, eb) = items[i], items[j]
                rest = items[:i] + items[i + 1:j] + items[j + 1:]
                steps = [(a + b, f"({ea} + {eb})"), (a * b, f"({ea} * {eb})"),
                         (a - b, f"({ea} - {eb})"), (b - a, f"({eb} - {ea})")]
                if b:
                    steps.append((a / b, f"({ea} / {eb})"))
                if a:
                    steps.append((b / a, f"({eb} / {ea})"))
                for step in steps:
                    found = search(rest + [step])
                    if found is not None:
                        return found
        dead.add(key)
        return None

    expr = search([(Fraction(int(n)), str(int(n))) for n in nums])
    if expr is not None and expr.startswith("(") and expr.endswith(")"):
        expr = expr[1:-1]  # the outermost pair always wraps the whole expression (one binary op)
    return expr


def iter_expressions(nums: Iterable[int]) -> Iterator[tuple[list[str], str, int]]:
    """Every way to combine all of ``nums`` under Countdown's rules, as (steps, expression, value), in a fixed order.

    Rules as the generator's: combine two values at a time with ``+ - * /`` keeping every intermediate a positive
    integer. ``steps`` are the intermediate results in the order they are made (``"8*4=32"``); ``expression`` is
    the same computation in one line without spaces (``"(3+5)*4"``), which the ``countdown`` reward parses. The
    order is deterministic (pairs in index order, then + * - /).
    """

    def search(items: list[tuple[int, str]], steps: list[str]) -> Iterator[tuple[list[str], str, int]]:
        if len(items) == 1:
            value, expr = items[0]
            yield list(steps), expr[1:-1] if expr.startswith("(") and expr.endswith(")") else expr, value
            return
        for i, j in itertools.permutations(range(len(items)), 2):
            (a, ea), (b, eb) = items[i], items[j]
            rest = [items[k] for k in range(len(items)) if k != i and k != j]
            ops = [("+", a + b), ("*", a * b)] if i < j else []  # commutative: one order only
            if a > b:
                ops.append(("-", a - b))
            if b > 1 and a % b == 0:
                ops.append(("/", a // b))
            for op, value in ops:
                yield from search(rest + [(value, f"({ea}{op}{eb})")], steps + [f"{a}{op}{b}={value}"])

    yield from search([(int(n), str(int(n))) for n in nums], [])


def iter_solutions(nums: Iterable[int], target: int) -> Iterator[tuple[list[str], str]]:
    """The expressions of :func:`iter_expressions` that equal ``target``, as (steps, expression)."""
    for steps, expr, value in iter_expressions(nums):
        if value == target:
            yield steps, expr


def closest_miss(nums: Iterable[int], target: int, rng: random.Random) -> tuple[list[str], str] | None:
    """An expression of :func:`iter_expressions` whose value is as close to ``target`` as any that misses it
    (ties broken by ``rng``), as (steps, expression); None when every expression hits the target."""
    misses = [(abs(value - target), steps, expr) for steps, expr, value in iter_expressions(nums) if value != target]
    if not misses:
        return None
    best = min(d for d, _, _ in misses)
    _, steps, expr = rng.choice([m for m in misses if m[0] == best])
    return steps, expr
