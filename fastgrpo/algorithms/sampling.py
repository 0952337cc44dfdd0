"""DAPO's dynamic sampling: keep only groups whose rewards differ, and sample more prompts until the batch is full.

Legend: B prompts per step on this rank, G completions per prompt, S = B*G sequences (grouped: row s is prompt
s // G), N completion tokens.

A group whose G rewards are all equal has advantage 0 for every completion: it adds no policy gradient but still
dilutes the token normaliser. Dynamic sampling (Yu et al., 2025) drops such groups and draws more prompts, at
most ``max_rounds`` extra rounds per step, each sized by the share of groups kept so far (:func:`round_size`;
surplus kept groups are dropped); the batch is then the first B kept groups, or fewer when the rounds ran
out (every kept group is used; with none kept at all the first round's batch is used as it is). Advantages are
recomputed on the final batch. Every rank runs the same number of rounds (decided by an all-reduce), because
advantage scaling over the batch and the policy update issue collectives.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch

from fastgrpo.algorithms.advantages import compute_advantages
from fastgrpo.algorithms.episodes import Episodes
from fastgrpo.runtime.metrics import StepMetrics


def select_groups(ep: Episodes, groups: list[int], group_size: int) -> Episodes:
    """The episodes of ``groups`` (prompt indices, in that order); advantages are left to the caller."""
    seqs = [b * group_size + j for b in groups for j in range(group_size)]
    sampler_lp = None
    if ep.sampler_logprobs is not None:
        starts = torch.cumsum(ep.lengths, 0) - ep.lengths  # [S] token offset of each sequence
        sampler_lp = torch.cat([ep.sampler_logprobs[int(starts[s]):int(starts[s]) + len(ep.completion_ids[s])]
                                for s in seqs]) if seqs else ep.sampler_logprobs[:0]
    pick = torch.tensor(seqs, dtype=torch.long)
    return replace(
        ep, prompt_texts=[ep.prompt_texts[s] for s in seqs], prompt_ids=[ep.prompt_ids[s] for s in seqs],
        completion_ids=[ep.completion_ids[s] for s in seqs], completion_texts=[ep.completion_texts[s] for s in seqs],
        finish_reasons=[ep.finish_reasons[s] for s in seqs], sampler_logprobs=sampler_lp,
        rewards_per_func=ep.rewards_per_func[pick], rewards=ep.rewards[pick],
        model_masks=None if ep.model_masks is None else [ep.model_masks[s] for s in seqs])


def concat_episodes(eps: list[Episodes]) -> Episodes:
    """The episodes one after the other (advantages are left to the caller)."""
    first = eps[0]
    lps = [e.sampler_logprobs for e in eps]
    return replace(
        first, prompt_texts=[x for e in eps for x in e.prompt_texts], prompt_ids=[x for e in eps for x in e.prompt_ids],
        completion_ids=[x for e in eps for x in e.completion_ids],
        completion_texts=[x for e in eps for x in e.completion_texts],
        finish_reasons=[x for e in eps for x in e.finish_reasons],
        sampler_logprobs=torch.cat(lps) if all(lp is not None for lp in lps) else None,
        rewards_per_func=torch.cat([e.rewards_per_func for e in eps]), rewards=torch.cat([e.rewards for e in eps]),
        model_masks=None if first.model_masks is None else [x for e in eps for x in e.model_masks])


def round_size(missing: int, kept: int, asked: int, num_prompts: int) -> int:
    """Prompts to draw in an extra round: the ``missing`` groups divided by the share of groups kept so far
    (``kept`` of ``asked``), so that one round usually fills the batch instead of several ever smaller ones (each
    round costs a whole decode loop whatever its size). At most ``num_prompts`` (the first round's size, so a round
    never needs more memory than the first), at least 1 (a full rank still takes part in the collectives)."""
    if missing <= 0:
        return 1
    if kept == 0:
        return num_prompts
    return max(1, min(num_prompts, -(-missing * asked // kept)))


def dynamic_sample(generate: Callable[[int, int], Episodes], *, num_prompts: int, group_size: int, max_rounds: int,
                   scale_rewards: str, any_rank: Callable[[bool], bool],
                   all_reduce: Callable[[torch.Tensor], torch.Tensor] | None, metrics: StepMetrics) -> Episodes:
    """Dynamic sampling (module docstring). ``generate(n_prompts, round)`` rolls out and scores n prompts;
    ``any_rank(flag)`` is True when ``flag`` holds on some rank. Metrics: ``sampling/extra_rounds``,
    ``sampling/dropped_groups``, ``sampling/kept_groups`` (totals over ranks), ``sampling/filled_frac``."""
    kept: list[Episodes] = []
    n_kept = dropped = rounds = 0
    first = ep = generate(num_prompts, 0)
    errors_F, interrupted = ep.reward_errors.clone(), ep.interrupted  # [F]: failed reward calls of every round
    while True:
        good = [b for b, zero in enumerate(ep.adv.zero_std_mask.tolist()) if not zero]
        dropped += len(ep.adv.zero_std_mask) - len(good)
        if good:
            kept.append(select_groups(ep, good, group_size))
            n_kept += len(good)
        if rounds >= max_rounds or not any_rank(n_kept < num_prompts):
            break
        rounds += 1
        ep = generate(round_size(num_prompts - n_kept, n_kept, n_kept + dropped, num_prompts), rounds)
        errors_F, interrupted = errors_F + ep.reward_errors, interrupted or ep.interrupted
    if n_kept:
        merged = concat_episodes(kept)
        if n_kept > num_prompts:
            merged = select_groups(merged, list(range(num_prompts)), group_size)
    else:
        merged = first
    merged = replace(merged, reward_errors=errors_F, interrupted=interrupted,
                     adv=compute_advantages(merged.rewards, group_size, scale=scale_rewards, all_reduce=all_reduce))
    metrics.set("sampling/extra_rounds", torch.tensor(float(rounds)))
    metrics.total("sampling/dropped_groups", torch.tensor(float(dropped)))
    metrics.total("sampling/kept_groups", torch.tensor(float(min(n_kept, num_prompts))))
    metrics.set("sampling/filled_frac", torch.tensor(min(n_kept, num_prompts) / num_prompts))
    return merged
