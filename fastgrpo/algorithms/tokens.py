"""What GRPO and PPO share between their batches and the fused loss: the per-token inputs of the policy term and
the one head loss that reads them.

Legend: S sequences, N their completion tokens (flat layout: sequence i's tokens are contiguous), n the target
tokens of one micro-batch, H hidden size, V vocabulary size.

    loss_type_weights   grpo.loss_type's token weights [N] over the global batch of a step plan (normaliser only)
    importance_weights  truncated importance weights [N] of the sampler's numerics (rollout.importance_sampling_cap)
    TokenInputs.build   weights, advantages, old / reference log-probs; the policy term's weights times its factors
                        (entropy mask, importance weights), the KL term's kept apart where they differ
    PolicyObjective     the fused loss's ``LossSettings``, built once from the config (grpo, rollout), and
                        ``head_loss``: the head ``optimizer_update`` runs per micro-batch, logging the policy's
                        statistics (a ``TokenHead``: gathered per-token tensors + a function of them, which a CUDA
                        graph replays)

As in TRL, the entropy mask and the importance weights scale the policy term only: the KL term keeps the plain
normaliser, and so do GSPO's sequence means, which count every token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastgrpo.algorithms.losses import GlobalCounts, token_weights, truncated_importance_weights
from fastgrpo.config import GRPOConfig, RolloutConfig
from fastgrpo.kernels import LossSettings, fused_grpo_loss, resolve_backend
from fastgrpo.models.packing import MicroBatch
from fastgrpo.runtime.metrics import StepMetrics
from fastgrpo.update.head import TokenHead
from fastgrpo.update.step import StepPlan

__all__ = ["POLICY_STATS", "PolicyObjective", "SequenceBatch", "TokenInputs", "importance_weights",
           "loss_type_weights"]

POLICY_STATS = ("clip_low_frac", "clip_high_frac", "kl_mean", "cispo_clip_frac")
"""The kernel's statistics logged as ``policy/<name>`` (each when the loss type's term reports it), besides
``policy/entropy``."""


@dataclass(kw_only=True)
class SequenceBatch:
    """One rollout batch's sequences on this rank, as every update needs them (GRPO's and PPO's batches add theirs)."""

    prompt_ids: list[list[int]]
    """[S] prompt token ids."""
    completion_ids: list[list[int]]
    """[S] completion token ids."""
    sampler_logprobs: torch.Tensor | None = None
    """[N] the sampler's log-probs (truncated importance sampling, rollout.importance_sampling_cap), or None."""


def loss_type_weights(loss_type: str, lengths: list[int], plan: StepPlan, *, max_completion_length: int,
                      device: torch.device | str | None = None) -> torch.Tensor:
    """Token weights [N] of ``loss_type`` for sequences of ``lengths`` [S] (the tokens that count), normalised by
    ``plan``'s global totals (sequences and counted tokens over all ranks), so the summed gradient depends neither
    on the micro-batch budget nor on the world size."""
    counts = GlobalCounts(num_sequences=plan.num_sequences, num_tokens=plan.num_tokens,
                          max_completion_length=max_completion_length)
    weights = token_weights(loss_type, torch.tensor(lengths, dtype=torch.long), counts, num_tokens=sum(lengths))
    return weights if device is None else weights.to(device)  # [N]


def importance_weights(old_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, *, cap: float,
                       metrics: StepMetrics, old_kept_log_mass: torch.Tensor | None = None,
                       counted: torch.Tensor | None = None) -> torch.Tensor:
    """Truncated importance weights [N] of the trainer's log-probs against the sampler's (the rollout engine's
    kernels, or vLLM's own weights, differ from the trainer's).

    The sampler's log-probs are renormalised over its top_k / top_p kept set (fastgrpo.rollout.truncation); with
    ``old_kept_log_mass`` [N] (:func:`fastgrpo.algorithms.kept_mass.packed_kept_log_mass`) the trainer's are
    renormalised over its own kept set the same way, so truncation alone leaves the ratio at 1. Logs the weights'
    mean ``is/weight_mean``, and the raw ratio's ``is/ratio_mean``, ``is/ratio_min``, ``is/ratio_max`` and the
    fraction of tokens the cap clips, ``is/clipped_frac``; the ratio's over the ``counted`` [N] bool tokens only
    when given (an environment's tokens were not sampled: their sampler log-prob is a placeholder 0)."""
    old = old_logprobs if old_kept_log_mass is None else old_logprobs - old_kept_log_mass.to(old_logprobs.device)
    sampler = sampler_logprobs.to(old_logprobs.device)
    is_w = truncated_importance_weights(old, sampler, cap)  # [N]
    ratio = torch.exp(old.detach().float() - sampler.float())  # [N] before the cap
    metrics.add("is/weight_mean", is_w.mean())
    nan = float("nan")
    left_out = None if counted is None else ~counted.to(ratio.device)  # [N]
    # moments skip NaN entries; the extremes skip what cannot be one (a masked fill, not boolean indexing)
    metrics.moments(ratio if left_out is None else ratio.masked_fill(left_out, nan), "is/ratio_mean")
    clipped = (ratio > cap).float()  # [N]
    metrics.moments(clipped if left_out is None else clipped.masked_fill(left_out, nan), "is/clipped_frac")
    if ratio.numel():
        inf = float("inf")
        metrics.min("is/ratio_min", (ratio if left_out is None else ratio.masked_fill(left_out, inf)).min())
        metrics.max("is/ratio_max", (ratio if left_out is None else ratio.masked_fill(left_out, -inf)).max())
    return is_w


@dataclass(frozen=True, kw_only=True)
class TokenInputs:
    """The per-token inputs of the policy loss in a batch's flat layout (all ``[N]``, on the device)."""

    weights: torch.Tensor
    """The policy term's weights: the normaliser times the policy-only factors."""
    kl_weights: torch.Tensor | None
    """The KL term's (and GSPO's sequence means') weights where they differ from ``weights``; else None."""
    advantages: torch.Tensor
    """Per-token advantages."""
    old_logprobs: torch.Tensor | None = None
    """Behaviour log-probs; None: ``logp.detach()`` (one update per batch, ratio 1)."""
    ref_logprobs: torch.Tensor | None = None
    """Reference log-probs (the KL term's), or None."""

    @classmethod
    def build(cls, weights: torch.Tensor, advantages: torch.Tensor, *, old_logprobs: torch.Tensor | None = None,
              ref_logprobs: torch.Tensor | None = None, policy_factors: tuple[torch.Tensor | None, ...] = (),
              separate_kl: bool = False) -> "TokenInputs":
        """``weights`` [N] the normaliser; ``policy_factors`` [N] each (None: absent) multiply the policy term's
        weights only. ``separate_kl``: whether the KL term (beta != 0) or the sequence means (GSPO) read weights at
        all; the plain ones are then kept for them when a factor changed the policy's (with beta 0 at token level
        they would only add softmax work for masked rows)."""
        policy = weights
        for factor in policy_factors:
            if factor is not None:
                policy = policy * factor  # [N]
        kl = weights if policy is not weights and separate_kl else None
        return cls(weights=policy, kl_weights=kl, advantages=advantages, old_logprobs=old_logprobs,
                   ref_logprobs=ref_logprobs)


@dataclass(frozen=True, kw_only=True)
class PolicyObjective:
    """The fused GRPO-family loss of a run: its settings, read once from the config, and the kernel path."""

    settings: LossSettings
    """The policy loss's settings (``GRPOConfig.loss_settings``), passed unchanged to the kernel."""
    backend: str
    """The resolved kernel path (a recompute path at the sequence level)."""

    @classmethod
    def from_config(cls, grpo: GRPOConfig, rollout: RolloutConfig, device: torch.device | str) -> "PolicyObjective":
        settings = grpo.loss_settings(temperature=rollout.temperature)
        # One kernel path for the loss and the old / reference log-probs: exp(logp - old) is exactly 1 while the
        # policy has not moved. Sequence level (GSPO) needs a recompute path: 'auto' then picks triton on CUDA.
        backend = resolve_backend(grpo.head_backend, device, needs_grad=True, sequence_level=settings.sequence_level)
        return cls(settings=settings, backend=backend)

    @property
    def sequence_level(self) -> bool:
        """GSPO: one importance ratio per sequence (``grpo.importance_sampling_level``)."""
        return self.settings.sequence_level

    @property
    def separate_kl(self) -> bool:
        """Whether the KL term or the sequence means read weights of their own (see ``TokenInputs.build``)."""
        return self.settings.beta != 0.0 or self.sequence_level

    def head_loss(self, inputs: TokenInputs, sequence_index: dict[int, torch.Tensor] | None = None) -> TokenHead:
        """``head_loss(mb, hidden [n, H], weight [V, H]) -> (loss, stats)`` of ``inputs`` for ``optimizer_update``;
        ``sequence_index``: ``id(mb)`` -> [n] sequence numbers (GSPO). Stats: ``policy/<POLICY_STATS>`` and
        ``policy/entropy`` over the tokens that get loss. A :class:`TokenHead`: rows whose tensors are all 0 (token
        weights 0) add nothing, so a CUDA graph can run it on padded rows."""
        ref = inputs.ref_logprobs if self.settings.beta != 0.0 else None
        numbers = sequence_index or {}
        per_token = {"advantages": inputs.advantages, "weights": inputs.weights, "old_logprobs": inputs.old_logprobs,
                     "ref_logprobs": ref, "kl_weights": inputs.kl_weights}

        def gather(mb: MicroBatch) -> dict[str, torch.Tensor]:
            i = mb.flat_index  # [n] into the batch's flat layout
            out = {"targets": mb.targets, **{k: v[i] for k, v in per_token.items() if v is not None}}
            if id(mb) in numbers:
                out["sequence_index"] = numbers[id(mb)]
            return out

        key = ("policy", self.settings, self.backend)
        return TokenHead(compute=self.compute_loss, gather=gather, key=key)

    def compute_loss(self, hidden: torch.Tensor, weight: torch.Tensor, *, targets: torch.Tensor,
                     advantages: torch.Tensor, weights: torch.Tensor, old_logprobs: torch.Tensor | None = None,
                     ref_logprobs: torch.Tensor | None = None, kl_weights: torch.Tensor | None = None,
                     sequence_index: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The fused loss of one micro-batch's rows (hidden [n, H], weight [V, H], the rest [n]) and its stats."""
        loss, stats = fused_grpo_loss(
            hidden, weight, targets, advantages, weights, self.settings, old_logprobs=old_logprobs,
            ref_logprobs=ref_logprobs, kl_token_weights=kl_weights, sequence_index=sequence_index,
            return_entropy=True, backend=self.backend)
        counted = weights != 0
        entropy = (stats["entropy"] * counted).sum() / counted.sum().clamp(min=1)  # over tokens that get loss
        return loss, {**{f"policy/{k}": stats[k] for k in POLICY_STATS if k in stats}, "policy/entropy": entropy}
