"""``soft_overlong``: DAPO's soft overlong punishment (Yu et al., 2025), with ms-swift's parameters.

For a completion of ``L`` tokens, ``L_max = soft_max_length`` (default: rollout.max_completion_length) and a
buffer of ``soft_cache_length`` tokens below it (required, as in ms-swift; DAPO uses 4096 of 20480):

    0                                        if L <= L_max - cache
    (L_max - cache - L) / cache              if L_max - cache < L <= L_max      (0 down to -1, linearly)
    -1                                       if L > L_max

It is added to the task reward, so a correct answer that ran into the buffer still beats a wrong one.
"""

from __future__ import annotations

from typing import Any

from fastgrpo.rewards.loader import register_reward


def soft_overlong_penalty(length: int, *, soft_max_length: int, soft_cache_length: int) -> float:
    expected = soft_max_length - soft_cache_length
    return max(min((expected - length) / soft_cache_length, 0.0), -1.0)


@register_reward("soft_overlong")
def soft_overlong_reward(completions: list[Any], completion_ids: list[list[int]], *,
                         soft_cache_length: int | None = None, soft_max_length: int | None = None,
                         max_completion_length: int | None = None, **_: Any) -> list[float]:
    """Per completion: :func:`soft_overlong_penalty` of its token count (module docstring)."""
    limit = soft_max_length if soft_max_length is not None else max_completion_length
    if soft_cache_length is None:
        raise ValueError("soft_overlong reward: set rewards.kwargs.soft_overlong.soft_cache_length (the buffer below "
                         "the length limit over which the penalty falls from 0 to -1; DAPO: 4096 of 20480)")
    if limit is None or not 0 < soft_cache_length < limit:
        raise ValueError(f"rewards.kwargs.soft_overlong: need 0 < soft_cache_length < soft_max_length, got "
                         f"{soft_cache_length} and {limit}")
    return [soft_overlong_penalty(len(ids), soft_max_length=limit, soft_cache_length=soft_cache_length)
            for ids in completion_ids]
