"""AdamW as the trainers build it: ``optim`` settings plus the implementation that fits the device.

``optim.implementation`` picks how the step runs, not what it computes. On CUDA, torch's fused AdamW reads and
writes each parameter, gradient and moment once per step in one kernel per chunk of tensors, where ``foreach``
makes a pass over all of them per arithmetic op (about ten): for a 0.5B model in float32 masters that is ~14 GB of
memory traffic against ~60 GB, the largest single difference between fastgrpo's and TRL's update on a GPU (TRL runs
transformers' default, fused AdamW). On a CPU 'auto' keeps foreach: the fused CPU kernel rounds differently and
stopped the LoRA toy task from learning (tests/test_lora.py).
"""

from __future__ import annotations

import math
from typing import Iterable

import torch

from fastgrpo.config import OptimConfig
from fastgrpo.update.master_weights import MasterAdamW

__all__ = ["adamw_implementation", "build_adamw", "build_scheduler"]


def adamw_implementation(choice: str, device: torch.device | str) -> str:
    """'fused' or 'foreach' for ``optim.implementation`` ``choice`` on ``device`` ('auto': fused on CUDA)."""
    if choice not in ("auto", "fused", "foreach"):
        raise ValueError(f"optim.implementation: must be auto, fused or foreach, got {choice!r}")
    if choice == "auto":
        return "fused" if torch.device(device).type == "cuda" else "foreach"
    return choice


def build_adamw(params: Iterable[torch.nn.Parameter], o: OptimConfig, device: torch.device | str, *,
                lr: float | None = None, master_weights: bool = False) -> torch.optim.Optimizer:
    """AdamW over ``params`` with ``o``'s betas and weight decay, at ``lr`` (default ``o.lr``); with
    ``master_weights`` on float32 masters of the (bf16) ``params``
    (:class:`fastgrpo.update.master_weights.MasterAdamW`)."""
    impl = adamw_implementation(o.implementation, device)
    if master_weights:
        return MasterAdamW(params, lr=o.lr if lr is None else lr, betas=tuple(o.betas), weight_decay=o.weight_decay,
                           implementation=impl)
    return torch.optim.AdamW(params, lr=o.lr if lr is None else lr, betas=tuple(o.betas),
                             weight_decay=o.weight_decay, foreach=impl == "foreach", fused=impl == "fused")


def build_scheduler(optimizer: torch.optim.Optimizer, *, warmup_steps: int, total_steps: int, schedule: str,
                    min_lr_ratio: float) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up, then constant or cosine decay to min_lr_ratio * lr at total_steps."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
