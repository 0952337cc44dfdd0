"""What an algorithm is to the trainer: one :class:`Algorithm` value, registered by name in
:data:`fastgrpo.algorithms.registry.ALGORITHMS` (``algorithm:`` in a run config).

The trainer (:class:`fastgrpo.trainers.grpo.Trainer`) holds no branch on the algorithm's name. It asks the entry
which models to build besides the policy (``extra_models``: each gets its own optimizer, schedule, guard and
checkpoint folder), whether a reference model is needed, how many optimizer updates the policy's LR schedule spans,
whether the rollout computes group advantages, whether multi-turn rollouts are served, and it hands each step's
episodes to ``update``. ``check_config`` runs when a run config is validated
(:func:`fastgrpo.algorithms.registry.check_algorithm`, registered with the config's ``section_check``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from fastgrpo.runtime.metrics import StepMetrics
from fastgrpo.update.bundle import TrainedModel

__all__ = ["Algorithm", "ExtraModel", "ModelSetup", "StepInputs"]


@dataclass(frozen=True, kw_only=True)
class ModelSetup:
    """What the trainer gives an extra model's builder."""

    cfg: Any
    """The run's TrainConfig."""
    device: torch.device
    world_size: int
    dtype: torch.dtype | None
    """The dtype trained models load in (None: model.dtype's; float32 masters on CUDA under FSDP or autocast)."""


@dataclass(frozen=True, kw_only=True)
class ExtraModel:
    """A model an algorithm trains besides the policy (PPO's critic)."""

    build: Callable[[ModelSetup], TrainedModel]
    """Loads, parallelizes and equips it (:func:`fastgrpo.update.bundle.build_trained`)."""
    nonfinite_cause: str
    """What to do when its updates keep having a non-finite gradient (the end-of-step error names it)."""


@dataclass(kw_only=True)
class StepInputs:
    """What one step's update gets from the trainer besides the episodes."""

    cfg: Any
    """The run's TrainConfig."""
    policy: TrainedModel
    extras: dict[str, TrainedModel]
    """The ``extra_models``, built, by name."""
    ref_model: torch.nn.Module | None
    """The reference policy when ``needs_reference``, else None."""
    metrics: StepMetrics
    device: torch.device
    step: int
    """The step being trained (0-based: the number of steps done before it)."""
    pad_token_id: int = 0
    max_tokens_per_microbatch: int | None = None
    """The micro-batch budget the trainer sized (CUDA, ``grpo.max_tokens_per_microbatch: null``), else None: the
    configured value, or the device's default."""


def _no_checks(cfg: Any) -> None:
    return None


@dataclass(frozen=True, kw_only=True)
class Algorithm:
    """One training algorithm, as the trainer and the config see it."""

    name: str
    update: Callable[[Any, StepInputs], None]
    """``update(episodes, step)``: the optimizer updates of one step (the policy's and the extra models'); it logs
    ``perf/update_tokens`` (the sequences' own tokens it trained on, for the throughput) and
    ``perf/update_tokens_forwarded`` (what the trunk ran: shared prefixes once, no bucket padding) besides its own
    metrics (``fastgrpo.update.step.count_update_tokens``)."""
    needs_reference: Callable[[Any], bool]
    """Whether a run config needs the frozen reference policy (a KL term)."""
    policy_updates: Callable[[Any], int]
    """The policy's optimizer updates over a run (its LR schedule's length)."""
    extra_models: dict[str, ExtraModel] = field(default_factory=dict)
    """Models trained beside the policy, by name: the trainer exposes ``trainer.<name>`` and
    ``trainer.<name>_optimizer``, and checkpoints each in its own folder."""
    group_advantages: bool = True
    """Whether the rollout computes (and logs) group-relative advantages (``adv/*``, ``groups/*``)."""
    multi_turn: bool = False
    """Whether multi-turn rollouts (``rollout.env``) can train with it."""
    asynchronous_rollout: bool = False
    """Whether it can train on batches from the asynchronous generation worker (``rollout.asynchronous``)."""
    check_config: Callable[[Any], None] = _no_checks
    """Raises ConfigError naming the field for settings it does not serve; run when a config is validated."""
