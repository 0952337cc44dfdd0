"""Held-out evaluation: greedy accuracy, mean@n, best-of-n, unbiased pass@k for every k up to n, and maj@n.

A sample is correct when the evaluation reward (the last of ``rewards.funcs``, e.g. ``countdown``) is >= 1.
best-of-n (easy-GRPO's metric) is the fraction of prompts with at least one correct sample among n (= pass@n).
pass@k uses the unbiased estimator of Chen et al. (2021), 1 - C(n-c, k) / C(n, k), averaged over prompts; with k = 1
it equals mean@n. maj@n (majority voting, self-consistency) is reported where answers can be compared: when the
evaluation reward has an ``answer_key(completion) -> hashable | None`` attribute (``gsm8k`` and ``math``: the exact
value of the final answer). The most frequent stated answer among the n samples wins (ties: the one stated first),
and the prompt counts as solved when a sample giving that answer is correct.
"""

from __future__ import annotations

from collections import Counter
from math import comb
from typing import Any, Callable, Hashable, Sequence

from fastgrpo.algorithms.episodes import reward_columns
from fastgrpo.environments import ENV_REWARDS_COLUMN
from fastgrpo.environments.trajectory import TrajectoryCompletion
from fastgrpo.rollout import RolloutEngine, SamplingParams


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct."""
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def majority_correct(keys: Sequence[Hashable | None], correct: Sequence[bool]) -> bool:
    """Whether the majority answer among ``keys`` (None: no answer stated; ties: first stated) is correct."""
    counts = Counter(k for k in keys if k is not None)
    if not counts:
        return False
    top = max(counts.values())
    winner = next(k for k in keys if k is not None and counts[k] == top)
    return correct[keys.index(winner)]


def answer_key_of(reward_fn: Callable) -> Callable | None:
    """The reward's ``answer_key`` (looking through parameters bound by ``rewards.kwargs``), or None."""
    return getattr(reward_fn, "answer_key", None) or getattr(getattr(reward_fn, "func", None), "answer_key", None)


def _correct(reward_fn: Callable, rows: list[dict[str, Any]], prompt_texts: list[str], groups: list,
             prompt_column: str = "prompt") -> list[list[bool]]:
    n = len(groups[0])
    comps = [c for g in groups for c in g]
    columns = reward_columns(rows, n, prompt_texts, [c.token_ids for c in comps], prompt_column)
    completions: list[Any] = [c.text for c in comps]
    if comps and all(isinstance(c, TrajectoryCompletion) for c in comps):  # multi-turn: as training scores them
        completions = [c.messages for c in comps]
        columns[ENV_REWARDS_COLUMN] = [c.env_rewards for c in comps]
    scores = reward_fn(completions, **columns)
    ok = [s is not None and s >= 1.0 for s in scores]
    return [ok[i * n:(i + 1) * n] for i in range(len(groups))]


def sample_metrics(correct: list[list[bool]], keys: list[list[Hashable | None]] | None = None) -> dict[str, float]:
    """mean@n, best_of_n, pass@k for k = 1..n (and maj@n with ``keys``) from per-prompt correctness of n samples."""
    n, num = len(correct[0]), len(correct)
    out = {f"mean@{n}": sum(sum(c) / n for c in correct) / num, f"best_of_{n}": sum(any(c) for c in correct) / num}
    for k in range(1, n + 1):
        out[f"pass@{k}"] = sum(pass_at_k(n, sum(c), k) for c in correct) / num
    if keys is not None:
        out[f"maj@{n}"] = sum(majority_correct(k, c) for k, c in zip(keys, correct)) / num
    return out


def evaluate(engine: RolloutEngine, rows: list[dict[str, Any]], prompt_texts: list[str], prompt_ids: list[list[int]],
             *, reward_fn: Callable, best_of_n: int, temperature: float, max_tokens: int, seed: int,
             prompt_column: str = "prompt") -> dict[str, float]:
    """Greedy accuracy, and with best_of_n > 1 also :func:`sample_metrics` of n samples per prompt."""
    greedy = engine.generate(prompt_ids, 1, SamplingParams(max_tokens=max_tokens, temperature=0.0, seed=seed))
    out = {"greedy_acc": sum(c[0] for c in _correct(reward_fn, rows, prompt_texts, greedy, prompt_column)) / len(rows)}
    if best_of_n > 1:
        sampled = engine.generate(prompt_ids, best_of_n,
                                  SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed))
        correct = _correct(reward_fn, rows, prompt_texts, sampled, prompt_column)
        key = answer_key_of(reward_fn)
        keys = [[key(c.text) for c in g] for g in sampled] if key is not None else None
        out.update(sample_metrics(correct, keys))
    return out
