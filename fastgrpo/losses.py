"""Loss types as per-token weights.

Legend: S sequences in the *global* batch (all ranks), L_i completion length of sequence i, L_max the configured
max_completion_length, N completion tokens held by this rank (flat layout: sequence i's tokens are contiguous).

The fused kernel computes ``sum_n w_n * l_n`` (fastgrpo.kernels.linear_grpo_loss). Every loss type is therefore one
small function that returns w, decided once per step over the global batch, so the gradient does not depend on the
micro-batch budget or the world size:

    grpo     w_{i,t} = 1 / (S * L_i)        sequence mean, then batch mean (TRL "grpo")
    dapo     w_{i,t} = 1 / sum_i L_i        token mean over the global batch (TRL "dapo"; alias "bnpo")
    dr_grpo  w_{i,t} = 1 / (S * L_max)      constant normaliser (Dr. GRPO; easy-GRPO's 1/(B*L))

With FSDP the per-rank gradients are *summed* (see parallelize.py), so these global weights give exactly the
single-process gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


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


def register_loss_type(*names: str):
    def deco(fn):
        for n in names:
            LOSS_TYPES[n] = fn
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
    gradient flows through it. Unlike TRL, which weights only the policy-gradient term, it then also weights the
    KL term (beta > 0): the fused loss takes one weight per token. With weights near 1 the difference is small.
    """
    if cap <= 0:
        raise ValueError(f"rollout.importance_sampling_cap: must be > 0, got {cap}")
    if old_logprobs.shape != sampler_logprobs.shape:
        raise ValueError(f"old log-probs {tuple(old_logprobs.shape)} and sampler log-probs "
                         f"{tuple(sampler_logprobs.shape)} must have the same shape")
    log_ratio = old_logprobs.detach().float() - sampler_logprobs.detach().float()  # [N]
    return torch.exp(log_ratio).clamp(max=cap)  # [N]
