"""Correction for the gap between the sampler's and the trainer's log-probs (truncated importance sampling).

The rollout engine samples with its own kernels (and, with vLLM, its own copy of the weights, often in
another precision), so the behaviour policy that produced a token is not exactly the policy the trainer
differentiates. Weighting each token's loss by ``w = min(exp(logp_trainer - logp_sampler), cap)`` corrects
the bias of that mismatch while the cap bounds the variance (Yao et al., "Your efficient RL framework secretly
brings you off-policy RL training", 2025; TRL's default is token-level with cap 2).

Legend: N completion tokens.
"""

from __future__ import annotations

import torch

__all__ = ["truncated_is_weights"]


def truncated_is_weights(trainer_logp: torch.Tensor, sampler_logp: torch.Tensor, cap: float) -> torch.Tensor:
    """Token-level truncated importance weights ``clamp(exp(trainer_logp - sampler_logp), max=cap)``.

    Both inputs are ``[N]`` log-probs of the same sampled tokens (any matching shape works). The result is
    float32 and detached: it rescales the loss, it is not optimised through.
    """
    if cap <= 0:
        raise ValueError(f"importance_sampling_cap: must be > 0, got {cap}")
    if trainer_logp.shape != sampler_logp.shape:
        raise ValueError(f"trainer_logp {tuple(trainer_logp.shape)} and sampler_logp "
                         f"{tuple(sampler_logp.shape)} must have the same shape")
    log_ratio = trainer_logp.detach().float() - sampler_logp.detach().float()  # [N]
    return torch.exp(log_ratio).clamp(max=cap)  # [N]
