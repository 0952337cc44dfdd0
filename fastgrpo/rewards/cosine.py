"""``cosine``: correctness scaled by completion length on a cosine schedule (Yeo et al., 2025, "Demystifying
Long Chain-of-Thought Reasoning in LLMs"), with ms-swift's parameters and defaults.

For a completion of ``L`` tokens and ``T = max_len`` (default: rollout.max_completion_length):

    cos(L; a, b) = b - (b - a) * (1 - cos(pi * L / T)) / 2        (b at L = 0, a at L = T)
    correct:  cos(L; max_len_value_correct, min_len_value_correct)   1.0 at L = 0 -> 0.5 at L = T
    wrong:    cos(L; max_len_value_wrong,   min_len_value_wrong)    -0.5 at L = 0 -> 0.0 at L = T

so short correct answers earn most and short wrong ones lose most (a wrong answer should think longer).
Correctness is another reward's verdict (``accuracy``, a REWARDS name; >= 1 counts as correct), so the
columns it needs are the accuracy reward's.
"""

from __future__ import annotations

import math
from typing import Any

from fastgrpo.rewards.columns import required_columns
from fastgrpo.rewards.loader import REWARDS, register_reward


def cosine_schedule(length: int, max_len: int, at_max: float, at_zero: float) -> float:
    """``at_zero`` at length 0 falling (or rising) on a half cosine to ``at_max`` at ``max_len``."""
    t = min(length, max_len)
    return at_zero - (at_zero - at_max) * (1.0 - math.cos(math.pi * t / max_len)) / 2.0


@register_reward("cosine")
def cosine_reward(completions: list[Any], completion_ids: list[list[int]], *, accuracy: str = "math",
                  min_len_value_wrong: float = -0.5, max_len_value_wrong: float = 0.0,
                  min_len_value_correct: float = 1.0, max_len_value_correct: float = 0.5,
                  max_len: int | None = None, max_completion_length: int | None = None,
                  **columns: Any) -> list[float]:
    """Length-scaled correctness (module docstring); lengths are token counts of ``completion_ids``."""
    limit = max_len if max_len is not None else max_completion_length
    if limit is None or limit <= 0:
        raise ValueError("cosine reward: set rewards.kwargs.cosine.max_len (or run it from the trainer, which passes "
                         "rollout.max_completion_length)")
    if accuracy not in REWARDS or accuracy == "cosine":
        raise ValueError(f"rewards.kwargs.cosine.accuracy: {accuracy!r} is not a correctness reward; choices: "
                         f"{sorted(set(REWARDS) - {'cosine'})}")
    verdicts = REWARDS[accuracy](completions=completions, completion_ids=completion_ids, **columns)
    out = []
    for ids, verdict in zip(completion_ids, verdicts, strict=True):
        if verdict is not None and verdict >= 1.0:
            out.append(cosine_schedule(len(ids), limit, max_len_value_correct, min_len_value_correct))
        else:
            out.append(cosine_schedule(len(ids), limit, max_len_value_wrong, min_len_value_wrong))
    return out


def _accuracy_columns(bound: dict[str, Any]) -> tuple[str, ...]:
    accuracy = bound.get("accuracy", "math")
    if accuracy not in REWARDS or accuracy == "cosine":
        raise ValueError(f"rewards.kwargs.cosine.accuracy: {accuracy!r} is not a correctness reward; choices: "
                         f"{sorted(set(REWARDS) - {'cosine'})}")
    return required_columns(REWARDS[accuracy])


cosine_reward.required_columns = _accuracy_columns
