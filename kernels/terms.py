"""The policy terms of the GRPO-family loss: each term's per-token loss, its closed-form gradient and where its
clip binds, keyed by name (``POLICY_LOSSES``). ``objective.TokenObjective`` combines a term with the KL term and the
token weights; ``settings.LossSettings`` names the term and holds its parameters (``o`` below).

Shapes: N rows (tokens), C rows of one chunk.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

__all__ = ["POLICY_LOSSES", "PolicyTerm", "clip_masks"]


class PolicyTerm(NamedTuple):
    """One per-token policy term. ``loss(o, ratio, adv, logp) -> l_pg [N]`` (``o`` the ``LossSettings``),
    differentiable through ``ratio`` and ``logp``; ``grad(o, ratio, adv) -> d l_pg / d logp [C]`` for a row-local
    objective, where ``d ratio / d logp = ratio`` (also when old is None: ``exp(logp - sg(logp))``);
    ``clipped(eps_low, eps_high, ratio, adv) -> (low, high)`` bool, the rows whose gradient the term's clip cuts off
    from below / above (both all False for a term without a clip); ``clip_stat``: the extra statistic that counts
    ``high`` under the term's own name (TRL's ``cispo_clip_ratio``), or None; ``bound_is_epsilon_high``: the
    ratio's cap is ``epsilon_high`` itself (not ``1 + epsilon_high``), so it must be > 0 and does not change with
    the importance level."""

    loss: Callable
    grad: Callable
    clipped: Callable
    clip_stat: str | None = None
    bound_is_epsilon_high: bool = False


def _clip_loss(o, ratio, adv, logp):
    ratio_unclipped = ratio if o.delta is None else torch.clamp(ratio, max=o.delta)
    ratio_clipped = torch.clamp(ratio, 1.0 - o.epsilon_low, 1.0 + o.epsilon_high)
    return -torch.minimum(ratio_unclipped * adv, ratio_clipped * adv)  # [N]


def _clip_grad(o, ratio, adv):
    # autograd's conventions at the kinks: clamp passes the gradient inside the closed interval, minimum splits it
    # evenly between equal arguments (every row when old_logprobs is None: both branches equal A)
    d_ratio = ratio  # d ratio / d logp
    unclipped, d_unclipped = ratio, d_ratio
    if o.delta is not None:
        unclipped = torch.clamp(ratio, max=o.delta)
        d_unclipped = torch.where(ratio <= o.delta, d_ratio, 0.0)
    lo, hi = 1.0 - o.epsilon_low, 1.0 + o.epsilon_high
    clipped = torch.clamp(ratio, lo, hi)
    d_clipped = torch.where((ratio >= lo) & (ratio <= hi), d_ratio, 0.0)
    a, b = unclipped * adv, clipped * adv
    da, db = d_unclipped * adv, d_clipped * adv
    d_min = torch.where(a < b, da, torch.where(a > b, db, 0.5 * (da + db)))
    return -d_min


def _cispo_loss(o, ratio, adv, logp):
    return -torch.clamp(ratio, max=o.epsilon_high).detach() * adv * logp  # [N]


def _cispo_grad(o, ratio, adv):
    return -torch.clamp(ratio, max=o.epsilon_high) * adv


def _sapo_tau(o, adv):
    return torch.where(adv > 0, o.sapo_temperature_pos, o.sapo_temperature_neg)  # [N]


def _sapo_loss(o, ratio, adv, logp):
    tau = _sapo_tau(o, adv)
    return -torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau * adv  # [N]


def _sapo_grad(o, ratio, adv):
    s = torch.sigmoid(_sapo_tau(o, adv) * (ratio - 1.0))
    return -4.0 * s * (1.0 - s) * ratio * adv  # d/dr of sigmoid(tau (r - 1)) 4 / tau is 4 s (1 - s)


def _clip_clipped(eps_low, eps_high, ratio, adv):
    # TRL's and Liger's clip ratios: a bound binds only on the side where the advantage pushes the ratio past it
    return (ratio < 1.0 - eps_low) & (adv < 0), (ratio > 1.0 + eps_high) & (adv > 0)


def _cispo_clipped(eps_low, eps_high, ratio, adv):
    # cispo truncates the weight from above only, at epsilon_high itself
    return torch.zeros_like(ratio, dtype=torch.bool), (ratio > eps_high) & (adv > 0)


def _no_clip(eps_low, eps_high, ratio, adv):
    # sapo's gate is smooth: nothing is cut off
    none = torch.zeros_like(ratio, dtype=torch.bool)
    return none, none


POLICY_LOSSES: dict[str, PolicyTerm] = {
    "clip": PolicyTerm(_clip_loss, _clip_grad, _clip_clipped),
    "cispo": PolicyTerm(_cispo_loss, _cispo_grad, _cispo_clipped, clip_stat="cispo_clip_frac",
                        bound_is_epsilon_high=True),
    "sapo": PolicyTerm(_sapo_loss, _sapo_grad, _no_clip),
}
"""``LossSettings.policy_loss`` -> its term."""


def clip_masks(policy_loss: str, ratio: torch.Tensor, advantages: torch.Tensor, *, epsilon_low: float,
               epsilon_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(low, high)`` bool, broadcast of ``ratio`` and ``advantages``: where the ``policy_loss`` term's clip binds
    (``"clip"``: ``r < 1 - eps_low and A < 0``, resp. ``r > 1 + eps_high and A > 0``; ``"cispo"``: high only,
    ``r > eps_high and A > 0``; ``"sapo"``: never). The one definition of a clip fraction: the kernels' statistics,
    the Liger-shaped module's ``clip_ratio`` and the TRL adapter's ``clip_ratio/*`` all count these."""
    return POLICY_LOSSES[policy_loss].clipped(epsilon_low, epsilon_high, ratio, advantages)
