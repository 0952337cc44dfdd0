"""fastgrpo.update.guard: a non-finite update is skipped and counted; too many in a row stop the run naming the step and
the cause."""

from __future__ import annotations

import math

import pytest
import torch

from fastgrpo.runtime.errors import NonFiniteError
from fastgrpo.update.guard import NonFiniteGuard
from fastgrpo.runtime.metrics import StepMetrics


def test_the_guard_skips_non_finite_updates_and_names_the_advantages_the_advantages_when_they_overflowed():
    param = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([param], lr=0.1)
    guard = NonFiniteGuard(2)
    for step, grad in enumerate([torch.tensor([1.0, 2.0, math.nan]), torch.tensor([math.inf, 0.0, 0.0])], 1):
        param.grad = grad
        assert not guard.step(opt, grad.norm())
        m = StepMetrics()
        if step == 1:
            guard.end_step(step, m, torch.zeros(4), torch.zeros(4))
            assert m.reduce()["policy/skipped_updates"] == 1
    assert torch.equal(param.detach(), torch.ones(3)) and param.grad is None
    with pytest.raises(NonFiniteError, match="step 2: 2 optimizer updates in a row.*advantages are not finite"):
        guard.end_step(2, StepMetrics(), torch.tensor([0.0, -math.inf]), torch.tensor([3e38, 3e38]))
    param.grad = torch.ones(3)
    assert guard.step(opt, param.grad.norm()) and guard.in_a_row == 0  # a finite update resets the count
