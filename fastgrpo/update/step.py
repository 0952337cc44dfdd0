"""The optimizer update on packed micro-batches: a loss-agnostic core and the GRPO update built on it.

Legend: S sequences on this rank, N completion (target) tokens on this rank (flat layout: sequence i's tokens are
contiguous), n target tokens of one micro-batch, H hidden size, V vocabulary size.

    plan_step          sequences -> micro-batches (every rank gets the same count: FSDP collectives per forward) and
                       the step's totals over ranks, in one collective and one host read
    packed_logprobs    no-grad log-probs [N] of the target tokens (old / reference passes)
    optimizer_update   zero grads -> per micro-batch: model.packed_forward(mb, head_loss) -> backward -> clip ->
                       optimizer step; any token loss whose gradient sums over micro-batches (GRPO, SFT, ...)
    grpo_update        token weights, advantages, old / ref log-probs, importance weights, then num_iterations
                       optimizer_update calls with the fused GRPO loss
    sft_weights        SFT token weights [N] over the global batch (sft.normalization)
    sft_update         one optimizer_update with the SFT loss sum_t w_t * -log p(y_t) (fastgrpo.sft)

The trainer, the golden test and the FSDP test all call these functions, so "1 process equals 2 ranks" and the
golden figures are checked on the code that trains.

Host syncs: none per micro-batch here (metrics stay on the device, token-level tensors are indexed with device
index tensors built by ``pack``); per optimizer update, the plan's one read of the totals, the guard's finiteness
check and the metrics' one read at the end of the step (``benchmarks/count_ops.py`` counts them).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch

from fastgrpo.distributed import groups as fdist
from fastgrpo.config import GRPOConfig, RolloutConfig
from fastgrpo.update.guard import NonFiniteGuard
from fastgrpo.kernels import linear_grpo_loss, linear_logprobs, resolve_backend
from fastgrpo.algorithms.losses import (
    POLICY_LOSS_OF,
    SFT_NORMALIZATIONS,
    GlobalCounts,
    token_weights,
    truncated_importance_weights,
)
from fastgrpo.runtime.metrics import StepMetrics
from fastgrpo.models.packing import MicroBatch, pack, plan_microbatches, split_to_count

__all__ = ["DEFAULT_MICROBATCH_TOKENS", "GRPOBatch", "HeadLoss", "StepPlan", "entropy_mask", "grpo_update",
           "microbatch_tokens", "optimizer_update", "packed_logprobs", "plan_packed", "plan_step", "sequence_numbers",
           "sft_update", "sft_weights"]

HeadLoss = Callable[[MicroBatch, torch.Tensor, torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]]
"""``head_loss(mb, hidden [n, H], lm_head_weight [V, H]) -> (loss, stats)``: loss a scalar whose gradients add up
over micro-batches (normalised over the global batch by the caller); stats maps metric names to device scalars,
each a mean over the micro-batch's n tokens (logged token-weighted)."""


DEFAULT_MICROBATCH_TOKENS = {"cpu": 1024, "cuda": 4096}
"""``grpo.max_tokens_per_microbatch`` when it is None, per device type (others: the CUDA value). On a CPU one
micro-batch's activations are the largest part of the update's peak memory after the weights, gradients and AdamW
state (about 0.4 MB per token on the 108M-style model), and rows of ~1000 tokens keep the products as fast as longer
ones (benchmarks/RESULTS.md)."""


def microbatch_tokens(budget: int | None, device: torch.device | str) -> int:
    """The micro-batch token budget: ``budget``, or the device's default when it is None."""
    if budget is not None:
        return budget
    return DEFAULT_MICROBATCH_TOKENS.get(torch.device(device).type, DEFAULT_MICROBATCH_TOKENS["cuda"])


def _gather_ints(values: list[int], *, device: torch.device | str) -> list[list[int]]:
    """Every rank's ``values`` as host ints ``[world size][len(values)]``, in one collective and one host read: each
    rank fills its own row of zeros and an all-reduce sum fills in the others (an all-gather through the one
    reduction every backend has). Sums and maxima over ranks are then taken on the host, so a step needs one such
    read instead of one per quantity."""
    rows = [[0] * len(values) for _ in range(fdist.get_world_size())]
    rows[fdist.get_rank()] = list(values)
    return fdist.all_reduce_(torch.tensor(rows, dtype=torch.int64, device=device), "sum").tolist()


@dataclass(frozen=True, kw_only=True)
class StepPlan:
    """This rank's micro-batches and the step's totals over all ranks."""

    mbs: list[MicroBatch]
    """The micro-batches, as many on every rank."""
    num_sequences: int
    """Sequences over all ranks."""
    num_tokens: int
    """``counted_tokens`` summed over all ranks."""


def plan_step(prompt_ids: list[list[int]], completion_ids: list[list[int]], max_tokens: int, *,
              device: torch.device | str, pad_token_id: int = 0, counted_tokens: int | None = None) -> StepPlan:
    """First-fit-decreasing micro-batches under ``max_tokens``, split or padded to the same count on every rank, and
    the global number of sequences and of ``counted_tokens`` (default: every completion token of this rank), all
    from one collective."""
    seq_lens = [len(p) + len(c) for p, c in zip(prompt_ids, completion_ids)]
    bins = plan_microbatches(seq_lens, max_tokens)
    counted = sum(len(c) for c in completion_ids) if counted_tokens is None else counted_tokens
    ranks = _gather_ints([len(seq_lens), counted, len(bins)], device=device)  # [world size][3]
    # FSDP: every rank must run the same number of forward/backward calls (collectives per block)
    bins = split_to_count(bins, seq_lens, max(r[2] for r in ranks))
    return StepPlan(mbs=pack(prompt_ids, completion_ids, bins, device=device, pad_token_id=pad_token_id),
                    num_sequences=sum(r[0] for r in ranks), num_tokens=sum(r[1] for r in ranks))


def plan_packed(prompt_ids: list[list[int]], completion_ids: list[list[int]], max_tokens: int, *,
                device: torch.device | str, pad_token_id: int = 0) -> list[MicroBatch]:
    """The micro-batches of :func:`plan_step` alone."""
    return plan_step(prompt_ids, completion_ids, max_tokens, device=device, pad_token_id=pad_token_id).mbs


@torch.no_grad()
def packed_logprobs(model: torch.nn.Module, mbs: list[MicroBatch], num_tokens: int, *, temperature: float,
                    backend: str, with_entropy: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs [N] float32 of the target tokens under ``model`` (no [N, V] tensor); with
    ``with_entropy`` also the policy's entropy [N] at each of those positions."""
    device = mbs[0].targets.device if mbs else "cpu"
    out = torch.zeros(num_tokens, dtype=torch.float32, device=device)
    ent = torch.zeros(num_tokens, dtype=torch.float32, device=device) if with_entropy else None
    for mb in mbs:
        # packed_forward runs trunk -> hidden [n, H] of target positions -> fn(hidden, lm_head.weight) inside FSDP's
        # hooks, so sharded (and tied) weights are gathered for the head too.
        res = model.packed_forward(mb, lambda h, w, mb=mb: linear_logprobs(
            h, w, mb.targets, temperature=temperature, backend=backend, return_entropy=with_entropy))
        if with_entropy:
            out[mb.flat_index], ent[mb.flat_index] = res
        else:
            out[mb.flat_index] = res
    return (out, ent) if with_entropy else out


def optimizer_update(model: torch.nn.Module, mbs: list[MicroBatch], head_loss: HeadLoss, *,
                     optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
                     max_grad_norm: float, metrics: StepMetrics, loss_divisor: int = 1,
                     guard: NonFiniteGuard | None = None, role: str = "policy") -> bool:
    """One optimizer update: gradients of ``sum over micro-batches of head_loss`` -> clip -> step.

    ``model`` has ``packed_forward`` (``parallelize_model``). Metrics: ``loss`` (the summed loss / loss_divisor: a
    step of several updates logs their mean), every key of the head's stats, ``policy/grad_norm`` (before clipping)
    and ``lr`` (the rate this update used). ``max_grad_norm`` 0 disables clipping. The optimizer steps only on a
    finite gradient norm (:class:`fastgrpo.update.guard.NonFiniteGuard`, which counts the skipped updates); returns
    whether it stepped. The schedule advances either way, so a step's learning rate does not depend on skips.
    Another ``role`` than 'policy' (PPO's 'critic') logs ``<role>/loss``, ``<role>/grad_norm`` and ``<role>/lr``.
    """
    optimizer.zero_grad(set_to_none=True)
    for mb in mbs:
        loss, stats = model.packed_forward(mb, partial(head_loss, mb))
        loss.backward()
        loss = loss.detach()
        metrics.total("loss" if role == "policy" else f"{role}/loss",
                      loss if loss_divisor == 1 else loss / loss_divisor)
        metrics.add_many(stats, float(mb.num_completion_tokens))  # one stack for all the head's statistics
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm if max_grad_norm > 0 else 1e30)
    if hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor
        grad_norm = grad_norm.full_tensor()
    metrics.set(f"{role}/grad_norm", grad_norm)
    metrics.host("lr" if role == "policy" else f"{role}/lr", optimizer.param_groups[0]["lr"])
    stepped = (guard or NonFiniteGuard(max_in_a_row=1)).step(optimizer, grad_norm)
    if scheduler is not None:
        with warnings.catch_warnings():  # "scheduler.step() before optimizer.step()" after a skipped first update
            warnings.simplefilter("ignore", UserWarning)
            scheduler.step()
    return stepped


@dataclass(kw_only=True)
class GRPOBatch:
    """One rollout batch on this rank, as the update needs it."""

    prompt_ids: list[list[int]]
    """[S] prompt token ids."""
    completion_ids: list[list[int]]
    """[S] completion token ids."""
    advantages: torch.Tensor
    """[S] one advantage per sequence."""
    sampler_logprobs: torch.Tensor | None = None
    """[N] the sampler's log-probs (truncated importance sampling), or None."""
    sequence_mask: torch.Tensor | None = None
    """[S] bool: sequences that get loss (False: truncated ones under mask_truncated_completions); None = all."""
    sil_mask: torch.Tensor | None = None
    """[S] bool: completions to imitate (self-imitation adds grpo.sil_coef to their advantages); None = none."""
    model_mask: torch.Tensor | None = None
    """[N] bool, multi-turn: True at tokens the model sampled, False at environment tokens, which are attended but
    get token weight 0 and are left out of the loss normaliser; None = all tokens are the model's."""


_LOGGED_STATS = ("clip_low_frac", "clip_high_frac", "kl_mean")
_OPTIONAL_STATS = ("cispo_clip_frac",)  # logged when the loss type's term reports it


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


def grpo_update(model: torch.nn.Module, batch: GRPOBatch, *, grpo: GRPOConfig, rollout: RolloutConfig,
                optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
                max_grad_norm: float, metrics: StepMetrics, device: torch.device | str,
                ref_model: torch.nn.Module | None = None, pad_token_id: int = 0,
                guard: NonFiniteGuard | None = None,
                max_tokens_per_microbatch: int | None = None) -> list[MicroBatch]:
    """``grpo.num_iterations`` optimizer updates on one rollout batch; returns the micro-batches it ran.

    ``max_tokens_per_microbatch``, when given, replaces ``grpo.max_tokens_per_microbatch`` (the trainer passes the
    budget it sized from free GPU memory, :meth:`fastgrpo.trainers.grpo.Trainer.microbatch_tokens`).

    Token weights (``grpo.loss_type``) are normalised over the global batch (all ranks), so the summed gradient
    does not depend on the micro-batch budget or the world size. Old log-probs are computed once, before the first
    update, when mu > 1 or for the importance-sampling correction; reference log-probs when ``ref_model`` is given.
    As in TRL, the entropy mask and the truncated importance weights scale the policy term only: the KL term keeps
    the plain normaliser (``kl_token_weights``), and so do GSPO's sequence means, which count every token.
    """
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
                     device=device,
                     pad_token_id=pad_token_id, counted_tokens=counted)
    mbs = plan.mbs
    counts = GlobalCounts(num_sequences=plan.num_sequences, num_tokens=plan.num_tokens,
                          max_completion_length=rollout.max_completion_length)
    weights = token_weights(grpo.loss_type, torch.tensor(model_lens, dtype=torch.long), counts,
                            num_tokens=sum(model_lens))  # [N] (model tokens only while model_mask is set)
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
    # One kernel path for the loss and the old / reference log-probs: exp(logp - old) is exactly 1 while the policy
    # has not moved. Sequence level (GSPO) needs a recompute path: 'auto' then picks triton on CUDA.
    sequence_level = grpo.importance_sampling_level == "sequence"
    backend = resolve_backend(grpo.head_backend, device, needs_grad=True, sequence_level=sequence_level)
    policy_loss = POLICY_LOSS_OF[grpo.loss_type]
    eps_low, eps_high = ((grpo.sequence_epsilon_low, grpo.sequence_epsilon_high) if sequence_level
                         else (grpo.epsilon_low, grpo.epsilon_high))
    if policy_loss == "cispo":  # epsilon_high is cispo's truncation bound at either level (TRL's one eps_max)
        eps_high = grpo.epsilon_high
    seq_numbers = {id(mb): sequence_numbers(mb, lengths).to(device) for mb in mbs} if sequence_level else {}
    logprobs = partial(packed_logprobs, mbs=mbs, num_tokens=n_tok, temperature=rollout.temperature, backend=backend)

    model.train()
    ref_lp = logprobs(ref_model) if ref_model is not None else None  # [N]
    plain_weights = weights  # [N] the normaliser alone: the KL term's weights
    old_lp = None
    if grpo.top_entropy_quantile < 1.0:  # entropies before the update decide which tokens get loss
        current_lp, entropy = logprobs(model, with_entropy=True)  # [N], [N]
        kept, threshold = entropy_mask(entropy, weights != 0, grpo.top_entropy_quantile)
        metrics.set("policy/entropy_threshold", threshold)
        metrics.set("policy/entropy_kept_frac", kept.sum() / (weights != 0).sum().clamp(min=1))
        weights = weights * kept
        if grpo.num_iterations > 1 or batch.sampler_logprobs is not None:
            old_lp = current_lp
    elif grpo.num_iterations > 1 or batch.sampler_logprobs is not None:
        old_lp = logprobs(model)  # [N]
    if batch.sampler_logprobs is not None:  # truncated importance sampling: sampler != trainer numerics
        is_w = truncated_importance_weights(old_lp, batch.sampler_logprobs.to(device),
                                            rollout.importance_sampling_cap)
        metrics.add("is/weight_mean", is_w.mean())
        weights = weights * is_w
        if grpo.num_iterations == 1:
            old_lp = None  # mu = 1: old = logp.detach(), exactly as without the correction

    # The KL term (and GSPO's sequence means) need their own weights only where the policy's differ; with beta 0 at
    # token level they would only add softmax work for masked rows.
    kl_weights = (plain_weights if weights is not plain_weights and (grpo.beta != 0.0 or sequence_level)
                  else None)  # [N] or None

    def head_loss(mb: MicroBatch, hidden: torch.Tensor, weight: torch.Tensor):  # hidden [n, H], weight [V, H]
        i = mb.flat_index
        w = weights[i]  # [n]
        loss, stats = linear_grpo_loss(
            hidden, weight, mb.targets, adv[i], w,
            old_logprobs=None if old_lp is None else old_lp[i], ref_logprobs=None if ref_lp is None else ref_lp[i],
            epsilon_low=eps_low, epsilon_high=eps_high, delta=grpo.delta, beta=grpo.beta,
            temperature=rollout.temperature, backend=backend, return_entropy=True,
            sequence_index=seq_numbers.get(id(mb)), policy_loss=policy_loss,
            sapo_temperature_pos=grpo.sapo_temperature_pos, sapo_temperature_neg=grpo.sapo_temperature_neg,
            use_bias_correction_kl=grpo.use_bias_correction_kl,
            kl_token_weights=None if kl_weights is None else kl_weights[i])
        counted = w != 0
        entropy = (stats["entropy"] * counted).sum() / counted.sum().clamp(min=1)  # over tokens that get loss
        logged = {f"policy/{k}": stats[k] for k in _LOGGED_STATS + _OPTIONAL_STATS if k in stats}
        return loss, {**logged, "policy/entropy": entropy}

    for _ in range(grpo.num_iterations):
        optimizer_update(model, mbs, head_loss, optimizer=optimizer, scheduler=scheduler,
                         max_grad_norm=max_grad_norm, metrics=metrics, loss_divisor=grpo.num_iterations, guard=guard)
    metrics.total("perf/update_tokens", torch.tensor(float(sum(mb.num_tokens for mb in mbs))))
    if keep is not None:
        metrics.moments((~keep).float(), "policy/masked_seq_frac")
    if batch.sil_mask is not None:
        metrics.moments(batch.sil_mask.float(), "policy/sil_frac")
    return mbs


def sft_weights(completion_ids: list[list[int]], normalization: str, *, device: torch.device | str) -> torch.Tensor:
    """Per-token weights [N] of the SFT loss for this rank's completions, normalised over the global batch."""
    ranks = _gather_ints([len(completion_ids), sum(len(c) for c in completion_ids)], device=device)  # [world size][2]
    return _sft_token_weights(completion_ids, normalization, num_sequences=sum(r[0] for r in ranks),
                              num_tokens=sum(r[1] for r in ranks), device=device)


def _sft_token_weights(completion_ids: list[list[int]], normalization: str, *, num_sequences: int, num_tokens: int,
                       device: torch.device | str) -> torch.Tensor:
    lens = [len(c) for c in completion_ids]  # [S]
    counts = GlobalCounts(num_sequences=num_sequences, num_tokens=num_tokens, max_completion_length=max(lens))
    return token_weights(normalization, torch.tensor(lens, dtype=torch.long), counts, SFT_NORMALIZATIONS,
                         num_tokens=sum(lens)).to(device)  # [N]


def sft_update(model: torch.nn.Module, prompt_ids: list[list[int]], completion_ids: list[list[int]], *,
               normalization: str, max_tokens_per_microbatch: int, head_backend: str,
               optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
               max_grad_norm: float, metrics: StepMetrics, device: torch.device | str,
               pad_token_id: int = 0, guard: NonFiniteGuard | None = None) -> list[MicroBatch]:
    """One optimizer update of supervised fine-tuning on this rank's (prompt, completion) pairs; returns the
    micro-batches it ran. The loss is ``sum_t w_t * -log p(y_t)`` over completion tokens only, the weights from
    :func:`sft_weights`; the log-probs come from the fused head (``-linear_logprobs``: no [N, V] tensor)."""
    plan = plan_step(prompt_ids, completion_ids, max_tokens_per_microbatch, device=device, pad_token_id=pad_token_id)
    mbs = plan.mbs
    weights = _sft_token_weights(completion_ids, normalization, num_sequences=plan.num_sequences,
                                 num_tokens=plan.num_tokens, device=device)  # [N], as sft_weights
    # The gradient goes through linear_logprobs, which the gradient-in-forward cublas path does not differentiate
    # (it forms the GRPO loss's gradient in forward): resolve as for log-probs, a recompute path on CUDA.
    backend = resolve_backend(head_backend, device, needs_grad=False)

    def head_loss(mb: MicroBatch, hidden: torch.Tensor, weight: torch.Tensor):  # hidden [n, H], weight [V, H]
        nll = -linear_logprobs(hidden, weight, mb.targets, backend=backend)  # [n]
        return (weights[mb.flat_index] * nll).sum(), {"sft/nll": nll.detach().mean()}

    model.train()
    optimizer_update(model, mbs, head_loss, optimizer=optimizer, scheduler=scheduler, max_grad_norm=max_grad_norm,
                     metrics=metrics, guard=guard)
    metrics.total("perf/update_tokens", torch.tensor(float(sum(mb.num_tokens for mb in mbs))))
    return mbs
