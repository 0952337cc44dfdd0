"""Group statistics -> advantages.

Legend: B prompts, G completions per prompt, S = B*G sequences (rows are grouped: row s belongs to prompt s // G).

    A_s = r_s - mean_group(r)                     (always: group mean-centring)
    A_s /= std_group(r) + eps     if scale == "group"   (GRPO / DeepSeekMath)
    A_s /= std_batch(r) + eps     if scale == "batch"   (Lite PPO's batch-level scaling)
    (no scaling)                  if scale == "none"    (Dr. GRPO: std scaling biases towards easy/hard prompts)

std is the unbiased sample std, as in TRL, so numbers are comparable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

EPS = 1e-4


@dataclass
class AdvantageResult:
    advantages: torch.Tensor
    """[S] float32."""
    group_std: torch.Tensor
    """[B] std of each group's rewards."""
    zero_std_mask: torch.Tensor
    """[B] bool: groups whose G rewards are all equal (their advantages are 0 and carry no signal)."""


def compute_advantages(rewards: torch.Tensor, group_size: int, *, scale: str = "group",
                       all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> AdvantageResult:
    """Group-centred (optionally scaled) advantages of ``rewards`` [S], S a multiple of ``group_size``.

    ``all_reduce`` sums a tensor over ranks in place (the trainer passes torch.distributed's): the batch std of
    ``scale="batch"`` is then the global batch's, so advantages do not depend on the number of ranks. Groups
    never span ranks, so group statistics need no communication. The statistics are taken in float64 (rewards
    near float32's limit would overflow a float32 std or sum of squares to inf, and every advantage to 0); the
    results are float32.
    """
    if rewards.ndim != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards must be [B*G] with G={group_size}, got shape {tuple(rewards.shape)}")
    grouped = rewards.double().view(-1, group_size)  # [B, G]
    mean = grouped.mean(dim=1, keepdim=True)  # [B, 1]
    std = grouped.std(dim=1)  # [B]
    centred = grouped - mean  # [B, G]
    if scale == "group":
        centred = centred / (std[:, None] + EPS)
    elif scale == "batch":
        r = rewards.double()
        sums = torch.stack([r.sum(), (r * r).sum(), r.new_tensor(float(r.numel()))])  # [3]
        if all_reduce is not None:
            sums = all_reduce(sums)
        mean = sums[0] / sums[2]
        batch_std = ((sums[1] - sums[2] * mean * mean).clamp(min=0) / (sums[2] - 1).clamp(min=1)).sqrt()
        centred = centred / (batch_std + EPS)
    elif scale != "none":
        raise ValueError(f"scale_rewards must be group, batch or none, got {scale!r}")
    zero = (grouped.max(dim=1).values - grouped.min(dim=1).values) == 0  # [B]
    return AdvantageResult(advantages=centred.reshape(-1).float(), group_std=std.float(), zero_std_mask=zero)


def self_imitation_mask(rewards: torch.Tensor, group_size: int, top_k: int,
                        min_reward: float | None = None) -> torch.Tensor:
    """[S] bool: the ``top_k`` highest rewards of each group (ties: the earlier completion first), among those
    eligible for imitation: reward >= ``min_reward``, or strictly above the group mean when it is None (so a group
    of equal rewards imitates nothing)."""
    grouped = rewards.float().view(-1, group_size)  # [B, G]
    if min_reward is None:
        eligible = grouped > grouped.mean(dim=1, keepdim=True)
    else:
        eligible = grouped >= min_reward
    order = torch.argsort(-grouped, dim=1, stable=True)  # [B, G] best first
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(group_size).expand_as(order))  # [B, G]
    return ((rank < top_k) & eligible).reshape(-1)
