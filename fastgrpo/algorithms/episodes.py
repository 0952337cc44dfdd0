"""One step's rollout batch as typed data: prompts -> G completions each -> rewards -> advantages.

Legend: B prompts on this rank, G completions per prompt, S = B*G sequences (grouped: row s is prompt s // G),
F reward functions, N completion tokens on this rank (flat layout: sequence s's tokens are contiguous).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from fastgrpo.algorithms.advantages import AdvantageResult, compute_advantages
from fastgrpo.runtime.metrics import StepMetrics
from fastgrpo.rewards import RewardRunner
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
    reward_errors: torch.Tensor
    """[F] completions whose reward from each function is rewards.on_error_value (the call failed)."""
    interrupted: bool
    """SIGTERM cut the reward calls short: these episodes must not train the policy."""
    adv: AdvantageResult | None
    """Advantages [S] and group statistics; None when the algorithm computes its own (PPO: the critic's GAE)."""
    model_masks: list[list[int]] | None = None
    """[S][L_s] multi-turn rollouts: 1 for a token the model sampled, 0 for an environment token (attended in the
    update, weight 0); None = every completion token is the model's."""

    @property
    def lengths(self) -> torch.Tensor:
        """[S] completion lengths (long, CPU)."""
        return torch.tensor([len(c) for c in self.completion_ids], dtype=torch.long)

    @property
    def num_sequences(self) -> int:
        return len(self.completion_ids)


def reward_columns(rows: list[dict[str, Any]], group_size: int, prompt_texts: list[str],
                   completion_ids: list[list[int]], prompt_column: str = "prompt") -> dict[str, list[Any]]:
    """TRL's reward keyword arguments for B rows x G completions: every dataset column (each row repeated G times),
    ``prompts`` (the rendered prompts, in place of the raw prompt column) and ``completion_ids``."""
    keys = sorted({k for r in rows for k in r} - {"prompt", prompt_column, "completion_ids"})
    columns = {k: [r.get(k) for r in rows for _ in range(group_size)] for k in keys}
    columns["prompts"] = [p for p in prompt_texts for _ in range(group_size)]
    columns["completion_ids"] = completion_ids
    return columns


def collect_episodes(engine: RolloutEngine, rows: list[dict[str, Any]], prompt_texts: list[str],
                     prompt_ids: list[list[int]], *, group_size: int, sampling: SamplingParams,
                     rewards: RewardRunner, scale_rewards: str | None, all_reduce: Callable | None = None,
                     prompt_column: str = "prompt") -> Episodes:
    """Generate G completions per prompt, score them and compute group advantages (``scale_rewards`` None: none,
    the algorithm computes its own)."""
    groups = engine.generate(prompt_ids, group_size, sampling)  # [B][G]
    comps = [c for g in groups for c in g]  # [S]
    if any(len(c.token_ids) == 0 for c in comps):
        raise RuntimeError("rollout engine returned an empty completion; every completion needs >= 1 token")
    sampler_lp = None
    if all(c.logprobs is not None for c in comps):
        sampler_lp = torch.tensor([lp for c in comps for lp in c.logprobs], dtype=torch.float32)
    return score_episodes(rows, prompt_texts, prompt_ids, group_size=group_size,
                          completion_ids=[list(c.token_ids) for c in comps], completion_texts=[c.text for c in comps],
                          finish_reasons=[c.finish_reason for c in comps], sampler_logprobs=sampler_lp,
                          rewards=rewards, scale_rewards=scale_rewards, all_reduce=all_reduce,
                          prompt_column=prompt_column)


def score_episodes(rows: list[dict[str, Any]], prompt_texts: list[str], prompt_ids: list[list[int]], *,
                   group_size: int, completion_ids: list[list[int]], completion_texts: list[str],
                   finish_reasons: list[str], sampler_logprobs: torch.Tensor | None, rewards: RewardRunner,
                   scale_rewards: str | None, all_reduce: Callable | None = None, prompt_column: str = "prompt",
                   completions: list[Any] | None = None, extra_columns: dict[str, list[Any]] | None = None,
                   model_masks: list[list[int]] | None = None) -> Episodes:
    """Score S = B*G sampled sequences and compute group advantages. ``completions``: what the reward functions
    get as ``completions`` (default: the texts; multi-turn rollouts give message lists); ``extra_columns``: more
    reward keyword arguments, one entry per sequence; ``model_masks`` as :attr:`Episodes.model_masks`;
    ``scale_rewards`` None: no group advantages (``Episodes.adv`` None)."""
    s_prompt_texts = [p for p in prompt_texts for _ in range(group_size)]
    s_prompt_ids = [p for p in prompt_ids for _ in range(group_size)]
    columns = reward_columns(rows, group_size, prompt_texts, completion_ids, prompt_column)
    scores = rewards(completion_texts if completions is None else completions, {**columns, **(extra_columns or {})})
    adv = (None if scale_rewards is None else
           compute_advantages(scores.total, group_size, scale=scale_rewards, all_reduce=all_reduce))
    return Episodes(
        prompt_texts=s_prompt_texts, prompt_ids=s_prompt_ids, completion_ids=completion_ids,
        completion_texts=completion_texts, finish_reasons=finish_reasons, sampler_logprobs=sampler_logprobs,
        reward_names=list(rewards.names), rewards_per_func=scores.per_func, rewards=scores.total,
        reward_errors=scores.errors, interrupted=scores.interrupted, adv=adv, model_masks=model_masks,
    )


def record_metrics(ep: Episodes, m: StepMetrics) -> None:
    """Reward, advantage, length and truncation statistics of one step, global over ranks once reduced (no
    advantage or group statistics when the episodes have no group advantages)."""
    lengths = ep.lengths.float()  # [S]
    m.moments(ep.rewards, "reward/mean", "reward/std")
    for j, name in enumerate(ep.reward_names):
        m.moments(ep.rewards_per_func[:, j], f"reward/{name}/mean", f"reward/{name}/std")
        m.total(f"reward/{name}/errors", ep.reward_errors[j])  # completions scored rewards.on_error_value
    m.moments(lengths, "completion/len_mean")
    m.max("completion/len_max", lengths.max())
    m.moments(torch.tensor([float(r == "length") for r in ep.finish_reasons]), "completion/truncated_frac")
    if ep.adv is None:
        return
    a = ep.adv.advantages  # [S]
    m.moments(a, "adv/mean", "adv/std")
    m.moments(a.abs(), "adv/abs_mean")
    m.max("adv/max", a.max())
    m.min("adv/min", a.min())
    zero = ep.adv.zero_std_mask.float()  # [B]
    m.moments(zero, "groups/zero_std_frac")
    m.total("groups/zero_std_count", zero.sum())
    m.moments(ep.adv.group_std, "groups/reward_std_mean")
