"""Padded-batch adapters of the fused GRPO loss: ``padded_grpo_loss`` and the Liger-shaped ``FusedLinearGRPOLoss``.

Shapes: B sequences, T completion positions, H hidden size, V vocabulary size, N = rows of the batch that count
(``attention_mask`` == 1), in row-major order.

Trainers hold a padded ``[B, T]`` batch and a mask; ``linear_grpo_loss`` (stable) takes flat ``[N]`` rows. The
conversion lives here, once: keep the masked rows (an ``index_select`` the gradient flows back through), give each
row its sequence's advantage, number the rows by sequence for the sequence-level ratio, call the kernel, and put the
per-row statistics back into ``[B, T]``. Selecting the rows costs one host sync per call (the row count), as in
TRL's own fused head on Triton devices; in exchange the lm_head products run on real tokens only.

``FusedLinearGRPOLoss`` takes ``LigerFusedLinearGRPOLoss``'s constructor options and call (Liger-Kernel 0.8), so
a Liger user swaps one import. Its loss types, normalisers and metrics are Liger's; the tests pin them against a
plain-torch reference of Liger's definitions. Options it cannot serve are refused when the module is built.
"""

from __future__ import annotations

import torch

from .grpo_loss import linear_grpo_loss
from .logprobs import linear_logprobs

__all__ = ["FusedLinearGRPOLoss", "padded_grpo_loss", "padded_logprobs", "LOSS_TYPE_TERMS"]

# loss type -> the kernel's per-token policy term (its normaliser is the caller's token weights)
LOSS_TYPE_TERMS = {"grpo": "clip", "bnpo": "clip", "dr_grpo": "clip", "dapo": "clip", "luspo": "clip",
                   "cispo": "cispo", "sapo": "sapo"}


def _check_padded(hidden, targets, mask, vectors: dict) -> tuple[int, int]:
    """Raise ValueError naming the argument unless the padded layout holds: hidden ``[B, T, H]``, the rest
    ``[B, T]`` (``advantages`` ``[B]`` or ``[B, T]``; a ratio ``[B, 1]`` is also accepted where named)."""
    if hidden.dim() != 3:
        raise ValueError(f"_input must be [B, T, H] (sequences, completion positions, hidden), got "
                         f"{tuple(hidden.shape)}; flat [N, H] rows go to fastgrpo.kernels.linear_grpo_loss")
    b, t = hidden.shape[:2]
    for name, vec in (("selected_token_ids", targets), ("attention_mask", mask)):
        if vec.shape != (b, t):
            raise ValueError(f"{name} must be [B, T]=({b}, {t}) like _input, got {tuple(vec.shape)}")
    for name, vec in vectors.items():
        if vec is None:
            continue
        allowed = {(b, t): "[B, T]"}
        if name == "advantages":
            allowed[(b,)] = "[B]"
        if name.endswith("ratio"):
            allowed[(b, 1)] = "[B, 1]"
        if tuple(vec.shape) not in allowed:
            raise ValueError(f"{name} must be {' or '.join(allowed.values())} with B={b}, T={t} (from _input), got "
                             f"{tuple(vec.shape)}")
    return b, t


def _rows(mask: torch.Tensor) -> torch.Tensor:
    """``[N]`` int64 flat indices (``b * T + t``) of the rows with ``mask != 0`` (one host sync: N)."""
    return mask.reshape(-1).nonzero().squeeze(1)


def _per_row(vec, rows, t):
    """A ``[B]``, ``[B, 1]`` or ``[B, T]`` tensor as its ``[N]`` values on ``rows``; None stays None."""
    if vec is None:
        return None
    if vec.dim() == 1 or vec.shape[1] == 1:
        return vec.reshape(-1)[rows // t]
    return vec.reshape(-1)[rows]


def _sequence_numbers(batch_row):
    """``[N]`` sequence numbers 0..K-1 of rows given their (sorted) batch row: sequences without any kept row are
    skipped, so the numbers stay below N as ``linear_grpo_loss`` asks."""
    first = torch.ones_like(batch_row, dtype=torch.bool)  # [N]
    first[1:] = batch_row[1:] != batch_row[:-1]
    return first.cumsum(0) - 1


def _scatter(values, rows, b, t):
    """``[N]`` row values back to ``[B, T]``, 0 at the other positions."""
    return values.new_zeros(b * t).index_copy(0, rows, values).view(b, t)


def padded_logprobs(hidden, weight, targets, mask, *, bias=None, temperature=1.0, return_entropy=False,
                    backend="auto"):
    """``linear_logprobs`` on the rows of a padded batch: ``logp [B, T]`` (0 where ``mask`` is 0), and the
    entropy ``[B, T]`` when asked."""
    b, t = _check_padded(hidden, targets, mask, {})
    rows = _rows(mask)
    out = linear_logprobs(hidden.reshape(b * t, -1).index_select(0, rows), weight, targets.reshape(-1)[rows],
                          temperature=temperature, return_entropy=return_entropy, backend=backend, bias=bias)
    if not return_entropy:
        return _scatter(out, rows, b, t)
    return _scatter(out[0], rows, b, t), _scatter(out[1], rows, b, t)


def padded_grpo_loss(hidden, weight, targets, mask, advantages, token_weights, *, kl_token_weights=None,
                     old_logprobs=None, ref_logprobs=None, importance_sampling_level="token", bias=None,
                     **objective):
    """``linear_grpo_loss`` on a padded batch. Returns ``(loss, stats)``.

    Args:
        hidden ``[B, T, H]``: the hidden state that predicts each completion token (already shifted by one).
        weight ``[V, H]``, bias ``[V]`` or None: the lm_head.
        targets ``[B, T]``: the completion tokens; mask ``[B, T]``: 1 on real tokens (the rows kept).
        advantages: ``[B]`` (one per sequence) or ``[B, T]``.
        token_weights ``[B, T]``: the policy term's weight per token (normaliser, and any entropy mask or sampler
            ratio); kl_token_weights ``[B, T]`` the KL term's (None: the policy weights).
        old_logprobs, ref_logprobs ``[B, T]``: as in ``linear_grpo_loss``.
        importance_sampling_level: ``"token"`` or ``"sequence"`` (GSPO: the ratio is the mean over the
            sequence's rows of nonzero weight in either term, which are all its masked rows when
            ``kl_token_weights`` is nonzero on them).
        objective: the other keyword arguments of ``linear_grpo_loss`` (epsilons, delta, beta, temperature, ...).

    Returns:
        ``loss`` as ``linear_grpo_loss``'s, and its ``stats`` with ``logprobs`` (and ``entropy``) as ``[B, T]``.
    """
    if importance_sampling_level not in ("token", "sequence"):
        raise ValueError(f"importance_sampling_level must be 'token' or 'sequence', got {importance_sampling_level!r}")
    b, t = _check_padded(hidden, targets, mask, {
        "advantages": advantages, "token_weights": token_weights, "kl_token_weights": kl_token_weights,
        "old_per_token_logps": old_logprobs, "ref_per_token_logps": ref_logprobs})
    rows = _rows(mask)
    extra = dict(objective, bias=bias)
    if kl_token_weights is not None:
        extra["kl_token_weights"] = kl_token_weights.reshape(-1)[rows]
    if importance_sampling_level == "sequence":
        extra["sequence_index"] = _sequence_numbers(rows // t)
    loss, stats = linear_grpo_loss(
        hidden.reshape(b * t, -1).index_select(0, rows), weight, targets.reshape(-1)[rows],
        _per_row(advantages, rows, t), token_weights.reshape(-1)[rows],
        old_logprobs=_per_row(old_logprobs, rows, t), ref_logprobs=_per_row(ref_logprobs, rows, t), **extra)
    for key in ("logprobs", "entropy"):
        if key in stats:
            stats[key] = _scatter(stats[key], rows, b, t)
    return loss, stats


class FusedLinearGRPOLoss(torch.nn.Module):
    """``LigerFusedLinearGRPOLoss`` (Liger-Kernel 0.8) on fastgrpo's fused head: same options, call and result.

    Per sequence ``i`` and completion token ``t`` (mask ``m``), with ``r`` the ratio (token, or the sequence's
    ``exp(mean(logp - old))``), ``A_i`` the advantage and ``rho`` the optional ``vllm_is_ratio``:
        ``clip`` types (grpo, bnpo, dr_grpo, dapo): ``l = -min(min(r, delta) A, clip(r, 1-eps_lo, 1+eps_hi) A)``
        ``cispo``: ``l = -sg(min(r, eps_hi)) A logp``;  ``sapo``: ``l = -sigmoid(tau (r - 1)) 4 / tau  A``
        (``tau`` = sapo_temperature_pos if A > 0 else _neg); then ``l = rho l + beta k3`` (k3 times ``r`` with
        ``use_bias_correction_kl``). The loss sums ``m l`` under Liger's normaliser: grpo/sapo the mean over
        sequences of each sequence's token mean, bnpo the batch's token count, dr_grpo ``B * max_completion_length``,
        dapo/cispo ``num_items_in_batch`` (else the token count summed over ranks) divided by the world size.

    Returns ``(loss, metrics)``: metrics as Liger's, a tuple ``(kl_mean, clip_ratio)`` (``kl_mean`` only when
    beta != 0), both means over the tokens with ``attention_mask`` set.

    Departures, refused at construction rather than run differently: ``loss_type`` luspo and vespo (Liger's
    luspo also weighs padding positions; the ``vespo_*`` options are accepted, for the signature's sake only).
    ``compiled`` and ``chunk_size`` are accepted and ignored (fastgrpo's kernel chunks by memory, not by
    sequences, and needs no torch.compile).
    """

    def __init__(self, beta: float = 0.04, compiled: bool = True, use_ref_model: bool = True, chunk_size: int = 1,
                 epsilon_low: float = 0.2, epsilon_high: float = 0.2, loss_type: str = "dapo",
                 max_completion_length: int | None = None, importance_sampling_level: str = "token",
                 sapo_temperature_pos: float = 1.0, sapo_temperature_neg: float = 1.05, temperature: float = 1.0,
                 delta: float | None = None, use_bias_correction_kl: bool = False, vespo_k_pos: float = 2.0,
                 vespo_lambda_pos: float = 3.0, vespo_k_neg: float = 3.0, vespo_lambda_neg: float = 2.0, *,
                 backend: str = "auto"):
        super().__init__()
        if loss_type not in ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo"):
            raise ValueError(f"loss_type={loss_type!r} is not served by fastgrpo's FusedLinearGRPOLoss "
                             "(grpo, bnpo, dr_grpo, dapo, cispo, sapo)")
        if loss_type == "dr_grpo" and max_completion_length is None:
            raise ValueError("max_completion_length must be given for loss_type='dr_grpo'")
        if importance_sampling_level not in ("token", "sequence"):
            raise ValueError(f"importance_sampling_level must be 'token' or 'sequence', got "
                             f"{importance_sampling_level!r}")
        if importance_sampling_level == "sequence" and loss_type in ("cispo", "sapo"):
            raise ValueError(f"importance_sampling_level='sequence' is not supported for loss_type={loss_type!r} "
                             "(as in Liger)")
        if sapo_temperature_pos <= 0 or sapo_temperature_neg <= 0:
            raise ValueError(f"sapo_temperature_pos / sapo_temperature_neg must be > 0, got "
                             f"{sapo_temperature_pos}, {sapo_temperature_neg}")
        if delta is not None and delta <= 0:
            raise ValueError(f"delta must be > 0, got {delta}")
        self.beta, self.compiled, self.use_ref_model, self.chunk_size = beta, compiled, use_ref_model, chunk_size
        self.epsilon_low, self.epsilon_high, self.loss_type = epsilon_low, epsilon_high, loss_type
        self.max_completion_length = max_completion_length
        self.importance_sampling_level = importance_sampling_level
        self.sapo_temperature_pos, self.sapo_temperature_neg = sapo_temperature_pos, sapo_temperature_neg
        self.temperature, self.delta, self.use_bias_correction_kl = temperature, delta, use_bias_correction_kl
        self.backend = backend

    def forward(self, _input, lin_weight, selected_token_ids, attention_mask, advantages, bias=None,
                ref_per_token_logps=None, old_per_token_logps=None, ref_input=None, ref_weight=None, ref_bias=None,
                vllm_is_ratio=None, num_items_in_batch=None):
        """``_input [B, T, H]``, ``lin_weight [V, H]``, ``selected_token_ids``/``attention_mask [B, T]``,
        ``advantages [B]``, ``bias [V]``, ``ref_per_token_logps``/``old_per_token_logps [B, T]``, ``ref_input
        [B, T, H]`` with ``ref_weight``/``ref_bias`` (the reference head, used when ``ref_per_token_logps`` is
        None), ``vllm_is_ratio [B, T]`` or ``[B, 1]``, ``num_items_in_batch`` (dapo/cispo's global token count).
        Returns ``(loss, (kl_mean, clip_ratio))``; ``kl_mean`` only when beta != 0."""
        b, t = _check_padded(_input, selected_token_ids, attention_mask, {
            "advantages": advantages, "ref_per_token_logps": ref_per_token_logps,
            "old_per_token_logps": old_per_token_logps, "vllm_is_ratio": vllm_is_ratio})
        if advantages.dim() != 1:
            raise ValueError(f"advantages must be [B]={b} (one per sequence), got {tuple(advantages.shape)}")
        beta = self.beta
        ref = ref_per_token_logps
        if beta != 0.0 and ref is None:
            if self.use_ref_model and ref_input is not None:
                with torch.no_grad():
                    ref = padded_logprobs(ref_input, lin_weight if ref_weight is None else ref_weight,
                                          selected_token_ids, attention_mask, bias=ref_bias,
                                          temperature=self.temperature, backend=self.backend)
            else:
                beta = 0.0  # Liger then takes the reference to be the policy itself: k3 and its gradient are 0
        mask = attention_mask.to(torch.float32)  # [B, T]
        weights = mask / self._normaliser(mask, num_items_in_batch)  # [B, T]
        policy_weights = weights
        if vllm_is_ratio is not None:
            policy_weights = weights * vllm_is_ratio.float()
        # the ratio weighs the policy term only; the KL term (and the rows a sequence mean counts) keep the mask's
        kl_weights = weights if vllm_is_ratio is not None else None
        term = LOSS_TYPE_TERMS[self.loss_type]
        loss, stats = padded_grpo_loss(
            _input, lin_weight, selected_token_ids, attention_mask, advantages, policy_weights,
            kl_token_weights=kl_weights, old_logprobs=old_per_token_logps, ref_logprobs=ref if beta else None,
            importance_sampling_level=self.importance_sampling_level, bias=bias, epsilon_low=self.epsilon_low,
            epsilon_high=self.epsilon_high, delta=self.delta if term == "clip" else None, beta=beta,
            temperature=self.temperature, backend=self.backend, policy_loss=term,
            sapo_temperature_pos=self.sapo_temperature_pos, sapo_temperature_neg=self.sapo_temperature_neg,
            use_bias_correction_kl=self.use_bias_correction_kl)
        metrics = self._metrics(stats["logprobs"], mask, advantages, old_per_token_logps, ref, beta)
        return loss, metrics

    def _normaliser(self, mask, num_items_in_batch):
        """Liger's divisor of the masked token-loss sum (a ``[B, 1]`` or scalar tensor)."""
        b = mask.shape[0]
        if self.loss_type in ("grpo", "sapo"):
            return mask.sum(-1, keepdim=True).clamp(min=1.0) * b
        if self.loss_type == "bnpo":
            return mask.sum().clamp(min=1.0)
        if self.loss_type == "dr_grpo":
            return mask.new_tensor(float(b * self.max_completion_length))
        # dapo, cispo: the global token count per rank
        world = torch.distributed.get_world_size() if _distributed() else 1
        if num_items_in_batch is not None:
            return (torch.as_tensor(num_items_in_batch, dtype=torch.float32, device=mask.device) / world).clamp(
                min=1.0)
        total = mask.sum()
        if world > 1:
            total = total.clone()
            torch.distributed.all_reduce(total)
        return (total / world).clamp(min=1.0)

    @torch.no_grad()
    def _metrics(self, logp, mask, advantages, old, ref, beta):
        """Liger's ``(kl_mean, clip_ratio)`` from the log-probs ``[B, T]`` the loss computed."""
        n = mask.sum().clamp(min=1.0)
        log_ratio = (logp - old.float()) * mask if old is not None else torch.zeros_like(logp)  # [B, T]
        if self.importance_sampling_level == "sequence":
            log_ratio = (log_ratio.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0))  # [B, 1]
        ratio = torch.exp(log_ratio)
        adv = advantages.float()[:, None]  # [B, 1]
        if self.loss_type == "cispo":
            clipped = (ratio > self.epsilon_high) & (adv > 0)
        elif self.loss_type == "sapo":
            clipped = torch.zeros_like(ratio, dtype=torch.bool)
        else:
            clipped = ((ratio < 1 - self.epsilon_low) & (adv < 0)) | ((ratio > 1 + self.epsilon_high) & (adv > 0))
        clip_ratio = (clipped.expand_as(mask) * mask).sum() / n
        if self.beta == 0.0:
            return (clip_ratio,)
        if beta == 0.0:  # no reference given: Liger's KL is that of the policy with itself
            return (mask.new_zeros(()), clip_ratio)
        diff = ref.float() - logp
        kl = torch.exp(diff) - diff - 1.0
        if self.use_bias_correction_kl:
            kl = kl * ratio
        return ((kl * mask).sum() / n, clip_ratio)


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()
