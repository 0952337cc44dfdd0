"""Metric sinks: where a step's record goes (``log.report_to``), and the jsonl files a resumed run trims.

A sink class has ``for_run(run_dir, name=, project=, config=)``, ``check_available()`` (called before any work, so a
missing package is a one-line error), ``write(record)`` and ``close()``.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from fastgrpo.runtime.errors import DiskFullError, is_disk_full
from fastgrpo.runtime.files import write_atomic

__all__ = ["SINKS", "JsonlSink", "WandbSink", "check_wandb_available", "drop_records_after", "json_safe"]


def drop_records_after(path: Path, step: int) -> None:
    """Remove records with ``step`` > step from a jsonl log (atomically), so a resumed run does not log twice.

    A last line that is not valid JSON is what a run killed in the middle of a write leaves: it is dropped (with a
    note). An invalid line elsewhere was not written by a kill: ValueError naming the file and the line.
    """
    if not path.is_file():
        return
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)
    kept = []
    for i, ln in enumerate(lines):
        if not ln.strip():
            continue
        try:
            record = json.loads(ln)
        except ValueError:
            if i == len(lines) - 1:
                print(f"[fastgrpo] {path}: dropping a torn last line (a run killed while writing it)", flush=True)
                continue
            raise ValueError(f"{path} line {i + 1} is not valid JSON; fix or delete that line to resume") from None
        if isinstance(record, dict) and record.get("step", 0) <= step:
            kept.append(ln if ln.endswith("\n") else ln + "\n")  # the next append must start a new line
    if kept != lines:
        write_atomic(path, "".join(kept))


def json_safe(value: Any) -> Any:
    """``value`` with every number a JSON number: JSON has no NaN or Infinity (Python writes them, and strict readers
    reject the line), so a non-finite number becomes null; tensors and numpy scalars become floats."""
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if value is None or isinstance(value, (str, bool, int)):
        return value
    value = float(value)
    return value if math.isfinite(value) else None


class JsonlSink:
    """Appends one JSON object per line (non-finite numbers as null); flushed per write so a killed run keeps every
    finished step."""

    @classmethod
    def for_run(cls, run_dir: Path, *, name: str, project: str, config: dict) -> "JsonlSink":
        return cls(run_dir / "metrics.jsonl")

    @staticmethod
    def check_available() -> None:
        pass

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._f = open(path, "a", encoding="utf-8")

    def write(self, record: dict) -> None:
        try:
            self._f.write(json.dumps(json_safe(record), allow_nan=False) + "\n")
            self._f.flush()
        except OSError as e:
            if is_disk_full(e):
                raise DiskFullError(f"no space left on the device while writing {self.path}; free some space "
                                    "and run the same command again (it resumes from the last checkpoint)") from None
            raise

    def close(self) -> None:
        try:
            self._f.close()
        except OSError:  # the failed flush of a full disk again; already reported by write()
            pass


def check_wandb_available() -> None:
    """Fail early, with the install command, when report_to names wandb but it is not installed."""
    try:
        import wandb  # noqa: F401
    except ImportError:
        raise ImportError("log.report_to includes 'wandb' but wandb is not installed: "
                          "pip install 'fastgrpo[wandb]'  (or remove wandb from log.report_to)") from None


class WandbSink:
    """wandb run; offline mode when no API key is configured, so a run never blocks on a login prompt."""

    @classmethod
    def for_run(cls, run_dir: Path, *, name: str, project: str, config: dict) -> "WandbSink":
        return cls(project, name, config, run_dir)

    check_available = staticmethod(check_wandb_available)

    def __init__(self, project: str, name: str, config: dict, run_dir: Path) -> None:
        check_wandb_available()
        import wandb

        mode = None
        if not os.environ.get("WANDB_API_KEY") and not os.environ.get("WANDB_MODE"):
            mode = "offline"
        self._run = wandb.init(project=project, name=name, config=config, dir=str(run_dir), mode=mode,
                               resume="allow")

    def write(self, record: dict) -> None:
        step = int(record.get("step", 0))
        self._run.log({k: v for k, v in record.items() if k != "step"}, step=step)

    def close(self) -> None:
        self._run.finish()


SINKS: dict[str, type] = {"jsonl": JsonlSink, "wandb": WandbSink}
"""Metric sink name (the choices of log.report_to) -> class with ``for_run(run_dir, name=, project=, config=)``,
``check_available()``, ``write(record)`` and ``close()``."""
