"""Entry point: config -> torch.distributed -> Trainer.run().

    python -m fastgrpo.train --config configs/tiny.yaml key=value ...
    torchrun --nproc-per-node K [--nnodes N ...] -m fastgrpo.train --config configs/X.yaml key=value ...
"""

from __future__ import annotations

import argparse
import sys

from fastgrpo.config import ConfigError, describe, load_config
from fastgrpo.errors import RunError


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="fastgrpo.train", description="GRPO training (see README.md).")
    p.add_argument("--config", help="YAML config file (configs/*.yaml)")
    p.add_argument("--help-config", action="store_true", help="list every config key with its default and meaning")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. optim.lr=1e-6")
    return p.parse_args(argv)


def check_optional_extras(cfg) -> None:
    """A missing optional extra is a one-line message with the install command, before anything loads."""
    from fastgrpo.metrics import SINKS
    from fastgrpo.rollout import ENGINES

    for sink in cfg.log.report_to:
        SINKS[sink].check_available()
    ENGINES[cfg.rollout.engine].check_available()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.help_config:
        print(describe())
        return 0
    try:
        cfg = load_config(args.config, args.overrides)
        check_optional_extras(cfg)
    except (ConfigError, ImportError) as e:
        print(f"fastgrpo: config error: {e}", file=sys.stderr)
        return 2

    from fastgrpo import distributed as fdist
    from fastgrpo.trainer import Trainer

    fdist.init_distributed(cfg.device)
    try:
        try:
            trainer = Trainer(cfg)
        except (ValueError, ImportError, OSError) as e:  # bad data, rewards, model path: before any training
            print(f"fastgrpo: error: {e}", file=sys.stderr)
            return 2
        try:
            record = trainer.run()
        except RunError as e:  # a full disk, rewards.on_error=raise, too many non-finite updates: one line
            print(f"fastgrpo: error: {e}", file=sys.stderr)
            return 1
        finally:
            trainer.close()
        if fdist.get_rank() == 0 and record:
            summary = {k: round(v, 4) for k, v in record.items() if k.startswith(("reward/mean", "eval/"))}
            print(f"[fastgrpo] done: step {int(record['step'])} {summary} -> {cfg.run_dir}", flush=True)
    finally:
        fdist.destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
