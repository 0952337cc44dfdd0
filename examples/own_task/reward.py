"""A reward plugin for examples/own_task: TRL's signature, reading the dataset's ``answer`` column.

``rewards.funcs: [examples/own_task/reward.py:exact_answer]`` loads it. Every column of the data file except the
prompt reaches the function as a keyword argument (one entry per completion), so ``answer`` (and ``difficulty``,
unused here) arrive as lists. ``answer`` has no default, so a data file without that column is rejected before
any model loads.
"""

import re


def exact_answer(completions, answer, **kwargs):
    """1.0 when the last integer in the completion equals the reference answer, else 0.0."""
    scores = []
    for text, ref in zip(completions, answer):
        numbers = re.findall(r"-?\d+", text)
        scores.append(1.0 if numbers and numbers[-1] == ref.strip() else 0.0)
    return scores


def brevity(completions, completion_ids, max_tokens=16, **kwargs):
    """A parameterised shaping term: 0 up to ``max_tokens`` tokens, then -0.1 per extra token (at most -1)."""
    return [-min(1.0, 0.1 * max(0, len(ids) - max_tokens)) for ids in completion_ids]
