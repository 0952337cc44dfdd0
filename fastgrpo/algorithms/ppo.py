"""PPO with a learned critic (``algorithm: ppo``): token rewards -> values -> GAE -> whitened advantages -> epochs of
mini-batch updates of the policy (grpo.loss_type's objective in the fused head, PPO's clip for grpo / dapo /
dr_grpo, with per-token advantages) and of the critic (clipped value loss), on the same packed micro-batches,
sharding and token weights as GRPO.

Legend: S sequences on this rank, N their completion tokens (flat layout: sequence i's tokens are contiguous), L a
completion's length, L_max the longest of this rank's, n target tokens of one micro-batch, E epochs, M mini-batches.

For token t = 0..L-1 of a completion with verifiable reward R (its state: the prefix that chooses token t):

    r_t     = -kl_coef * (logp_t - ref_t) + [t == L-1] * R     reward: terminal, plus the KL penalty if asked
    delta_t = r_t + gamma * V_{t+1} - V_t                       V_L = 0: the episode ends with the completion
    A_t     = sum_{k>=t} (gamma * lam)^(k-t) * delta_k          GAE (Schulman et al., 2016)
    G_t     = A_t + V_t                                         the value target (before whitening)
    A       <- (A - mean(A)) / sqrt(var(A) + 1e-8)              over every rank's tokens (ppo.whiten_advantages)

    value loss per token: 0.5 * max((V - G)^2, (V_old + clamp(V - V_old, -c, c) - G)^2)   c = ppo.cliprange_value

as oat runs it (``oat/algorithms/ppo.py``), with two departures: the whitening is over the global batch (oat whitens
each rank's), and both losses take grpo.loss_type's token weights, normalised over the mini-batch on all ranks (oat:
a mean over each sequence's tokens, then over the mini-batch: ``loss_type: grpo``), so the gradient does not depend
on the micro-batch budget or the world size.

Each rank shuffles its sequences every epoch (a generator seeded by the run's seed, the step and the epoch) and splits
them into M mini-batches; each mini-batch is one optimizer update of the policy, then one of the critic (oat's
order). The old log-probs, reference log-probs and old values are computed once, before the first update.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from fastgrpo.algorithms.critic import build_critic, packed_values, value_head_forward
from fastgrpo.algorithms.interface import Algorithm, ExtraModel, StepInputs
from fastgrpo.algorithms.kept_mass import old_kept_log_mass
from fastgrpo.algorithms.tokens import (PolicyObjective, SequenceBatch, TokenInputs, importance_weights,
                                       loss_type_weights)
from fastgrpo.config import GRPOConfig, PPOConfig, RolloutConfig
from fastgrpo.config.loader import check, section_check
from fastgrpo.distributed import groups as fdist
from fastgrpo.distributed.runner import ModelRunner, as_runner
from fastgrpo.models.packing import MicroBatch, completion_offsets
from fastgrpo.runtime.metrics import StepMetrics
from fastgrpo.update.guard import NonFiniteGuard
from fastgrpo.update.step import (count_update_tokens, microbatch_tokens, optimizer_update, packed_logprobs,
                                  plan_step, shares_prefix)

__all__ = ["PPO", "PPOBatch", "clipped_value_loss", "gae", "mini_batches", "ppo_update", "token_rewards",
           "total_updates", "whiten"]

WHITEN_EPS = 1e-8


@dataclass(kw_only=True)
class PPOBatch(SequenceBatch):
    """One rollout batch on this rank, as PPO's update needs it."""

    rewards: torch.Tensor
    """[S] the verifiable reward of each completion (given to its last token)."""


def _positions(lengths: list[int], device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence [N], position in its sequence [N]) of every token of the flat layout, built on the host."""
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths, dtype=torch.long),
                                  output_size=sum(lengths))  # [N]
    offsets = torch.tensor(completion_offsets(lengths), dtype=torch.long)  # [S]
    return seq.to(device), (torch.arange(len(seq)) - offsets[seq]).to(device)


def token_rewards(rewards: torch.Tensor, lengths: list[int], *, kl: torch.Tensor | None = None,
                  kl_coef: float = 0.0) -> torch.Tensor:
    """Per-token rewards [N] float32: ``rewards`` [S] on each completion's last token, plus ``-kl_coef * kl`` [N]
    (``kl`` = logp - ref_logp per token) on every token when given."""
    if rewards.shape != (len(lengths),):
        raise ValueError(f"rewards must be [S={len(lengths)}], got {tuple(rewards.shape)}")
    if any(n < 1 for n in lengths):
        raise ValueError("every completion needs at least one token (its last one takes the reward)")
    device = rewards.device if kl is None else kl.device
    out = torch.zeros(sum(lengths), dtype=torch.float32, device=device)  # [N]
    if kl is not None and kl_coef:
        out = out - kl_coef * kl.float()
    last = torch.tensor(completion_offsets(lengths), dtype=torch.long) + torch.tensor(lengths) - 1  # [S]
    return out.index_add(0, last.to(device), rewards.to(device, torch.float32))


def gae(rewards: torch.Tensor, values: torch.Tensor, lengths: list[int], *, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE advantages [N] and value targets (returns) [N], float32, from per-token ``rewards`` [N] and ``values``
    [N] of completions of ``lengths`` [S] (flat layout), each an episode that ends after its last token.

    No loop over tokens: the sequences are laid out as rows of [S, L_max] (zeros after the end, which is what
    ``V_L = 0`` asks), and ``A = delta @ P^T`` with ``P[t, k] = (gamma * lam)^(k - t)`` for k >= t, else 0: one
    product, in float64 (the powers of a discount near 1 over long completions), whatever the lengths.
    """
    if rewards.shape != values.shape or rewards.numel() != sum(lengths):
        raise ValueError(f"rewards {tuple(rewards.shape)} and values {tuple(values.shape)} must both be [N="
                         f"{sum(lengths)}] (the completion lengths' sum)")
    if not lengths:
        return rewards.float(), values.float()
    device = rewards.device
    seq, pos = _positions(lengths, device)
    rows = torch.zeros(2, len(lengths), max(lengths) + 1, dtype=torch.float64, device=device)  # [2, S, L_max + 1]
    rows[0, seq, pos] = rewards.double()
    rows[1, seq, pos] = values.double()
    r, v = rows[0, :, :-1], rows[1]  # [S, L_max], [S, L_max + 1] (the extra column: V after the longest end)
    delta = r + gamma * v[:, 1:] - v[:, :-1]  # [S, L_max]
    steps = torch.arange(max(lengths), device=device, dtype=torch.float64)
    ahead = steps[None, :] - steps[:, None]  # [L_max, L_max]: k - t
    powers = torch.where(ahead >= 0, torch.full_like(ahead, gamma * lam) ** ahead.clamp(min=0), 0.0)
    adv = delta @ powers.t()  # [S, L_max]
    adv_n = adv[seq, pos]  # [N]
    return adv_n.float(), (adv_n + values.double()).float()


def _global_mean_var(*xs: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(mean, unbiased variance) of each of ``xs`` over every rank's elements, in float64, from one all-reduce."""
    device = xs[0].device
    parts = []
    for x in xs:
        x = x.double()
        parts += [x.sum(), (x * x).sum(), torch.tensor(float(x.numel()), dtype=torch.float64, device=device)]
    sums = fdist.all_reduce_(torch.stack(parts), "sum").view(-1, 3)  # [len(xs), 3]
    n = sums[:, 2]
    mean = sums[:, 0] / n.clamp(min=1)
    var = (sums[:, 1] - n * mean * mean).clamp(min=0) / (n - 1).clamp(min=1)
    return list(zip(mean.unbind(), var.unbind()))


def whiten(x: torch.Tensor) -> torch.Tensor:
    """``(x - mean) / sqrt(var + 1e-8)`` [N] with the mean and (unbiased) variance of every rank's elements."""
    ((mean, var),) = _global_mean_var(x)
    return ((x.double() - mean) * torch.rsqrt(var + WHITEN_EPS)).to(x.dtype)


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                       weights: torch.Tensor, *, cliprange: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum_n w_n * 0.5 * max((V - G)^2, (V_clip - G)^2), clip fraction)`` with ``V_clip = V_old + clamp(V -
    V_old, -c, c)``: the loss (a scalar whose gradient sums over micro-batches) and the fraction of tokens of
    nonzero weight where the clipped branch is the larger (its gradient is then zero)."""
    clipped = old_values + (values - old_values).clamp(-cliprange, cliprange)  # [n]
    plain_sq, clipped_sq = (values - returns).square(), (clipped - returns).square()  # [n]
    loss = 0.5 * (weights * torch.maximum(plain_sq, clipped_sq)).sum()
    counted = (weights != 0).float()  # [n]
    clipfrac = ((clipped_sq > plain_sq).float() * counted).sum() / counted.sum().clamp(min=1)
    return loss, clipfrac


def mini_batches(num_sequences: int, num_mini_batches: int, generator: torch.Generator) -> list[list[int]]:
    """A random split of this rank's sequences into ``num_mini_batches`` parts (sizes differing by at most one;
    each part in ascending order, so a part's packing does not depend on the shuffle's order within it)."""
    perm = torch.randperm(num_sequences, generator=generator)
    return [sorted(part.tolist()) for part in torch.tensor_split(perm, num_mini_batches)]


def _flat_index(parts: list[int], lengths: list[int], device: torch.device | str) -> torch.Tensor:
    """[n] where the tokens of the sequences ``parts`` (in that order) sit in the step's flat layout."""
    offsets = completion_offsets(lengths)
    return torch.tensor([t for i in parts for t in range(offsets[i], offsets[i] + lengths[i])], dtype=torch.long,
                        device=device)


def ppo_update(policy: ModelRunner | torch.nn.Module, critic: ModelRunner | torch.nn.Module, batch: PPOBatch, *, grpo: GRPOConfig,
               ppo: PPOConfig, rollout: RolloutConfig, optimizer: torch.optim.Optimizer,
               critic_optimizer: torch.optim.Optimizer,
               scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
               critic_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None, max_grad_norm: float,
               metrics: StepMetrics, device: torch.device | str,
               ref_model: ModelRunner | torch.nn.Module | None = None,
               pad_token_id: int = 0, guard: NonFiniteGuard | None = None,
               critic_guard: NonFiniteGuard | None = None, train_policy: bool = True, seed: int = 0,
               max_tokens_per_microbatch: int | None = None) -> None:
    """``ppo.num_ppo_epochs`` x ``ppo.num_mini_batches`` updates of the critic, and of the policy when
    ``train_policy`` (False: the critic's warm-up), on one rollout batch (see the module docstring).

    ``ref_model`` gives the reference log-probs of ``grpo.beta`` (the k3 term of the loss) and of ``ppo.kl_coef``
    (the KL penalty in the reward). ``seed`` seeds the mini-batch shuffles (the trainer passes seed and step).
    ``max_tokens_per_microbatch``, when given, replaces ``grpo.max_tokens_per_microbatch`` (the budget the trainer
    sized from free GPU memory, as for GRPO). The guards count skipped updates; the trainer ends each model's step
    (:meth:`fastgrpo.update.guard.NonFiniteGuard.end_step`).
    Metrics: the policy's as in GRPO, ``critic/loss``, ``critic/grad_norm``, ``critic/lr``,
    ``critic/value_clipfrac``, ``critic/explained_variance`` (1 - Var(G - V) / Var(G) of the values before the
    update), ``critic/value_mean``, ``ppo/return_mean``, ``ppo/adv_abs_mean`` (before whitening).
    """
    policy, critic = as_runner(policy), as_runner(critic)  # runners, or modules run by default ones
    lens = [len(c) for c in batch.completion_ids]  # [S] host ints
    n_tok = sum(lens)
    budget = max_tokens_per_microbatch or microbatch_tokens(grpo.max_tokens_per_microbatch, device)
    buckets = policy.token_buckets  # the critic is prepared with the same settings
    # one layout for the policy, the reference and the critic: shared where all of them can attend it
    shared = shares_prefix(grpo.shared_prefix, policy) and shares_prefix(grpo.shared_prefix, critic)
    plan = plan_step(batch.prompt_ids, batch.completion_ids, budget, device=device, pad_token_id=pad_token_id,
                     buckets=buckets, shared_prefix=shared)
    objective = PolicyObjective.from_config(grpo, rollout, device)
    logprobs = partial(packed_logprobs, mbs=plan.mbs, num_tokens=n_tok, temperature=rollout.temperature,
                       backend=objective.backend)

    policy.train()
    critic.train()
    old_lp = logprobs(policy)  # [N]: several updates per batch, so the ratio needs them from the start
    ref_lp = logprobs(ref_model) if ref_model is not None else None  # [N]
    old_values = packed_values(critic, plan.mbs, n_tok)  # [N]
    kl = old_lp - ref_lp if ref_lp is not None and ppo.kl_coef > 0 else None
    rewards = token_rewards(batch.rewards.to(device), lens, kl=kl, kl_coef=ppo.kl_coef)  # [N]
    adv, returns = gae(rewards, old_values, lens, gamma=ppo.gamma, lam=ppo.lam)  # [N], [N]
    (_, var_g), (_, var_err) = _global_mean_var(returns, returns - old_values)
    # undefined (NaN) when every return is the same, as when every completion of the batch got the same reward
    metrics.set("critic/explained_variance", torch.where(var_g > 0, 1 - var_err / var_g, float("nan")))
    metrics.moments(old_values, "critic/value_mean")
    metrics.moments(returns, "ppo/return_mean")
    metrics.moments(adv.abs(), "ppo/adv_abs_mean")
    if ppo.whiten_advantages:
        adv = whiten(adv)
    is_w = None
    if batch.sampler_logprobs is not None:  # truncated importance sampling: sampler != trainer numerics
        is_w = importance_weights(old_lp, batch.sampler_logprobs, cap=rollout.importance_sampling_cap,
                                  metrics=metrics, old_kept_log_mass=old_kept_log_mass(policy, plan.mbs, n_tok, rollout))

    updates = ppo.num_ppo_epochs * ppo.num_mini_batches
    g = torch.Generator().manual_seed(seed)
    for _ in range(ppo.num_ppo_epochs):
        for part in mini_batches(len(lens), ppo.num_mini_batches, g):
            p_lens = [lens[i] for i in part]
            sub = plan_step([batch.prompt_ids[i] for i in part], [batch.completion_ids[i] for i in part], budget,
                            device=device, pad_token_id=pad_token_id, buckets=buckets, shared_prefix=shared)
            w = loss_type_weights(grpo.loss_type, p_lens, sub, max_completion_length=rollout.max_completion_length,
                                  device=device)  # [n_part]
            at = _flat_index(part, lens, device)  # [n_part]: the part's tokens in the step's layout
            if train_policy:  # as in GRPO, the importance weights scale the policy term, not the KL term
                inputs = TokenInputs.build(w, adv[at], old_logprobs=old_lp[at],
                                           ref_logprobs=None if ref_lp is None else ref_lp[at],
                                           policy_factors=(None if is_w is None else is_w[at],),
                                           separate_kl=objective.separate_kl)
                optimizer_update(policy, sub.mbs, objective.head_loss(inputs), optimizer=optimizer,
                                 scheduler=scheduler, max_grad_norm=max_grad_norm, metrics=metrics,
                                 loss_divisor=updates, guard=guard)
            optimizer_update(critic, sub.mbs, partial(_value_loss, old_values=old_values[at], returns=returns[at],
                                                      w=w * ppo.vf_coef, cliprange=ppo.cliprange_value),
                             optimizer=critic_optimizer, scheduler=critic_scheduler, max_grad_norm=max_grad_norm,
                             metrics=metrics, loss_divisor=updates, guard=critic_guard, role="critic")
    count_update_tokens(metrics, plan.mbs, updates)


def _value_loss(mb: MicroBatch, hidden: torch.Tensor, weight: torch.Tensor, *, old_values: torch.Tensor,
                returns: torch.Tensor, w: torch.Tensor, cliprange: float):  # hidden [n, H], weight [1, H]: the head
    i = mb.flat_index  # [n] into the mini-batch's layout
    values = value_head_forward(hidden, weight)  # [n]
    loss, clipfrac = clipped_value_loss(values, old_values[i], returns[i], w[i], cliprange=cliprange)
    return loss, {"critic/value_clipfrac": clipfrac}


def total_updates(max_steps: int, ppo: PPOConfig) -> tuple[int, int]:
    """(policy, critic) optimizer updates of a run: the lengths of their LR schedules. oat stretches its schedules
    by hand (``max_step_adjustment``, ``critic_max_step_adjustment``: optimizer steps per rollout batch); here
    they are counted: E x M per step, the policy's without the critic's warm-up steps."""
    per_step = ppo.num_ppo_epochs * ppo.num_mini_batches
    return max(1, (max_steps - ppo.critic_warmup_steps) * per_step), max_steps * per_step


@section_check(PPOConfig)
def check_ppo_section(ppo: PPOConfig, p: str) -> None:
    check(0 <= ppo.gamma <= 1, f"{p}.gamma", f"must be in [0, 1], got {ppo.gamma}")
    check(0 <= ppo.lam <= 1, f"{p}.lam", f"must be in [0, 1], got {ppo.lam}")
    check(ppo.kl_coef >= 0, f"{p}.kl_coef", "must be >= 0")
    check(ppo.vf_coef > 0, f"{p}.vf_coef", "must be > 0")
    check(ppo.cliprange_value > 0, f"{p}.cliprange_value", "must be > 0")
    check(0 < ppo.critic_lr <= 1, f"{p}.critic_lr", f"must be in (0, 1], got {ppo.critic_lr}")
    check(ppo.num_ppo_epochs >= 1, f"{p}.num_ppo_epochs", "must be >= 1")
    check(ppo.num_mini_batches >= 1, f"{p}.num_mini_batches", "must be >= 1")
    check(ppo.critic_init is None or bool(ppo.critic_init), f"{p}.critic_init", "must be non-empty or null")
    check(ppo.critic_warmup_steps >= 0, f"{p}.critic_warmup_steps", "must be >= 0")


def check_ppo_config(cfg) -> None:
    """The grpo options that PPO's update does not implement are errors, not silently ignored."""
    g = cfg.grpo
    check(g.num_iterations == 1, "grpo.num_iterations", "algorithm ppo reuses a batch by ppo.num_ppo_epochs instead")
    for name, on in (("dynamic_sampling", g.dynamic_sampling), ("sil_top_k", g.sil_top_k > 0),
                     ("top_entropy_quantile", g.top_entropy_quantile < 1),
                     ("importance_sampling_level", g.importance_sampling_level != "token"),
                     ("mask_truncated_completions", g.mask_truncated_completions)):
        check(not on, f"grpo.{name}", "is a GRPO option that algorithm ppo does not implement: leave it at its default")
    check(g.prompts_per_step * g.num_generations >= cfg.ppo.num_mini_batches, "ppo.num_mini_batches",
          f"must be <= the sequences per rank (grpo.prompts_per_step * grpo.num_generations = "
          f"{g.prompts_per_step * g.num_generations})")
    check(getattr(cfg.rollout, "max_turns", 1) == 1, "rollout.max_turns",
          "algorithm ppo trains on single-turn completions (environment tokens would get values and advantages)")
    check(cfg.ppo.critic_warmup_steps < cfg.max_steps, "ppo.critic_warmup_steps",
          f"must be < max_steps={cfg.max_steps} (the policy would never train)")


def _update(ep, step: StepInputs) -> None:
    """A step's episodes -> :class:`PPOBatch` -> :func:`ppo_update` (the trainer's update of policy and critic)."""
    cfg, policy, critic = step.cfg, step.policy, step.extras["critic"]
    ppo_update(policy.runner, critic.runner, PPOBatch(
        prompt_ids=ep.prompt_ids, completion_ids=ep.completion_ids, rewards=ep.rewards,
        sampler_logprobs=ep.sampler_logprobs), grpo=cfg.grpo, ppo=cfg.ppo, rollout=cfg.rollout,
        optimizer=policy.optimizer, scheduler=policy.scheduler, critic_optimizer=critic.optimizer,
        critic_scheduler=critic.scheduler, max_grad_norm=cfg.optim.max_grad_norm, metrics=step.metrics,
        device=step.device, ref_model=step.ref_model, pad_token_id=step.pad_token_id, guard=policy.guard,
        critic_guard=critic.guard, train_policy=step.step >= cfg.ppo.critic_warmup_steps,
        seed=(cfg.seed * 1_000_003 + step.step) % (2**31), max_tokens_per_microbatch=step.max_tokens_per_microbatch)


PPO = Algorithm(
    name="ppo",
    update=_update,
    # the reference gives the k3 term of the loss (grpo.beta) and the KL penalty of the reward (ppo.kl_coef)
    needs_reference=lambda cfg: cfg.grpo.beta > 0 or cfg.ppo.kl_coef > 0,
    policy_updates=lambda cfg: total_updates(cfg.max_steps, cfg.ppo)[0],
    # built before the policy, so that the policy's resume restores it too
    extra_models={"critic": ExtraModel(
        build=lambda setup: build_critic(setup, total_steps=total_updates(setup.cfg.max_steps, setup.cfg.ppo)[1]),
        nonfinite_cause="lower ppo.critic_lr or ppo.vf_coef, or keep optim.max_grad_norm > 0")},
    group_advantages=False,  # token advantages come from the critic (GAE)
    multi_turn=False,
    check_config=check_ppo_config,
)
"""A learned critic and GAE token advantages, PPO's epochs of mini-batch updates of the policy and the critic."""
