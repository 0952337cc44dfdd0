"""Loss types as per-token weights, for fastgrpo's trainer.

Legend: S sequences in the *global* batch (all ranks), L_i completion length of sequence i, L_max the configured
max_completion_length, N completion tokens held by this rank (flat layout: sequence i's tokens are contiguous).

The fused kernel computes ``sum_n w_n * l_n`` (fastgrpo.kernels.linear_grpo_loss). Every loss type is therefore a
normaliser that gives w, decided once per step over the global batch, so the gradient does not depend on the
micro-batch budget or the world size, plus the kernel's per-token policy term ``l``: one row of the loss-type table
``fastgrpo.kernels.loss_types.LOSS_TYPES`` (its ``weights`` column; the TRL adapter and the Liger-shaped module read
the other columns). README's "Loss and algorithm options" lists them.

With FSDP the per-rank gradients are *summed* (see parallelize.py), so these global weights give exactly the
single-process gradient.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Callable

import torch

from fastgrpo.kernels.loss_types import (LOSS_TYPES, BatchCounts, LossType, Normaliser, add_loss_type,
                                         sequence_mean, token_mean)

__all__ = ["GlobalCounts", "LOSS_TYPES", "POLICY_LOSS_OF", "SFT_NORMALIZATIONS", "register_loss_type",
           "token_weights", "truncated_importance_weights"]

GlobalCounts = BatchCounts
"""The step's totals over every rank (S, sum_i L_i, L_max), computed once before the update."""


class _TermColumn(Mapping):
    """``LOSS_TYPES``'s term column, read-only and live: loss type -> the kernel's per-token policy term."""

    def __getitem__(self, name: str) -> str:
        return LOSS_TYPES[name].term

    def __iter__(self) -> Iterator[str]:
        return iter(LOSS_TYPES)

    def __len__(self) -> int:
        return len(LOSS_TYPES)


POLICY_LOSS_OF: Mapping[str, str] = _TermColumn()
"""Loss type -> the kernel's per-token policy term (a key of ``fastgrpo.kernels.POLICY_LOSSES``)."""


def register_loss_type(*names: str, policy_loss: str = "clip"):
    """Register ``fn(lengths [S_local] long, counts) -> per-sequence weight [S_local] float32`` under ``names``,
    each with the kernel's per-token ``policy_loss`` term: a row of ``LOSS_TYPES`` for fastgrpo's trainer only."""

    def deco(fn):
        for n in names:
            add_loss_type(n, LossType(policy_loss, Normaliser(fn)))
        return fn

    return deco


SFT_NORMALIZATIONS: dict[str, Normaliser] = {
    "token": token_mean,
    "sequence": sequence_mean,
}
"""SFT loss normalisation (sft.normalization) -> its normaliser, as LOSS_TYPES: 'token' = 1 / sum_i L_i (every
completion token of the global batch weighs the same), 'sequence' = 1 / (S * L_i) (each sequence's mean, then the
mean over sequences). The SFT loss is sum_t w_t * -log p(y_t) with these weights."""


def token_weights(loss_type: str, lengths: torch.Tensor, counts: GlobalCounts,
                  registry: Mapping[str, LossType | Callable] = LOSS_TYPES, *,
                  num_tokens: int | None = None) -> torch.Tensor:
    """Per-token weights [N] in the flat layout, for this rank's sequences of completion ``lengths`` [S_local].
    ``registry``: LOSS_TYPES (GRPO) or SFT_NORMALIZATIONS. ``num_tokens``: N when the caller knows it (otherwise it
    is read from ``lengths``, a host sync when they live on a GPU)."""
    try:
        fn = registry[loss_type]
    except KeyError:
        what = "loss_type" if registry is LOSS_TYPES else "normalization"
        raise ValueError(f"unknown {what} {loss_type!r}; known: {sorted(registry)}") from None
    if isinstance(fn, LossType):
        fn = fn.weights
    per_seq = fn(lengths, counts)  # [S_local]
    return torch.repeat_interleave(per_seq, lengths, output_size=num_tokens)  # [N]


def truncated_importance_weights(old_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, cap: float) -> torch.Tensor:
    """Per-token truncated importance weight ``min(pi_old / pi_sampler, cap)`` [N] (token-level TIS; TRL's current
    default instead masks whole sequences, with cap 3).

    The rollout engine samples with its own kernels (with vLLM, its own copy of the weights, often in another
    precision), so the behaviour policy is not exactly the one the trainer differentiates. Multiplied into the token
    weights, this corrects that bias while the cap bounds the variance (Yao et al., 2025). It is a constant: no
    gradient flows through it. As in TRL, it weights the policy-gradient term only (``grpo_update`` passes the KL
    term its own weights).
    """
    if cap <= 0:
        raise ValueError(f"rollout.importance_sampling_cap: must be > 0, got {cap}")
    if old_logprobs.shape != sampler_logprobs.shape:
        raise ValueError(f"old log-probs {tuple(old_logprobs.shape)} and sampler log-probs "
                         f"{tuple(sampler_logprobs.shape)} must have the same shape")
    log_ratio = old_logprobs.detach().float() - sampler_logprobs.detach().float()  # [N]
    return torch.exp(log_ratio).clamp(max=cap)  # [N]
