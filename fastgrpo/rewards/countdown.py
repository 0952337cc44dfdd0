"""The ``countdown`` reward: does the last ``<answer>`` hold an equation that reaches the target?

Rules (the seeds' Countdown task): the answer is an arithmetic expression over integer literals with
``+ - * /`` and parentheses; it uses each given number exactly once (as a multiset: ``[5, 5, 3]`` needs both
fives); its exact value (rational arithmetic, so ``7 / 2 * 2`` is 7) equals the target. An optional
``= N`` suffix is allowed, and N must then equal the target. Unary signs, powers, decimals, names and calls
are rejected.

The text comes from the policy, so this never calls ``eval`` and never raises on any completion: it
gates the answer cheaply *before* ``ast.parse`` (ASCII only, an allowed-character set, at most
:data:`MAX_ANSWER_CHARS` characters, at most :data:`MAX_DEPTH` nested parentheses, literals of at most
:data:`MAX_LITERAL_DIGITS` digits) so the parser cannot recurse deeply or build huge integers, and it bounds
the size of every intermediate fraction. Any 64 KB completion is scored in well under 10 ms.
"""

from __future__ import annotations

import ast
import operator
from collections import Counter
from fractions import Fraction
from typing import Any, Iterable

from fastgrpo.rewards.format import as_text, last_answer

MAX_ANSWER_CHARS = 256
"""Longer answers are rejected unparsed: a Countdown equation over <= 6 numbers is far shorter."""
MAX_DEPTH = 32
"""Most nested parentheses accepted; bounds the parser's recursion."""
MAX_LITERAL_DIGITS = 9
MAX_CLAIM_DIGITS = 64  # the "= N" suffix: a target can exceed any literal; still far below int()'s 4300 limit
"""Longest integer literal accepted; keeps int parsing and fraction arithmetic small."""
MAX_VALUE_BITS = 4096
"""An intermediate numerator or denominator wider than this rejects the answer (cannot happen with at most
MAX_ANSWER_CHARS characters of small literals, but the bound makes the cost independent of the input)."""

_ALLOWED_CHARS = frozenset("0123456789+-*/() \t\n\r=")
_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


class _Reject(Exception):
    """The answer breaks a rule; scored 0."""


def _gate(expr: str, max_digits: int = MAX_LITERAL_DIGITS) -> None:
    """Cheap linear checks that make ``ast.parse`` (and ``int()``) safe to call."""
    if len(expr) > MAX_ANSWER_CHARS or not expr.isascii() or not _ALLOWED_CHARS.issuperset(expr):
        raise _Reject
    depth = run = 0
    for ch in expr:
        if ch == "(":
            depth += 1
            if depth > MAX_DEPTH:
                raise _Reject
        elif ch == ")":
            depth -= 1
        # A digit run longer than MAX_LITERAL_DIGITS would be a literal too wide to be a given number.
        run = run + 1 if ch.isdigit() else 0
        if run > max_digits:
            raise _Reject


def _literals(node: ast.AST, out: list[int]) -> None:
    """Collect int literals, rejecting any node outside ``int | (expr op expr)``."""
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        _literals(node.left, out)
        _literals(node.right, out)
    elif isinstance(node, ast.Constant) and type(node.value) is int:
        out.append(node.value)
    else:
        raise _Reject


def _evaluate(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant):
        return Fraction(node.value)
    left, right = _evaluate(node.left), _evaluate(node.right)
    if isinstance(node.op, ast.Div) and right == 0:
        raise _Reject
    value = _BINOPS[type(node.op)](left, right)
    if value.numerator.bit_length() > MAX_VALUE_BITS or value.denominator.bit_length() > MAX_VALUE_BITS:
        raise _Reject
    return value


def _split_claim(answer: str) -> tuple[str, int | None]:
    """``"expr = 24"`` -> ``("expr", 24)``; ``"expr"`` -> ``("expr", None)``."""
    if answer.count("=") > 1:
        raise _Reject
    if "=" not in answer:
        return answer, None
    expr, claim = answer.split("=")
    claim = claim.strip()
    digits = claim[1:] if claim.startswith("-") else claim
    if not digits.isdigit():  # ASCII-only was checked by _gate, so isdigit means 0-9
        raise _Reject
    return expr, int(claim)


def score_equation(answer: str, nums: Iterable[Any], target: Any) -> float:
    """1.0 if ``answer`` (the text inside ``<answer>``) is a valid equation reaching ``target``, else 0.0.

    ``nums`` is read only once the answer has passed the cheap checks, so a long ``nums`` column costs
    nothing on the (common) malformed answers. Ill-typed ``nums``/``target`` values raise ``ValueError``.
    """
    target = _as_int(target, "target")
    try:
        _gate(answer, MAX_CLAIM_DIGITS)  # the "= N" claim may be wider than any given number...
        expr, claim = _split_claim(answer)
        _gate(expr)  # ...but no literal of the expression may be
        if claim is not None and claim != target:
            return 0.0
        tree = ast.parse(expr.strip(), mode="eval").body
        used: list[int] = []
        _literals(tree, used)
    except (_Reject, SyntaxError, ValueError, RecursionError, MemoryError, OverflowError):
        return 0.0
    if Counter(used) != Counter(_as_int(n, "nums") for n in nums):
        return 0.0
    try:
        return 1.0 if _evaluate(tree) == target else 0.0
    except (_Reject, RecursionError, MemoryError, OverflowError):
        return 0.0


def _as_int(value: Any, column: str) -> int:
    """An int column value (numpy ints and integral floats included); bools and anything else raise."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise ValueError(f"countdown reward: column {column!r} must hold integers, got {value!r}")
    return operator.index(value)


def countdown_reward(
    completions: list[Any], nums: list[Iterable[int]] | None = None, target: list[int] | None = None, **_: Any
) -> list[float]:
    """TRL-style reward: 1.0 when the last ``<answer>`` block solves the row's Countdown problem, else 0.0.

    Needs the dataset columns ``nums`` (list of ints per row) and ``target`` (int per row). Missing or
    ill-typed columns are a data bug and raise ``ValueError``; completions never make it raise.
    """
    if nums is None or target is None:
        missing = [name for name, col in (("nums", nums), ("target", target)) if col is None]
        raise ValueError(f"countdown reward needs the dataset column(s) {missing}; got a dataset without them")
    scores = []
    for completion, row_nums, row_target in zip(completions, nums, target, strict=True):
        answer = last_answer(as_text(completion))
        scores.append(0.0 if answer is None else score_equation(answer, row_nums, row_target))
    return scores


countdown_reward.required_columns = ("nums", "target")
