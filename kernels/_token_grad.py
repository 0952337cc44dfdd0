"""Closed-form gradient of the GRPO token loss with respect to the log-prob, for the passes that form the loss's
gradient in forward (``_gradfwd.loss_pass`` on CUDA, ``_chunked.loss_pass`` elsewhere). Plain torch on ``[C]``
vectors, so the torch path needs no Triton.
"""

from __future__ import annotations

import torch

__all__ = ["grpo_logp_grad"]


def grpo_logp_grad(logp, advantages, token_weights, *, old_logprobs, ref_logprobs, epsilon_low, epsilon_high,
                   delta, beta):
    """``token_weights * d l / d logp`` per token, ``[C]`` float32, for ``grpo_loss.grpo_token_loss``'s ``l``.

    Closed form of autograd's result, with its conventions at the kinks (tests compare the two):
    ``clamp`` passes the gradient where the input lies inside the closed interval, and ``minimum`` splits it
    evenly between equal arguments (which is every token when ``old_logprobs`` is None: both branches equal A).
    """
    logp = logp.float()
    adv = advantages.float()
    ratio = torch.ones_like(logp) if old_logprobs is None else torch.exp(logp - old_logprobs.float())
    d_ratio = ratio  # d ratio / d logp
    unclipped, d_unclipped = ratio, d_ratio
    if delta is not None:
        unclipped = torch.clamp(ratio, max=delta)
        d_unclipped = torch.where(ratio <= delta, d_ratio, 0.0)
    clipped = torch.clamp(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high)
    d_clipped = torch.where((ratio >= 1.0 - epsilon_low) & (ratio <= 1.0 + epsilon_high), d_ratio, 0.0)
    a, b = unclipped * adv, clipped * adv
    da, db = d_unclipped * adv, d_clipped * adv
    d_min = torch.where(a < b, da, torch.where(a > b, db, 0.5 * (da + db)))
    g = -d_min
    if beta != 0.0:
        g = g + beta * (1.0 - torch.exp(ref_logprobs.float() - logp))  # d k3 / d logp
    w = token_weights.float()
    return torch.where(w != 0, g * w, 0.0)  # a skipped row's logp is a placeholder: never let inf * 0 through
