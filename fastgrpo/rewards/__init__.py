"""Rewards: one file per reward family, the REWARDS registry, and loading of users' plugin files.

Every reward function has TRL's signature ``fn(completions, **kwargs) -> list[float | None]``; see
:mod:`fastgrpo.rewards.loader` for how they are found, :mod:`fastgrpo.rewards.scoring` for how they are called
(sandboxed, with a time bound and an error policy) and combined.
"""

from fastgrpo.rewards.countdown import countdown_reward, score_equation
from fastgrpo.rewards.format import as_text, format_reward, is_well_formatted, last_answer
from fastgrpo.rewards.loader import REWARDS, RewardFunc, load_reward_funcs, register_reward
from fastgrpo.rewards.math_answer import gsm8k_reward, math_verify_reward
from fastgrpo.rewards.scoring import RewardRunner, RewardScores, combine_rewards
# The seeds' shaping rewards register themselves on import.
from fastgrpo.rewards.columns import check_reward_columns, configure_rewards, required_columns
from fastgrpo.rewards.cosine import cosine_reward
from fastgrpo.rewards.overlong import soft_overlong_reward
from fastgrpo.rewards.repetition import repetition_reward
from fastgrpo.rewards.toy import toy_digit_reward

__all__ = [
    "REWARDS",
    "RewardFunc",
    "RewardRunner",
    "RewardScores",
    "as_text",
    "check_reward_columns",
    "combine_rewards",
    "configure_rewards",
    "cosine_reward",
    "countdown_reward",
    "format_reward",
    "gsm8k_reward",
    "is_well_formatted",
    "last_answer",
    "load_reward_funcs",
    "math_verify_reward",
    "register_reward",
    "repetition_reward",
    "required_columns",
    "score_equation",
    "soft_overlong_reward",
    "toy_digit_reward",
]
