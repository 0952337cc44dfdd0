"""The optimizer update on packed micro-batches, whatever the loss: the step plan, the no-grad log-prob pass and one
optimizer update. The algorithms build their losses on it (GRPO and PPO in fastgrpo.algorithms, SFT in
fastgrpo.algorithms.sft).

Legend: S sequences on this rank, N completion (target) tokens on this rank (flat layout: sequence i's tokens are
contiguous), n target tokens of one micro-batch, H hidden size, V vocabulary size.

    plan_step          sequences -> micro-batches (every rank gets the same count: FSDP collectives per forward) and
                       the step's totals over ranks, in one collective and one host read
    packed_logprobs    no-grad log-probs [N] of the target tokens (old / reference passes)
    optimizer_update   zero grads -> per micro-batch: runner.packed_forward(mb, head_loss) -> backward -> clip ->
                       optimizer step; any token loss whose gradient sums over micro-batches (GRPO, PPO, SFT, ...)

The trainer, the golden test and the FSDP test all call these functions, so "1 process equals 2 ranks" and the
golden figures are checked on the code that trains.

Host syncs: none per micro-batch here (metrics stay on the device, token-level tensors are indexed with device
index tensors built by ``pack``); per optimizer update, the plan's one read of the totals, the guard's finiteness
check and the metrics' one read at the end of the step (``benchmarks/count_ops.py`` counts them).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch

from fastgrpo.distributed import groups as fdist
from fastgrpo.distributed.runner import ModelRunner, as_runner
from fastgrpo.kernels import linear_logprobs
from fastgrpo.models.attention import use_shared_prefix
from fastgrpo.models.packing import (MicroBatch, pack, plan_microbatches, plan_shared_microbatches, power_of_two,
                                     prefix_groups, resolve_buckets, split_to_count)
from fastgrpo.runtime.metrics import StepMetrics
from fastgrpo.runtime.step_cost import causal_pairs
from fastgrpo.update.guard import NonFiniteGuard
from fastgrpo.update.head import TokenHead
from fastgrpo.update.master_weights import gradients_for_clipping

__all__ = ["DEFAULT_MICROBATCH_TOKENS", "HeadLoss", "StepPlan", "gather_ints", "microbatch_tokens",
           "count_update_tokens", "optimizer_update", "packed_logprobs", "plan_packed", "plan_step",
           "shares_prefix"]

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


def gather_ints(values: list[int], *, device: torch.device | str) -> list[list[int]]:
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


def shares_prefix(setting: str, runner: ModelRunner | torch.nn.Module) -> bool:
    """Whether the packed passes on ``runner`` (a ``fastgrpo.distributed.runner.ModelRunner``, or a module) share
    each group's prompt prefix: ``setting`` is ``grpo.shared_prefix`` ('auto': wherever the model's attention can,
    with eager blocks; 'true' where it cannot: a ValueError naming both keys)."""
    runner = as_runner(runner)
    config = getattr(runner.module, "config", None)
    return use_shared_prefix(setting, impl=getattr(config, "_attn_implementation", None), config=config,
                             static_shapes=bool(runner.block_forwards))


def plan_step(prompt_ids: list[list[int]], completion_ids: list[list[int]], max_tokens: int, *,
              device: torch.device | str, pad_token_id: int = 0, counted_tokens: int | None = None,
              buckets: Sequence[int] | str = (), shared_prefix: bool = False) -> StepPlan:
    """First-fit-decreasing micro-batches under ``max_tokens``, split or padded to the same count on every rank, and
    the global number of sequences and of ``counted_tokens`` (default: every completion token of this rank), all
    from one collective. ``buckets``: the token buckets each row is padded to (the runner's ``token_buckets``, set by
    ``prepare_model``; 'auto' resolves against ``max_tokens``); () = no padding. A padded row's shapes are
    kept to a few values, each one compiled graph or one set of CUDA graphs: its ``max_seqlen`` is the step's
    longest sequence (over all ranks) rounded up to a power of two (at least ``MIN_PADDED_SEQLEN``; at most the
    row's bucket), its ``cu_seqlens`` the power of two >= the entries it uses (``pack``'s ``min_boundaries``).
    ``shared_prefix`` (:func:`shares_prefix`): the sequences with the same prompt hold it once per row
    (``fastgrpo.models.packing``, "Shared prefixes"), a group kept in one row where it fits the budget."""
    seq_lens = [len(p) + len(c) for p, c in zip(prompt_ids, completion_ids)]
    groups = prefix_groups(prompt_ids) if shared_prefix else None
    bins = plan_microbatches(seq_lens, max_tokens) if groups is None else plan_shared_microbatches(
        seq_lens, groups, max_tokens)
    counted = sum(len(c) for c in completion_ids) if counted_tokens is None else counted_tokens
    ranks = gather_ints([len(seq_lens), counted, len(bins), max(seq_lens, default=0)], device=device)  # [world][4]
    # FSDP: every rank must run the same number of forward/backward calls (collectives per block)
    bins = split_to_count(bins, seq_lens, max(r[2] for r in ranks))
    buckets = resolve_buckets(buckets, max_tokens)
    # padded rows: max_seqlen the step's longest sequence over all ranks, rounded up to a power of two
    max_seqlen = power_of_two(max(r[3] for r in ranks), MIN_PADDED_SEQLEN) if buckets else None
    mbs = pack(prompt_ids, completion_ids, bins, device=device, pad_token_id=pad_token_id, buckets=buckets,
               max_seqlen=max_seqlen, groups=groups, min_boundaries=MIN_BOUNDARIES)
    return StepPlan(mbs=mbs, num_sequences=sum(r[0] for r in ranks), num_tokens=sum(r[1] for r in ranks))


MIN_PADDED_SEQLEN = 16
"""The smallest ``max_seqlen`` of a padded row (:func:`plan_step`)."""
MIN_BOUNDARIES = 8
"""The fewest ``cu_seqlens`` entries of a padded row (:func:`plan_step`)."""


def count_update_tokens(metrics: StepMetrics, mbs: list[MicroBatch], passes: int = 1) -> None:
    """Log ``perf/update_tokens``, the sequences' own tokens in ``mbs`` (prompt + completion each, as a trainer
    without shared prefixes forwards them: what throughput compares across trainers), and beside it
    ``perf/update_tokens_forwarded``, the tokens the trunk ran (each shared prefix once, no bucket padding); each
    ``passes`` times (PPO's updates over one plan). With them the rest of the update's work, from which the trainer
    counts its FLOPs (:func:`fastgrpo.runtime.metrics.add_update_flops`): ``perf/update_completion_tokens`` (the rows
    the head runs on) and the causal attention's query-key pairs, ``perf/update_attention_pairs`` of the sequences
    unshared and ``perf/update_attention_pairs_forwarded`` of the rows as forwarded (a shared prefix's pairs once,
    a completion's over the prefix and its own tokens: :func:`fastgrpo.runtime.step_cost.causal_pairs`)."""
    def total(name: str, value: int) -> None:
        metrics.total(name, torch.tensor(float(value * passes)))

    total("perf/update_tokens", sum(mb.num_sequence_tokens for mb in mbs))
    total("perf/update_tokens_forwarded", sum(mb.num_real_tokens for mb in mbs))
    total("perf/update_completion_tokens", sum(mb.num_completion_tokens for mb in mbs))
    total("perf/update_attention_pairs", causal_pairs((t, t) for mb in mbs for t in mb.seq_lengths))
    total("perf/update_attention_pairs_forwarded", sum(causal_pairs(_forwarded_segments(mb)) for mb in mbs))


def _forwarded_segments(mb: MicroBatch) -> list[tuple[int, int]]:
    """``(queries, keys)`` of each segment ``mb`` forwards, the bucket padding's dummy segments left out."""
    real = len(mb.segment_lengths) - len(mb.pad_lengths)
    return list(zip(mb.segment_lengths[:real], mb.key_segment_lengths[:real]))


def plan_packed(prompt_ids: list[list[int]], completion_ids: list[list[int]], max_tokens: int, *,
                device: torch.device | str, pad_token_id: int = 0) -> list[MicroBatch]:
    """The micro-batches of :func:`plan_step` alone."""
    return plan_step(prompt_ids, completion_ids, max_tokens, device=device, pad_token_id=pad_token_id).mbs


@torch.no_grad()
def packed_logprobs(model: ModelRunner | torch.nn.Module, mbs: list[MicroBatch], num_tokens: int, *,
                    temperature: float, backend: str,
                    with_entropy: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs [N] float32 of the target tokens under ``model`` (a runner, or a module run by a default
    one: :func:`fastgrpo.distributed.runner.as_runner`; no [N, V] tensor); with ``with_entropy`` also the policy's
    entropy [N] at each of those positions."""
    runner = as_runner(model)
    device = mbs[0].targets.device if mbs else "cpu"
    out = torch.zeros(num_tokens, dtype=torch.float32, device=device)
    ent = torch.zeros(num_tokens, dtype=torch.float32, device=device) if with_entropy else None
    for mb in mbs:
        # packed_forward runs trunk -> hidden [n, H] of target positions -> fn(hidden, lm_head.weight) inside FSDP's
        # hooks, so sharded (and tied) weights are gathered for the head too.
        res = runner.packed_forward(mb, lambda h, w, mb=mb: linear_logprobs(
            h, w, mb.targets, temperature=temperature, backend=backend, return_entropy=with_entropy))
        if with_entropy:
            out[mb.flat_index], ent[mb.flat_index] = res
        else:
            out[mb.flat_index] = res
    return (out, ent) if with_entropy else out


def optimizer_update(model: ModelRunner | torch.nn.Module, mbs: list[MicroBatch], head_loss: HeadLoss, *,
                     optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
                     max_grad_norm: float, metrics: StepMetrics, loss_divisor: int = 1,
                     guard: NonFiniteGuard | None = None, role: str = "policy") -> bool:
    """One optimizer update: gradients of ``sum over micro-batches of head_loss`` -> clip -> step.

    ``model``: a runner (``fastgrpo.distributed.runner.prepare_model``), or a module run by a default one. Metrics: ``loss`` (the summed loss / loss_divisor: a
    step of several updates logs their mean), every key of the head's stats, ``policy/grad_norm`` (before clipping)
    and ``lr`` (the rate this update used). ``max_grad_norm`` 0 disables clipping. The optimizer steps only on a
    finite gradient norm (:class:`fastgrpo.update.guard.NonFiniteGuard`, which counts the skipped updates); returns
    whether it stepped. The schedule advances either way, so a step's learning rate does not depend on skips.
    Another ``role`` than 'policy' (PPO's 'critic') logs ``<role>/loss``, ``<role>/grad_norm`` and ``<role>/lr``.
    """
    runner = as_runner(model)
    optimizer.zero_grad(set_to_none=True)
    if runner.gradient_buffers is not None:  # CUDA graphs: .grad buffers of the parameters' own
        runner.gradient_buffers.install()
    for mb in mbs:
        # a TokenHead goes in whole (bound to mb): a model with head graphs replays its compute (update.cuda_graphs)
        head = head_loss.bind(mb) if isinstance(head_loss, TokenHead) else partial(head_loss, mb)
        loss, stats = runner.packed_forward(mb, head)
        loss.backward()
        loss = loss.detach()
        metrics.total("loss" if role == "policy" else f"{role}/loss",
                      loss if loss_divisor == 1 else loss / loss_divisor)
        metrics.add_many(stats, float(mb.num_completion_tokens))  # one stack for all the head's statistics
    # float32 master gradients when the optimizer keeps masters of bf16 weights (parallel.master_weights)
    clipped = gradients_for_clipping(runner.module, optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(clipped, max_grad_norm if max_grad_norm > 0 else 1e30)
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
