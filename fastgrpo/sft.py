"""Entry point of supervised fine-tuning: config -> torch.distributed -> SFTTrainer.run().

    python -m fastgrpo.sft --config configs/X.yaml key=value ...
    torchrun --nproc-per-node K -m fastgrpo.sft --config configs/X.yaml key=value ...
"""

from __future__ import annotations

import sys

from fastgrpo.cli import run_cli
from fastgrpo.config import SFTConfig, SFTOptions
from fastgrpo.trainers.sft import SFTTrainer

__all__ = ["SFTConfig", "SFTOptions", "SFTTrainer", "main"]


def main(argv: list[str] | None = None) -> int:
    return run_cli(argv, prog="fastgrpo.sft", description="Supervised fine-tuning (see README.md).", cls=SFTConfig,
                   make_trainer=SFTTrainer, summary_prefixes=("sft/nll", "eval/"), done="sft done",
                   example="model.name_or_path=<folder> data.source=<pairs.jsonl>")


if __name__ == "__main__":
    sys.exit(main())
