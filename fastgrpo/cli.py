"""The command line shared by ``fastgrpo.train`` and ``fastgrpo.sft``: parse, load and check the config, start
torch.distributed, build the trainer, run it, and turn the errors a user can cause into one line and an exit code.

Exit codes: 0 done; 2 bad config, data, model path or missing extra, or a run folder in use (before any training);
1 a run that started and then failed for a reason it names (a full disk, ``rewards.on_error=raise``, too many
non-finite updates); 143 (128 + SIGTERM) stopped early by SIGTERM, with a checkpoint saved: the same command
resumes; 130 (128 + SIGINT) interrupted by Ctrl-C / SIGINT, resumable from the last checkpoint. Each is one line
on stderr, no traceback.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable

from fastgrpo.config import ConfigError, describe, load_config
from fastgrpo.distributed import groups as fdist
from fastgrpo.runtime.errors import Preempted, RunError, is_disk_full
from fastgrpo.runtime.sinks import SINKS


def check_sinks(cfg: Any) -> None:
    """A missing metrics extra (wandb) is a one-line message with the install command, before anything loads."""
    for sink in cfg.log.report_to:
        SINKS[sink].check_available()


EXIT_PREEMPTED = 128 + 15
"""Exit status of a run that SIGTERM stopped early (as a shell reports a process that SIGTERM ended)."""
EXIT_INTERRUPTED = 128 + 2
"""Exit status after SIGINT (Ctrl-C)."""


def run_cli(argv: list[str] | None, *, prog: str, description: str, cls: type, make_trainer: Callable[[Any], Any],
            summary_prefixes: tuple[str, ...], done: str, preflight: Callable[[Any], None] = check_sinks,
            example: str = "--config configs/tiny.yaml") -> int:
    """Parse ``argv`` as ``prog [--config F] [--help-config] key=value ...`` for config class ``cls``, then train
    with ``make_trainer(cfg).run()``; prints ``[fastgrpo] <done>: step N {summary}`` on rank 0. Returns the exit
    code (module docstring). Neither a config file nor an override is a config error naming ``example``: the
    defaults alone would start a long run that nobody asked for."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--config", action="append", help="YAML config file (configs/*.yaml); one only")
    p.add_argument("--help-config", action="store_true", help="list every config key with its default and meaning")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. optim.lr=1e-6")
    args = p.parse_intermixed_args(argv)  # overrides may stand before and after --config
    if args.config is not None and len(args.config) > 1:  # one file defines a run; a second would silently win
        print(f"{prog}: config error: --config given {len(args.config)} times ({', '.join(args.config)}): pass one "
              "config file and change its keys with key=value overrides", file=sys.stderr)
        return 2
    args.config = args.config[0] if args.config else None
    if args.help_config:
        print(describe(cls))
        return 0
    if args.config is None and not args.overrides:  # the defaults alone are a long run nobody asked for
        print(f"{prog}: config error: no config given: pass --config <file.yaml> and/or key=value overrides "
              f"(e.g. {example}); --help-config lists every key", file=sys.stderr)
        return 2
    try:
        return _run(args, prog=prog, cls=cls, make_trainer=make_trainer, summary_prefixes=summary_prefixes,
                    done=done, preflight=preflight)
    except KeyboardInterrupt:  # Ctrl-C: one line, not a traceback from wherever it landed
        return interrupted(prog)


def config_error(prog: str, error: BaseException) -> int:
    """A bad config, argument or missing extra: one line on stderr; the exit code 2. Benchmarks report theirs
    through this too (benchmarks/harness.py ``benchmark_main``)."""
    print(f"{prog}: config error: {error}", file=sys.stderr)
    return 2


def interrupted(prog: str) -> int:
    """Ctrl-C: one line on stderr; the exit code 130."""
    print(f"{prog}: interrupted (SIGINT); checkpoints are written atomically, so the same command resumes from "
          "the last one", file=sys.stderr)
    return EXIT_INTERRUPTED


def _run(args: argparse.Namespace, *, prog: str, cls: type, make_trainer: Callable[[Any], Any],
         summary_prefixes: tuple[str, ...], done: str, preflight: Callable[[Any], None]) -> int:
    try:
        cfg = load_config(args.config, args.overrides, cls=cls)
        preflight(cfg)
    except (ConfigError, ImportError) as e:
        return config_error(prog, e)

    fdist.init_distributed(cfg.device)
    ended_normally = False
    try:
        try:
            trainer = make_trainer(cfg)
        except (ValueError, ImportError) as e:  # bad data, rewards, model path: before any training
            print(f"{prog}: error: {e}", file=sys.stderr)
            return 2
        except RunError as e:  # a full disk while the run folder is set up: the run failed, not its input
            print(f"{prog}: error: {e}", file=sys.stderr)
            return 1
        except OSError as e:
            if not is_disk_full(e):  # a model folder, a data file that cannot be read
                print(f"{prog}: error: {e}", file=sys.stderr)
                return 2
            print(f"{prog}: error: no space left on the device while writing "
                  f"{e.filename if e.filename else 'the run folder or a model cache'}; free some space and run the "
                  "same command again", file=sys.stderr)
            return 1
        try:
            record = trainer.run()
        except Preempted as e:
            print(f"{prog}: stopped early: {e}", file=sys.stderr)
            return EXIT_PREEMPTED
        except RunError as e:  # one line, not a traceback from deep inside
            print(f"{prog}: error: {e}", file=sys.stderr)
            return 1
        finally:
            close = getattr(trainer, "close", None)
            if close is not None:
                close()
        if fdist.get_rank() == 0 and record:
            summary = {k: round(v, 4) for k, v in record.items() if k.startswith(summary_prefixes)}
            print(f"[fastgrpo] {done}: step {int(record['step'])} {summary} -> {cfg.run_dir}", flush=True)
        ended_normally = True
    finally:
        fdist.destroy_distributed(barrier=ended_normally)
    return 0
