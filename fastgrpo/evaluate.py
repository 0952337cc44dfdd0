"""Held-out evaluation: greedy accuracy, mean@k, best-of-n and unbiased pass@k.

A sample is correct when the evaluation reward (the last of ``rewards.funcs``, e.g. ``countdown``) is >= 1.
best-of-n (easy-GRPO's metric) is the fraction of prompts with at least one correct sample among n; pass@k uses the
unbiased estimator of Chen et al. (2021): 1 - C(n-c, k) / C(n, k).
"""

from __future__ import annotations

from math import comb
from typing import Any, Callable

from fastgrpo.episodes import reward_columns
from fastgrpo.rollout import RolloutEngine, SamplingParams


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct."""
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def _correct(reward_fn: Callable, rows: list[dict[str, Any]], prompt_texts: list[str], groups: list,
             prompt_column: str = "prompt") -> list[list[bool]]:
    n = len(groups[0])
    texts = [c.text for g in groups for c in g]
    columns = reward_columns(rows, n, prompt_texts, [c.token_ids for g in groups for c in g], prompt_column)
    scores = reward_fn(texts, **columns)
    ok = [s is not None and s >= 1.0 for s in scores]
    return [ok[i * n:(i + 1) * n] for i in range(len(groups))]


def evaluate(engine: RolloutEngine, rows: list[dict[str, Any]], prompt_texts: list[str], prompt_ids: list[list[int]],
             *, reward_fn: Callable, best_of_n: int, temperature: float, max_tokens: int, seed: int) -> dict[str, float]:
    """Greedy accuracy, and with best_of_n > 1 also mean@n, best-of-n and pass@1 from n samples."""
    greedy = engine.generate(prompt_ids, 1, SamplingParams(max_tokens=max_tokens, temperature=0.0, seed=seed))
    out = {"greedy_acc": sum(c[0] for c in _correct(reward_fn, rows, prompt_texts, greedy)) / len(rows)}
    if best_of_n > 1:
        sampled = engine.generate(prompt_ids, best_of_n,
                                  SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed))
        correct = _correct(reward_fn, rows, prompt_texts, sampled)
        out[f"mean@{best_of_n}"] = sum(sum(c) / best_of_n for c in correct) / len(rows)
        out[f"best_of_{best_of_n}"] = sum(any(c) for c in correct) / len(rows)
        out["pass@1"] = sum(pass_at_k(best_of_n, sum(c), 1) for c in correct) / len(rows)
    return out
