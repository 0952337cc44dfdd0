"""Supervised fine-tuning on prompt/completion pairs, on the GRPO trainer's machinery.

    python -m fastgrpo.sft --config configs/tiny-countdown-sft.yaml key=value ...
    torchrun --nproc-per-node K -m fastgrpo.sft --config configs/X.yaml key=value ...

What it shares with GRPO: the config system (YAML + dotted overrides, closest-key errors), packed micro-batches
with no padding and the one optimizer update (:func:`fastgrpo.update.optimizer_update`), the lm_head through
``fastgrpo.kernels`` (the token loss is ``-linear_logprobs``: no ``[tokens x vocab]`` tensor), FSDP2, atomic
checkpoints with ``resume: auto``, metrics.jsonl and the progress bar (:class:`fastgrpo.loop.TrainingLoop`), and
a Hugging Face export in ``<run>/final`` that ``fastgrpo.train`` starts from (``model.name_or_path=<run>/final``).

The loss is on completion tokens only: ``sum_t w_t * -log p(y_t)``, with per-token weights ``w`` fixed once per
step over the global batch by ``sft.normalization`` (registry ``SFT_NORMALIZATIONS``), exactly as GRPO's loss
types are, so the gradient does not depend on the micro-batch budget or the number of ranks.

Legend: S sequences on this rank, N completion tokens on this rank (flat layout), n of one micro-batch, H hidden
size, V vocabulary size.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from fastgrpo.config import (CheckpointConfig, ConfigError, DataConfig, EvalConfig, LogConfig, ModelConfig,
                             OptimConfig, ParallelConfig, check_sections, describe, load_config, registry, to_dict)

__all__ = ["SFTConfig", "SFTOptions", "SFTTrainer", "main"]


@dataclass(kw_only=True)
class SFTOptions:
    batch_size: int = 32
    """Sequences per optimizer step on each rank."""
    normalization: str = field(default="token", metadata=registry("fastgrpo.losses:SFT_NORMALIZATIONS"))
    """Loss average over the global batch: 'token' (every completion token weighs the same) or 'sequence' (the
    token mean of each sequence, then the mean over sequences)."""
    max_tokens_per_microbatch: int = 1024
    """Token budget of one packed micro-batch (prompt + completion tokens); gradients accumulate across them."""
    trace: str = field(default="steps", metadata=registry("fastgrpo.data.sft:TRACES"))
    """data.source=countdown: how a solver's solution is written ('answer': equation only; 'steps': the
    intermediate results, then the equation)."""
    head_backend: str = field(default="auto", metadata=registry("fastgrpo.kernels:BACKENDS"))
    """lm_head + loss kernel path, as grpo.head_backend."""
    eval_reward: str | None = None
    """A reward (fastgrpo.rewards.REWARDS name, e.g. 'countdown') that scores greedy completions of held-out
    prompts at each evaluation, besides their loss; None = loss only."""

    def validate(self, p: str) -> None:
        if self.batch_size < 1:
            raise ConfigError(f"{p}.batch_size: must be >= 1")
        if self.max_tokens_per_microbatch < 1:
            raise ConfigError(f"{p}.max_tokens_per_microbatch: must be >= 1")


def _sft_data() -> DataConfig:
    return DataConfig(system_prompt="")


@dataclass(kw_only=True)
class SFTConfig:
    name: str = "sft"
    """Run name: outputs go to <output_dir>/<name>/."""
    output_dir: str = "runs"
    """Parent folder of run folders."""
    max_steps: int = 200
    """Optimizer steps."""
    seed: int = 0
    """Global seed (model init of the tiny model, data order)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """'auto' (cuda if available), 'cpu' or 'cuda'."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=_sft_data)
    sft: SFTOptions = field(default_factory=SFTOptions)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.name

    def validate(self) -> "SFTConfig":
        check_sections(self, head_backend=self.sft.head_backend, head_backend_field="sft.head_backend")
        if self.sft.eval_reward is not None:
            from fastgrpo.rewards import REWARDS

            if self.sft.eval_reward not in REWARDS:
                raise ConfigError(f"sft.eval_reward: unknown reward {self.sft.eval_reward!r}; "
                                  f"choices: {', '.join(REWARDS)}")
        return self


# ---------------------------------------------------------------------------------------------------------------


class SFTTrainer:
    """Placeholder: filled in on top of the refactored update step."""
