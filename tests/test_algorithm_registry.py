"""The algorithm registry (fastgrpo.algorithms.registry.ALGORITHMS): the config and the trainer ask it, and a new
algorithm is one registration; PPO, asked, computes no group advantages and gets the trainer's micro-batch budget."""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import pytest
import torch

from fastgrpo.algorithms.grpo import GRPO
from fastgrpo.algorithms.registry import ALGORITHMS
from fastgrpo.config import ConfigError, load_config
from fastgrpo.config.loader import check
from fastgrpo.runtime.errors import NonFiniteError
from fastgrpo.runtime.metrics import StepMetrics
from fastgrpo.update.guard import NonFiniteGuard
from test_trainer import TOY

ROOT = Path(__file__).resolve().parents[1]
SMALL = TOY + ["grpo.prompts_per_step=2", "grpo.num_generations=4", "rollout.max_completion_length=3",
               "max_steps=2"]


def _trainer(tmp_path, *extra):
    from fastgrpo.trainers.grpo import Trainer

    return Trainer(load_config(None, SMALL + [f"output_dir={tmp_path}", *extra]))


def test_the_algorithm_choices_are_the_registry():
    assert {"grpo", "ppo"} <= set(ALGORITHMS)
    with pytest.raises(ConfigError, match=r"algorithm.*unknown 'grpo2'.*grpo, ppo"):
        load_config(None, ["algorithm=grpo2"])


def test_a_registered_algorithm_brings_its_own_config_checks(monkeypatch):
    def refuse_beta(cfg):
        check(cfg.grpo.beta == 0, "grpo.beta", "algorithm strict trains without a KL term")

    monkeypatch.setitem(ALGORITHMS, "strict", dataclasses.replace(GRPO, name="strict", check_config=refuse_beta))
    assert load_config(None, ["algorithm=strict"]).algorithm == "strict"
    with pytest.raises(ConfigError, match=r"grpo\.beta.*without a KL term"):
        load_config(None, ["algorithm=strict", "grpo.beta=0.1"])


def test_multi_turn_rollouts_are_refused_for_an_algorithm_that_does_not_serve_them():
    with pytest.raises(ConfigError, match=r"rollout\.env.*algorithm ppo"):
        load_config(None, ["algorithm=ppo", "rollout.env.name=tools", "rollout.env.tools=[calculator]"])


def test_a_new_algorithm_is_one_registration_and_the_trainer_asks_it(tmp_path, monkeypatch):
    """No branch on the name in the trainer: an entry that wants a reference model, no group advantages and a
    schedule of 7 updates gets exactly that, and each step's episodes go to its update."""
    seen = []

    def update(ep, step):
        seen.append((ep.adv, step.ref_model is not None, step.step, step.policy.optimizer is step_optimizer[0]))
        step.metrics.total("perf/update_tokens", torch.tensor(0.0))  # an update's one obligatory record

    step_optimizer = []
    monkeypatch.setitem(ALGORITHMS, "probe", dataclasses.replace(
        GRPO, name="probe", update=update, needs_reference=lambda cfg: True, policy_updates=lambda cfg: 7,
        group_advantages=False))
    trainer = _trainer(tmp_path, "algorithm=probe", "name=probe")
    step_optimizer.append(trainer.optimizer)
    assert trainer.ref_model is not None and trainer.total_updates == 7 and trainer.extras == {}
    record, _ = trainer.train_step()
    assert seen == [(None, True, 0, True)]
    assert "reward/mean" in record and not any(k.startswith(("adv/", "groups/")) for k in record)


def test_ppo_logs_no_group_advantages_and_ends_the_critic_step(tmp_path):
    trainer = _trainer(tmp_path, "algorithm=ppo", "ppo.critic_lr=1e-2", "name=ppo")
    record, ep = trainer.train_step()
    assert ep.adv is None and not any(k.startswith(("adv/", "groups/")) for k in record)
    assert record["critic/skipped_updates"] == 0 and record["policy/skipped_updates"] == 0
    assert "advantage" not in trainer.log_rows(ep)[0]


def test_ppo_gets_the_micro_batch_budget_the_trainer_sized(tmp_path, monkeypatch):
    import fastgrpo.algorithms.ppo as ppo
    from fastgrpo.trainers.grpo import Trainer

    budgets = []
    real = ppo.plan_step
    monkeypatch.setattr(ppo, "plan_step", lambda p, c, budget, **k: budgets.append(budget) or real(p, c, budget, **k))
    monkeypatch.setattr(Trainer, "microbatch_tokens", lambda self: 9)  # as if sized from free GPU memory
    trainer = _trainer(tmp_path, "algorithm=ppo", "ppo.critic_lr=1e-2", "name=budget")
    trainer.train_step()
    assert budgets and set(budgets) == {9}


def test_a_model_guard_ends_its_step_under_its_role_and_names_the_cause():
    param = torch.nn.Parameter(torch.ones(2))
    guard = NonFiniteGuard(1)
    param.grad = torch.tensor([math.nan, 0.0])
    assert not guard.step(torch.optim.SGD([param], lr=0.1), param.grad.norm())
    metrics = StepMetrics()
    with pytest.raises(NonFiniteError, match=r"step 3: 1 critic updates in a row.*likely cause: lower ppo\.critic_lr"):
        guard.end_step(3, metrics, role="critic", cause="lower ppo.critic_lr")
    assert metrics.reduce()["critic/skipped_updates"] == 1


def test_no_branch_on_an_algorithm_or_loss_type_name_outside_the_registries():
    """The trainer asks the algorithm registry; the peers' adapters read their loss-type tables."""
    branch = re.compile(r"\b(algorithm|loss_type)\s*(==|!=|in\s*\()")
    files = [*(ROOT / "fastgrpo").rglob("*.py"), ROOT / "kernels" / "module.py"]  # config's checks included
    hits = [f"{f.relative_to(ROOT)}:{i}" for f in files for i, line in enumerate(f.read_text().splitlines(), 1)
            if branch.search(line.split("#")[0])]
    assert len(files) > 20 and hits == []
