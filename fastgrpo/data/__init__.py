"""Prompt data: sources (generators, files, hub), templates, and resumable per-rank sampling.

``build_datasets(cfg)`` turns a DataConfig into (train rows, eval rows, info). Each row is a dict holding its
dataset columns (passed to reward functions as keyword arguments, except the prompt column) plus ``"task"``,
which picks how :func:`render_prompt` builds the prompt: ``"prompt"`` for any dataset (the prompt is the column
``DataConfig.prompt_column``), else a preset's user message (arithmetic, countdown, gsm8k, math, toy).
"""

from __future__ import annotations

from typing import Any, Callable

from fastgrpo.config import DataConfig
from fastgrpo.data.arithmetic import arithmetic_splits
from fastgrpo.data.countdown import countdown_splits, problem_key, solve
from fastgrpo.data.files import SCHEMAS, file_splits, validate_rows
from fastgrpo.data.sampler import PromptSampler
from fastgrpo.data.templates import PROMPT_TASK, TEMPLATES, USER_MESSAGES, render_prompt
from fastgrpo.data.toy import toy_splits

Rows = list[dict[str, Any]]


def _countdown(cfg: DataConfig, cache_dir: str | None) -> tuple[Rows, Rows, dict[str, Any]]:
    train, eval_rows = countdown_splits(
        num_train=cfg.num_train, num_eval=cfg.num_eval, seed=cfg.seed, min_numbers=cfg.min_numbers,
        max_numbers=cfg.max_numbers, max_value=cfg.max_value,
    )
    return train, eval_rows, {"task": "countdown"}


def _arithmetic(cfg: DataConfig, cache_dir: str | None) -> tuple[Rows, Rows, dict[str, Any]]:
    train, eval_rows = arithmetic_splits(num_train=cfg.num_train, num_eval=cfg.num_eval, seed=cfg.seed, ops=cfg.ops,
                                         digits=cfg.digits)
    return train, eval_rows, {"task": "arithmetic"}


def _toy(cfg: DataConfig, cache_dir: str | None) -> tuple[Rows, Rows, dict[str, Any]]:
    train, eval_rows = toy_splits(num_eval=cfg.num_eval, seed=cfg.seed)
    return train, eval_rows, {"task": "toy"}


GENERATORS: dict[str, Callable[[DataConfig, str | None], tuple[Rows, Rows, dict[str, Any]]]] = {
    "arithmetic": _arithmetic,
    "countdown": _countdown,
    "toy": _toy,
}
"""DataConfig.source names that generate data; any other source is a file path or hub id."""


def build_datasets(cfg: DataConfig, *, cache_dir: str | None = None) -> tuple[Rows, Rows, dict[str, Any]]:
    """(train rows, eval rows, info) for ``cfg``; train and eval share no problem.

    info always holds ``task``, ``num_train``, ``num_eval``, ``skipped_invalid_rows`` (rows dropped by
    ``skip_invalid_rows``; the trainer should log it) and ``removed_eval_overlap`` (training rows equal to a
    held-out row, dropped). ``cache_dir`` is passed to ``datasets.load_dataset`` for file and hub sources.
    """
    if cfg.source in GENERATORS:
        train, eval_rows, info = GENERATORS[cfg.source](cfg, cache_dir)
        task = info["task"]
        for row in train + eval_rows:
            row["task"] = task
        info = {"skipped_invalid_rows": 0, "removed_eval_overlap": 0, **info}
    else:
        train, eval_rows, info = file_splits(
            cfg.source, split=cfg.split, eval_split=cfg.eval_split, num_eval=cfg.num_eval, seed=cfg.seed,
            skip_invalid_rows=cfg.skip_invalid_rows, cache_dir=cache_dir, prompt_column=cfg.prompt_column,
        )
        if info["task"] == PROMPT_TASK and cfg.template != "chat" and any(
                not isinstance(r[cfg.prompt_column], str) for r in train + eval_rows):
            raise ValueError(f"data.template={cfg.template!r} needs string prompts; column {cfg.prompt_column!r} of "
                             f"{cfg.source!r} holds chat messages (use data.template='chat')")
    info.update(source=cfg.source, num_train=len(train), num_eval=len(eval_rows))
    return train, eval_rows, info


__all__ = [
    "GENERATORS",
    "PROMPT_TASK",
    "PromptSampler",
    "SCHEMAS",
    "TEMPLATES",
    "USER_MESSAGES",
    "arithmetic_splits",
    "build_datasets",
    "countdown_splits",
    "file_splits",
    "problem_key",
    "render_prompt",
    "solve",
    "toy_splits",
    "validate_rows",
]
