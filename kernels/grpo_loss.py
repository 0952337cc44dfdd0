"""Fused linear -> GRPO-family loss: ``sum_n token_weights[n] * l_n``, without an ``[N, V]`` tensor.

Shapes: N rows (tokens), H hidden size, V vocabulary size.

Per token (TRL's objective, so runs are comparable):
    r      = exp(logp - old)                      (old = logp.detach() when old_logprobs is None: r == 1)
             or, with ``sequence_index`` (GSPO, sequence-level importance sampling), the sequence's ratio
             exp(mean over its counted tokens of (logp - old)), the same for each of its tokens
    r_u    = r, or min(r, delta) when delta is set (two-sided clipping)
    l_pg   = -min(r_u * A, clip(r, 1 - eps_low, 1 + eps_high) * A)
    k3     = exp(ref - logp) - (ref - logp) - 1    (only when beta != 0)
    l      = l_pg + beta * k3

Backends (``backend=``, resolved by ``backends.resolve_backend``):
  ``"cublas"``  CUDA default when a gradient is needed (``_gradfwd.py``): the gradient is formed in forward, chunk
               by chunk, from cuBLAS logits; three large products in all, the floor. Zero-weight rows skip the
               softmax work but not the products.
  ``"triton"``  the fused op of ``logprobs.py`` (online log-sum-exp in forward, logits recomputed in backward: four
               products, no host sync, no ``[C, V]`` buffer in forward); CUDA default without a gradient (old /
               reference log-probs, evaluation).
  ``"torch"``   the default off CUDA (``_chunked.loss_pass``): the same gradient-in-forward design in plain torch,
               float32, chunk sizes from a memory budget; three products.
For ``"triton"`` the token loss above is a handful of ``[N]`` vector ops whose gradient autograd hands to the
fused op as ``g_logp[n] = token_weights[n] * dl_n/dlogp_n``; ``"cublas"`` and ``"torch"`` use the closed form of
the same derivative (``_token_grad.grpo_logp_grad``, tested against autograd).

Sequence level (GSPO): the sequence means are segment sums over ``[N]`` vectors (``index_add`` by sequence), so
the loss still needs only per-token log-probs and the recompute backends run it unchanged. The gradient-in-forward
designs form each row's gradient before a sequence's other rows are known: ``"cublas"`` refuses
``sequence_index`` (``"auto"`` then picks ``"triton"`` on CUDA, and the trainer computes old / reference log-probs
on that same path), and ``"torch"`` runs it as a recompute path (the chunked log-prob op, four products).

Zero-weight tokens: every backend skips their softmax work in forward (``token_weights != 0``; the Triton paths
select rows on the device, without a host sync); their ``stats["logprobs"]`` entries are 0. ``"triton"`` also skips,
in backward, every row whose ``g_logp`` is 0, and ``"torch"`` every row with advantage 0 when beta == 0 (whole
groups with equal rewards, common in GRPO), whose gradient is 0 whatever the logits.
"""

from __future__ import annotations

import torch

from . import _chunked
from .backends import cublas_module, resolve_backend
from .logprobs import check_inputs, fused_logprobs

__all__ = ["linear_grpo_loss", "grpo_token_loss", "sequence_mean"]


def sequence_mean(values, sequence_index, counted):
    """Each token's sequence mean of ``values [N]`` over the sequence's counted tokens, ``[N]`` (differentiable).

    ``sequence_index [N]`` numbers the sequences 0..K-1 (K <= N); segment sums by ``index_add``, no host sync."""
    n = values.shape[0]
    c = counted.to(values.dtype)
    sums = values.new_zeros(n).index_add(0, sequence_index, values * c)  # [N], entries >= K stay 0
    count = values.new_zeros(n).index_add(0, sequence_index, c)  # [N]
    return (sums / count.clamp(min=1))[sequence_index]  # [N]


def grpo_token_loss(logp, advantages, *, old_logprobs, ref_logprobs, epsilon_low, epsilon_high, delta, beta,
                    sequence_index=None, counted=None):
    """Per-token loss ``l [N]`` and the tensors the stats need, from ``logp [N]`` (float32, differentiable).

    ``sequence_index [N]`` (with ``counted [N]`` bool): the ratio is the sequence-level one (GSPO)."""
    old = logp.detach() if old_logprobs is None else old_logprobs.float()  # [N]
    adv = advantages.float()  # [N]
    log_ratio = logp - old  # [N]
    if sequence_index is not None:
        log_ratio = sequence_mean(log_ratio, sequence_index, counted)
    ratio = torch.exp(log_ratio)  # [N]
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
    sequence_index: torch.Tensor | None = None,
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
        return_entropy: also return the softmax entropy per row in ``stats`` (not differentiated).
        backend: ``"auto"``, ``"cublas"``, ``"triton"`` or ``"torch"``; see the module docstring.
        chunk_size: rows per chunk (``"cublas"``: the ``[C, V]`` buffer; otherwise see ``linear_logprobs``).
        sequence_index: ``[N]`` int64, the sequence (numbered 0..K-1) of each row: sequence-level importance
            sampling (GSPO), the ratio of every token being its sequence's ``exp(mean(logp - old))`` over the
            sequence's nonzero-weight rows. A sequence must lie wholly in this call. Not on ``"cublas"``.

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
                      ("old_logprobs", old_logprobs), ("ref_logprobs", ref_logprobs),
                      ("sequence_index", sequence_index)):
        if vec is not None and vec.shape != hidden.shape[:1]:
            raise ValueError(f"{name} must be [N]={hidden.shape[0]}, got {tuple(vec.shape)}")

    counted = token_weights != 0  # [N]
    token_kw = dict(old_logprobs=old_logprobs, ref_logprobs=ref_logprobs, epsilon_low=epsilon_low,
                    epsilon_high=epsilon_high, delta=delta, beta=beta)
    wants_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    # sequence level: the gradient-in-forward path cannot form a row's gradient before its sequence is complete
    name = resolve_backend(backend, hidden.device, needs_grad=wants_grad and sequence_index is None)
    if name == "cublas" and sequence_index is not None:
        raise ValueError("linear_grpo_loss(backend='cublas') has no sequence-level importance sampling (it forms "
                         "each row's gradient before its sequence's other rows are known): use 'triton' or 'auto'")
    if name in ("cublas", "torch") and sequence_index is None:  # the gradient is formed in forward
        check_inputs(hidden, weight, targets, temperature)
        grad_on = torch.is_grad_enabled()
        needs = (grad_on and hidden.requires_grad, grad_on and weight.requires_grad)
        impl = _chunked if name == "torch" else cublas_module(hidden.device)
        loss, logp, entropy, ratio, kl = _GradInForwardLoss.apply(
            hidden, weight, targets, advantages, token_weights, 1.0 / float(temperature), chunk_size, token_kw, needs,
            impl, return_entropy)
    else:
        logp, entropy = fused_logprobs(hidden, weight, targets, active=counted, temperature=temperature,
                                       with_entropy=return_entropy, backend=name, chunk_size=chunk_size)
        per_token, ratio, kl = grpo_token_loss(_with_old(logp, counted, old_logprobs), advantages, **token_kw,
                                               sequence_index=sequence_index, counted=counted)
        loss = (token_weights.float() * per_token).sum()

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


def _with_old(logp, counted, old_logprobs):
    # Skipped rows have logp == 0; using old there keeps exp(logp - old) finite (0 * inf would be NaN in the
    # gradient) and the row still gets no gradient through the where.
    return logp if old_logprobs is None else torch.where(counted, logp, old_logprobs.float())


class _GradInForwardLoss(torch.autograd.Function):
    """``(loss, logp, entropy, ratio, kl)``; only ``loss`` is differentiable (the others feed the stats; ``kl`` is
    None when beta == 0). Forward runs ``impl.loss_pass`` (``_gradfwd`` or ``_chunked``), which also forms the
    gradients of the loss; backward scales them by the upstream gradient."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, advantages, token_weights, inv_temp, chunk_size, token_kw, needs, impl,
                with_entropy):
        logp, entropy, grad_hidden, grad_weight = impl.loss_pass(
            hidden, weight, targets, advantages, token_weights, inv_temp=inv_temp, chunk_size=chunk_size,
            need_grad_hidden=needs[0], need_grad_weight=needs[1], with_entropy=with_entropy, **token_kw,
        )
        counted = token_weights != 0
        per_token, ratio, kl = grpo_token_loss(_with_old(logp, counted, token_kw["old_logprobs"]), advantages,
                                               **token_kw)
        loss = (token_weights.float() * per_token).sum()
        # Held on ctx, not saved: backward scales them in place, which torch ops (the _chunked path) record in the
        # version counter that saved tensors are checked against. They are no outputs, so no reference cycle.
        ctx.grads, ctx.impl, ctx.used = (grad_hidden, grad_weight), impl, False
        ctx.mark_non_differentiable(*(x for x in (logp, entropy, ratio, kl) if x is not None))
        return loss, logp, entropy, ratio, kl

    @staticmethod
    def backward(ctx, g_loss, *_g_stats):
        grad_hidden, grad_weight = ctx.grads
        if g_loss is None:
            return (None,) * 11
        # Dropped from ctx so that the returned gradients have no other owner: autograd then moves grad_weight into
        # weight.grad instead of cloning it (a clone would hold a second [V, H] at the peak).
        ctx.grads = (None, None)
        if ctx.used:
            raise RuntimeError("linear_grpo_loss(backend='cublas' or 'torch') computes its gradients once, in "
                               "forward, and scales them in place: a second backward through it is not supported "
                               "(use backend='triton', or linear_logprobs and grpo_token_loss, for retain_graph / "
                               "double backward)")
        ctx.used = True
        # In place, no host sync (_gradfwd: a no-op launch when g_loss == 1, i.e. loss.backward()).
        for grad in (grad_hidden, grad_weight):
            if grad is not None:
                ctx.impl.scale_(grad, g_loss)
        return grad_hidden, grad_weight, *(None,) * 9
