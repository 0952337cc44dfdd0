"""One step's rollout batch as typed data: prompts -> G completions each -> rewards -> advantages.

Legend: B prompts on this rank, G completions per prompt, S = B*G sequences (grouped: row s is prompt s // G),
F reward functions, N completion tokens on this rank (flat layout: sequence s's tokens are contiguous).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from fastgrpo.advantages import AdvantageResult, compute_advantages
from fastgrpo.rewards import combine_rewards
from fastgrpo.rollout import RolloutEngine, SamplingParams


@dataclass
class Episodes:
    """Everything the policy update and the logs need about one step's rollouts on this rank."""

    prompt_texts: list[str]
    """[S] rendered prompt of each sequence (repeated G times)."""
    prompt_ids: list[list[int]]
    """[S] prompt token ids."""
    completion_ids: list[list[int]]
    """[S] completion token ids (EOS included when generation stopped on it)."""
    completion_texts: list[str]
    """[S] decoded completions."""
    finish_reasons: list[str]
    """[S] 'stop' or 'length'."""
    sampler_logprobs: torch.Tensor | None
    """[N] the sampler's log-prob of each completion token, when the engine returned them."""
    reward_names: list[str]
    """[F]."""
    rewards_per_func: torch.Tensor
    """[S, F] float32."""
    rewards: torch.Tensor
    """[S] weighted sum over functions."""
    adv: AdvantageResult
    """Advantages [S] and group statistics."""

    @property
    def lengths(self) -> torch.Tensor:
        """[S] completion lengths (long, CPU)."""
        return torch.tensor([len(c) for c in self.completion_ids], dtype=torch.long)

    @property
    def num_sequences(self) -> int:
        return len(self.completion_ids)


def expand_columns(rows: list[dict[str, Any]], group_size: int) -> dict[str, list[Any]]:
    """Dataset columns of B rows -> dict of lists with one entry per completion (each row repeated G times)."""
    keys = sorted({k for r in rows for k in r})
    return {k: [r.get(k) for r in rows for _ in range(group_size)] for k in keys}


def collect_episodes(engine: RolloutEngine, rows: list[dict[str, Any]], prompt_texts: list[str],
                     prompt_ids: list[list[int]], *, group_size: int, sampling: SamplingParams,
                     reward_funcs: list[tuple[str, Callable]], reward_weights: list[float] | None,
                     scale_rewards: str) -> Episodes:
    """Generate G completions per prompt, score them and compute group advantages."""
    groups = engine.generate(prompt_ids, group_size, sampling)  # [B][G]
    comps = [c for g in groups for c in g]  # [S]
    if any(len(c.token_ids) == 0 for c in comps):
        raise RuntimeError("rollout engine returned an empty completion; every completion needs >= 1 token")
    s_prompt_texts = [p for p in prompt_texts for _ in range(group_size)]
    s_prompt_ids = [p for p in prompt_ids for _ in range(group_size)]
    completion_ids = [list(c.token_ids) for c in comps]
    texts = [c.text for c in comps]
    columns = expand_columns(rows, group_size)
    columns.pop("prompt", None)  # the rendered prompt is passed as `prompts`, as TRL does
    columns.pop("completion_ids", None)
    per_func, total = combine_rewards(reward_funcs, reward_weights, texts,
                                      dict(columns, prompts=s_prompt_texts, completion_ids=completion_ids))
    adv = compute_advantages(total, group_size, scale=scale_rewards)
    sampler_lp = None
    if all(c.logprobs is not None for c in comps):
        sampler_lp = torch.tensor([lp for c in comps for lp in c.logprobs], dtype=torch.float32)
    return Episodes(
        prompt_texts=s_prompt_texts, prompt_ids=s_prompt_ids, completion_ids=completion_ids,
        completion_texts=texts, finish_reasons=[c.finish_reason for c in comps], sampler_logprobs=sampler_lp,
        reward_names=[n for n, _ in reward_funcs], rewards_per_func=per_func, rewards=total, adv=adv,
    )


def episode_metrics(ep: Episodes) -> dict[str, torch.Tensor]:
    """Reward, length and truncation statistics of one step (device tensors)."""
    lengths = ep.lengths.float()
    out = {
        "reward/mean": ep.rewards.mean(),
        "reward/std": ep.rewards.std() if ep.num_sequences > 1 else ep.rewards.new_zeros(()),
        "completion/len_mean": lengths.mean(),
        "completion/truncated_frac": torch.tensor(
            sum(r == "length" for r in ep.finish_reasons) / max(ep.num_sequences, 1)),
    }
    for j, name in enumerate(ep.reward_names):
        col = ep.rewards_per_func[:, j]
        out[f"reward/{name}/mean"] = col.nanmean()
        out[f"reward/{name}/std"] = col.std() if ep.num_sequences > 1 else col.new_zeros(())
    return out
