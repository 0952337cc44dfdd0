"""Checks of the launch and the run folder that need no model: run first, so that a mistake costs no model load.

Each failure is a ValueError with one line that names the setting or the path and says what to do.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from fastgrpo import checkpoint as ckpt
from fastgrpo.config import TrainConfig

LOGS = ("metrics.jsonl", "completions.jsonl")
"""The run folder's append-only logs."""


def check_launch(cfg: TrainConfig, world_size: int) -> None:
    """The parallel settings fit the launch."""
    if not cfg.parallel.fsdp and world_size > 1:
        # Without FSDP nothing would synchronise the ranks' gradients: each would train its own copy of the model
        # and rank 0's would be exported. FSDP2 is the one data-parallel path (it also shards and reshards the
        # checkpoints); a second, DDP-style one would duplicate that for no measured gain.
        raise ValueError(f"parallel.fsdp=false with {world_size} processes would train {world_size} unsynchronised "
                         "copies of the model; set parallel.fsdp=true (FSDP2 synchronises gradients) or run one "
                         "process")


def check_run_dir(cfg: TrainConfig) -> None:
    """Every output path is usable (a folder where a folder goes, a file where a file goes, writable), and the
    resume setting does not silently discard an existing run."""
    out, run = Path(cfg.output_dir), cfg.run_dir
    for path, what in ((out, "output_dir"), (run, "the run folder (output_dir/name)"),
                       (run / "checkpoints", "the checkpoint folder"), (run / "final", "the export folder")):
        if path.exists() and not path.is_dir():
            raise ValueError(f"{what} {str(path)!r} is a file, not a folder; move it or choose another "
                             f"{'output_dir' if path == out else 'name'}")
    for name in (*LOGS, "config.json"):
        if (run / name).is_dir():
            raise ValueError(f"{str(run / name)!r} is a folder; the run writes a file there: move it away")
    existing = next(p for p in (run, *run.parents) if p.exists())
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"cannot write to {str(existing)!r} (permission denied), so the run folder {str(run)!r} "
                         "cannot be created; choose another output_dir")
    if cfg.checkpoint.resume == "never" and not cfg.checkpoint.overwrite and holds_run(run):
        raise ValueError(f"{str(run)!r} already holds a run and checkpoint.resume=never would overwrite it; use "
                         "another name, resume it (checkpoint.resume=auto), or set checkpoint.overwrite=true to "
                         "delete it and start over")
    if cfg.checkpoint.resume not in ("auto", "never"):
        ckpt.resolve_resume(cfg.checkpoint.resume, run / "checkpoints")  # an explicit path must be a checkpoint


def holds_run(run: Path) -> bool:
    """A checkpoint, a non-empty log or an export in the run folder."""
    return (bool(ckpt.list_checkpoints(run / "checkpoints")) or (run / "final").is_dir()
            or any((run / name).is_file() and (run / name).stat().st_size > 0 for name in LOGS))


def clear_run(run: Path) -> None:
    """Delete a run's checkpoints, logs and export (checkpoint.resume=never with checkpoint.overwrite=true)."""
    print(f"[fastgrpo] checkpoint.overwrite=true: deleting the run in {run}", flush=True)
    shutil.rmtree(run / "checkpoints", ignore_errors=True)
    shutil.rmtree(run / "final", ignore_errors=True)
    for name in LOGS:
        (run / name).unlink(missing_ok=True)
