"""Keeping NaN and inf out of the weights: the optimizer step is taken only on a finite gradient.

One non-finite number anywhere in the loss (an advantage that overflowed, a bf16 overflow, a log-prob of -inf)
makes the gradient norm non-finite, and AdamW would spread it into every weight and both moment buffers in one
step. So :meth:`NonFiniteGuard.step` looks at the global gradient norm (which clipping computes anyway) and
skips the step when it is not finite. That is one host sync per optimizer update, none per micro-batch. Under
FSDP the norm is the global one, so every rank makes the same decision. After ``optim.max_nonfinite_steps``
skipped updates in a row the run stops, since such a run learns nothing, with an error that names the step and the
likely cause.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from fastgrpo.runtime.errors import NonFiniteError


class NonFiniteGuard:
    """Steps the optimizer on finite gradients only; counts and limits the skipped updates."""

    def __init__(self, max_in_a_row: int) -> None:
        self.max_in_a_row = max_in_a_row
        self.in_a_row = 0
        self.skipped = 0  # this step's skipped updates (a step has grpo.num_iterations updates)
        self.last_norm = float("nan")

    def step(self, optimizer: torch.optim.Optimizer, grad_norm: torch.Tensor) -> bool:
        """``optimizer.step()`` if the (global, unclipped) ``grad_norm`` is finite, else drop the gradients.
        Returns whether it stepped."""
        norm = float(grad_norm)  # the one host sync of the update (a read, then a host test: one op, not five)
        if math.isfinite(norm):
            optimizer.step()
            self.in_a_row = 0
            return True
        optimizer.zero_grad(set_to_none=True)  # nothing non-finite reaches the weights or Adam's moments
        self.in_a_row += 1
        self.skipped += 1
        self.last_norm = norm
        return False

    def end_step(self, step: int, metrics: Any, advantages: torch.Tensor | None = None,
                 rewards: torch.Tensor | None = None, *, role: str = "policy", cause: str | None = None) -> None:
        """Log ``<role>/skipped_updates`` of the step that just ended; raise NonFiniteError past the limit.

        The error names the likely ``cause``; without one it is read from ``advantages`` and ``rewards`` ([S], this
        rank's) when given. Every trained model (the policy, PPO's critic) ends its step through here.
        """
        metrics.host(f"{role}/skipped_updates", self.skipped)
        self.skipped = 0
        if self.in_a_row < self.max_in_a_row:
            return
        if cause is None and advantages is not None and not bool(torch.isfinite(advantages).all()):
            cause = (f"the advantages are not finite: rewards as large as {rewards.abs().max().item():.3g} overflow "
                     "float32 in the group statistics; scale the reward function down")
        elif cause is None:
            cause = ("the loss or its gradient overflowed with finite advantages: lower optim.lr, keep "
                     "optim.max_grad_norm > 0, or compute in float32 (model.dtype, parallel.param_dtype)")
        what = "optimizer" if role == "policy" else role
        raise NonFiniteError(f"step {step}: {self.in_a_row} {what} updates in a row had a non-finite gradient "
                             f"(norm {self.last_norm}) and were skipped (optim.max_nonfinite_steps="
                             f"{self.max_in_a_row}); likely cause: {cause}")
