"""Entry point: config -> torch.distributed -> Trainer.run().

    python -m fastgrpo.train --config configs/tiny.yaml key=value ...
    torchrun --nproc-per-node K [--nnodes N ...] -m fastgrpo.train --config configs/X.yaml key=value ...
"""

from __future__ import annotations

import sys

from fastgrpo.cli import check_sinks, run_cli
from fastgrpo.config import TrainConfig
from fastgrpo.rollout import ENGINES
from fastgrpo.trainers.grpo import Trainer
from fastgrpo.trainers.warm import build_warm  # noqa: F401  (importing it registers the warm models, e.g. tiny:countdown)


def check_optional_extras(cfg: TrainConfig) -> None:
    """A missing optional extra (wandb, vLLM) is a one-line message with the install command, before anything
    loads."""
    check_sinks(cfg)
    ENGINES[cfg.rollout.engine].check_available()


def main(argv: list[str] | None = None) -> int:
    return run_cli(argv, prog="fastgrpo", description="GRPO training (see README.md).", cls=TrainConfig,
                   make_trainer=Trainer, summary_prefixes=("reward/mean", "eval/"), done="done",
                   preflight=check_optional_extras)


if __name__ == "__main__":
    sys.exit(main())
