"""Metric sinks: where a step's record goes (``log.report_to``), and the jsonl files a resumed run trims.

A sink class has ``for_run(run_dir, name=, project=, config=, step=)`` (``step``: the step a resumed run starts
after, 0 for a fresh one), ``check_available()`` (called before any work, so a missing package is a one-line
error), ``write(record)`` and ``close()``.
"""

from __future__ import annotations

import json
import math
import os
import secrets
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
    def for_run(cls, run_dir: Path, *, name: str, project: str, config: dict, step: int = 0) -> "JsonlSink":
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
    """A wandb run; offline mode when no API key is configured, so a run never blocks on a login prompt.

    Its id is kept in the run folder (``wandb_run_id``): a resumed run (``step`` > 0) logs to the same wandb run, a
    fresh one starts a new run. wandb is a view of the run, not its record (metrics.jsonl is): a failure of wandb
    (its start, a log call, its finish) is printed once and ends this sink, never the training.
    """

    ID_FILE = "wandb_run_id"

    @classmethod
    def for_run(cls, run_dir: Path, *, name: str, project: str, config: dict, step: int = 0) -> "WandbSink":
        return cls(project, name, config, run_dir, resume=step > 0)

    check_available = staticmethod(check_wandb_available)

    def __init__(self, project: str, name: str, config: dict, run_dir: Path, *, resume: bool = False) -> None:
        check_wandb_available()
        import wandb

        self._run = None
        id_file = run_dir / self.ID_FILE
        run_id = id_file.read_text().strip() if resume and id_file.is_file() else ""
        if not run_id:
            run_id = secrets.token_hex(6)
            write_atomic(id_file, run_id + "\n")
        mode = None
        if not os.environ.get("WANDB_API_KEY") and not os.environ.get("WANDB_MODE"):
            mode = "offline"
        try:
            self._run = wandb.init(project=project, name=name, config=config, dir=str(run_dir), mode=mode, id=run_id,
                                   resume="allow")
        except Exception as e:  # noqa: BLE001 (whatever wandb raises: a missing key, a network error)
            self._give_up("could not start", e)

    def _give_up(self, what: str, e: BaseException) -> None:
        print(f"[fastgrpo] wandb {what} ({type(e).__name__}: {str(e)[:200]}); training goes on without wandb "
              "(metrics.jsonl has every step)", flush=True)
        self._run = None

    def write(self, record: dict) -> None:
        if self._run is None:
            return
        step = int(record.get("step", 0))
        try:
            self._run.log({k: v for k, v in record.items() if k != "step"}, step=step)
        except Exception as e:  # noqa: BLE001
            self._give_up(f"failed to log step {step}", e)

    def close(self) -> None:
        if self._run is None:
            return
        try:
            self._run.finish()
        except Exception as e:  # noqa: BLE001
            self._give_up("failed to finish", e)


SINKS: dict[str, type] = {"jsonl": JsonlSink, "wandb": WandbSink}
"""Metric sink name (the choices of log.report_to) -> class with ``for_run(run_dir, name=, project=, config=, step=)``,
``check_available()``, ``write(record)`` and ``close()``."""
