"""The loss types of the GRPO family: one table (``LOSS_TYPES``) of each type's policy term and its normaliser in
fastgrpo's trainer, in TRL and in Liger-Kernel. The trainer (``fastgrpo.algorithms.losses``), the TRL adapter
(``fastgrpo.integrations.trl``) and the Liger-shaped module (``module.py``) read it; a new loss type is a row here
(and a normaliser or a policy term, ``terms.py``, where none of the existing ones fits).

Shapes: S sequences of the batch a normaliser divides over, L_i the counted tokens of sequence i.

A normaliser turns the loss's sum over tokens into the loss type's mean: ``(lengths [S], counts) -> [S]`` float32,
the weight of each token of sequence i. ``counts`` (``BatchCounts``) says over what: fastgrpo's trainer passes the
step's global batch (every rank), TRL's adapter the micro-batch (its sequences times the accumulation steps), the
Liger module the micro-batch. That is why one formula serves all three, and why ``bnpo`` and ``dapo`` differ in TRL
and Liger (the micro-batch's tokens, the generation batch's) but not in fastgrpo (its batch is the global one).

    normaliser           weight of a token of sequence i
    sequence_mean        1 / (S * L_i)            each sequence's token mean, then the mean over sequences
    token_mean           1 / N                    N = the batch's tokens
    global_token_mean    1 / N_global             N_global = the generation batch's tokens per rank (TRL's and
                                                  Liger's num_items_in_batch); the batch's own in fastgrpo
    max_length_mean      1 / (S * L_max)          L_max = max_completion_length (Dr. GRPO)
    sequence_sum         1 / S                    each sequence's token sum, then the mean over sequences
    length_over_positions  L_i / (B * T)          every position, padding included (Liger's luspo)

    loss type  term   fastgrpo           TRL                Liger
    grpo       clip   sequence_mean      sequence_mean      sequence_mean
    dapo       clip   token_mean         global_token_mean  global_token_mean
    bnpo       clip   token_mean         token_mean         token_mean
    dr_grpo    clip   max_length_mean    max_length_mean    max_length_mean
    luspo      clip   sequence_sum       sequence_sum       length_over_positions
    cispo      cispo  token_mean         global_token_mean  global_token_mean   (Liger: token level only)
    sapo       sapo   sequence_mean      sequence_mean      sequence_mean       (Liger: token level only)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

from .terms import POLICY_LOSSES

__all__ = ["BatchCounts", "LOSS_TYPES", "LossType", "Normaliser", "add_loss_type", "global_token_mean",
           "length_over_positions", "max_length_mean", "sequence_mean", "sequence_sum", "token_mean"]


@dataclass(frozen=True)
class BatchCounts:
    """The totals of the batch a normaliser divides over (numbers, or 0-dim tensors on the loss's device)."""

    num_sequences: int | float
    """S."""
    num_tokens: int | float | torch.Tensor
    """N: the batch's counted tokens."""
    max_completion_length: int | None = None
    """L_max (the configured limit, not the observed maximum: a constant normaliser is the point of dr_grpo)."""
    global_tokens_of: Callable[[], int | float | torch.Tensor] | None = None
    """N_global, read only by ``global_token_mean`` (it may cost a collective); None: ``num_tokens``."""
    num_positions: int | None = None
    """B * T of a padded batch, padding included (``length_over_positions``)."""


def _at_least_one(n):
    return n.clamp(min=1) if isinstance(n, torch.Tensor) else max(n, 1)


def _each(lengths: torch.Tensor, value) -> torch.Tensor:
    """``value`` (a number or a 0-dim tensor) for each of the ``lengths`` sequences, float32 ``[S]``."""
    if isinstance(value, torch.Tensor):
        return value.to(device=lengths.device, dtype=torch.float32).expand(lengths.shape)
    return torch.full(lengths.shape, value, dtype=torch.float32, device=lengths.device)


class Normaliser(NamedTuple):
    """A loss type's weight per token: ``normaliser(lengths [S], counts) -> [S]`` float32."""

    weight: Callable[[torch.Tensor, BatchCounts], torch.Tensor]
    reads_max_completion_length: bool = False
    """It divides by ``max_completion_length``, which must then be known."""
    every_position: bool = False
    """It weighs the padding positions of a padded batch too (their rows then go to the kernel)."""

    def __call__(self, lengths: torch.Tensor, counts: BatchCounts) -> torch.Tensor:
        return self.weight(lengths, counts)


sequence_mean = Normaliser(lambda lengths, c: 1.0 / (c.num_sequences * lengths.clamp(min=1).float()))
token_mean = Normaliser(lambda lengths, c: _each(lengths, 1.0 / _at_least_one(c.num_tokens)))
global_token_mean = Normaliser(lambda lengths, c: _each(lengths, 1.0 / _at_least_one(
    c.num_tokens if c.global_tokens_of is None else c.global_tokens_of())))
max_length_mean = Normaliser(lambda lengths, c: _each(lengths, 1.0 / (c.num_sequences * c.max_completion_length)),
                             reads_max_completion_length=True)
sequence_sum = Normaliser(lambda lengths, c: _each(lengths, 1.0 / _at_least_one(c.num_sequences)))
length_over_positions = Normaliser(lambda lengths, c: lengths.float() / _at_least_one(c.num_positions),
                                   every_position=True)


class LossType(NamedTuple):
    """One loss type: its per-token policy term and its normaliser in each place that serves it."""

    term: str
    """The kernel's per-token policy term (a key of ``terms.POLICY_LOSSES``)."""
    weights: Normaliser
    """fastgrpo's trainer, over the step's global batch."""
    trl: Normaliser | None = None
    """TRL's (``fastgrpo.integrations.trl``), over the micro-batch; None: not a TRL loss type."""
    liger: Normaliser | None = None
    """Liger-Kernel's (``FusedLinearGRPOLoss``), over the micro-batch; None: not a Liger loss type."""
    liger_sequence_level: bool = True
    """Whether Liger serves ``importance_sampling_level="sequence"`` for it."""


LOSS_TYPES: dict[str, LossType] = {
    "grpo": LossType("clip", sequence_mean, trl=sequence_mean, liger=sequence_mean),
    "dapo": LossType("clip", token_mean, trl=global_token_mean, liger=global_token_mean),
    "bnpo": LossType("clip", token_mean, trl=token_mean, liger=token_mean),
    "dr_grpo": LossType("clip", max_length_mean, trl=max_length_mean, liger=max_length_mean),
    "luspo": LossType("clip", sequence_sum, trl=sequence_sum, liger=length_over_positions),
    "cispo": LossType("cispo", token_mean, trl=global_token_mean, liger=global_token_mean,
                      liger_sequence_level=False),
    "sapo": LossType("sapo", sequence_mean, trl=sequence_mean, liger=sequence_mean, liger_sequence_level=False),
}
"""Loss type -> its row (module docstring). vespo is in none of the columns: its weight is not a per-token term of
the kernel's shape (``objective.py``)."""


def add_loss_type(name: str, row: LossType) -> None:
    """Add ``row`` to ``LOSS_TYPES`` under ``name`` (ValueError naming the term when it is unknown)."""
    if row.term not in POLICY_LOSSES:
        raise ValueError(f"policy_loss must be one of {sorted(POLICY_LOSSES)}, got {row.term!r}")
    LOSS_TYPES[name] = row
