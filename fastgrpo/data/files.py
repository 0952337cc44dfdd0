"""Datasets from json/jsonl/parquet files or the Hugging Face hub, through ``datasets``, with row validation.

DataConfig.source is a path (``.json``, ``.jsonl``, ``.parquet`` file, or a folder ``datasets`` can read) or a
hub id, optionally with a config name after a colon (``openai/gsm8k:main``). JSON files are read with Python's
``json``, not through ``datasets``: Arrow's type inference would turn a column into floats when one value passes
2**63 (rounding every value) or coerce strings, and a broken line would be reported without its number. A hub id needs network (or a
filled ``datasets`` cache with ``HF_DATASETS_OFFLINE=1``); the CPU test environment has none, so tests use
local files only.

Any dataset works: a row's prompt is its ``DataConfig.prompt_column`` (default ``prompt``): a string (the user
message) or a list of chat messages ``[{"role": ..., "content": ...}]`` (rendered with the chat template as
given). The built-in tasks are presets of that mapping, used when the prompt column is absent: each entry of
SCHEMAS names its required columns with a checker per column and the user message its template builds
(countdown ``{nums, target}``, gsm8k ``{question, answer}``, math ``{problem, solution}``, whose ``answer`` is
derived from the solution's last ``\\boxed{}``). A row with a missing or ill-typed required field raises
``ValueError`` naming the row index and the field; with ``skip_invalid_rows`` such rows are dropped and counted
instead. Every other column passes through untouched: reward functions receive it as a keyword argument. A
column whose name the trainer uses for something else (RESERVED_COLUMNS) is a ValueError naming it.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Hashable, Iterable

from fastgrpo.data.countdown import problem_key
from fastgrpo.data.templates import PROMPT_TASK
from fastgrpo.rewards.columns import ALWAYS_PASSED
from fastgrpo.rewards.math_answer import boxed_content  # the rewards' own reader, so both agree

_FILE_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}

RESERVED_COLUMNS = {
    **{name: "reward functions get the rollout's values under that name" for name in sorted(ALWAYS_PASSED)},
    "prompt": "reward functions never get a column of that name; they get the rendered prompts as 'prompts'",
    "task": "each row's task (which picks its prompt template) is kept under that name",
}
"""Column names a file or hub dataset may not use (except as data.prompt_column), and why: a column under such a
name would be replaced or dropped before it reached a reward function."""


class _BadField(Exception):
    """Raised by a column checker; the message says what is wrong with the value."""


def _int(value: Any) -> int:
    # Only integers: bool is an int subclass but never a meaningful number here, and "3" or 3.0 would be a silent
    # conversion of the user's data (a float column may already have been rounded).
    if isinstance(value, (bool, float, str)) or not hasattr(value, "__index__"):
        raise _BadField(f"must be an integer, got {value!r}")
    return int(value)


def _int_list(value: Any) -> list[int]:
    if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__iter__"):
        raise _BadField(f"must be a list of integers, got {value!r}")
    items = list(value)
    if not items:
        raise _BadField("must be a non-empty list of integers")
    try:
        return [_int(v) for v in items]
    except _BadField:
        raise _BadField(f"must be a list of integers, got {value!r}") from None


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise _BadField(f"must be a string, got {value!r}")
    return value


def _prompt(value: Any) -> Any:
    """A prompt: a non-empty string, or a non-empty list of chat messages with string ``role`` and ``content``."""
    if isinstance(value, str):
        if not value:
            raise _BadField("is an empty string")
        return value
    if isinstance(value, (list, tuple)) and value and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in value):
        return [{"role": m["role"], "content": m["content"]} for m in value]
    raise _BadField(f"must be a string or a list of chat messages {{'role': str, 'content': str}}, got {value!r}")


def _boxed_answer(row: dict[str, Any]) -> dict[str, Any]:
    """MATH rows: ``answer`` = the solution's last ``\\boxed{...}`` (the whole solution when it has none)."""
    if row.get("answer") is None:
        boxed = boxed_content(row["solution"])
        row["answer"] = boxed if boxed is not None else row["solution"]
    return row


@dataclass(frozen=True, kw_only=True)
class Schema:
    """Required columns of one task's rows."""

    task: str
    """Task name (row["task"]; picks the prompt template's user message)."""
    columns: dict[str, Callable[[Any], Any]]
    """Column -> checker returning the normalised value (raises _BadField otherwise)."""
    key: Callable[[dict[str, Any]], Hashable]
    """Canonical identity of a row, for keeping held-out rows out of training."""
    prepare: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    """Derives columns the task's rewards read from a validated row (math: ``answer`` from ``solution``)."""


SCHEMAS: dict[str, Schema] = {
    "countdown": Schema(task="countdown", columns={"nums": _int_list, "target": _int}, key=problem_key),
    "gsm8k": Schema(task="gsm8k", columns={"question": _str, "answer": _str}, key=lambda r: r["question"]),
    "math": Schema(task="math", columns={"problem": _str, "solution": _str}, key=lambda r: r["problem"],
                   prepare=_boxed_answer),
}
"""Preset name -> schema, for data without a prompt column: the first whose required columns a file has wins."""


def prompt_schema(prompt_column: str) -> Schema:
    """The schema of any dataset whose prompt is the column ``prompt_column``."""
    return Schema(task=PROMPT_TASK, columns={prompt_column: _prompt},
                  key=lambda r: json.dumps(r[prompt_column], sort_keys=True))


def detect_schema(column_names: list[str], prompt_column: str = "prompt") -> Schema:
    if prompt_column in column_names:
        return prompt_schema(prompt_column)
    for schema in SCHEMAS.values():
        if set(schema.columns) <= set(column_names):
            return schema
    wanted = "; ".join(f"{name}: {sorted(s.columns)}" for name, s in SCHEMAS.items())
    raise ValueError(f"dataset columns {sorted(column_names)} have no prompt column {prompt_column!r} "
                     f"(data.prompt_column) and match no known task (needed columns: {wanted})")


def check_reserved_columns(columns: Iterable[str], *, source: str, prompt_column: str) -> None:
    """ValueError naming every column of ``columns`` with a reserved name (RESERVED_COLUMNS)."""
    clash = sorted((set(columns) & set(RESERVED_COLUMNS)) - {prompt_column})
    if clash:
        why = "; ".join(f"{name!r}: {RESERVED_COLUMNS[name]}" for name in clash)
        raise ValueError(f"data.source {source!r}: column name(s) {clash} are reserved ({why}); rename them in "
                         "the data")


def no_training_rows(source: str, *, valid: int, held_out: int, overlap: int, num_eval: int,
                     eval_split: str | None) -> ValueError:
    """The error for a source that leaves no training rows, saying where its ``valid`` rows went: ``held_out`` by
    ``data.num_eval`` (without ``data.eval_split``), ``overlap`` dropped as equal to a held-out row."""
    parts = [f"{valid} valid row(s)"]
    if eval_split is None:
        parts.append(f"{held_out} held out for evaluation (data.num_eval={num_eval})")
    if overlap:
        of_split = f" of data.eval_split={eval_split!r}" if eval_split else ""
        parts.append(f"{overlap} equal to a held-out row{of_split}")
    fix = "lower data.num_eval or add rows" if eval_split is None else "check data.split and data.eval_split"
    return ValueError(f"data.source: {source!r} leaves no training rows: {', '.join(parts)}; {fix}")


def validate_rows(
    rows: list[dict[str, Any]], schema: Schema, *, skip_invalid_rows: bool = False, lines: list[int] | None = None,
) -> tuple[list[dict[str, Any]], int]:
    """Check the required fields (nothing is converted): returns (valid rows, number skipped). ``lines``: each
    row's line in its file, named in errors."""
    valid, skipped = [], 0
    for i, row in enumerate(rows):
        fixed, problem = dict(row), None
        for column, check in schema.columns.items():
            try:
                if row.get(column) is None:  # a column absent from some json lines reads as null
                    raise _BadField("is missing")
                fixed[column] = check(row[column])
            except _BadField as e:
                where = f"row {i}" if lines is None else f"row {i} (line {lines[i]})"
                problem = f"{where}: field {column!r} {e}"
                break
        if problem is None and schema.prepare is not None:
            fixed = schema.prepare(fixed)
        if problem is not None:
            if not skip_invalid_rows:
                raise ValueError(f"{problem} (set data.skip_invalid_rows=true to skip and count such rows)")
            skipped += 1
            continue
        valid.append(fixed)
    return valid, skipped


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def read_json_rows(path: Path) -> tuple[list[dict[str, Any]], list[int]]:
    """(rows, line number of each) of a JSON-lines file, or of a ``.json`` file holding one array of objects.

    Integers stay exact Python ints, strings stay strings. A line that is not a JSON object (a torn or edited
    line, NaN, a bare value) is a ValueError naming the file and the line.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"data.source: {str(path)!r} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    if path.suffix == ".json" and text.lstrip().startswith("["):
        try:
            data = json.loads(text, parse_constant=_no_constant)
        except ValueError as e:
            where = f" at line {e.lineno}, column {e.colno}" if isinstance(e, json.JSONDecodeError) else ""
            raise ValueError(f"data.source: {str(path)!r} is not valid JSON{where}: "
                             f"{e.msg if isinstance(e, json.JSONDecodeError) else e}") from None
        if not all(isinstance(r, dict) for r in data):
            i = next(i for i, r in enumerate(data) if not isinstance(r, dict))
            raise ValueError(f"data.source: {str(path)!r}: item {i} of the array is not a JSON object")
        return data, [0] * len(data)  # one document: no meaningful line per row
    rows, lines = [], []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line, parse_constant=_no_constant)
        except ValueError as e:
            msg = f"{e.msg} at column {e.colno}" if isinstance(e, json.JSONDecodeError) else str(e)
            raise ValueError(f"data.source: {str(path)!r} line {lineno} is not valid JSON ({msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"data.source: {str(path)!r} line {lineno} is a JSON {type(row).__name__}, "
                             "expected an object (one row per line)")
        rows.append(row)
        lines.append(lineno)
    return rows, lines


def load_source_rows(source: str, *, split: str, cache_dir: str | None = None) -> list[dict[str, Any]]:
    """Rows of a local file/folder or a hub dataset, as plain dicts."""
    return _load_source(source, split=split, cache_dir=cache_dir)[0]


def _load_source(source: str, *, split: str, cache_dir: str | None) -> tuple[list[dict[str, Any]], list[int] | None]:
    """(rows, line of each row for JSON-lines files, else None)."""
    path = Path(source).expanduser()
    if path.suffix in _FILE_FORMATS:
        if not path.is_file():
            raise ValueError(f"data.source: file {str(path)!r} does not exist")
        if _FILE_FORMATS[path.suffix] == "json":
            rows, lines = read_json_rows(path)
            return rows, (lines if path.suffix == ".jsonl" or any(lines) else None)
        import pyarrow.parquet as pq

        try:  # a typed format: no inference, so Arrow's own reader keeps every value as written
            return pq.read_table(path).to_pylist(), None
        except Exception as e:  # pyarrow's errors have no common base class
            raise ValueError(f"data.source: {str(path)!r} is not a readable parquet file: {e}") from None
    import datasets  # heavy; only needed for folder and hub sources

    if path.is_dir():
        try:
            ds = datasets.load_dataset(str(path), split=split, cache_dir=cache_dir)
        except Exception as e:  # DatasetGenerationError, a missing split, an empty folder, ...
            cause = e.__cause__ or e
            raise ValueError(f"data.source: could not read the folder {str(path)!r} (split {split!r}) with "
                             f"datasets: {type(cause).__name__}: {cause}") from None
    else:
        name, _, config = source.partition(":")
        try:
            ds = datasets.load_dataset(name, config or None, split=split, cache_dir=cache_dir)
        except Exception as e:
            raise ValueError(
                f"data.source: could not load {source!r} (split {split!r}) as a Hugging Face hub dataset: {e}. "
                "A hub id needs network or a filled datasets cache; a local path must end in "
                f"{sorted(_FILE_FORMATS)} or be a folder"
            ) from e
    return ds.to_list(), None


def file_splits(
    source: str, *, split: str, eval_split: str | None, num_eval: int, seed: int, skip_invalid_rows: bool,
    cache_dir: str | None = None, prompt_column: str = "prompt",
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any]]:
    """(train rows, eval rows, info) from a file or hub source; rows carry ``"task"``.

    Held-out rows come from ``eval_split`` when given, else ``num_eval`` rows are carved off by a seeded
    shuffle. Either way, training rows whose key (see Schema.key) equals a held-out row's are dropped and
    counted: public sets contain duplicates, and an eval prompt seen in training measures nothing.
    """
    raw, lines = _load_source(source, split=split, cache_dir=cache_dir)
    if not raw:
        raise ValueError(f"data.source: {source!r} (split {split!r}) has no rows")
    columns = sorted({k for r in raw for k in r})
    check_reserved_columns(columns, source=source, prompt_column=prompt_column)
    schema = detect_schema(columns, prompt_column)
    rows, skipped = validate_rows(raw, schema, skip_invalid_rows=skip_invalid_rows, lines=lines)
    skipped_eval = 0
    if eval_split is not None:
        raw_eval, lines_eval = _load_source(source, split=eval_split, cache_dir=cache_dir)
        check_reserved_columns({k for r in raw_eval for k in r}, source=source, prompt_column=prompt_column)
        eval_rows, skipped_eval = validate_rows(raw_eval, schema, skip_invalid_rows=skip_invalid_rows,
                                                lines=lines_eval)
        train_rows = rows
    else:
        order = list(range(len(rows)))
        random.Random(f"holdout-{seed}").shuffle(order)
        eval_rows = [rows[i] for i in order[:num_eval]]
        train_rows = [rows[i] for i in sorted(order[num_eval:])]
    eval_keys = {schema.key(r) for r in eval_rows}
    kept = [r for r in train_rows if schema.key(r) not in eval_keys]
    if not kept:
        raise no_training_rows(source, valid=len(rows), held_out=len(eval_rows), overlap=len(train_rows),
                               num_eval=num_eval, eval_split=eval_split)
    for r in kept + eval_rows:
        r["task"] = schema.task
    info = {
        "task": schema.task,
        "skipped_invalid_rows": skipped + skipped_eval,
        "removed_eval_overlap": len(train_rows) - len(kept),
    }
    return kept, eval_rows, info
