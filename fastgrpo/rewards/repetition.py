"""``repetition``: an n-gram repetition penalty (Yeo et al., 2025), with ms-swift's parameters and defaults.

Words are the lower-cased completion split on whitespace. With ``total`` n-grams of which ``unique`` distinct:

    reward = (1 - unique / total) * max_penalty          (0 for text shorter than n words)

so a completion without a repeated n-gram scores 0 and one repeating a single n-gram tends to ``max_penalty``.
"""

from __future__ import annotations

from typing import Any

from fastgrpo.rewards.format import as_text
from fastgrpo.rewards.loader import register_reward


def repetition_penalty(text: str, *, n_grams: int = 3, max_penalty: float = -1.0) -> float:
    words = text.lower().split()
    if len(words) < n_grams:
        return 0.0
    grams = [tuple(words[i:i + n_grams]) for i in range(len(words) - n_grams + 1)]
    return (1.0 - len(set(grams)) / len(grams)) * max_penalty


@register_reward("repetition")
def repetition_reward(completions: list[Any], *, n_grams: int = 3, max_penalty: float = -1.0,
                      **_: Any) -> list[float]:
    """Per completion: :func:`repetition_penalty` of its text (module docstring)."""
    if n_grams < 1:
        raise ValueError(f"rewards.kwargs.repetition.n_grams: must be >= 1, got {n_grams}")
    if max_penalty > 0:
        raise ValueError(f"rewards.kwargs.repetition.max_penalty: must be <= 0, got {max_penalty}")
    return [repetition_penalty(as_text(c), n_grams=n_grams, max_penalty=max_penalty) for c in completions]
