"""Supervised fine-tuning's loss on the packed update (``python -m fastgrpo.sft``): ``sum_t w_t * -log p(y_t)`` over
completion tokens only, with token weights fixed per step over the global batch (``sft.normalization``), so the
gradient does not depend on the micro-batch budget or the world size, as for GRPO.

Legend: S sequences on this rank, N their completion tokens (flat layout), n the target tokens of one micro-batch,
H hidden size, V vocabulary size.
"""

from __future__ import annotations

import torch

from fastgrpo.algorithms.losses import SFT_NORMALIZATIONS, GlobalCounts, token_weights
from fastgrpo.distributed.runner import ModelRunner, as_runner
from fastgrpo.kernels import linear_logprobs, resolve_backend
from fastgrpo.models.packing import MicroBatch
from fastgrpo.runtime.metrics import StepMetrics
from fastgrpo.update.guard import NonFiniteGuard
from fastgrpo.update.head import TokenHead
from fastgrpo.update.step import count_update_tokens, gather_ints, optimizer_update, plan_step

__all__ = ["sft_update", "sft_weights"]


def sft_weights(completion_ids: list[list[int]], normalization: str, *, device: torch.device | str) -> torch.Tensor:
    """Per-token weights [N] of the SFT loss for this rank's completions, normalised over the global batch."""
    ranks = gather_ints([len(completion_ids), sum(len(c) for c in completion_ids)], device=device)  # [world size][2]
    return _sft_token_weights(completion_ids, normalization, num_sequences=sum(r[0] for r in ranks),
                              num_tokens=sum(r[1] for r in ranks), device=device)


def _sft_token_weights(completion_ids: list[list[int]], normalization: str, *, num_sequences: int, num_tokens: int,
                       device: torch.device | str) -> torch.Tensor:
    lens = [len(c) for c in completion_ids]  # [S]
    counts = GlobalCounts(num_sequences=num_sequences, num_tokens=num_tokens, max_completion_length=max(lens))
    return token_weights(normalization, torch.tensor(lens, dtype=torch.long), counts, SFT_NORMALIZATIONS,
                         num_tokens=sum(lens)).to(device)  # [N]


def sft_update(model: ModelRunner | torch.nn.Module, prompt_ids: list[list[int]], completion_ids: list[list[int]], *,
               normalization: str, max_tokens_per_microbatch: int, head_backend: str,
               optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
               max_grad_norm: float, metrics: StepMetrics, device: torch.device | str,
               pad_token_id: int = 0, guard: NonFiniteGuard | None = None) -> list[MicroBatch]:
    """One optimizer update of supervised fine-tuning on this rank's (prompt, completion) pairs; returns the
    micro-batches it ran. The loss is ``sum_t w_t * -log p(y_t)`` over completion tokens only, the weights from
    :func:`sft_weights`; the log-probs come from the fused head (``-linear_logprobs``: no [N, V] tensor).
    ``model``: a runner (``fastgrpo.distributed.runner``), or a module run by a default one."""
    model = as_runner(model)
    plan = plan_step(prompt_ids, completion_ids, max_tokens_per_microbatch, device=device, pad_token_id=pad_token_id,
                     buckets=model.token_buckets)
    mbs = plan.mbs
    weights = _sft_token_weights(completion_ids, normalization, num_sequences=plan.num_sequences,
                                 num_tokens=plan.num_tokens, device=device)  # [N], as sft_weights
    # The gradient goes through linear_logprobs, which the gradient-in-forward cublas path does not differentiate
    # (it forms the GRPO loss's gradient in forward): resolve as for log-probs, a recompute path on CUDA.
    backend = resolve_backend(head_backend, device, needs_grad=False)

    def compute(hidden: torch.Tensor, weight: torch.Tensor, *, targets: torch.Tensor, weights: torch.Tensor):
        nll = -linear_logprobs(hidden, weight, targets, backend=backend)  # [n]; hidden [n, H], weight [V, H]
        counted = weights != 0  # every real token (a weight is 1 / a count); a graph's padding rows are 0
        mean_nll = (nll.detach() * counted).sum() / counted.sum().clamp(min=1)
        return (weights * nll).sum(), {"sft/nll": mean_nll}

    # a TokenHead (fastgrpo.update.head): a CUDA graph can replay compute on padded rows
    head_loss = TokenHead(compute=compute, key=("sft", backend),
                          gather=lambda mb: {"targets": mb.targets, "weights": weights[mb.flat_index]})

    model.train()
    optimizer_update(model, mbs, head_loss, optimizer=optimizer, scheduler=scheduler, max_grad_norm=max_grad_norm,
                     metrics=metrics, guard=guard)
    count_update_tokens(metrics, mbs)
    return mbs
