"""Plain-torch references for the fused ops: the test oracle.

They materialise the full logits ``[N, V]`` on purpose: nothing clever, so that they are easy to check by eye
(the tests also check them against a hand-computed case). Tests and benchmarks import them; the trainer's
tests use them too. They are written independently of ``grpo_loss.py`` (TRL's formulation, with ``torch.min``
and ``torch.clamp``) so that a slip in the fused path's token loss is caught rather than copied.

Shapes: N tokens (rows), H hidden size, V vocabulary size.

Precision: the matmul runs in the inputs' dtype (as ``model(...).logits`` does in TRL), everything after it in
float32 -- or float64 when the inputs are float64, which the tests use as the "exact" answer.
"""

from __future__ import annotations

import torch

__all__ = ["reference_linear_logprobs", "reference_linear_grpo_loss"]


def _logits(hidden: torch.Tensor, weight: torch.Tensor, temperature: float, bias=None) -> torch.Tensor:
    out_dtype = torch.promote_types(hidden.dtype, torch.float32)
    logits = hidden @ weight.T if bias is None else torch.nn.functional.linear(hidden, weight, bias)  # as nn.Linear
    return logits.to(out_dtype) / temperature  # [N, V]


def reference_linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    return_entropy: bool = False,
    bias: torch.Tensor | None = None,
):
    """``log_softmax((hidden @ weight.T + bias) / temperature)[n, targets[n]]`` (and the softmax entropy per row)."""
    logits = _logits(hidden, weight, temperature, bias)  # [N, V]
    logp_all = torch.log_softmax(logits, dim=-1)  # [N, V]
    logp = logp_all.gather(1, targets.long()[:, None]).squeeze(1)  # [N]
    if not return_entropy:
        return logp
    entropy = -(logp_all.exp() * logp_all).sum(-1)  # [N]
    return logp, entropy


def reference_linear_grpo_loss(
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
    sequence_index: torch.Tensor | None = None,
    policy_loss: str = "clip",
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    use_bias_correction_kl: bool = False,
    kl_token_weights: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
):
    """TRL 1.16's per-token objective (its ``_compute_loss`` terms), summed with ``token_weights`` (the policy term)
    and ``kl_token_weights`` (the KL term; None: ``token_weights``). Returns ``(loss, stats)``.

    ``sequence_index [N]``: GSPO's sequence-level ratio, ``exp`` of the mean of ``logp - old`` over each
    sequence's nonzero-weight tokens, shared by its tokens (a plain loop over sequences here). ``policy_loss``:
    "clip", "cispo" (``-sg(min(r, epsilon_high)) A logp``) or "sapo" (``-sigmoid(tau (r - 1)) 4 / tau A``).
    ``use_bias_correction_kl``: the KL term is ``k3 * r``. ``bias [V]``: added to the logits."""
    out = reference_linear_logprobs(hidden, weight, targets, temperature=temperature, return_entropy=return_entropy,
                                    bias=bias)
    logp, entropy = out if return_entropy else (out, None)
    old = logp.detach() if old_logprobs is None else old_logprobs.to(logp.dtype)
    adv = advantages.to(logp.dtype)  # [N]
    kl_w = token_weights if kl_token_weights is None else kl_token_weights  # [N]

    counted = (token_weights != 0) | (kl_w != 0)  # [N] rows either term weighs
    log_ratio = logp - old  # [N]
    if sequence_index is not None:
        per_seq = []
        for s in range(int(sequence_index.max()) + 1):
            rows = (sequence_index == s) & counted
            mean = log_ratio[rows].mean() if rows.any() else log_ratio.new_zeros(())
            per_seq.append(mean)
        log_ratio = torch.stack(per_seq)[sequence_index.long()]  # [N]
    ratio = torch.exp(log_ratio)  # [N]
    if policy_loss == "clip":
        ratio_unclipped = ratio if delta is None else torch.clamp(ratio, max=delta)
        ratio_clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
        per_token = -torch.min(ratio_unclipped * adv, ratio_clipped * adv)  # [N]
    elif policy_loss == "cispo":  # a truncated, detached importance weight times the REINFORCE term
        per_token = -(torch.clamp(ratio, max=epsilon_high).detach() * adv) * logp
    elif policy_loss == "sapo":  # a sigmoid gate in place of the hard clip
        tau = torch.where(adv > 0, torch.full_like(adv, sapo_temperature_pos), sapo_temperature_neg)
        per_token = -(4 / tau) * torch.sigmoid(tau * (ratio - 1)) * adv
    else:
        raise ValueError(f"unknown policy_loss {policy_loss!r}")

    n_counted = counted.sum().clamp(min=1)
    kl_mean = torch.zeros((), dtype=logp.dtype, device=logp.device)
    kl_loss = 0.0
    if beta != 0.0:
        if ref_logprobs is None:
            raise ValueError("beta != 0 needs ref_logprobs")
        diff = ref_logprobs.to(logp.dtype) - logp
        kl = torch.exp(diff) - diff - 1  # [N], k3 estimator
        if use_bias_correction_kl:
            kl = ratio * kl
        if kl_token_weights is None:
            per_token = per_token + beta * kl
        else:
            kl_loss = beta * (kl_token_weights.to(logp.dtype) * kl).sum()
        kl_mean = (kl.detach() * counted).sum() / n_counted
    loss = (token_weights.to(logp.dtype) * per_token).sum() + kl_loss

    stats = {
        "logprobs": logp.detach(),
        "clip_low_frac": (((ratio < 1 - epsilon_low) & (adv < 0) & counted).sum() / n_counted).detach(),
        "clip_high_frac": (((ratio > 1 + epsilon_high) & (adv > 0) & counted).sum() / n_counted).detach(),
        "kl_mean": kl_mean,
    }
    if policy_loss == "cispo":
        stats["cispo_clip_frac"] = (((ratio > epsilon_high) & (adv > 0) & counted).sum() / n_counted).detach()
    if entropy is not None:
        stats["entropy"] = entropy.detach()
    return loss, stats
