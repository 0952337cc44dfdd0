"""The GRPO-family token objective: the one description of the per-token loss that every kernel backend reads.

Shapes: N rows (tokens), C rows of one chunk (a backend's subset, see ``TokenObjective.rows``).

Per token (TRL 1.16's ``_compute_loss``, so runs are comparable):
    r      = exp(logp - old)                      (old = logp.detach() when old_logprobs is None: r == 1)
             or, with ``sequence_index`` (GSPO, sequence-level importance sampling), the sequence's ratio
             exp(mean over its counted tokens of (logp - old)), the same for each of its tokens
    l_pg   the policy term, by ``policy_loss`` (``POLICY_LOSSES``):
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
A new knob of the objective is a field here plus its terms in ``token_loss`` and ``logp_grad``; no backend changes.
Not here: VESPO, whose weight is a function of the sum (not the mean) of the sequence's log-ratios at token-level
importance sampling, with the vLLM importance ratio folded into that sum: it needs a sequence grouping apart from
the ratio's level and the sampler's ratio as an input, not a per-token term of this shape.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

__all__ = ["POLICY_LOSSES", "TokenObjective", "clip_masks", "sequence_mean"]


def sequence_mean(values, sequence_index, counted):
    """Each token's sequence mean of ``values [N]`` over the sequence's counted tokens, ``[N]`` (differentiable).

    ``sequence_index [N]`` numbers the sequences 0..K-1 (K <= N); segment sums by ``index_add``, no host sync."""
    n = values.shape[0]
    c = counted.to(values.dtype)
    sums = values.new_zeros(n).index_add(0, sequence_index, values * c)  # [N], entries >= K stay 0
    count = values.new_zeros(n).index_add(0, sequence_index, c)  # [N]
    return (sums / count.clamp(min=1))[sequence_index]  # [N]


# ------------------------------------------------------------------------------------ the policy terms


class PolicyTerm(NamedTuple):
    """One per-token policy term. ``loss(obj, ratio, adv, logp) -> l_pg [N]``, differentiable through ``ratio`` and
    ``logp``; ``grad(obj, ratio, adv) -> d l_pg / d logp [C]`` for a row-local objective, where
    ``d ratio / d logp = ratio`` (also when old is None: ``exp(logp - sg(logp))``); ``clipped(eps_low, eps_high,
    ratio, adv) -> (low, high)`` bool, the rows whose gradient the term's clip cuts off from below / above (both
    all False for a term without a clip); ``clip_stat``: the extra statistic that counts ``high`` under the term's
    own name (TRL's ``cispo_clip_ratio``), or None; ``bound_is_epsilon_high``: the ratio's cap is ``epsilon_high``
    itself (not ``1 + epsilon_high``), so it must be > 0 and does not change with the importance level."""

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
"""``TokenObjective.policy_loss`` -> its term (module docstring)."""


def clip_masks(policy_loss: str, ratio: torch.Tensor, advantages: torch.Tensor, *, epsilon_low: float,
               epsilon_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(low, high)`` bool, broadcast of ``ratio`` and ``advantages``: where the ``policy_loss`` term's clip binds
    (``"clip"``: ``r < 1 - eps_low and A < 0``, resp. ``r > 1 + eps_high and A > 0``; ``"cispo"``: high only,
    ``r > eps_high and A > 0``; ``"sapo"``: never). The one definition of a clip fraction: the kernels' statistics,
    the Liger-shaped module's ``clip_ratio`` and the TRL adapter's ``clip_ratio/*`` all count these."""
    return POLICY_LOSSES[policy_loss].clipped(epsilon_low, epsilon_high, ratio, advantages)


@dataclass(frozen=True, eq=False)  # eq=False: tensor fields have no boolean ==
class TokenObjective:
    """The settings of the per-token GRPO loss (module docstring), validated once when built."""

    advantages: torch.Tensor
    """[N] per-token advantage (the sequence's advantage repeated)."""
    old_logprobs: torch.Tensor | None = None
    """[N] behaviour-policy log-probs; None means ``logp.detach()`` (one update per batch: r == 1)."""
    ref_logprobs: torch.Tensor | None = None
    """[N] reference-model log-probs; required when ``beta != 0``."""
    epsilon_low: float = 0.2
    """Lower clip range of the ratio: ``r >= 1 - epsilon_low`` ("clip")."""
    epsilon_high: float = 0.2
    """Upper clip range of the ratio: ``r <= 1 + epsilon_high`` ("clip"); "cispo": the truncation bound itself,
    ``min(r, epsilon_high)`` (TRL's eps_max; ScaleRL recommends 5.0)."""
    delta: float | None = None
    """Upper clamp of the unclipped ratio (two-sided clipping, "clip"); None disables it."""
    beta: float = 0.0
    """Weight of the k3 KL penalty towards the reference model."""
    sequence_index: torch.Tensor | None = None
    """[N] int64 sequence (0..K-1) of each row: GSPO's sequence-level ratio; None: token-level."""
    policy_loss: str = "clip"
    """The per-token policy term, a key of ``POLICY_LOSSES``: "clip", "cispo" or "sapo"."""
    sapo_temperature_pos: float = 1.0
    """"sapo": gate temperature of tokens with positive advantage (TRL's default)."""
    sapo_temperature_neg: float = 1.05
    """"sapo": gate temperature of tokens with advantage <= 0 (TRL's default)."""
    use_bias_correction_kl: bool = False
    """Multiply k3 by the (differentiable) ratio r, as TRL's ``use_bias_correction_kl`` (TRL's default is True)."""
    kl_token_weights: torch.Tensor | None = None
    """[N] weight of each row's KL term; None: ``token_weights`` (the policy term's weights)."""

    def __post_init__(self):
        if self.policy_loss not in POLICY_LOSSES:
            raise ValueError(f"policy_loss must be one of {sorted(POLICY_LOSSES)}, got {self.policy_loss!r}")
        if self.beta != 0.0 and self.ref_logprobs is None:
            raise ValueError("beta != 0 needs ref_logprobs")
        if self.epsilon_low < 0 or self.epsilon_high < 0:
            raise ValueError(f"epsilon_low / epsilon_high must be >= 0, got {self.epsilon_low}, {self.epsilon_high}")
        if POLICY_LOSSES[self.policy_loss].bound_is_epsilon_high and not self.epsilon_high > 0:
            raise ValueError(f"policy_loss={self.policy_loss!r} truncates the ratio at epsilon_high, which must be > 0 "
                             f"(TRL recommends 5.0), got {self.epsilon_high}")
        if self.delta is not None and self.delta <= 0:
            raise ValueError(f"delta must be > 0 (TRL recommends > 1 + epsilon_high), got {self.delta}")
        if not (self.sapo_temperature_pos > 0 and self.sapo_temperature_neg > 0):
            raise ValueError(f"sapo_temperature_pos / sapo_temperature_neg must be > 0, got "
                             f"{self.sapo_temperature_pos}, {self.sapo_temperature_neg}")

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
        loss = POLICY_LOSSES[self.policy_loss].loss(self, ratio, adv, logp)  # [N]
        kl = None
        if self.beta != 0.0:
            diff = self.ref_logprobs.float() - logp  # [N]
            kl = torch.exp(diff) - diff - 1.0  # k3, >= 0
            if self.use_bias_correction_kl:
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
        g = POLICY_LOSSES[self.policy_loss].grad(self, ratio, adv)
        g_kl = None
        if self.beta != 0.0:
            e = torch.exp(self.ref_logprobs.float() - logp)
            g_kl = 1.0 - e  # d k3 / d logp
            if self.use_bias_correction_kl:  # d (k3 r) = r dk3 + k3 dr, dr = r
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
        eps = dict(epsilon_low=self.epsilon_low, epsilon_high=self.epsilon_high)
        low, high = clip_masks("clip", ratio, self.advantages, **eps)  # logged under every term, as before
        out = {
            "clip_low_frac": frac(low),
            "clip_high_frac": frac(high),
            "kl_mean": (kl.detach() * counted).sum() / n_counted if kl is not None else ratio.new_zeros(()),
        }
        own = POLICY_LOSSES[self.policy_loss].clip_stat
        if own is not None:
            out[own] = frac(clip_masks(self.policy_loss, ratio, self.advantages, **eps)[1])
        return out


def _pick(vec, index):
    if vec is None:
        return None
    return vec[index] if isinstance(index, slice) else vec.index_select(0, index)
