"""Padded-batch adapters of the fused GRPO loss: ``padded_grpo_loss`` and the Liger-shaped ``FusedLinearGRPOLoss``.

Shapes: B sequences, T completion positions, H hidden size, V vocabulary size, N = rows of the batch that count
(``attention_mask`` == 1), in row-major order.

Trainers hold a padded ``[B, T]`` batch and a mask; ``linear_grpo_loss`` (stable) takes flat ``[N]`` rows. The
conversion lives here, once: keep the masked rows (an ``index_select`` the gradient flows back through), give each
row its sequence's advantage, number the rows by sequence for the sequence-level ratio, call the kernel, and put the
per-row statistics back into ``[B, T]``. Selecting the rows costs one host sync per call (the row count), as in
TRL's own fused head on Triton devices; in exchange the lm_head products run on real tokens only.

``FusedLinearGRPOLoss`` takes ``LigerFusedLinearGRPOLoss``'s constructor options and call (Liger-Kernel 0.8), so
a Liger user swaps one import. Its loss types, normalisers and metrics are Liger's, read from the ``liger`` column
of the loss-type table (``loss_types.LOSS_TYPES``); the tests pin them against Liger 0.8.5 itself and a plain-torch
reference of its definitions. Options it cannot serve are refused when the module is built.
"""

from __future__ import annotations

import dataclasses

import torch

from .grpo_loss import fused_grpo_loss
from .logprobs import linear_logprobs
from .loss_types import LOSS_TYPES, BatchCounts
from .settings import LossSettings
from .terms import clip_masks

__all__ = ["FusedLinearGRPOLoss", "liger_weights", "padded_grpo_loss", "padded_logprobs"]


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
        if name.endswith("ratio"):  # one ratio per sequence: [B, 1] or [B] (Liger's own tests pass both)
            allowed[(b, 1)] = "[B, 1]"
            allowed[(b,)] = "[B]"
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


def _sequence_numbers(batch_row, b, own=None):
    """``[N]`` sequence numbers of rows given their batch row ``[N]`` (of ``b``): the K sequences with a row are
    numbered 0..K-1 (sequences without any are skipped), and each row marked in ``own`` ``[N]`` bool is a sequence
    of its own, numbered from K on; so the numbers stay below N, as ``linear_grpo_loss`` asks. No host sync."""
    shared = torch.ones_like(batch_row, dtype=torch.bool) if own is None else ~own  # [N]
    has_rows = torch.zeros(b, dtype=torch.long, device=batch_row.device).index_fill(0, batch_row[shared], 1)  # [B]
    dense = has_rows.cumsum(0) - 1  # [B]: K-numbering of the sequences that have rows
    numbers = dense[batch_row]  # [N]
    if own is not None:
        numbers = torch.where(own, has_rows.sum() + own.long().cumsum(0) - 1, numbers)
    return numbers


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


def padded_grpo_loss(hidden, weight, targets, mask, advantages, token_weights, settings=LossSettings(), *,
                     kl_token_weights=None, old_logprobs=None, ref_logprobs=None, bias=None, ratio_mask=None,
                     return_entropy=False, backend="auto", chunk_size=None):
    """``fused_grpo_loss`` on a padded batch. Returns ``(loss, stats)``.

    Args:
        hidden ``[B, T, H]``: the hidden state that predicts each completion token (already shifted by one).
        weight ``[V, H]``, bias ``[V]`` or None: the lm_head.
        targets ``[B, T]``: the completion tokens; mask ``[B, T]``: 1 on real tokens (the rows kept).
        advantages: ``[B]`` (one per sequence) or ``[B, T]``.
        token_weights ``[B, T]``: the policy term's weight per token (normaliser, and any entropy mask or sampler
            ratio); kl_token_weights ``[B, T]`` the KL term's (None: the policy weights).
        settings: the loss's ``LossSettings``; at ``importance_sampling_level="sequence"`` (GSPO) the ratio is the
            mean over the sequence's rows of nonzero weight in either term, which are all its masked rows when
            ``kl_token_weights`` is nonzero on them.
        old_logprobs, ref_logprobs ``[B, T]``: as in ``linear_grpo_loss``.
        ratio_mask ``[B, T]`` or None: at the sequence level, the rows whose log-ratio the sequence's mean takes
            (None: every row of ``mask``); a kept row outside it is a sequence of its own (Liger's luspo weighs
            padding positions, which its sequence ratio leaves out).
        return_entropy, backend, chunk_size: as in ``linear_grpo_loss``.

    Returns:
        ``loss`` as ``linear_grpo_loss``'s, and its ``stats`` with ``logprobs`` (and ``entropy``) as ``[B, T]``. No
        row kept (B = 0, T = 0 or an all-zero mask): a loss of 0 whose gradients are 0, and ``logprobs`` of 0.
    """
    b, t = _check_padded(hidden, targets, mask, {
        "advantages": advantages, "token_weights": token_weights, "kl_token_weights": kl_token_weights,
        "old_per_token_logps": old_logprobs, "ref_per_token_logps": ref_logprobs})
    rows = _rows(mask)
    if rows.numel() == 0:  # nothing to score: the flat ops would get 0 rows; the sum over no token is 0
        return _empty_loss(hidden, weight, bias, b, t, return_entropy)
    extra = dict(bias=bias, return_entropy=return_entropy, backend=backend, chunk_size=chunk_size)
    if kl_token_weights is not None:
        extra["kl_token_weights"] = kl_token_weights.reshape(-1)[rows]
    if settings.sequence_level:
        own = None if ratio_mask is None else ratio_mask.reshape(-1)[rows] == 0  # [N]
        extra["sequence_index"] = _sequence_numbers(rows // t, b, own)
    loss, stats = fused_grpo_loss(
        hidden.reshape(b * t, -1).index_select(0, rows), weight, targets.reshape(-1)[rows],
        _per_row(advantages, rows, t), token_weights.reshape(-1)[rows], settings,
        old_logprobs=_per_row(old_logprobs, rows, t), ref_logprobs=_per_row(ref_logprobs, rows, t), **extra)
    for key in ("logprobs", "entropy"):
        if key in stats:
            stats[key] = _scatter(stats[key], rows, b, t)
    return loss, stats


def _empty_loss(hidden, weight, bias, b, t, return_entropy):
    """``padded_grpo_loss`` with no row kept: 0, still a function of the inputs (their gradients are 0)."""
    loss = (hidden.sum() * 0.0 + weight.sum() * 0.0).float()
    if bias is not None:
        loss = loss + bias.sum().float() * 0.0
    zero = torch.zeros(b, t, dtype=torch.float32, device=hidden.device)
    stats = {"logprobs": zero, "clip_low_frac": zero.new_zeros(()), "clip_high_frac": zero.new_zeros(()),
             "kl_mean": zero.new_zeros(())}
    if return_entropy:
        stats["entropy"] = zero.clone()
    return loss, stats


# ------------------------------------------------------------------------------------ Liger's loss types


def _global_tokens(mask, num_items_in_batch):
    """Liger's dapo / cispo count: the generation batch's tokens per rank (``num_items_in_batch`` when given, else
    the mask's count summed over ranks, a collective), divided by the world size."""
    world = torch.distributed.get_world_size() if _distributed() else 1
    if num_items_in_batch is not None:
        return torch.as_tensor(num_items_in_batch, dtype=torch.float32, device=mask.device) / world
    total = mask.sum()
    if world > 1:
        total = total.clone()
        torch.distributed.all_reduce(total)
    return total / world


def liger_weights(loss_type: str, mask: torch.Tensor, max_completion_length: int | None = None,
                  num_items_in_batch=None) -> torch.Tensor:
    """``[B, T]``: each position's weight in the loss sum under Liger's normaliser of ``loss_type`` (the
    ``liger`` column of ``LOSS_TYPES``), over the micro-batch ``mask`` ``[B, T]`` float32; nonzero on the padding
    positions too where the normaliser weighs every position (luspo)."""
    normaliser = LOSS_TYPES[loss_type].liger
    b, t = mask.shape
    counts = BatchCounts(num_sequences=b, num_tokens=mask.sum(), max_completion_length=max_completion_length,
                         global_tokens_of=lambda: _global_tokens(mask, num_items_in_batch), num_positions=b * t)
    positions = torch.ones_like(mask) if normaliser.every_position else mask
    return positions * normaliser(mask.sum(-1), counts)[:, None]


class FusedLinearGRPOLoss(torch.nn.Module):
    """``LigerFusedLinearGRPOLoss`` (Liger-Kernel 0.8) on fastgrpo's fused head: same options, call and result.

    Per sequence ``i`` and completion token ``t`` (mask ``m``), with ``r`` the ratio (token, or the sequence's
    ``exp(mean(logp - old))``), ``A_i`` the advantage and ``rho`` the optional ``vllm_is_ratio``:
        ``clip`` types (grpo, bnpo, dr_grpo, dapo, luspo): ``l = -min(min(r, delta) A, clip(r, 1-eps_lo, 1+eps_hi) A)``
        ``cispo``: ``l = -sg(min(r, eps_hi)) A logp``;  ``sapo``: ``l = -sigmoid(tau (r - 1)) 4 / tau  A``
        (``tau`` = sapo_temperature_pos if A > 0 else _neg); then ``l = rho l + beta k3`` (k3 times ``r`` with
        ``use_bias_correction_kl``). The loss sums ``m l`` under Liger's normaliser (``liger_weights``): grpo/sapo
        the mean over sequences of each sequence's token mean, bnpo the batch's token count, dr_grpo ``B *
        max_completion_length``, dapo/cispo ``num_items_in_batch`` (else the token count summed over ranks)
        divided by the world size; luspo sums ``l`` over every position, padding included, each weighted by its
        sequence's length, over ``B * T``.

    The reference, as Liger reads it: with ``use_ref_model=False`` any reference passed is ignored (the KL term is
    that of the policy with itself: 0, and so is its gradient); with ``use_ref_model=True`` and ``beta != 0`` one of
    ``ref_per_token_logps`` / ``ref_input`` is required (ValueError where Liger asserts). ``vllm_is_ratio`` may be
    ``[B, T]``, ``[B, 1]`` or ``[B]``.

    Returns ``(loss, metrics)``: metrics as Liger's, a tuple ``(kl_mean, clip_ratio)`` (``kl_mean`` only when
    beta != 0), both means over the tokens with ``attention_mask`` set. A batch with no token (B = 0, T = 0 or an
    all-zero mask) gives a loss of 0 with gradients of 0 (Liger gives 0, or NaN where its divisor is 0).

    Departures, refused at construction rather than run differently: ``loss_type="vespo"`` (the ``vespo_*`` options
    are accepted, for the signature's sake only), and luspo at the sequence level with ``beta != 0`` and
    ``use_bias_correction_kl`` (Liger multiplies the padding positions' KL by the sequence's ratio, which the
    kernel's padding rows do not read). ``compiled`` and ``chunk_size`` are accepted and ignored (fastgrpo's kernel
    chunks by memory, not by sequences, and needs no torch.compile).
    """

    def __init__(self, beta: float = 0.04, compiled: bool = True, use_ref_model: bool = True, chunk_size: int = 1,
                 epsilon_low: float = 0.2, epsilon_high: float = 0.2, loss_type: str = "dapo",
                 max_completion_length: int | None = None, importance_sampling_level: str = "token",
                 sapo_temperature_pos: float = 1.0, sapo_temperature_neg: float = 1.05, temperature: float = 1.0,
                 delta: float | None = None, use_bias_correction_kl: bool = False, vespo_k_pos: float = 2.0,
                 vespo_lambda_pos: float = 3.0, vespo_k_neg: float = 3.0, vespo_lambda_neg: float = 2.0, *,
                 backend: str = "auto"):
        super().__init__()
        served = [name for name, row in LOSS_TYPES.items() if row.liger is not None]
        if loss_type not in served:
            raise ValueError(f"loss_type={loss_type!r} is not served by fastgrpo's FusedLinearGRPOLoss "
                             f"({', '.join(served)})")
        kind = LOSS_TYPES[loss_type]
        self.settings = LossSettings(
            policy_loss=kind.term, epsilon_low=epsilon_low, epsilon_high=epsilon_high, delta=delta, beta=beta,
            sapo_temperature_pos=sapo_temperature_pos, sapo_temperature_neg=sapo_temperature_neg,
            use_bias_correction_kl=use_bias_correction_kl, importance_sampling_level=importance_sampling_level,
            temperature=temperature)  # the loss's settings, checked here once
        if kind.liger.reads_max_completion_length and max_completion_length is None:
            raise ValueError(f"max_completion_length must be given for loss_type={loss_type!r}")
        if self.settings.sequence_level and not kind.liger_sequence_level:
            raise ValueError(f"importance_sampling_level='sequence' is not supported for loss_type={loss_type!r} "
                             "(as in Liger)")
        if (kind.liger.every_position and self.settings.sequence_level and beta != 0.0 and use_ref_model
                and use_bias_correction_kl):
            raise ValueError(f"use_bias_correction_kl with loss_type={loss_type!r} at importance_sampling_level="
                             "'sequence' and beta != 0 is not served by fastgrpo's FusedLinearGRPOLoss (Liger's "
                             "padding positions take the sequence's ratio into their KL term)")
        self.loss_type, self.max_completion_length = loss_type, max_completion_length
        self.compiled, self.use_ref_model, self.chunk_size = compiled, use_ref_model, chunk_size
        self.vespo_k_pos, self.vespo_lambda_pos = vespo_k_pos, vespo_lambda_pos
        self.vespo_k_neg, self.vespo_lambda_neg = vespo_k_neg, vespo_lambda_neg
        self.backend = backend

    def forward(self, _input, lin_weight, selected_token_ids, attention_mask, advantages, bias=None,
                ref_per_token_logps=None, old_per_token_logps=None, ref_input=None, ref_weight=None, ref_bias=None,
                vllm_is_ratio=None, num_items_in_batch=None):
        """``_input [B, T, H]``, ``lin_weight [V, H]``, ``selected_token_ids``/``attention_mask [B, T]``,
        ``advantages [B]``, ``bias [V]``, ``ref_per_token_logps``/``old_per_token_logps [B, T]``, ``ref_input
        [B, T, H]`` with ``ref_weight``/``ref_bias`` (the reference head, used when ``ref_per_token_logps`` is
        None), ``vllm_is_ratio [B, T]``, ``[B, 1]`` or ``[B]``, ``num_items_in_batch`` (dapo/cispo's global token
        count). Returns ``(loss, (kl_mean, clip_ratio))``; ``kl_mean`` only when beta != 0."""
        b, t = _check_padded(_input, selected_token_ids, attention_mask, {
            "advantages": advantages, "ref_per_token_logps": ref_per_token_logps,
            "old_per_token_logps": old_per_token_logps, "vllm_is_ratio": vllm_is_ratio})
        if advantages.dim() != 1:
            raise ValueError(f"advantages must be [B]={b} (one per sequence), got {tuple(advantages.shape)}")
        every_position = LOSS_TYPES[self.loss_type].liger.every_position
        # luspo's KL term reads the padding positions too: the reference head must score every position
        ref = self._reference(ref_per_token_logps, ref_input, ref_weight, ref_bias, lin_weight, selected_token_ids,
                              torch.ones_like(attention_mask) if every_position else attention_mask)
        # without use_ref_model Liger's reference is the policy itself: k3 and its gradient are 0
        settings = self.settings if ref is not None else dataclasses.replace(self.settings, beta=0.0)
        beta = settings.beta
        mask = attention_mask.to(torch.float32)  # [B, T]
        weights = liger_weights(self.loss_type, mask, self.max_completion_length, num_items_in_batch)  # [B, T]
        policy_weights, kl_weights = weights, None
        if vllm_is_ratio is not None:  # the ratio weighs the policy term only; the KL term keeps the plain weights
            policy_weights, kl_weights = weights * vllm_is_ratio.float().reshape(b, -1), weights
        rows, ratio_mask = attention_mask, None
        if every_position:
            rows, ratio_mask = torch.ones_like(attention_mask), attention_mask
            if settings.sequence_level:
                # the policy term is one value per sequence there, so its weight over every position folds onto the
                # rows its ratio reads; the padding rows keep the KL term alone
                policy_weights = mask * policy_weights.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(
                    min=1.0)
                kl_weights = weights
                if beta == 0.0:  # no KL term: the padding rows carry nothing
                    rows, kl_weights = attention_mask, None
        loss, stats = padded_grpo_loss(
            _input, lin_weight, selected_token_ids, rows, advantages, policy_weights, settings,
            kl_token_weights=kl_weights, old_logprobs=old_per_token_logps, ref_logprobs=ref if beta else None,
            bias=bias, ratio_mask=ratio_mask, backend=self.backend)
        metrics = self._metrics(stats["logprobs"], mask, advantages, old_per_token_logps, ref, beta)
        return loss, metrics

    def _reference(self, ref_logps, ref_input, ref_weight, ref_bias, lin_weight, targets, scored):
        """The reference log-probs ``[B, T]`` Liger would use, or None (its KL term is then 0). From ``ref_input``
        they are computed where ``scored`` ``[B, T]`` is set (0 elsewhere): the positions the loss reads."""
        if not self.use_ref_model or self.settings.beta == 0.0:
            return None  # Liger reads no reference without use_ref_model, and beta 0 needs none
        if ref_logps is not None:
            return ref_logps
        if ref_input is None:
            raise ValueError("beta != 0 with use_ref_model=True needs ref_per_token_logps or ref_input (Liger asserts "
                             "the same); pass one, or use_ref_model=False for a KL term of 0")
        with torch.no_grad():
            return padded_logprobs(ref_input, lin_weight if ref_weight is None else ref_weight, targets,
                                   scored, bias=ref_bias, temperature=self.settings.temperature,
                                   backend=self.backend)

    @torch.no_grad()
    def _metrics(self, logp, mask, advantages, old, ref, beta):
        """Liger's ``(kl_mean, clip_ratio)`` from the log-probs ``[B, T]`` the loss computed."""
        s = self.settings
        n = mask.sum().clamp(min=1.0)
        log_ratio = (logp - old.float()) * mask if old is not None else torch.zeros_like(logp)  # [B, T]
        if s.sequence_level:
            log_ratio = (log_ratio.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0))  # [B, 1]
        ratio = torch.exp(log_ratio)
        low, high = clip_masks(s.policy_loss, ratio, advantages.float()[:, None], epsilon_low=s.epsilon_low,
                               epsilon_high=s.epsilon_high)
        clip_ratio = ((low | high).expand_as(mask) * mask).sum() / n
        if s.beta == 0.0:
            return (clip_ratio,)
        if beta == 0.0:  # no reference read: Liger's KL is that of the policy with itself
            return (mask.new_zeros(()), clip_ratio)
        diff = ref.float() - logp
        kl = torch.exp(diff) - diff - 1.0
        if s.use_bias_correction_kl:
            kl = kl * ratio
        return ((kl * mask).sum() / n, clip_ratio)


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()
