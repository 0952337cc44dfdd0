"""fastgrpo.algorithms.sampling: DAPO's dynamic sampling refills the batch with groups whose rewards differ, sizes its extra
rounds by the keep rate, and stops at its cap keeping what it has."""

from __future__ import annotations

import torch

from fastgrpo.algorithms.advantages import compute_advantages
from fastgrpo.algorithms.episodes import Episodes
from fastgrpo.runtime.metrics import StepMetrics
from fastgrpo.algorithms.sampling import dynamic_sample, round_size


def _episodes(rewards_per_prompt: list[list[float]]) -> Episodes:
    G = len(rewards_per_prompt[0])
    r = torch.tensor([x for g in rewards_per_prompt for x in g])
    S = r.numel()
    return Episodes(prompt_texts=[f"p{s // G}" for s in range(S)], prompt_ids=[[s // G] for s in range(S)],
                    completion_ids=[[s] * (1 + s % 2) for s in range(S)], completion_texts=[str(s) for s in range(S)],
                    finish_reasons=["stop"] * S,
                    sampler_logprobs=torch.arange(float(sum(1 + s % 2 for s in range(S)))),
                    reward_names=["r"], rewards_per_func=r[:, None].clone(), rewards=r,
                    reward_errors=torch.ones(1), interrupted=False, adv=compute_advantages(r, G))


def test_dynamic_sampling_refills_the_batch_and_counts():
    rounds = [  # B = 3 prompts, G = 2; round 0 keeps 1 group, round 1 keeps 1 of 2, round 2 keeps 1 (batch full)
        [[1, 1], [0, 1], [0, 0]],
        [[2, 2], [1, 0]],
        [[0, 3]],
    ]
    asked = []

    def generate(n, k):
        asked.append((n, k))
        return _episodes(rounds[k])

    m = StepMetrics()
    ep = dynamic_sample(generate, num_prompts=3, group_size=2, max_rounds=4, scale_rewards="none",
                        any_rank=lambda flag: flag, all_reduce=None, metrics=m)
    # each extra round asks for the missing groups divided by the share kept so far, at most B: round 1 misses 2
    # with 1 of 3 kept (asks min(3, 6)); round 2 misses 1 with 2 of 5 kept (asks ceil(5 / 2) = 3)
    assert asked == [(3, 0), (3, 1), (3, 2)]
    assert ep.rewards.tolist() == [0, 1, 1, 0, 0, 3]
    assert ep.adv.advantages.tolist() == [-0.5, 0.5, 0.5, -0.5, -1.5, 1.5]
    # the sampler log-probs follow their sequences (lengths alternate 1, 2 tokens): group 1 of round 0 is
    # sequences 2 (1 token at offset 3) and 3 (2 tokens at offset 4)
    assert ep.sampler_logprobs[:3].tolist() == [3.0, 4.0, 5.0]
    assert ep.reward_errors.tolist() == [3.0] and not ep.interrupted  # failed reward calls of every round count
    rec = m.reduce()
    assert rec["sampling/extra_rounds"] == 2 and rec["sampling/dropped_groups"] == 3
    assert rec["sampling/kept_groups"] == 3 and rec["sampling/filled_frac"] == 1.0


def test_dynamic_sampling_round_size_follows_the_keep_rate():
    assert round_size(2, kept=6, asked=16, num_prompts=16) == 6  # 2 missing at a keep rate of 6/16: ceil(5.33)
    assert round_size(10, kept=6, asked=16, num_prompts=16) == 16  # capped at the first round's size
    assert round_size(3, kept=0, asked=16, num_prompts=16) == 16  # nothing kept yet: a full round
    assert round_size(4, kept=8, asked=8, num_prompts=16) == 4  # every group kept: just the missing ones
    assert round_size(0, kept=16, asked=20, num_prompts=16) == 1  # a full rank still joins the round


def test_dynamic_sampling_stops_at_the_cap_and_keeps_what_it_has():
    m = StepMetrics()
    ep = dynamic_sample(lambda n, k: _episodes([[1, 1], [0, 2]] if k == 0 else [[5, 5]] * n), num_prompts=2,
                        group_size=2, max_rounds=1, scale_rewards="group", any_rank=lambda f: f, all_reduce=None,
                        metrics=m)
    assert ep.rewards.tolist() == [0, 2] and m.reduce()["sampling/filled_frac"] == 0.5
    # nothing kept at all: the first round's batch is used as it is (advantages 0)
    ep = dynamic_sample(lambda n, k: _episodes([[1, 1]] * n), num_prompts=2, group_size=2, max_rounds=2,
                        scale_rewards="group", any_rank=lambda f: f, all_reduce=None, metrics=StepMetrics())
    assert ep.num_sequences == 4 and ep.adv.advantages.abs().sum() == 0
