"""GRPO's update (``algorithm: grpo``): group-relative advantages -> token weights, old / reference log-probs and
importance weights -> ``grpo.num_iterations`` optimizer updates of the policy with the fused GRPO loss.

Legend: S sequences on this rank, N their completion tokens (flat layout: sequence i's tokens are contiguous), n the
target tokens of one micro-batch.

    grpo_update    one rollout batch (:class:`GRPOBatch`) -> num_iterations optimizer updates; the trainer, the
                   golden test and the FSDP 1-vs-2-rank test call it, so those checks run the code that trains
    GRPO           the registry entry (:mod:`fastgrpo.algorithms.registry`): a step's episodes -> GRPOBatch ->
                   grpo_update, with the reference model when grpo.beta > 0
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from fastgrpo.algorithms.advantages import self_imitation_mask
from fastgrpo.algorithms.interface import Algorithm, StepInputs
from fastgrpo.algorithms.kept_mass import old_kept_log_mass
from fastgrpo.algorithms.tokens import (PolicyObjective, SequenceBatch, TokenInputs, importance_weights,
                                       loss_type_weights)
from fastgrpo.config import GRPOConfig, RolloutConfig
from fastgrpo.distributed.runner import ModelRunner, as_runner
from fastgrpo.models.packing import MicroBatch
from fastgrpo.runtime.metrics import StepMetrics
from fastgrpo.update.guard import NonFiniteGuard
from fastgrpo.update.step import (count_update_tokens, microbatch_tokens, optimizer_update, packed_logprobs,
                                  plan_step, shares_prefix)

__all__ = ["GRPO", "GRPOBatch", "entropy_mask", "grpo_update", "sequence_numbers"]


@dataclass(kw_only=True)
class GRPOBatch(SequenceBatch):
    """One rollout batch on this rank, as the update needs it."""

    advantages: torch.Tensor
    """[S] one advantage per sequence."""
    sequence_mask: torch.Tensor | None = None
    """[S] bool: sequences that get loss (False: truncated ones under mask_truncated_completions); None = all."""
    sil_mask: torch.Tensor | None = None
    """[S] bool: completions to imitate (self-imitation adds grpo.sil_coef to their advantages); None = none."""
    model_mask: torch.Tensor | None = None
    """[N] bool, multi-turn: True at tokens the model sampled, False at environment tokens, which are attended but
    get token weight 0 and are left out of the loss normaliser; None = all tokens are the model's."""


def sequence_numbers(mb: MicroBatch, lengths: torch.Tensor) -> torch.Tensor:
    """[n] the sequence of each target row of ``mb``, numbered 0..K-1 in row order (host tensor)."""
    if not mb.seq_indices:
        return torch.zeros(0, dtype=torch.long)
    return torch.repeat_interleave(torch.arange(len(mb.seq_indices)), lengths[mb.seq_indices],
                                   output_size=mb.num_completion_tokens)


def entropy_mask(entropy: torch.Tensor, counted: torch.Tensor, quantile: float) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL's top-entropy mask: (keep [N] bool, threshold) where keep marks counted tokens whose entropy is at least
    the (1 - quantile) quantile of the counted tokens' entropies (this rank's batch)."""
    values = entropy[counted]
    if values.numel() == 0:
        return counted.clone(), entropy.new_zeros(())
    threshold = torch.quantile(values.float(), 1.0 - quantile)
    return counted & (entropy >= threshold), threshold


def grpo_update(model: ModelRunner | torch.nn.Module, batch: GRPOBatch, *, grpo: GRPOConfig, rollout: RolloutConfig,
                optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
                max_grad_norm: float, metrics: StepMetrics, device: torch.device | str,
                ref_model: ModelRunner | torch.nn.Module | None = None, pad_token_id: int = 0,
                guard: NonFiniteGuard | None = None,
                max_tokens_per_microbatch: int | None = None) -> list[MicroBatch]:
    """``grpo.num_iterations`` optimizer updates on one rollout batch; returns the micro-batches it ran.

    ``model``: the policy's runner (``fastgrpo.distributed.runner``), or a module run by a default one; likewise
    ``ref_model``. ``max_tokens_per_microbatch``, when given, replaces ``grpo.max_tokens_per_microbatch`` (the trainer passes the
    budget it sized from free GPU memory, :meth:`fastgrpo.trainers.grpo.Trainer.microbatch_tokens`).

    Token weights (``grpo.loss_type``) are normalised over the global batch (all ranks), so the summed gradient
    does not depend on the micro-batch budget or the world size. Old log-probs are computed once, before the first
    update, when mu > 1 or for the importance-sampling correction; reference log-probs when ``ref_model`` is given.
    As in TRL, the entropy mask and the truncated importance weights scale the policy term only
    (:class:`fastgrpo.algorithms.tokens.TokenInputs`).
    """
    model = as_runner(model)
    lens = [len(c) for c in batch.completion_ids]  # [S] host ints
    lengths = torch.tensor(lens, dtype=torch.long)  # [S]
    n_tok = sum(lens)  # N on this rank
    model_mask = None if batch.model_mask is None else batch.model_mask.cpu().bool()  # [N]
    # multi-turn: the loss types normalise by the model's tokens of each sequence (environment tokens get weight 0)
    model_lens = lens if model_mask is None else [int(m.sum()) for m in model_mask.split(lens)]  # [S]
    keep = None if batch.sequence_mask is None else batch.sequence_mask.cpu()  # [S] bool
    # masked sequences leave the token normaliser (dapo), as in TRL
    counted = sum(model_lens) if keep is None else sum(n for n, k in zip(model_lens, keep.tolist()) if k)
    plan = plan_step(batch.prompt_ids, batch.completion_ids,
                     max_tokens_per_microbatch or microbatch_tokens(grpo.max_tokens_per_microbatch, device),
                     device=device, pad_token_id=pad_token_id, counted_tokens=counted,
                     buckets=model.token_buckets, shared_prefix=shares_prefix(grpo.shared_prefix, model))
    mbs = plan.mbs
    # [N] (model tokens only while model_mask is set)
    weights = loss_type_weights(grpo.loss_type, model_lens, plan, max_completion_length=rollout.max_completion_length)
    if model_mask is not None:  # environment tokens: weight 0 (no loss, no KL, no gradient)
        weights = torch.zeros(n_tok, dtype=weights.dtype).masked_scatter(model_mask, weights)  # [N]
    if keep is not None:
        weights = weights * torch.repeat_interleave(keep.float(), lengths, output_size=n_tok)  # [N]
    weights = weights.to(device)
    adv_seq = batch.advantages.float()  # [S], on the CPU or already on the device (the caller's choice)
    if batch.sil_mask is not None:  # self-imitation: at ratio 1 the gradient of -(A + c) r is that of -(A + c) logp
        adv_seq = adv_seq + grpo.sil_coef * batch.sil_mask.to(adv_seq.device).float()
    # lengths follow the advantages (a host-to-device copy, no sync), so either placement works
    adv = torch.repeat_interleave(adv_seq, lengths.to(adv_seq.device), output_size=n_tok).to(device)  # [N]
    objective = PolicyObjective.from_config(grpo, rollout, device)
    seq_numbers = ({id(mb): sequence_numbers(mb, lengths).to(device) for mb in mbs} if objective.sequence_level
                   else None)
    logprobs = partial(packed_logprobs, mbs=mbs, num_tokens=n_tok, temperature=rollout.temperature,
                       backend=objective.backend)

    model.train()
    ref_lp = logprobs(ref_model) if ref_model is not None else None  # [N]
    needs_old = grpo.num_iterations > 1 or batch.sampler_logprobs is not None
    old_lp = kept = is_w = None
    if grpo.top_entropy_quantile < 1.0:  # entropies before the update decide which tokens get loss
        current_lp, entropy = logprobs(model, with_entropy=True)  # [N], [N]
        kept, threshold = entropy_mask(entropy, weights != 0, grpo.top_entropy_quantile)
        metrics.set("policy/entropy_threshold", threshold)
        metrics.set("policy/entropy_kept_frac", kept.sum() / (weights != 0).sum().clamp(min=1))
        old_lp = current_lp if needs_old else None
    elif needs_old:
        old_lp = logprobs(model)  # [N]
    if batch.sampler_logprobs is not None:  # truncated importance sampling: sampler != trainer numerics
        is_w = importance_weights(old_lp, batch.sampler_logprobs, cap=rollout.importance_sampling_cap,
                                  metrics=metrics, old_kept_log_mass=old_kept_log_mass(model, mbs, n_tok, rollout),
                                  counted=weights != 0)
        if grpo.num_iterations == 1:
            old_lp = None  # mu = 1: old = logp.detach(), exactly as without the correction
    inputs = TokenInputs.build(weights, adv, old_logprobs=old_lp, ref_logprobs=ref_lp, policy_factors=(kept, is_w),
                               separate_kl=objective.separate_kl)
    head_loss = objective.head_loss(inputs, seq_numbers)
    for _ in range(grpo.num_iterations):
        optimizer_update(model, mbs, head_loss, optimizer=optimizer, scheduler=scheduler,
                         max_grad_norm=max_grad_norm, metrics=metrics, loss_divisor=grpo.num_iterations, guard=guard)
    count_update_tokens(metrics, mbs)
    if keep is not None:
        metrics.moments((~keep).float(), "policy/masked_seq_frac")
    if batch.sil_mask is not None:
        metrics.moments(batch.sil_mask.float(), "policy/sil_frac")
    return mbs


def _update(ep, step: StepInputs) -> None:
    """A step's episodes -> :class:`GRPOBatch` -> :func:`grpo_update` (the trainer's policy update)."""
    g = step.cfg.grpo
    batch = GRPOBatch(
        prompt_ids=ep.prompt_ids, completion_ids=ep.completion_ids, advantages=ep.adv.advantages,
        sampler_logprobs=ep.sampler_logprobs,
        sequence_mask=torch.tensor([f != "length" for f in ep.finish_reasons], dtype=torch.bool)
        if g.mask_truncated_completions else None,
        sil_mask=self_imitation_mask(ep.rewards, g.num_generations, g.sil_top_k, g.sil_min_reward)
        if g.sil_top_k else None,
        model_mask=None if ep.model_masks is None else  # multi-turn: environment tokens get weight 0
        torch.tensor([m for ms in ep.model_masks for m in ms], dtype=torch.bool))
    policy = step.policy
    grpo_update(policy.runner, batch, grpo=g, rollout=step.cfg.rollout, optimizer=policy.optimizer,
                scheduler=policy.scheduler, max_grad_norm=step.cfg.optim.max_grad_norm, metrics=step.metrics,
                device=step.device, ref_model=step.ref_model, pad_token_id=step.pad_token_id, guard=policy.guard,
                max_tokens_per_microbatch=step.max_tokens_per_microbatch)


GRPO = Algorithm(
    name="grpo",
    update=_update,
    needs_reference=lambda cfg: cfg.grpo.beta > 0,
    policy_updates=lambda cfg: cfg.max_steps * cfg.grpo.num_iterations,
    group_advantages=True,
    multi_turn=True,
    asynchronous_rollout=True,
)
"""Group-relative advantages, the clipped objective of grpo.loss_type, grpo.num_iterations updates per batch."""
