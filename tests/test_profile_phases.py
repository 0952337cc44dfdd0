"""benchmarks/profile_phases.py: a profiled update's self CPU time by phase (trunk fwd/bwd, head, optimizer)."""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.profile_phases import PHASES, phase_seconds, phase_table

V = 37  # a vocabulary size no other dimension below has


def test_each_phase_gets_its_own_ops_and_the_phases_add_up_to_the_profile():
    torch.manual_seed(0)
    trunk, head = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 16)), \
        torch.nn.Linear(16, V, bias=False)
    opt = torch.optim.AdamW([*trunk.parameters(), *head.parameters()], lr=1e-3)
    x, y = torch.randn(64, 8), torch.randint(0, V, (64,))
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        torch.nn.functional.cross_entropy(head(trunk(x)), y).backward()
        opt.step()
        opt.zero_grad()
    split = phase_seconds(prof.events(), V)
    assert set(split) == set(PHASES) and all(split[p] > 0 for p in PHASES), split
    total = sum(e.self_cpu_time_total for e in prof.events() if e.device_type.name == "CPU") / 1e6
    assert sum(split.values()) == pytest.approx(total)
    # the head's matmul (and its gradient) reads [.., V] tensors: none of it is trunk time
    head_names = {e.name for e in prof.events() if any(V in s for s in e.input_shapes or [] if isinstance(s, list))}
    assert "aten::mm" in head_names or "aten::matmul" in head_names
    assert "| total |" in phase_table(split, extra={"rollout": 1.0})
