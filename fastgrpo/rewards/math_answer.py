"""Final-answer rewards for GSM8K / MATH style tasks: ``gsm8k`` (exact numbers) and ``math`` (symbolic).

Both read the completion's final answer the same way, in this order of precedence:

1. the content of the last ``<answer>...</answer>`` block (a ``\\boxed{...}`` inside it is unwrapped);
2. else the content of the last ``\\boxed{...}``;
3. else the last number in the text.

A completion that declares an answer (an ``<answer>`` block or a ``\\boxed{``) is held to it: a malformed or
non-numeric declared answer scores 0 rather than falling through to a stray number elsewhere in the text.

The reference is the dataset's ``answer`` column: GSM8K references end in ``#### <number>`` and only what
follows the last ``####`` counts; a reference without ``####`` is used whole (MATH-style short answers).

Numbers are compared exactly as :class:`fractions.Fraction` after normalisation (``$``, ``\\$``, commas,
whitespace and a trailing ``.`` dropped), so ``18``, ``18.0``, ``$18.00``, ``36/2`` and ``\\frac{36}{2}`` are
all 18. Exponents, units and words are not numbers here.

The text comes from the policy, so nothing here uses a regular expression or ``Fraction(str)`` (whose regex
accepts non-ASCII digits and ``1e999999999``): extraction is ``rfind`` plus loops bounded by
:data:`MAX_ANSWER_CHARS`, and a number is ASCII digits only, at most :data:`MAX_DIGITS` of them, so the
int-str conversion limit is never reached. Any 64 KB completion is scored in well under 10 ms and no
completion makes these functions raise.
"""

from __future__ import annotations

import logging
import threading
from fractions import Fraction
from typing import Any, Callable

from fastgrpo.rewards.format import as_text, last_answer

log = logging.getLogger(__name__)

MAX_ANSWER_CHARS = 256
"""Longest final answer considered (after extraction, before normalisation); longer ones score 0."""
MAX_DIGITS = 64
"""Most digits in one number (integer and decimal parts together); more is rejected unparsed."""
MATH_VERIFY_TIMEOUT_S = 2
"""Per-call time bound handed to math-verify's parse/verify (SIGALRM based, so main thread only)."""

_BOXED = "\\boxed{"
_FRAC_COMMANDS = ("\\frac{", "\\dfrac{", "\\tfrac{")
_DIGITS = "0123456789"
# Dropped before parsing: currency signs and thousands separators (order matters: "\$" before "$").
_DROP = ("\\$", "$", ",", "\\!", "\\,", "\\ ")


# ---------------------------------------------------------------------------------------------------------
# extraction


def boxed_content(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (braces matched), or None when absent, unclosed or too long."""
    start = text.rfind(_BOXED)
    if start < 0:
        return None
    start += len(_BOXED)
    depth = 1
    # Scan at most MAX_ANSWER_CHARS + 1 characters: 10,000 nested braces cost the same as a short answer.
    for i in range(start, min(len(text), start + MAX_ANSWER_CHARS + 1)):
        ch = text[i]
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
    return None


def last_number(text: str) -> str | None:
    """The last number written in ``text`` (``-1,234.5``), or None when there is none or it is too long.

    A comma is part of the number only as a thousands separator (three digits after it), so the last number
    of ``"1, 2, 3"`` is ``3``. A ``-`` counts as a sign only when not preceded by a word character or digit,
    so ``"7-5"`` ends in ``5``.
    """
    end = max(text.rfind(d) for d in _DIGITS)  # ten C-speed scans instead of a Python loop over 64 KB
    if end < 0:
        return None
    i, group = end, 0  # group: digits seen since the last separator
    stop = max(-1, end - MAX_ANSWER_CHARS)
    while i > stop:
        ch = text[i]
        if "0" <= ch <= "9":
            group += 1
        elif ch == "." and group > 0 and i > 0 and "0" <= text[i - 1] <= "9":
            group = 0
        elif ch == "," and group == 3 and i > 0 and "0" <= text[i - 1] <= "9":
            group = 0
        else:
            break
        i -= 1
    else:
        if i >= 0:  # ran into the bound while still inside the number
            return None
    start = i + 1
    if i >= 0 and text[i] == "-" and (i == 0 or not text[i - 1].isalnum()):
        start = i
    return text[start:end + 1]


def final_answer(completion: Any) -> str | None:
    """The completion's final answer text by the precedence in the module docstring, or None."""
    text = as_text(completion)
    answer = last_answer(text)
    if answer is not None:
        inner = boxed_content(answer)
        return inner if inner is not None else answer
    if _BOXED in text:
        return boxed_content(text)
    return last_number(text)


def reference_answer(reference: Any) -> str:
    """What follows the last ``####`` of a reference, or the whole reference. Non-strings are a data bug."""
    if isinstance(reference, (int, float)) and not isinstance(reference, bool):
        return str(reference)  # a numeric column read from json/parquet
    if not isinstance(reference, str):
        raise ValueError(f"math reward: column 'answer' must hold strings, got {reference!r}")
    cut = reference.rfind("####")
    return reference[cut + 4:] if cut >= 0 else reference


# ---------------------------------------------------------------------------------------------------------
# normalisation and exact comparison


def normalize_answer(answer: str) -> str | None:
    """Answer text with currency signs, separators, whitespace and a trailing ``.`` removed; None if too long."""
    if len(answer) > MAX_ANSWER_CHARS:
        return None
    s = answer
    for token in _DROP:
        s = s.replace(token, "")
    s = "".join(s.split())
    return s.rstrip(".")


def _decimal(s: str) -> Fraction | None:
    """``12``, ``12.5``, ``.5`` (ASCII digits, no sign, no exponent) -> exact Fraction."""
    whole, dot, frac = s.partition(".")
    digits = whole + frac
    if not digits or len(digits) > MAX_DIGITS or not (digits.isascii() and digits.isdigit()):
        return None
    if dot and not frac:
        return None
    return Fraction(int(digits), 10 ** len(frac))


def _ratio(num: str, den: str) -> Fraction | None:
    a, b = _decimal(num), _decimal(den)
    if a is None or b is None or b == 0:
        return None
    return a / b


def _latex_frac(s: str) -> Fraction | None:
    """``\\frac{a}{b}`` with plain decimal a and b (``\\dfrac``/``\\tfrac`` too)."""
    for command in _FRAC_COMMANDS:
        if s.startswith(command):
            num, sep, rest = s[len(command):].partition("}{")
            if sep and rest.endswith("}"):
                return _ratio(num, rest[:-1])
    return None


def parse_number(answer: str) -> Fraction | None:
    """Exact value of a normalised numeric answer (integer, decimal, ``a/b`` or ``\\frac{a}{b}``), else None."""
    s = normalize_answer(answer)
    if not s:
        return None
    sign = 1
    if s[0] in "+-":
        sign, s = (-1 if s[0] == "-" else 1), s[1:]
    if s.startswith("\\"):
        value = _latex_frac(s)
    elif "/" in s:
        num, _, den = s.partition("/")
        value = _ratio(num, den)
    else:
        value = _decimal(s)
    return None if value is None else sign * value


def exact_match(prediction: str | None, reference: str) -> bool:
    """Equal as exact numbers; if the reference is not a number, equal as normalised strings."""
    if prediction is None:
        return False
    ref_value = parse_number(reference)
    if ref_value is not None:
        pred_value = parse_number(prediction)
        return pred_value is not None and pred_value == ref_value
    ref_text, pred_text = normalize_answer(reference), normalize_answer(prediction)
    return bool(ref_text) and ref_text == pred_text


# ---------------------------------------------------------------------------------------------------------
# rewards


def _score(
    completions: list[Any], answer: list[Any] | None, reward: str, match: Callable[[str | None, str], bool]
) -> list[float]:
    if answer is None:
        raise ValueError(f"{reward} reward needs the dataset column 'answer'; got a dataset without it")
    refs = [reference_answer(a) for a in answer]  # data bugs raise here, before any completion is read
    scores = []
    for completion, ref in zip(completions, refs, strict=True):
        try:
            scores.append(1.0 if match(final_answer(completion), ref) else 0.0)
        except Exception:  # the contract: no completion makes a reward raise; a checker bug scores 0
            log.debug("%s reward: scoring a completion raised", reward, exc_info=True)
            scores.append(0.0)
    return scores


def gsm8k_reward(completions: list[Any], answer: list[Any] | None = None, **_: Any) -> list[float]:
    """TRL-style reward: 1.0 when the completion's final answer equals the reference number, else 0.0.

    Needs the dataset column ``answer`` (GSM8K's ``"... #### 18"`` or a bare ``"18"``).
    """
    return _score(completions, answer, "gsm8k", exact_match)


_math_verify: Any = None  # the math_verify module, False once found missing, None before the first look
_warn_lock = threading.Lock()


def _load_math_verify() -> Any:
    """The math_verify module, or False (warning once) when the optional extra is not installed."""
    global _math_verify
    if _math_verify is None:
        with _warn_lock:
            if _math_verify is None:
                try:
                    import math_verify
                except ImportError:
                    log.warning(
                        "math reward: math-verify is not installed, so answers are compared as exact numbers "
                        "only; pip install 'fastgrpo[math]' enables symbolic checking"
                    )
                    math_verify = False
                _math_verify = math_verify
    return _math_verify


def symbolic_match(prediction: str | None, reference: str) -> bool:
    """Exact numbers first (fast, no sympy); then math-verify's symbolic equivalence when installed."""
    if exact_match(prediction, reference):
        return True
    mv = _load_math_verify()
    if not mv or prediction is None or len(prediction) > MAX_ANSWER_CHARS or len(reference) > MAX_ANSWER_CHARS:
        return False
    # math-verify's timeouts use SIGALRM, which only the main thread may set; elsewhere run unbounded
    # (inputs are already capped at MAX_ANSWER_CHARS).
    timeout = MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None

    def parse(s: str) -> Any:
        # Bare answers ("\frac{1}{2}", "x^2") are only read as LaTeX inside math delimiters.
        return mv.parse(f"${s}$", parsing_timeout=timeout) or mv.parse(s, parsing_timeout=timeout)

    gold, pred = parse(reference), parse(prediction)
    return bool(gold and pred and mv.verify(gold, pred, timeout_seconds=timeout))


def math_verify_reward(completions: list[Any], answer: list[Any] | None = None, **_: Any) -> list[float]:
    """TRL-style reward: 1.0 when the final answer is equivalent to the reference, else 0.0.

    With the ``fastgrpo[math]`` extra (math-verify) equivalence is symbolic (``\\frac{1}{2}`` = ``0.5``,
    ``x^2+2x`` = ``x(x+2)``); without it, the same exact-number comparison as ``gsm8k``, after one warning.
    """
    return _score(completions, answer, "math", symbolic_match)


def answer_key(completion: Any) -> Any:
    """What majority voting (maj@n) compares: the exact value of a numeric final answer, else its normalised text;
    None when the completion states no answer."""
    answer = final_answer(completion)
    if answer is None:
        return None
    value = parse_number(answer)
    return value if value is not None else (normalize_answer(answer) or None)


gsm8k_reward.required_columns = math_verify_reward.required_columns = ("answer",)
gsm8k_reward.answer_key = math_verify_reward.answer_key = answer_key
