"""Fused linear -> GRPO-family loss: ``sum_n token_weights[n] * l_n``, without an ``[N, V]`` tensor.

Shapes: N rows (tokens), H hidden size, V vocabulary size.

Two layers meet here. The objective, ``l_n`` as a function of the token's log-prob, is ``objective.TokenObjective``
(the maths is written out there), built once per call from a ``settings.LossSettings``, which checks the settings,
and the call's per-row tensors. The backends (``backend=``, resolved by ``backends.resolve_backend``) only turn
log-probs and their gradient into products with the lm_head; they take the objective as one argument and ask it for
what they need:
  ``"cublas"``  CUDA default when a gradient is needed (``_gradfwd.loss_pass``): the gradient is formed in forward,
               chunk by chunk, from cuBLAS logits and ``TokenObjective.logp_grad``; three large products in all,
               the floor. Zero-weight rows skip the softmax work but not the products.
  ``"triton"``  the fused op of ``logprobs.py`` (online log-sum-exp in forward, logits recomputed in backward: four
               products, no host sync, no ``[C, V]`` buffer in forward); CUDA default without a gradient (old /
               reference log-probs, evaluation). Autograd differentiates ``TokenObjective.token_loss``, a handful
               of ``[N]`` vector ops, and hands ``g_logp[n] = token_weights[n] * dl_n/dlogp_n`` to the fused op.
  ``"torch"``   the default off CUDA (``_chunked.loss_pass``): the same gradient-in-forward design in plain torch,
               float32, chunk sizes from a memory budget; three products.

Sequence level (GSPO): the sequence means are segment sums over ``[N]`` vectors, so the loss still needs only
per-token log-probs and the recompute backends run it unchanged. A gradient-in-forward pass forms each row's
gradient before a sequence's other rows are known (``TokenObjective.row_local`` is False): ``"cublas"`` refuses it
(``backends.check_backend``; ``"auto"`` then picks ``"triton"`` on CUDA), and ``"torch"`` runs it as a recompute
path (the chunked log-prob op, four products).

Zero-weight tokens: every backend skips their softmax work in forward (``token_weights != 0``; the Triton paths
select rows on the device, without a host sync); their ``stats["logprobs"]`` entries are 0. ``"triton"`` also skips,
in backward, every row whose ``g_logp`` is 0, and ``"torch"`` every row outside ``TokenObjective.moving`` (with
beta == 0, advantage 0: whole groups with equal rewards, common in GRPO), whose gradient is 0 whatever the logits.
"""

from __future__ import annotations

import torch

from .backends import grad_in_forward_module, resolve_backend
from .logprobs import check_inputs, fused_logprobs
from .objective import TokenObjective
from .settings import LossSettings

__all__ = ["fused_grpo_loss", "linear_grpo_loss"]


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
    policy_loss: str = "clip",
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    use_bias_correction_kl: bool = False,
    kl_token_weights: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
):
    """GRPO-family loss (the normaliser is in ``token_weights``, the term in ``policy_loss``) of an lm_head applied
    to ``hidden``: ``sum_n token_weights[n] l_pg_n + beta sum_n kl_token_weights[n] k3_n`` (``objective.py``).
    The settings' keywords build one ``LossSettings`` (which checks them) for ``fused_grpo_loss``.

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
            sequence's rows of nonzero weight (in either term). A sequence must lie wholly in this call. Not on
            ``"cublas"``.
        policy_loss: the per-token policy term, ``"clip"`` (PPO / GRPO), ``"cispo"`` (``-sg[min(r, epsilon_high)]
            A logp``: ``epsilon_high`` is the bound itself, TRL's eps_max) or ``"sapo"`` (the soft gate with
            ``sapo_temperature_pos`` / ``sapo_temperature_neg``, TRL's names and defaults).
        use_bias_correction_kl: the KL term is ``k3 * r`` (r differentiable), TRL's ``use_bias_correction_kl``.
        kl_token_weights: ``[N]`` weights of the KL term; None: ``token_weights``. TRL weights the KL term by the
            plain normaliser and the policy term also by the entropy mask and the vLLM importance ratio.
        bias: ``[V]`` lm_head bias (logits ``= hidden @ weight.T + bias``), the weight's dtype; differentiable.

    Returns:
        ``(loss, stats)``: ``loss`` a float32 scalar; ``stats`` device tensors, no host sync: ``logprobs [N]``
        (detached, 0 where the weight is 0), ``clip_low_frac`` and ``clip_high_frac`` (TRL's: among tokens with
        nonzero weight, the fraction with ``r < 1 - eps_low and A < 0``, resp. ``r > 1 + eps_high and A > 0``),
        ``kl_mean`` (mean KL term over those tokens, bias-corrected when asked; 0 when beta == 0), ``entropy [N]``
        when asked, and ``cispo_clip_frac`` (TRL's ``cispo_clip_ratio``: ``r > epsilon_high and A > 0``) under
        cispo. "Tokens with nonzero weight" are those with a nonzero weight in either term.
    """
    settings = LossSettings(policy_loss=policy_loss, epsilon_low=epsilon_low, epsilon_high=epsilon_high, delta=delta,
                            beta=beta, sapo_temperature_pos=sapo_temperature_pos,
                            sapo_temperature_neg=sapo_temperature_neg, use_bias_correction_kl=use_bias_correction_kl,
                            importance_sampling_level="token" if sequence_index is None else "sequence",
                            temperature=temperature)
    return fused_grpo_loss(hidden, weight, targets, advantages, token_weights, settings, old_logprobs=old_logprobs,
                           ref_logprobs=ref_logprobs, kl_token_weights=kl_token_weights,
                           sequence_index=sequence_index, return_entropy=return_entropy, backend=backend,
                           chunk_size=chunk_size, bias=bias)


def fused_grpo_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    advantages: torch.Tensor,
    token_weights: torch.Tensor,
    settings: LossSettings,
    *,
    old_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    kl_token_weights: torch.Tensor | None = None,
    sequence_index: torch.Tensor | None = None,
    return_entropy: bool = False,
    backend: str = "auto",
    chunk_size: int | None = None,
    bias: torch.Tensor | None = None,
):
    """``linear_grpo_loss`` with its settings as one ``LossSettings`` (what the trainer and the adapters call): the
    same loss, arguments and result. ``sequence_index`` is required at ``importance_sampling_level="sequence"``
    and refused at "token"."""
    if settings.sequence_level != (sequence_index is not None):
        raise ValueError(f"importance_sampling_level={settings.importance_sampling_level!r} "
                         + ("needs sequence_index (the sequence of each row)" if settings.sequence_level else
                            "takes no sequence_index (set importance_sampling_level='sequence' for GSPO)"))
    temperature = settings.temperature
    objective = TokenObjective(advantages, settings=settings, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs,
                               sequence_index=sequence_index, kl_token_weights=kl_token_weights)
    objective.check_rows(hidden.shape[0], token_weights)

    counted = objective.active(token_weights)  # [N]
    grad_on = torch.is_grad_enabled()
    needs = tuple(grad_on and x is not None and x.requires_grad for x in (hidden, weight, bias))
    name = resolve_backend(backend, hidden.device, needs_grad=any(needs), sequence_level=not objective.row_local)
    impl = grad_in_forward_module(name, hidden.device) if objective.row_local else None
    if impl is not None:
        check_inputs(hidden, weight, targets, temperature, bias)
        loss, logp, entropy, ratio, kl = _GradInForwardLoss.apply(
            hidden, weight, targets, token_weights, objective, 1.0 / float(temperature), chunk_size, needs, impl,
            return_entropy, bias)
    else:
        logp, entropy = fused_logprobs(hidden, weight, targets, active=counted, temperature=temperature,
                                       with_entropy=return_entropy, backend=name, chunk_size=chunk_size, bias=bias)
        loss, ratio, kl, _ = objective.weighted_loss(logp, token_weights)

    stats = {"logprobs": logp.detach(), **objective.stats(ratio, kl, counted)}
    if return_entropy:
        stats["entropy"] = entropy.detach()
    return loss, stats


class _GradInForwardLoss(torch.autograd.Function):
    """``(loss, logp, entropy, ratio, kl)``; only ``loss`` is differentiable, in hidden, weight and bias (the others
    feed the stats; ``kl`` is None when beta == 0). Forward runs ``impl.loss_pass`` (``_gradfwd`` or ``_chunked``),
    which also forms the gradients of the loss; backward scales them by the upstream gradient. The objective's
    tensors are no inputs of the function: none of them gets a gradient on this path."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, token_weights, objective, inv_temp, chunk_size, needs, impl,
                with_entropy, bias):
        # grad_bias: float32 [V], summed into by the pass (the bias's dtype after backward's scaling)
        grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if needs[2] else None
        logp, entropy, grad_hidden, grad_weight = impl.loss_pass(
            hidden, weight, targets, token_weights, objective, inv_temp=inv_temp, chunk_size=chunk_size,
            need_grad_hidden=needs[0], need_grad_weight=needs[1], with_entropy=with_entropy, bias=bias,
            grad_bias=grad_bias,
        )
        loss, ratio, kl, _ = objective.weighted_loss(logp, token_weights)
        if grad_bias is not None:
            grad_bias = grad_bias.to(bias.dtype)
        # Held on ctx, not saved: backward scales them in place, which torch ops (the _chunked path) record in the
        # version counter that saved tensors are checked against. They are no outputs, so no reference cycle.
        ctx.grads, ctx.impl, ctx.used = (grad_hidden, grad_weight, grad_bias), impl, False
        ctx.mark_non_differentiable(*(x for x in (logp, entropy, ratio, kl) if x is not None))
        return loss, logp, entropy, ratio, kl

    @staticmethod
    def backward(ctx, g_loss, *_g_stats):
        grad_hidden, grad_weight, grad_bias = ctx.grads
        if g_loss is None:
            return (None,) * 11
        # Dropped from ctx so that the returned gradients have no other owner: autograd then moves grad_weight into
        # weight.grad instead of cloning it (a clone would hold a second [V, H] at the peak).
        ctx.grads = (None, None, None)
        if ctx.used:
            raise RuntimeError("linear_grpo_loss(backend='cublas' or 'torch') computes its gradients once, in "
                               "forward, and scales them in place: a second backward through it is not supported "
                               "(use backend='triton', or linear_logprobs and TokenObjective.token_loss, for "
                               "retain_graph / double backward)")
        ctx.used = True
        # In place, no host sync (_gradfwd: a no-op launch when g_loss == 1, i.e. loss.backward()).
        for grad in (grad_hidden, grad_weight, grad_bias):
            if grad is not None:
                ctx.impl.scale_(grad, g_loss)
        return grad_hidden, grad_weight, *(None,) * 8, grad_bias
