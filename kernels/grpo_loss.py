"""Fused linear -> GRPO-family loss: ``sum_n token_weights[n] * l_n``, without an ``[N, V]`` tensor.

Shapes: N rows (tokens), H hidden size, V vocabulary size.

Per token (TRL's objective, so runs are comparable):
    r      = exp(logp - old)                      (old = logp.detach() when old_logprobs is None: r == 1)
    r_u    = r, or min(r, delta) when delta is set (two-sided clipping)
    l_pg   = -min(r_u * A, clip(r, 1 - eps_low, 1 + eps_high) * A)
    k3     = exp(ref - logp) - (ref - logp) - 1    (only when beta != 0)
    l      = l_pg + beta * k3

How it is split: the heavy part (``logp`` per row, and its backward through the vocabulary) is the fused
op of ``logprobs.py``; the token loss above is a handful of ``[N]`` vector ops whose gradient autograd hands
to that op as ``g_logp[n] = token_weights[n] * dl_n/dlogp_n``. Those vector ops cost nothing next to the
``N x V x H`` products, and reusing autograd keeps the tie and clamp-boundary gradient conventions identical to
the reference's.

Zero-weight tokens: forward skips them (``active = token_weights != 0``; on the Triton path the selection is
made on the device, so there is no host sync); their ``stats["logprobs"]`` entries are 0. Backward also skips
every row whose ``g_logp`` is 0 -- in particular tokens with advantage 0 when beta == 0 (whole groups with equal
rewards), which are common in GRPO.
"""

from __future__ import annotations

import torch

from .logprobs import fused_logprobs

__all__ = ["linear_grpo_loss", "grpo_token_loss"]


def grpo_token_loss(logp, advantages, *, old_logprobs, ref_logprobs, epsilon_low, epsilon_high, delta, beta):
    """Per-token loss ``l [N]`` and the tensors the stats need, from ``logp [N]`` (float32, differentiable)."""
    old = logp.detach() if old_logprobs is None else old_logprobs.float()  # [N]
    adv = advantages.float()  # [N]
    ratio = torch.exp(logp - old)  # [N]
    ratio_unclipped = ratio if delta is None else torch.clamp(ratio, max=delta)
    ratio_clipped = torch.clamp(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high)
    loss = -torch.minimum(ratio_unclipped * adv, ratio_clipped * adv)  # [N]
    kl = None
    if beta != 0.0:
        diff = ref_logprobs.float() - logp  # [N]
        kl = torch.exp(diff) - diff - 1.0  # k3, >= 0
        loss = loss + beta * kl
    return loss, ratio.detach(), kl


def linear_grpo_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    advantages: torch.Tensor,
    token_weights: torch.Tensor,
    *,
    old_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    delta: float | None = None,
    beta: float = 0.0,
    temperature: float = 1.0,
    return_entropy: bool = False,
    backend: str = "auto",
    chunk_size: int | None = None,
):
    """GRPO / DAPO / Dr. GRPO loss (the variant is in ``token_weights``) of an lm_head applied to ``hidden``.

    Args:
        hidden ``[N, H]``, weight ``[V, H]``, targets ``[N]``: as in ``linear_logprobs``.
        advantages: ``[N]`` per-token advantage (the sequence's advantage repeated).
        token_weights: ``[N]`` loss normalisation per token, decided by the caller over the global batch; 0
            drops a token (no softmax work for it). Not differentiated.
        old_logprobs: ``[N]`` behaviour-policy log-probs; None means ``logp.detach()`` (one update per batch).
        ref_logprobs: ``[N]`` reference-model log-probs; required when ``beta != 0``.
        epsilon_low, epsilon_high: ratio clip range ``[1 - epsilon_low, 1 + epsilon_high]``.
        delta: upper clamp of the unclipped ratio (two-sided clipping); None disables it.
        beta: weight of the k3 KL penalty.
        temperature: logits are divided by it.
        return_entropy, backend, chunk_size: extras; see ``linear_logprobs``.

    Returns:
        ``(loss, stats)``: ``loss`` a float32 scalar; ``stats`` device tensors, no host sync: ``logprobs [N]``
        (detached, 0 where the weight is 0), ``clip_low_frac`` and ``clip_high_frac`` (TRL's: among tokens with
        nonzero weight, the fraction with ``r < 1 - eps_low and A < 0``, resp. ``r > 1 + eps_high and A > 0``),
        ``kl_mean`` (mean k3 over those tokens; 0 when beta == 0) and ``entropy [N]`` when asked.
    """
    if beta != 0.0 and ref_logprobs is None:
        raise ValueError("beta != 0 needs ref_logprobs")
    if epsilon_low < 0 or epsilon_high < 0:
        raise ValueError(f"epsilon_low / epsilon_high must be >= 0, got {epsilon_low}, {epsilon_high}")
    if delta is not None and delta <= 0:
        raise ValueError(f"delta must be > 0 (TRL recommends > 1 + epsilon_high), got {delta}")
    for name, vec in (("advantages", advantages), ("token_weights", token_weights),
                      ("old_logprobs", old_logprobs), ("ref_logprobs", ref_logprobs)):
        if vec is not None and vec.shape != hidden.shape[:1]:
            raise ValueError(f"{name} must be [N]={hidden.shape[0]}, got {tuple(vec.shape)}")

    counted = token_weights != 0  # [N]
    logp, entropy = fused_logprobs(hidden, weight, targets, active=counted, temperature=temperature,
                                   with_entropy=return_entropy, backend=backend, chunk_size=chunk_size)
    if old_logprobs is not None:
        # Skipped rows have logp == 0; using old there keeps exp(logp - old) finite (0 * inf would be NaN
        # in the gradient) and the row still gets no gradient through the where.
        logp_used = torch.where(counted, logp, old_logprobs.float())
    else:
        logp_used = logp
    per_token, ratio, kl = grpo_token_loss(
        logp_used, advantages, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs,
        epsilon_low=epsilon_low, epsilon_high=epsilon_high, delta=delta, beta=beta,
    )
    weights = token_weights.float()  # [N]
    loss = (weights * per_token).sum()

    adv = advantages
    n_counted = counted.sum().clamp(min=1).float()
    stats = {
        "logprobs": logp.detach(),
        "clip_low_frac": ((ratio < 1.0 - epsilon_low) & (adv < 0) & counted).sum() / n_counted,
        "clip_high_frac": ((ratio > 1.0 + epsilon_high) & (adv > 0) & counted).sum() / n_counted,
        "kl_mean": (kl.detach() * counted).sum() / n_counted if kl is not None else logp.new_zeros(()),
    }
    if return_entropy:
        stats["entropy"] = entropy.detach()
    return loss, stats
