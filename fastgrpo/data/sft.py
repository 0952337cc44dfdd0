"""SFT data: prompt/completion pairs from files, hub datasets, chat messages, or Countdown solver traces.

``build_sft_datasets(cfg, trace=..., tokenizer=...)`` turns a DataConfig into (train pairs, held-out pairs, info);
a pair is ``{"prompt": str, "completion": str}`` (plus the row's other columns, e.g. ``nums`` and ``target`` for
Countdown, so a held-out pair can be scored by a reward). The loss is taken on the completion only.

Sources (DataConfig.source):
- ``countdown``: problems from the seeded generator, split exactly as the GRPO trainer splits them (the held-out
  problems are drawn first from their own stream, so a GRPO run with the same ``data`` settings evaluates on
  problems this SFT never saw). The prompt is rendered with ``data.template`` as the GRPO trainer renders it; the
  completion is the exhaustive solver's solution written by the trace style ``trace`` (registry ``TRACES``) in
  the format the rewards check: ``<think>...</think><answer>expr</answer>``. Optionally a share of the training
  completions (``near_miss``) are honest attempts that miss the target by as little as any: with only solutions,
  a small model learns to write the target as its last intermediate result whatever the arithmetic gives; with
  misses mixed in it must compute, and its samples become diverse candidates that GRPO can choose among.
- a json/jsonl/parquet file, a folder ``datasets`` reads, or a hub dataset id (``name:config``), with either
  ``prompt`` and ``completion`` string columns (the prompt is used verbatim) or a chat ``messages`` column (a
  list of ``{"role", "content"}`` whose last message is the assistant's: the prompt is the tokenizer's chat
  template over the earlier messages with the assistant turn opened, the completion is the last content).

Every completion gets the tokenizer's EOS token appended (unless it already ends with it), so the model learns to
stop where the GRPO rollout engines stop. A row with a missing or ill-typed field is an error naming the row and
the field (``data.skip_invalid_rows`` skips and counts such rows instead), before any model loads.
"""

from __future__ import annotations

import random
from typing import Any, Callable

from fastgrpo.config import DataConfig
from fastgrpo.data.countdown import closest_miss, countdown_splits, iter_expressions, iter_solutions
from fastgrpo.data.files import load_source_rows, no_training_rows
from fastgrpo.data.templates import render_prompt

Pair = dict[str, Any]


# ---------------------------------------------------------------------------------------------------------------
# Countdown traces: a solution found by the exhaustive solver, written as a completion the rewards score 1.0


def _answer_only(row: dict[str, Any], steps: list[str], expr: str, rng: random.Random) -> str:
    return f"<think></think><answer>{expr}</answer>"


def _steps(row: dict[str, Any], steps: list[str], expr: str, rng: random.Random) -> str:
    return f"<think>{' '.join(steps)}</think><answer>{expr}</answer>"


SEARCH_MAX_MISSES = 2
"""``search`` traces show 0..SEARCH_MAX_MISSES failed attempts before the solution."""


def _search(row: dict[str, Any], steps: list[str], expr: str, rng: random.Random) -> str:
    misses = [s for s, _, value in iter_expressions(row["nums"]) if value != row["target"]]
    tried = rng.sample(misses, min(len(misses), rng.randint(0, SEARCH_MAX_MISSES)))
    return f"<think>{' '.join(step for attempt in tried + [steps] for step in attempt)}</think><answer>{expr}</answer>"


TOOL_MISS_SHARE = 0.3
"""``tool`` traces first try an attempt that misses the target this often."""


def _tool(row: dict[str, Any], steps: list[str], expr: str, rng: random.Random) -> str:
    # The conversation after the prompt as a multi-turn rollout with the calculator tool writes it in the embedded
    # tiny model's chat format (Qwen's): each call ends the model's turn, the tool's message opens the next.
    tries = []
    misses = [(e, v) for _, e, v in iter_expressions(row["nums"]) if v != row["target"]]
    if misses and rng.random() < TOOL_MISS_SHARE:
        tries.append(rng.choice(misses))
    tries.append((expr, steps[-1].rpartition("=")[2] if steps else expr))  # the last step's result is the value
    calls = "".join('<tool_call>{"name": "calculator", "arguments": {"expression": "' + e + '"}}</tool_call>'
                    f"<|im_end|>\n<|im_start|>tool\n{v}<|im_end|>\n<|im_start|>assistant\n" for e, v in tries)
    return f"{calls}<think></think><answer>{expr}</answer>"  # the last turn, which the rewards read, as _answer_only


TRACES: dict[str, Callable[[dict[str, Any], list[str], str, random.Random], str]] = {
    "answer": _answer_only,
    "steps": _steps,
    "search": _search,
    "tool": _tool,
}
"""Trace style -> fn(row, steps, expression, rng) -> completion, for one way (steps, expression) to compute an
equation. ``answer``: an empty think block, then the equation; ``steps``: the intermediate results in order
(``3+5=8 4*8=32``), then the equation; ``search``: first 0-2 random attempts that miss the target, each computed
honestly to its end (``3*5=15 15+4=19``), then the solution's steps and its equation; ``tool``: calls of the
calculator tool (sometimes first on a miss), each followed by the tool's answer, then a last turn as ``answer``'s
(fastgrpo.environments, ``configs/tiny-tools.yaml``; the rewards of a multi-turn run read the last turn)."""


SOLUTIONS = ("first", "random")
"""Which solution a trace shows: ``first``, the exhaustive solver's first (one fixed answer per problem); ``random``,
one drawn uniformly from all of the problem's solutions (the data then teaches that any solution is right)."""


def countdown_trace(row: dict[str, Any], style: str, rng: random.Random, *, miss: bool = False,
                    solution: str = "first") -> str | None:
    """The completion for a Countdown row in trace ``style``: a solution chosen by ``solution`` (None if there is
    none); with ``miss``, instead an honest attempt that misses the target by as little as any (None if none does)."""
    if style not in TRACES:
        raise ValueError(f"sft.trace: unknown trace style {style!r}; choices: {', '.join(TRACES)}")
    if solution not in SOLUTIONS:
        raise ValueError(f"sft.solution: unknown choice {solution!r}; choices: {', '.join(SOLUTIONS)}")
    if miss:
        found = closest_miss(row["nums"], row["target"], rng)
    elif solution == "first":
        found = next(iter_solutions(row["nums"], row["target"]), None)
    else:
        every = list(iter_solutions(row["nums"], row["target"]))
        found = rng.choice(every) if every else None
    return None if found is None else TRACES[style](row, *found, rng)


# ---------------------------------------------------------------------------------------------------------------
# Rows -> pairs


class _BadRow(ValueError):
    pass


def _text_field(row: dict[str, Any], i: int, name: str) -> str:
    value = row.get(name)
    if value is None:
        raise _BadRow(f"row {i}: field {name!r} is missing")
    if not isinstance(value, str):
        raise _BadRow(f"row {i}: field {name!r} must be a string, got {value!r}")
    return value


def _messages_pair(row: dict[str, Any], i: int, tokenizer: Any) -> Pair:
    msgs = row.get("messages")
    if msgs is None:
        raise _BadRow(f"row {i}: field 'messages' is missing")
    if not isinstance(msgs, list) or len(msgs) < 2:
        raise _BadRow(f"row {i}: field 'messages' must be a list of at least two messages, got {msgs!r}")
    for j, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise _BadRow(f"row {i}: field 'messages[{j}]' must be {{'role': str, 'content': str}}, got {m!r}")
    if msgs[-1]["role"] != "assistant":
        raise _BadRow(f"row {i}: field 'messages' must end with an assistant message, got role "
                      f"{msgs[-1]['role']!r}")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("data.source: rows with 'messages' need a tokenizer with a chat template; this one has none")
    prompt = tokenizer.apply_chat_template([{"role": m["role"], "content": m["content"]} for m in msgs[:-1]],
                                           tokenize=False, add_generation_prompt=True)
    return {"prompt": prompt, "completion": msgs[-1]["content"]}


def rows_to_pairs(rows: list[dict[str, Any]], *, tokenizer: Any,
                  skip_invalid_rows: bool = False) -> tuple[list[Pair], int]:
    """(pairs, rows skipped) from rows with ``prompt``/``completion`` or ``messages``; see the module docstring."""
    if rows and "messages" in rows[0]:
        convert = lambda row, i: _messages_pair(row, i, tokenizer)  # noqa: E731
    elif rows and ("prompt" in rows[0] or "completion" in rows[0]):
        convert = lambda row, i: {"prompt": _text_field(row, i, "prompt"),  # noqa: E731
                                  "completion": _text_field(row, i, "completion")}
    else:
        raise ValueError(f"data.source: SFT rows need 'prompt' and 'completion' columns or a 'messages' column; "
                         f"got columns {sorted(rows[0]) if rows else []}")
    pairs, skipped = [], 0
    for i, row in enumerate(rows):
        try:
            pairs.append({**{k: v for k, v in row.items() if k != "messages"}, **convert(row, i)})
        except _BadRow as e:
            if not skip_invalid_rows:
                raise ValueError(f"{e} (set data.skip_invalid_rows=true to skip and count such rows)") from None
            skipped += 1
    return pairs, skipped


def _with_eos(pairs: list[Pair], eos: str | None) -> list[Pair]:
    if eos:
        for p in pairs:
            if not p["completion"].endswith(eos):
                p["completion"] += eos
    return pairs


def _countdown_pairs(cfg: DataConfig, trace: str, near_miss: float, solution: str,
                     tokenizer: Any) -> tuple[list[Pair], list[Pair], dict[str, Any]]:
    train, eval_rows = countdown_splits(num_train=cfg.num_train, num_eval=cfg.num_eval, seed=cfg.seed,
                                        min_numbers=cfg.min_numbers, max_numbers=cfg.max_numbers,
                                        max_value=cfg.max_value)
    rng = random.Random(f"sft-traces-{cfg.seed}")
    out = []
    for rows, miss_share in ((train, near_miss), (eval_rows, 0.0)):  # held-out pairs are solutions
        pairs = []
        for row in rows:
            completion = countdown_trace(row, trace, rng, miss=rng.random() < miss_share, solution=solution)
            if completion is None:  # the generator only makes reachable targets; the rational solver is wider
                continue
            row = {**row, "task": "countdown"}
            prompt = render_prompt(row, template=cfg.template, system_prompt=cfg.system_prompt, tokenizer=tokenizer)
            pairs.append({**row, "prompt": prompt, "completion": completion})
        out.append(pairs)
    return out[0], out[1], {"task": "countdown", "skipped_invalid_rows": 0}


def build_sft_datasets(cfg: DataConfig, *, trace: str, tokenizer: Any, near_miss: float = 0.0,
                       solution: str = "first", cache_dir: str | None = None) -> tuple[list[Pair], list[Pair], dict[str, Any]]:
    """(train pairs, held-out pairs, info); completions end with the tokenizer's EOS token.

    Countdown: a ``near_miss`` share of the training completions are honest attempts that miss the target by as
    little as any (:func:`countdown_trace`); held-out completions are always solutions.

    File and hub sources: held-out pairs come from ``data.eval_split`` when set, else ``data.num_eval`` rows are
    carved off by a seeded shuffle; held-out prompts are removed from training.
    """
    if cfg.source == "countdown":
        train, held_out, info = _countdown_pairs(cfg, trace, near_miss, solution, tokenizer)
    else:
        raw = load_source_rows(cfg.source, split=cfg.split, cache_dir=cache_dir)
        if not raw:
            raise ValueError(f"data.source: {cfg.source!r} (split {cfg.split!r}) has no rows")
        train, skipped = rows_to_pairs(raw, tokenizer=tokenizer, skip_invalid_rows=cfg.skip_invalid_rows)
        if cfg.eval_split is not None:
            held_out, skipped_eval = rows_to_pairs(load_source_rows(cfg.source, split=cfg.eval_split,
                                                                    cache_dir=cache_dir),
                                                   tokenizer=tokenizer, skip_invalid_rows=cfg.skip_invalid_rows)
            skipped += skipped_eval
        else:
            order = list(range(len(train)))
            random.Random(f"holdout-{cfg.seed}").shuffle(order)
            held_out = [train[i] for i in order[:cfg.num_eval]]
            train = [train[i] for i in sorted(order[cfg.num_eval:])]
        prompts = {p["prompt"] for p in held_out}
        valid, before = len(train) + (len(held_out) if cfg.eval_split is None else 0), len(train)
        train = [p for p in train if p["prompt"] not in prompts]
        if not train:
            raise no_training_rows(cfg.source, valid=valid, held_out=len(held_out), overlap=before,
                                   num_eval=cfg.num_eval, eval_split=cfg.eval_split)
        info = {"task": "sft", "skipped_invalid_rows": skipped}
    if not train:
        raise ValueError(f"data.source: {cfg.source!r} leaves no training rows")
    eos = getattr(tokenizer, "eos_token", None)
    info.update(source=cfg.source, num_train=len(train), num_eval=len(held_out))
    return _with_eos(train, eos), _with_eos(held_out, eos), info
