"""AdamW as the trainers build it: ``optim`` settings plus the implementation that fits the device.

``optim.implementation`` picks how the step runs, not what it computes. On CUDA, torch's fused AdamW reads and
writes each parameter, gradient and moment once per step in one kernel per chunk of tensors, where ``foreach``
makes a pass over all of them per arithmetic op (about ten): for a 0.5B model in float32 masters that is ~14 GB of
memory traffic against ~60 GB, the largest single difference between fastgrpo's and TRL's update on a GPU (TRL runs
transformers' default, fused AdamW). On a CPU 'auto' keeps foreach: the fused CPU kernel rounds differently and
stopped the LoRA toy task from learning (tests/test_lora.py).

A foreach step builds temporaries as large as the parameters it steps at once (``sqrt`` of the second moments:
one float32 copy of every weight, on top of the weights, gradients and moments). :class:`ChunkedAdamW` steps the parameters in
chunks of at most :data:`FOREACH_CHUNK_BYTES`, so that copy is one chunk's; its results are bitwise torch's (every
foreach op is elementwise per tensor), and its param groups and state dict are torch's, as checkpoints read them.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch

from fastgrpo.config import OptimConfig
from fastgrpo.update.master_weights import MasterAdamW

__all__ = ["ChunkedAdamW", "FOREACH_CHUNK_BYTES", "adamw_implementation", "build_adamw", "build_scheduler"]


FOREACH_CHUNK_BYTES = 64 * 2**20
"""Parameter bytes per foreach AdamW call: large enough that a step is a few dozen calls at 0.5B parameters, small
enough that its temporaries are ~0.1 GB (AdamW alone over SmolLM2-135M's shapes on a CPU: peak RSS 2.96 -> 2.47 GB)."""


class ChunkedAdamW(torch.optim.AdamW):
    """torch's foreach AdamW, stepping each param group ``chunk_bytes`` of parameters at a time (see the module
    docstring). Between steps ``param_groups`` is torch's own: schedulers, checkpoints and ``state_dict`` see one
    group per configured group."""

    def __init__(self, params, *, chunk_bytes: int = FOREACH_CHUNK_BYTES, **kwargs):
        if chunk_bytes <= 0:
            raise ValueError(f"ChunkedAdamW: chunk_bytes must be > 0, got {chunk_bytes}")
        super().__init__(params, **kwargs)
        self.chunk_bytes = chunk_bytes

    def _chunks(self) -> list[dict]:
        parts = []
        for group in self.param_groups:
            chunk, size = [], 0
            for p in group["params"]:
                nbytes = p.numel() * p.element_size()
                if chunk and size + nbytes > self.chunk_bytes:
                    parts.append({**group, "params": chunk})
                    chunk, size = [], 0
                chunk.append(p)
                size += nbytes
            parts.append({**group, "params": chunk})
        return parts

    @torch.no_grad()
    def step(self, closure=None):
        groups = self.param_groups
        # torch wraps a class's step with the optimizer hooks once the class has an instance; this class's own step
        # runs them, so AdamW's step is called unwrapped (hooks once per step)
        inner = torch.optim.AdamW.step
        inner = inner.__wrapped__ if getattr(inner, "hooked", False) else inner
        self.param_groups = self._chunks()  # state is keyed by parameter: each chunk finds its own
        try:
            return inner(self, closure)
        finally:
            self.param_groups = groups


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
    kwargs = dict(lr=o.lr if lr is None else lr, betas=tuple(o.betas), weight_decay=o.weight_decay)
    if impl == "foreach":
        return ChunkedAdamW(params, foreach=True, **kwargs)
    return torch.optim.AdamW(params, foreach=False, fused=True, **kwargs)


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
