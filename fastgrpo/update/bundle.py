"""A trained model as the update needs it: the parallelized model, its AdamW, its LR schedule and its non-finite
guard, built in one place for the policy and for any other model an algorithm trains (PPO's critic)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastgrpo.config import OptimConfig, ParallelConfig
from fastgrpo.distributed.parallelize import parallelize_model, transformer_blocks
from fastgrpo.models.lora import trainable_parameters
from fastgrpo.models.loading import get_trunk_and_head
from fastgrpo.update.cuda_graphs import GradientBuffers, graph_blocks, graph_head
from fastgrpo.update.guard import NonFiniteGuard
from fastgrpo.update.optim import build_adamw, build_scheduler

__all__ = ["TrainedModel", "build_trained"]


@dataclass
class TrainedModel:
    """One model that an optimizer trains, and what steps it."""

    model: torch.nn.Module
    """Parallelized (``parallelize_model``): it has ``packed_forward``."""
    optimizer: torch.optim.Optimizer
    """AdamW over the trainable parameters (LoRA: the adapters and whatever else is left trainable)."""
    scheduler: torch.optim.lr_scheduler.LRScheduler
    """The LR schedule over the run's optimizer updates of this model."""
    guard: NonFiniteGuard
    """Steps the optimizer on finite gradients only (``optim.max_nonfinite_steps``)."""

    def checkpoint_entry(self) -> tuple:
        """``(model, optimizer, scheduler)``, what a checkpoint holds of it."""
        return self.model, self.optimizer, self.scheduler


def build_trained(model: torch.nn.Module, *, parallel: ParallelConfig, optim: OptimConfig,
                  device: torch.device | str, world_size: int, total_steps: int,
                  lr: float | None = None) -> TrainedModel:
    """``model`` (loaded, adapters applied) parallelized like the policy, with AdamW at ``lr`` (default
    ``optim.lr``; optim's betas, weight decay and implementation), the warm-up / decay schedule of ``optim`` over
    ``total_steps`` optimizer updates, and a guard allowing ``optim.max_nonfinite_steps`` skips in a row."""
    model = parallelize_model(model, parallel, device=device, world_size=world_size)
    if parallel.cuda_graphs and not parallel.compile:  # (compiled blocks are graphed by inductor: parallelize)
        graph_blocks(transformer_blocks(model), parallel.token_buckets or None)  # None: 'auto', any row length
    if parallel.cuda_graphs and parallel.cuda_graphs_head:  # the head loss per padded row count (a TokenHead's)
        graph_head(model, get_trunk_and_head(model)[1])
    if parallel.cuda_graphs:  # a graphed backward's static gradients must not become .grad (update.cuda_graphs)
        model.gradient_buffers = GradientBuffers(trainable_parameters(model))
    # optim.implementation 'auto': fused on CUDA (one pass over the weights and moments per step), foreach on a CPU
    # (a handful of multi-tensor ops; torch's CPU default is a loop of several ops per parameter)
    optimizer = build_adamw(trainable_parameters(model), optim, device, lr=lr, master_weights=parallel.master_weights)
    scheduler = build_scheduler(optimizer, warmup_steps=optim.warmup_steps, total_steps=total_steps,
                                schedule=optim.schedule, min_lr_ratio=optim.min_lr_ratio)
    return TrainedModel(model=model, optimizer=optimizer, scheduler=scheduler,
                        guard=NonFiniteGuard(optim.max_nonfinite_steps))
