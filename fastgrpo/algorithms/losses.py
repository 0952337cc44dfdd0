"""Loss types as per-token weights.

Legend: S sequences in the *global* batch (all ranks), L_i completion length of sequence i, L_max the configured
max_completion_length, N completion tokens held by this rank (flat layout: sequence i's tokens are contiguous).

The fused kernel computes ``sum_n w_n * l_n`` (fastgrpo.kernels.linear_grpo_loss). Every loss type is therefore one
small function that returns w, decided once per step over the global batch, so the gradient does not depend on the
micro-batch budget or the world size, plus the kernel's per-token policy term ``l`` (``policy_loss``), both given
by one registration:

    grpo     w_{i,t} = 1 / (S * L_i)        sequence mean, then batch mean (TRL "grpo")              clip
    dapo     w_{i,t} = 1 / sum_i L_i        token mean over the global batch (TRL "dapo"; alias       clip
                                            "bnpo": TRL's bnpo normalises per micro-batch instead)
    dr_grpo  w_{i,t} = 1 / (S * L_max)      constant normaliser (Dr. GRPO; easy-GRPO's 1/(B*L))     clip
    luspo    w_{i,t} = 1 / S                sequence sums, then batch mean (TRL "luspo", meant for   clip
                                            importance_sampling_level 'sequence')
    cispo    w_{i,t} = 1 / sum_i L_i        as dapo (TRL "cispo")                                     cispo
    sapo     w_{i,t} = 1 / (S * L_i)        as grpo (TRL "sapo")                                      sapo

With FSDP the per-rank gradients are *summed* (see parallelize.py), so these global weights give exactly the
single-process gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from fastgrpo.kernels.objective import POLICY_LOSSES


@dataclass(frozen=True)
class GlobalCounts:
    """Step-wide totals over every rank, computed once before the update."""

    num_sequences: int
    """S."""
    num_tokens: int
    """sum_i L_i."""
    max_completion_length: int
    """L_max (the configured limit, not the observed maximum: a constant normaliser is the point of dr_grpo)."""


# name -> fn(lengths [S_local] long, counts) -> per-sequence weight [S_local] float32 (broadcast over its tokens)
LOSS_TYPES: dict[str, Callable[[torch.Tensor, GlobalCounts], torch.Tensor]] = {}

POLICY_LOSS_OF: dict[str, str] = {}
"""Loss type -> the kernel's per-token policy term (a key of ``fastgrpo.kernels.objective.POLICY_LOSSES``), filled
by the same ``register_loss_type`` call as LOSS_TYPES."""


def register_loss_type(*names: str, policy_loss: str = "clip"):
    """Register ``fn(lengths, counts) -> per-sequence weight`` under ``names``, each with the kernel's per-token
    ``policy_loss`` term."""
    if policy_loss not in POLICY_LOSSES:
        raise ValueError(f"policy_loss must be one of {sorted(POLICY_LOSSES)}, got {policy_loss!r}")

    def deco(fn):
        for n in names:
            LOSS_TYPES[n] = fn
            POLICY_LOSS_OF[n] = policy_loss
        return fn

    return deco


@register_loss_type("grpo")
def _grpo(lengths: torch.Tensor, c: GlobalCounts) -> torch.Tensor:
    return 1.0 / (c.num_sequences * lengths.clamp(min=1).float())


@register_loss_type("dapo", "bnpo")
def _dapo(lengths: torch.Tensor, c: GlobalCounts) -> torch.Tensor:
    return torch.full(lengths.shape, 1.0 / max(c.num_tokens, 1), dtype=torch.float32, device=lengths.device)


@register_loss_type("dr_grpo")
def _dr_grpo(lengths: torch.Tensor, c: GlobalCounts) -> torch.Tensor:
    return torch.full(lengths.shape, 1.0 / (c.num_sequences * c.max_completion_length), dtype=torch.float32,
                      device=lengths.device)


register_loss_type("cispo", policy_loss="cispo")(_dapo)
register_loss_type("sapo", policy_loss="sapo")(_grpo)


@register_loss_type("luspo")
def _luspo(lengths: torch.Tensor, c: GlobalCounts) -> torch.Tensor:
    return torch.full(lengths.shape, 1.0 / max(c.num_sequences, 1), dtype=torch.float32, device=lengths.device)


SFT_NORMALIZATIONS: dict[str, Callable[[torch.Tensor, GlobalCounts], torch.Tensor]] = {
    "token": _dapo,
    "sequence": _grpo,
}
"""SFT loss normalisation (sft.normalization) -> per-sequence weight, as LOSS_TYPES: 'token' = 1 / sum_i L_i (every
completion token of the global batch weighs the same), 'sequence' = 1 / (S * L_i) (each sequence's mean, then the
mean over sequences). The SFT loss is sum_t w_t * -log p(y_t) with these weights."""


def token_weights(loss_type: str, lengths: torch.Tensor, counts: GlobalCounts,
                  registry: dict[str, Callable] = LOSS_TYPES, *, num_tokens: int | None = None) -> torch.Tensor:
    """Per-token weights [N] in the flat layout, for this rank's sequences of completion ``lengths`` [S_local].
    ``registry``: LOSS_TYPES (GRPO) or SFT_NORMALIZATIONS. ``num_tokens``: N when the caller knows it (otherwise it
    is read from ``lengths``, a host sync when they live on a GPU)."""
    try:
        fn = registry[loss_type]
    except KeyError:
        what = "loss_type" if registry is LOSS_TYPES else "normalization"
        raise ValueError(f"unknown {what} {loss_type!r}; known: {sorted(registry)}") from None
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
