"""The GRPO-family token objective: the one description of the per-token loss that every kernel backend reads.

Shapes: N rows (tokens), C rows of one chunk (a backend's subset, see ``TokenObjective.rows``).

Per token (TRL's objective, so runs are comparable):
    r      = exp(logp - old)                      (old = logp.detach() when old_logprobs is None: r == 1)
             or, with ``sequence_index`` (GSPO, sequence-level importance sampling), the sequence's ratio
             exp(mean over its counted tokens of (logp - old)), the same for each of its tokens
    r_u    = r, or min(r, delta) when delta is set (two-sided clipping)
    l_pg   = -min(r_u * A, clip(r, 1 - eps_low, 1 + eps_high) * A)
    k3     = exp(ref - logp) - (ref - logp) - 1    (only when beta != 0)
    l      = l_pg + beta * k3
The loss of ``linear_grpo_loss`` is ``sum_n token_weights[n] * l_n``; token weights stay outside the objective
because they also decide which rows a backend computes at all (0: no softmax work).

What a backend asks of the objective, and nothing else:
  * ``token_loss(logp, counted)``: ``l [N]`` from the log-probs, differentiable; the recompute backends let
    autograd hand its gradient to the fused op, the gradient-in-forward ones use it for the loss value;
  * ``logp_grad(logp, token_weights)``: the closed form of ``token_weights * dl/dlogp``, which the
    gradient-in-forward backends form chunk by chunk before any ``[N]`` vector of log-probs is complete;
  * facts that let them skip work: ``moving(counted)`` (rows whose gradient can be nonzero),
    ``grad_depends_on_logp`` (False: one gradient call before any product serves all rows) and ``row_local``
    (a row's gradient depends on its own log-prob only; GSPO's does not, so it needs a recompute backend).
A new knob of the objective is a field here plus its terms in ``token_loss`` and ``logp_grad``; no backend changes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

__all__ = ["TokenObjective", "sequence_mean"]


def sequence_mean(values, sequence_index, counted):
    """Each token's sequence mean of ``values [N]`` over the sequence's counted tokens, ``[N]`` (differentiable).

    ``sequence_index [N]`` numbers the sequences 0..K-1 (K <= N); segment sums by ``index_add``, no host sync."""
    n = values.shape[0]
    c = counted.to(values.dtype)
    sums = values.new_zeros(n).index_add(0, sequence_index, values * c)  # [N], entries >= K stay 0
    count = values.new_zeros(n).index_add(0, sequence_index, c)  # [N]
    return (sums / count.clamp(min=1))[sequence_index]  # [N]


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
    """Lower clip range of the ratio: ``r >= 1 - epsilon_low``."""
    epsilon_high: float = 0.2
    """Upper clip range of the ratio: ``r <= 1 + epsilon_high``."""
    delta: float | None = None
    """Upper clamp of the unclipped ratio (two-sided clipping); None disables it."""
    beta: float = 0.0
    """Weight of the k3 KL penalty towards the reference model."""
    sequence_index: torch.Tensor | None = None
    """[N] int64 sequence (0..K-1) of each row: GSPO's sequence-level ratio; None: token-level."""

    def __post_init__(self):
        if self.beta != 0.0 and self.ref_logprobs is None:
            raise ValueError("beta != 0 needs ref_logprobs")
        if self.epsilon_low < 0 or self.epsilon_high < 0:
            raise ValueError(f"epsilon_low / epsilon_high must be >= 0, got {self.epsilon_low}, {self.epsilon_high}")
        if self.delta is not None and self.delta <= 0:
            raise ValueError(f"delta must be > 0 (TRL recommends > 1 + epsilon_high), got {self.delta}")

    def check_rows(self, n: int, token_weights: torch.Tensor) -> None:
        """Raise ValueError unless every per-row vector, ``token_weights`` included, is ``[n]``."""
        for name, vec in (("advantages", self.advantages), ("token_weights", token_weights),
                          ("old_logprobs", self.old_logprobs), ("ref_logprobs", self.ref_logprobs),
                          ("sequence_index", self.sequence_index)):
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

    def moving(self, counted: torch.Tensor) -> torch.Tensor:
        """``[N]`` bool, rows of ``counted`` whose gradient can be nonzero. Without the KL term a row with
        advantage 0 has ``l = 0`` whatever its log-prob (every row of a group with equal rewards)."""
        return counted if self.beta != 0.0 else counted & (self.advantages != 0)

    def rows(self, index) -> "TokenObjective":
        """The objective of the rows ``index`` (an int64 tensor of row ids, or a slice), for a backend's chunk."""
        assert self.row_local, "a sequence-level objective has no per-row restriction"
        return dataclasses.replace(self, advantages=_pick(self.advantages, index),
                                   old_logprobs=_pick(self.old_logprobs, index),
                                   ref_logprobs=_pick(self.ref_logprobs, index))

    # ------------------------------------------------------------------------------------ the maths

    def token_loss(self, logp: torch.Tensor, counted: torch.Tensor):
        """``(l [N], ratio [N] detached, k3 [N] or None when beta == 0)`` from ``logp [N]`` (float32,
        differentiable). ``counted [N]`` bool marks the rows with nonzero token weight; the others' ``logp`` are
        placeholders (the backends leave 0 there) and get no gradient."""
        old = logp.detach() if self.old_logprobs is None else self.old_logprobs.float()  # [N]
        if self.old_logprobs is not None:
            # old at a placeholder row keeps exp(logp - old) finite: 0 * inf would be NaN in the gradient
            logp = torch.where(counted, logp, old)
        adv = self.advantages.float()  # [N]
        log_ratio = logp - old  # [N]
        if self.sequence_index is not None:
            log_ratio = sequence_mean(log_ratio, self.sequence_index, counted)
        ratio = torch.exp(log_ratio)  # [N]
        ratio_unclipped = ratio if self.delta is None else torch.clamp(ratio, max=self.delta)
        ratio_clipped = torch.clamp(ratio, 1.0 - self.epsilon_low, 1.0 + self.epsilon_high)
        loss = -torch.minimum(ratio_unclipped * adv, ratio_clipped * adv)  # [N]
        kl = None
        if self.beta != 0.0:
            diff = self.ref_logprobs.float() - logp  # [N]
            kl = torch.exp(diff) - diff - 1.0  # k3, >= 0
            loss = loss + self.beta * kl
        return loss, ratio.detach(), kl

    def logp_grad(self, logp: torch.Tensor, token_weights: torch.Tensor) -> torch.Tensor:
        """``token_weights * dl/dlogp`` per row, ``[C]`` float32, for a row-local objective (``rows`` of a chunk).

        Closed form of autograd's result on ``token_loss``, with its conventions at the kinks (tests compare the
        two): ``clamp`` passes the gradient where the input lies inside the closed interval, and ``minimum``
        splits it evenly between equal arguments (which is every row when ``old_logprobs`` is None: both
        branches equal A).
        """
        assert self.row_local, "the sequence-level gradient couples rows: take it by autograd"
        logp = logp.float()  # [C]
        adv = self.advantages.float()  # [C]
        ratio = torch.ones_like(logp) if self.old_logprobs is None else torch.exp(logp - self.old_logprobs.float())
        d_ratio = ratio  # d ratio / d logp
        unclipped, d_unclipped = ratio, d_ratio
        if self.delta is not None:
            unclipped = torch.clamp(ratio, max=self.delta)
            d_unclipped = torch.where(ratio <= self.delta, d_ratio, 0.0)
        lo, hi = 1.0 - self.epsilon_low, 1.0 + self.epsilon_high
        clipped = torch.clamp(ratio, lo, hi)
        d_clipped = torch.where((ratio >= lo) & (ratio <= hi), d_ratio, 0.0)
        a, b = unclipped * adv, clipped * adv
        da, db = d_unclipped * adv, d_clipped * adv
        d_min = torch.where(a < b, da, torch.where(a > b, db, 0.5 * (da + db)))
        g = -d_min
        if self.beta != 0.0:
            g = g + self.beta * (1.0 - torch.exp(self.ref_logprobs.float() - logp))  # d k3 / d logp
        w = token_weights.float()
        return torch.where(w != 0, g * w, 0.0)  # a skipped row's logp is a placeholder: never let inf * 0 through

    def stats(self, ratio: torch.Tensor, kl: torch.Tensor | None, counted: torch.Tensor) -> dict:
        """TRL's clip fractions among counted rows (``r < 1 - eps_low and A < 0``, resp. ``r > 1 + eps_high and
        A > 0``) and the mean k3 over them (0 when beta == 0), from ``token_loss``'s outputs; device scalars."""
        adv = self.advantages
        n_counted = counted.sum().clamp(min=1).float()
        return {
            "clip_low_frac": ((ratio < 1.0 - self.epsilon_low) & (adv < 0) & counted).sum() / n_counted,
            "clip_high_frac": ((ratio > 1.0 + self.epsilon_high) & (adv > 0) & counted).sum() / n_counted,
            "kl_mean": (kl.detach() * counted).sum() / n_counted if kl is not None else ratio.new_zeros(()),
        }


def _pick(vec, index):
    if vec is None:
        return None
    return vec[index] if isinstance(index, slice) else vec.index_select(0, index)
