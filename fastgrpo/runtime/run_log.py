"""Rank 0's outputs of a run in one object: the metric sinks, completions.jsonl, config.json and the progress bar."""

from __future__ import annotations

import json
from pathlib import Path

from fastgrpo.runtime.errors import DiskFullError, is_disk_full
from fastgrpo.runtime.files import write_atomic
from fastgrpo.runtime.progress import ProgressBar
from fastgrpo.runtime.sinks import SINKS, JsonlSink, drop_records_after

__all__ = ["RunLog"]


class RunLog:
    """Rank 0's outputs of a run: the metric sinks, completions.jsonl and the progress bar (all no-ops elsewhere).

    A resumed run redoes the steps after its checkpoint, so records after ``step`` are dropped first.
    """

    def __init__(self, run_dir: Path, *, report_to: list[str], name: str, project: str, config: dict,
                 step: int, max_steps: int, enabled: bool, progress: bool, desc: str = "grpo") -> None:
        self.sinks: list = []
        self.completions = None
        if enabled:
            run_dir.mkdir(parents=True, exist_ok=True)
            for log in ("metrics.jsonl", "completions.jsonl"):
                drop_records_after(run_dir / log, step)
            try:  # atomic: a full disk leaves the old config.json whole, and the run can resume once there is room
                write_atomic(run_dir / "config.json", json.dumps(config, indent=2))
            except OSError as e:
                if not is_disk_full(e):
                    raise
                raise DiskFullError(f"no space left on the device while writing {run_dir / 'config.json'} (the "
                                    "previous one is intact); free some space and run the same command again") \
                    from None
            self.sinks = [SINKS[s].for_run(run_dir, name=name, project=project, config=config, step=step)
                          for s in report_to]
            self.completions = JsonlSink(run_dir / "completions.jsonl")
        self.bar = ProgressBar(max_steps, step, enabled=enabled and progress, desc=desc)

    def write(self, record: dict, completions: list[dict], advance: bool = True) -> None:
        """Log one record; ``advance=False`` for one that is no step (an evaluation before the first)."""
        for s in self.sinks:
            s.write(record)
        if self.completions is not None:
            for row in completions:
                self.completions.write(row)
        self.bar.update(record, advance=advance)

    def close(self) -> None:
        self.bar.close()
        for s in self.sinks:
            s.close()
        if self.completions is not None:
            self.completions.close()
