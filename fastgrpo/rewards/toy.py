"""``toy_digit``: the reward of the learning test's toy task ("Write a number:")."""

from __future__ import annotations

from typing import Any

from fastgrpo.rewards.format import as_text

_DIGITS = frozenset("0123456789")


def toy_digit_reward(completions: list[Any], **_: Any) -> list[float]:
    """1.0 if the completion's first non-whitespace character is an ASCII digit, else 0.0.

    ASCII only on purpose: ``str.isdigit`` also accepts e.g. Arabic-Indic digits, which a tiny model can
    hit by chance and which no reader would call "a number" here.
    """
    scores = []
    for completion in completions:
        text = as_text(completion).lstrip()
        scores.append(1.0 if text[:1] in _DIGITS else 0.0)
    return scores
