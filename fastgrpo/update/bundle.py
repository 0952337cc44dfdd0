"""A trained model as the update needs it: its runner (the parallelized module and what runs packed passes on it),
its AdamW, its LR schedule and its non-finite guard, built in one place for the policy and for any other model an
algorithm trains (PPO's critic)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastgrpo.config import OptimConfig, ParallelConfig
from fastgrpo.distributed.runner import ModelRunner, prepare_model
from fastgrpo.models.lora import trainable_parameters
from fastgrpo.models.loading import get_trunk_and_head
from fastgrpo.update.cuda_graphs import GradientBuffers, graph_blocks, graph_head
from fastgrpo.update.guard import NonFiniteGuard
from fastgrpo.update.optim import build_adamw, build_scheduler

__all__ = ["TrainedModel", "build_trained"]


@dataclass
class TrainedModel:
    """One model that an optimizer trains, and what steps it."""

    runner: ModelRunner
    """The parallelized module and what runs its packed passes (``fastgrpo.distributed.runner``)."""
    optimizer: torch.optim.Optimizer
    """AdamW over the trainable parameters (LoRA: the adapters and whatever else is left trainable)."""
    scheduler: torch.optim.lr_scheduler.LRScheduler
    """The LR schedule over the run's optimizer updates of this model."""
    guard: NonFiniteGuard
    """Steps the optimizer on finite gradients only (``optim.max_nonfinite_steps``)."""

    @property
    def model(self) -> torch.nn.Module:
        """The module (plain or FSDP2-sharded): what a checkpoint, the rollout and an export take."""
        return self.runner.module

    def checkpoint_entry(self) -> tuple:
        """``(model, optimizer, scheduler)``, what a checkpoint holds of it."""
        return self.model, self.optimizer, self.scheduler


def build_trained(model: torch.nn.Module, *, parallel: ParallelConfig, optim: OptimConfig,
                  device: torch.device | str, world_size: int, total_steps: int,
                  lr: float | None = None) -> TrainedModel:
    """``model`` (loaded, adapters applied) parallelized like the policy, with AdamW at ``lr`` (default
    ``optim.lr``; optim's betas, weight decay and implementation), the warm-up / decay schedule of ``optim`` over
    ``total_steps`` optimizer updates, and a guard allowing ``optim.max_nonfinite_steps`` skips in a row."""
    # the fixed order: master weights, activation checkpointing, compile, FSDP2 (prepare_model), then the CUDA graphs
    runner = prepare_model(model, parallel, device=device, world_size=world_size)
    model = runner.module
    if parallel.cuda_graphs and not parallel.compile:  # (compiled blocks are graphed by inductor: prepare_model)
        runner.block_graphs = graph_blocks(runner.blocks, parallel.token_buckets or None)  # None: any row length
        runner.block_forwards = runner.block_graphs.block_forwards()
    if parallel.cuda_graphs and parallel.cuda_graphs_head:  # the head loss per padded row count (a TokenHead's)
        runner.head_graphs = graph_head(get_trunk_and_head(model)[1])
    if parallel.cuda_graphs:  # a graphed backward's static gradients must not become .grad (update.cuda_graphs)
        runner.gradient_buffers = GradientBuffers(trainable_parameters(model))
    # optim.implementation 'auto': fused on CUDA (one pass over the weights and moments per step), foreach on a CPU
    # (a handful of multi-tensor ops; torch's CPU default is a loop of several ops per parameter)
    optimizer = build_adamw(trainable_parameters(model), optim, device, lr=lr, master_weights=parallel.master_weights)
    scheduler = build_scheduler(optimizer, warmup_steps=optim.warmup_steps, total_steps=total_steps,
                                schedule=optim.schedule, min_lr_ratio=optim.min_lr_ratio)
    return TrainedModel(runner=runner, optimizer=optimizer, scheduler=scheduler,
                        guard=NonFiniteGuard(optim.max_nonfinite_steps))
