"""Configuration: the run configs and their sections, and the loader that reads them.

A run is described by a YAML file plus dotted ``key=value`` overrides on the command line::

    python -m fastgrpo.train --config configs/tiny.yaml optim.lr=1e-4 grpo.loss_type=dr_grpo

- :mod:`fastgrpo.config.loader`: the framework (YAML, overrides, coercion, strict keys with a closest-key hint,
  per-section checks, ``--help-config``); it knows no section;
- :mod:`fastgrpo.config.sections`: one keyword-only dataclass per component (model, data, rewards, rollout with
  one sub-section per engine, grpo, optim, parallel, checkpoint, eval, log);
- :mod:`fastgrpo.config.runs`: :class:`RunConfig` (what every run has), :class:`TrainConfig` (GRPO) and
  :class:`SFTConfig`.

Bad values raise :class:`ConfigError` (a ``ValueError``) naming the field, before any model loads. This package
imports no other fastgrpo module at import time. A component checks what it serves of its section itself and
registers the check (:func:`fastgrpo.config.loader.section_check`); validation reaches it through the component's
choice table, never by name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastgrpo.config import loader
from fastgrpo.config.loader import ConfigError, check_section, choices, not_a_file, registry, to_dict
from fastgrpo.config.runs import (RESUMABLE_KEYS, RunConfig, SFTConfig, SFTOptions, TrainConfig, check_run_config,
                                  run_defining_changes, run_kind_of)
from fastgrpo.config.sections import (SEEDS_SYSTEM_PROMPT, CheckpointConfig, DataConfig, EnvConfig, EvalConfig,
                                      GRPOConfig, HFRolloutConfig, LogConfig, LoraConfig, ModelConfig, OptimConfig,
                                      ParallelConfig, PPOConfig, RewardConfig, RolloutConfig, VLLMRolloutConfig)

__all__ = ["RESUMABLE_KEYS", "SEEDS_SYSTEM_PROMPT", "CheckpointConfig", "ConfigError", "DataConfig", "EnvConfig",
           "EvalConfig", "GRPOConfig", "HFRolloutConfig", "LogConfig", "LoraConfig", "ModelConfig", "OptimConfig",
           "ParallelConfig", "PPOConfig", "RewardConfig", "RolloutConfig", "RunConfig", "SFTConfig", "SFTOptions", "TrainConfig",
           "VLLMRolloutConfig", "check_run_config", "check_section", "choices", "describe", "load_config",
           "not_a_file", "registry", "run_defining_changes", "run_kind_of", "to_dict"]


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (), *,
                cls: type = TrainConfig) -> Any:
    """Read a YAML file (optional), apply ``key=value`` overrides, build and validate a ``cls`` (TrainConfig;
    SFTConfig for SFT)."""
    return loader.load_config(path, overrides, cls=cls)


def describe(cls: type = TrainConfig) -> str:
    """Every key of the run config ``cls`` with its default and docstring (for --help-config)."""
    return loader.describe(cls)
