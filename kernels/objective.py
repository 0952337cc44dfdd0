"""The GRPO-family token objective: the one description of the per-token loss that every kernel backend reads.

Shapes: N rows (tokens), C rows of one chunk (a backend's subset, see ``TokenObjective.rows``).

Per token (TRL 1.16's ``_compute_loss``, so runs are comparable):
    r      = exp(logp - old)                      (old = logp.detach() when old_logprobs is None: r == 1)
             or, with ``sequence_index`` (GSPO, sequence-level importance sampling), the sequence's ratio
             exp(mean over its counted tokens of (logp - old)), the same for each of its tokens
    l_pg   the policy term, by ``policy_loss`` (``terms.POLICY_LOSSES``):
      "clip"   -min(r_u * A, clip(r, 1 - eps_low, 1 + eps_high) * A),  r_u = r, or min(r, delta) when delta is set
               (PPO / GRPO / DAPO / Dr. GRPO / GSPO / LUSPO: those differ in the token weights only)
      "cispo"  -sg[min(r, eps_high)] * A * logp   (MiniMax-M1; ``epsilon_high`` is the bound itself, TRL's eps_max,
               not 1 + eps_high; sg = stop-gradient)
      "sapo"   -sigmoid(tau * (r - 1)) * 4 / tau * A,  tau = sapo_temperature_pos if A > 0 else
               sapo_temperature_neg (Soft Adaptive Policy Optimization)
    k3     = exp(ref - logp) - (ref - logp) - 1    (only when beta != 0); times r (differentiable, before delta's
             clamp) with ``use_bias_correction_kl`` (TRL's default there: the unbiased reverse-KL gradient)
The loss of ``linear_grpo_loss`` is ``sum_n token_weights[n] * l_pg_n + beta * sum_n kl_token_weights[n] * k3_n``
(``kl_token_weights`` None: the same weights for both terms, i.e. ``sum_n token_weights[n] * (l_pg_n + beta k3_n)``).
Two weight vectors express TRL's rule that the entropy mask and the vLLM importance weight scale the policy term
only. Token weights stay outside the per-token maths because they also decide which rows a backend computes at all
(``active``: a row with both weights 0 gets no softmax work).

What a backend asks of the objective, and nothing else:
  * ``weighted_loss(logp, token_weights)``: the scalar loss from the log-probs, differentiable; the recompute
    backends let autograd hand its gradient to the fused op, the gradient-in-forward ones use it for the value;
  * ``logp_grad(logp, token_weights)``: its closed-form gradient per row, which the gradient-in-forward backends
    form chunk by chunk before any ``[N]`` vector of log-probs is complete;
  * facts that let them skip work: ``active(token_weights)`` (rows whose log-prob is needed), ``moving`` (rows
    whose gradient can be nonzero), ``grad_depends_on_logp`` (False: one gradient call before any product serves
    all rows) and ``row_local`` (a row's gradient depends on its own log-prob only; GSPO's does not, so it needs a
    recompute backend).
The scalars above (the term and its parameters, beta, the bias correction) are one ``settings.LossSettings``; a new
knob is a field there (with its check) plus its terms in ``token_loss`` and ``logp_grad``; no backend changes.
Not here: VESPO, whose weight is a function of the sum (not the mean) of the sequence's log-ratios at token-level
importance sampling, with the vLLM importance ratio folded into that sum: it needs a sequence grouping apart from
the ratio's level and the sampler's ratio as an input, not a per-token term of this shape.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .settings import LossSettings
from .terms import POLICY_LOSSES, clip_masks

__all__ = ["POLICY_LOSSES", "LossSettings", "TokenObjective", "clip_masks", "sequence_mean"]


def sequence_mean(values, sequence_index, counted):
    """Each token's sequence mean of ``values [N]`` over the sequence's counted tokens, ``[N]`` (differentiable).

    ``sequence_index [N]`` numbers the sequences 0..K-1 (K <= N); segment sums by ``index_add``, no host sync."""
    n = values.shape[0]
    c = counted.to(values.dtype)
    sums = values.new_zeros(n).index_add(0, sequence_index, values * c)  # [N], entries >= K stay 0
    count = values.new_zeros(n).index_add(0, sequence_index, c)  # [N]
    return (sums / count.clamp(min=1))[sequence_index]  # [N]


@dataclass(frozen=True, eq=False, init=False)  # eq=False: tensor fields have no boolean ==
class TokenObjective:
    """The per-token GRPO loss of one call (module docstring): the loss's ``LossSettings`` and the per-row tensors
    they act on. Built by ``TokenObjective(advantages, settings=LossSettings(...), ...)``, or with the settings'
    fields as keywords (``TokenObjective(advantages, beta=0.1, ref_logprobs=...)``), checked by ``LossSettings``."""

    settings: LossSettings
    """The policy term and its parameters, the KL weight and the bias correction."""
    advantages: torch.Tensor
    """[N] per-token advantage (the sequence's advantage repeated)."""
    old_logprobs: torch.Tensor | None
    """[N] behaviour-policy log-probs; None means ``logp.detach()`` (one update per batch: r == 1)."""
    ref_logprobs: torch.Tensor | None
    """[N] reference-model log-probs; required when ``beta != 0``."""
    sequence_index: torch.Tensor | None
    """[N] int64 sequence (0..K-1) of each row: GSPO's sequence-level ratio; None: token-level."""
    kl_token_weights: torch.Tensor | None
    """[N] weight of each row's KL term; None: ``token_weights`` (the policy term's weights)."""

    def __init__(self, advantages: torch.Tensor, *, settings: LossSettings | None = None,
                 old_logprobs: torch.Tensor | None = None, ref_logprobs: torch.Tensor | None = None,
                 sequence_index: torch.Tensor | None = None, kl_token_weights: torch.Tensor | None = None,
                 **setting_fields):
        if settings is None:
            settings = LossSettings(**setting_fields)
        elif setting_fields:
            raise TypeError(f"TokenObjective takes settings= or their fields, not both: {sorted(setting_fields)}")
        if settings.beta != 0.0 and ref_logprobs is None:
            raise ValueError("beta != 0 needs ref_logprobs")
        for name, value in (("settings", settings), ("advantages", advantages), ("old_logprobs", old_logprobs),
                            ("ref_logprobs", ref_logprobs), ("sequence_index", sequence_index),
                            ("kl_token_weights", kl_token_weights)):
            object.__setattr__(self, name, value)

    @property
    def beta(self) -> float:
        """The KL term's weight (``settings.beta``); 0: no KL term."""
        return self.settings.beta

    def check_rows(self, n: int, token_weights: torch.Tensor) -> None:
        """Raise ValueError unless every per-row vector, ``token_weights`` included, is ``[n]``."""
        for name, vec in (("advantages", self.advantages), ("token_weights", token_weights),
                          ("old_logprobs", self.old_logprobs), ("ref_logprobs", self.ref_logprobs),
                          ("sequence_index", self.sequence_index), ("kl_token_weights", self.kl_token_weights)):
            if vec is not None and vec.shape != (n,):
                raise ValueError(f"{name} must be [N]={n}, got {tuple(vec.shape)}")

    # ------------------------------------------------------------------- facts the backends skip work by

    @property
    def row_local(self) -> bool:
        """A row's loss gradient depends on that row's log-prob alone, so a pass may form it as soon as the row's
        softmax is known. False for the sequence-level ratio, whose rows wait for their whole sequence."""
        return self.sequence_index is None

    @property
    def grad_depends_on_logp(self) -> bool:
        """False when ``logp_grad`` is the same for any log-prob (r == 1 and no KL term): it can then be formed
        once, before any logits exist."""
        return self.old_logprobs is not None or self.beta != 0.0

    def active(self, token_weights: torch.Tensor) -> torch.Tensor:
        """``[N]`` bool, the rows whose log-prob the loss needs: a nonzero weight in either term. These are the
        rows counted by the sequence means (GSPO) and by the statistics."""
        if self.kl_token_weights is None:
            return token_weights != 0
        return (token_weights != 0) | (self.kl_token_weights != 0)

    def moving(self, token_weights: torch.Tensor) -> torch.Tensor:
        """``[N]`` bool, rows whose gradient can be nonzero, from ``token_weights`` (or ``token_weights != 0``).
        Every policy term is proportional to the advantage, so without the KL term a row with advantage 0 has
        ``l = 0`` whatever its log-prob (every row of a group with equal rewards)."""
        counted = token_weights != 0
        if self.kl_token_weights is None:
            return counted if self.beta != 0.0 else counted & (self.advantages != 0)
        policy = counted & (self.advantages != 0)
        return policy | (self.kl_token_weights != 0) if self.beta != 0.0 else policy

    def rows(self, index) -> "TokenObjective":
        """The objective of the rows ``index`` (an int64 tensor of row ids, or a slice), for a backend's chunk."""
        assert self.row_local, "a sequence-level objective has no per-row restriction"
        return dataclasses.replace(self, advantages=_pick(self.advantages, index),
                                   old_logprobs=_pick(self.old_logprobs, index),
                                   ref_logprobs=_pick(self.ref_logprobs, index),
                                   kl_token_weights=_pick(self.kl_token_weights, index))

    # ------------------------------------------------------------------------------------ the maths

    def terms(self, logp: torch.Tensor, counted: torch.Tensor):
        """``(l_pg [N], ratio [N] detached, kl [N] or None when beta == 0)`` from ``logp [N]`` (float32,
        differentiable); ``kl`` is k3, times r under ``use_bias_correction_kl``. ``counted [N]`` bool marks the
        rows of ``active``; the others' ``logp`` are placeholders (the backends leave 0 there) and get no
        gradient."""
        old = logp.detach() if self.old_logprobs is None else self.old_logprobs.float()  # [N]
        if self.old_logprobs is not None:
            # old at a placeholder row keeps exp(logp - old) finite: 0 * inf would be NaN in the gradient
            logp = torch.where(counted, logp, old)
        adv = self.advantages.float()  # [N]
        log_ratio = logp - old  # [N]
        if self.sequence_index is not None:
            log_ratio = sequence_mean(log_ratio, self.sequence_index, counted)
        ratio = torch.exp(log_ratio)  # [N]
        loss = POLICY_LOSSES[self.settings.policy_loss].loss(self.settings, ratio, adv, logp)  # [N]
        kl = None
        if self.beta != 0.0:
            diff = self.ref_logprobs.float() - logp  # [N]
            kl = torch.exp(diff) - diff - 1.0  # k3, >= 0
            if self.settings.use_bias_correction_kl:
                kl = kl * ratio
        return loss, ratio.detach(), kl

    def token_loss(self, logp: torch.Tensor, counted: torch.Tensor):
        """``(l [N], ratio [N] detached, kl [N] or None)`` with ``l = l_pg + beta * kl``: the per-token loss when
        one weight vector serves both terms (``kl_token_weights`` None). See ``terms``."""
        loss, ratio, kl = self.terms(logp, counted)
        if kl is not None:
            loss = loss + self.beta * kl
        return loss, ratio, kl

    def weighted_loss(self, logp: torch.Tensor, token_weights: torch.Tensor):
        """``(loss, ratio [N] detached, kl [N] or None, counted [N] bool)``: the float32 scalar
        ``sum_n token_weights[n] l_pg_n + beta sum_n kl_token_weights[n] kl_n``, differentiable in ``logp``."""
        counted = self.active(token_weights)
        if self.kl_token_weights is None:
            per_token, ratio, kl = self.token_loss(logp, counted)
            return (token_weights.float() * per_token).sum(), ratio, kl, counted
        policy, ratio, kl = self.terms(logp, counted)
        loss = (token_weights.float() * policy).sum()
        if kl is not None:
            loss = loss + self.beta * (self.kl_token_weights.float() * kl).sum()
        return loss, ratio, kl, counted

    def logp_grad(self, logp: torch.Tensor, token_weights: torch.Tensor) -> torch.Tensor:
        """``d weighted_loss / d logp`` per row, ``[C]`` float32, for a row-local objective (``rows`` of a chunk).

        Closed form of autograd's result on ``weighted_loss``, with its conventions at the kinks (tests compare the
        two): ``clamp`` passes the gradient where the input lies inside the closed interval, and ``minimum``
        splits it evenly between equal arguments (which is every row when ``old_logprobs`` is None: both
        branches equal A).
        """
        assert self.row_local, "the sequence-level gradient couples rows: take it by autograd"
        logp = logp.float()  # [C]
        adv = self.advantages.float()  # [C]
        ratio = torch.ones_like(logp) if self.old_logprobs is None else torch.exp(logp - self.old_logprobs.float())
        g = POLICY_LOSSES[self.settings.policy_loss].grad(self.settings, ratio, adv)
        g_kl = None
        if self.beta != 0.0:
            e = torch.exp(self.ref_logprobs.float() - logp)
            g_kl = 1.0 - e  # d k3 / d logp
            if self.settings.use_bias_correction_kl:  # d (k3 r) = r dk3 + k3 dr, dr = r
                diff = self.ref_logprobs.float() - logp
                g_kl = ratio * g_kl + (e - diff - 1.0) * ratio
        w = token_weights.float()
        # a skipped row's logp is a placeholder: never let inf * 0 through
        if self.kl_token_weights is None:
            if g_kl is not None:
                g = g + self.beta * g_kl
            return torch.where(w != 0, g * w, 0.0)
        out = torch.where(w != 0, g * w, 0.0)
        if g_kl is not None:
            kw = self.kl_token_weights.float()
            out = out + torch.where(kw != 0, self.beta * g_kl * kw, 0.0)
        return out

    def stats(self, ratio: torch.Tensor, kl: torch.Tensor | None, counted: torch.Tensor) -> dict:
        """TRL's clip fractions among counted rows (``r < 1 - eps_low and A < 0``, resp. ``r > 1 + eps_high and
        A > 0``) and the mean KL term over them (0 when beta == 0), from ``terms``'s outputs; under "cispo" also
        TRL's ``cispo_clip_ratio`` (``r > eps_high and A > 0``) as ``cispo_clip_frac``; device scalars."""
        n_counted = counted.sum().clamp(min=1).float()
        frac = lambda rows: (rows & counted).sum() / n_counted  # noqa: E731
        eps = dict(epsilon_low=self.settings.epsilon_low, epsilon_high=self.settings.epsilon_high)
        low, high = clip_masks("clip", ratio, self.advantages, **eps)  # logged under every term, as before
        out = {
            "clip_low_frac": frac(low),
            "clip_high_frac": frac(high),
            "kl_mean": (kl.detach() * counted).sum() / n_counted if kl is not None else ratio.new_zeros(()),
        }
        own = POLICY_LOSSES[self.settings.policy_loss].clip_stat
        if own is not None:
            out[own] = frac(clip_masks(self.settings.policy_loss, ratio, self.advantages, **eps)[1])
        return out


def _pick(vec, index):
    if vec is None:
        return None
    return vec[index] if isinstance(index, slice) else vec.index_select(0, index)
