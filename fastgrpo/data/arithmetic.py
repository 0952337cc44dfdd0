"""Arithmetic problems asked for a bare number: a seeded generator with train/held-out splits.

A problem is a row ``{"a": int, "op": str, "b": int, "answer": str}``: compute ``a op b``. ``answer`` is the exact
result as a decimal string, the reference column the ``gsm8k`` reward reads (the completion's last number, or its
``<answer>`` block, compared as an exact value), so the task needs no reward of its own.

Operands: ``a`` has ``digits[0]`` digits and ``b`` has ``digits[1]``, each drawn uniformly among such numbers (one
digit: 1..9); the operator is drawn uniformly from ``ops`` (keys of :data:`OPERATORS`). Subtraction puts the larger
operand first, so every result is a non-negative integer. ``a + b`` and ``b + a`` (``a * b`` and ``b * a``) are one
problem (:func:`problem_key`), so a held-out problem never reaches training with its operands swapped.

Why this task (configs/smollm2.yaml: two-digit sums): SmolLM2-135M-Instruct, asked "What is 65 + 15? Answer with
just the number.", mostly does not answer: it starts an explanation ("To calculate 84 + 18, you need to add the
numbers themselves and then take") and runs past any length limit, and when it does write a sum it is often wrong
("66 + 52 = 21"). Greedy, it is right on about one two-digit sum in ten. Both failures are ones a policy gradient
can move within minutes on a CPU: after a few GRPO steps it writes "63 + 79 = 142" and stops. Two-digit by one-digit
products (``ops: ["*"]``, ``digits: [2, 1]``) start higher (about 30%) and gain less (benchmarks/RESULTS.md, section
"A real pretrained model").
"""

from __future__ import annotations

import operator
import random
from typing import Any, Callable, Hashable, Iterable

from fastgrpo.data.distinct import distinct_problems, held_out_splits

OPERATORS: dict[str, tuple[Callable[[int, int], int], bool]] = {
    "+": (operator.add, True),
    "-": (operator.sub, False),
    "*": (operator.mul, True),
}
"""Operator symbol -> (function, commutative). ``data.ops`` picks from these keys."""


def problem_key(row: dict[str, Any]) -> Hashable:
    """Canonical identity: the operator and its operands, unordered for a commutative operator."""
    a, b, op = int(row["a"]), int(row["b"]), row["op"]
    return (op, *sorted((a, b))) if OPERATORS[op][1] else (op, a, b)


def _operand(rng: random.Random, digits: int) -> int:
    return rng.randint(1 if digits == 1 else 10 ** (digits - 1), 10 ** digits - 1)


def generate_problem(rng: random.Random, *, ops: list[str], digits: list[int]) -> dict[str, Any]:
    """One problem drawn from ``rng`` (the distribution of the module docstring)."""
    op = rng.choice(ops)
    a, b = _operand(rng, digits[0]), _operand(rng, digits[1])
    if op == "-" and b > a:  # a non-negative result: the sign is not what the task asks to learn
        a, b = b, a
    return {"a": a, "op": op, "b": b, "answer": str(OPERATORS[op][0](a, b))}


def generate_problems(n: int, *, seed: int | str, ops: list[str], digits: list[int],
                      exclude: Iterable[Hashable] = ()) -> list[dict[str, Any]]:
    """``n`` distinct problems (by :func:`problem_key`), none of whose keys is in ``exclude``; deterministic given
    the arguments. ValueError when the operators or digit counts are unknown or hold too few distinct problems."""
    unknown = sorted(set(ops) - set(OPERATORS))
    if not ops or unknown:
        raise ValueError(f"arithmetic: unknown operators {unknown} in data.ops; known: {sorted(OPERATORS)}")
    if len(digits) != 2 or not all(1 <= d <= 9 for d in digits):
        raise ValueError(f"arithmetic: data.digits must be two digit counts in 1..9, got {digits}")
    return distinct_problems(
        n, seed=seed, exclude=exclude, key=problem_key, draw=lambda rng: generate_problem(rng, ops=ops, digits=digits),
        too_few=lambda found: f"arithmetic: found only {found} distinct problems of the {n} asked for with digits "
                              f"{digits} and ops {ops}; use more digits or operators, or ask for fewer "
                              "(data.num_train, data.num_eval)")


def arithmetic_splits(*, num_train: int, num_eval: int, seed: int, ops: list[str],
                      digits: list[int]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train, eval) problem lists that share no :func:`problem_key` (see
    :func:`fastgrpo.data.distinct.held_out_splits`)."""
    return held_out_splits("arithmetic", num_train=num_train, num_eval=num_eval, seed=seed, key=problem_key,
                           problems=lambda n, **kw: generate_problems(n, ops=ops, digits=digits, **kw))
