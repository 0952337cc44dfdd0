"""The reasoning format ``<think>...</think> <answer>...</answer>`` and the ``format`` reward.

This module also owns the two text helpers every reward here shares: turning a completion (plain text or
TRL's conversational form) into a string, and reading the last ``<answer>`` block.

Everything runs in linear time with ``str.find``/``rfind`` and slicing, no regular expressions: a policy
can emit 64 KB of adversarial text and the reward must still answer in well under a millisecond.
"""

from __future__ import annotations

from typing import Any

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
_TAGS = (THINK_OPEN, THINK_CLOSE, ANSWER_OPEN, ANSWER_CLOSE)


def as_text(item: Any) -> str:
    """A completion or prompt as text.

    TRL passes conversational data as a list of message dicts (``[{"role": "assistant", "content": ...}]``);
    the reward reads the last message's content. Plain strings pass through; anything else becomes ``""``
    (a reward must score it 0, not crash on it).
    """
    if isinstance(item, str):
        return item
    if isinstance(item, dict):
        content = item.get("content", "")
        return content if isinstance(content, str) else ""
    if isinstance(item, (list, tuple)) and item:
        return as_text(item[-1])
    return ""


def last_answer(text: str) -> str | None:
    """Content of the last complete ``<answer>...</answer>`` block, or None when there is none.

    "Last" means the block closed by the last ``</answer>``; its opening tag is the nearest ``<answer>``
    before it, so ``<answer>1</answer> text <answer>2</answer>`` gives ``"2"``.
    """
    end = text.rfind(ANSWER_CLOSE)
    if end < 0:
        return None
    start = text.rfind(ANSWER_OPEN, 0, end)
    if start < 0:
        return None
    return text[start + len(ANSWER_OPEN):end]


def prompt_opens_think(prompt: Any) -> bool:
    """Whether the prompt already ends in ``<think>`` (the base-model template prefills it)."""
    return as_text(prompt).rstrip().endswith(THINK_OPEN)


def is_well_formatted(text: str, *, think_prefilled: bool = False) -> bool:
    """``<think>T</think> <answer>A</answer>`` with only whitespace around and between the blocks.

    T may be empty (some models think silently); A must hold non-whitespace text. Neither may contain any of
    the four tags, so a reopened or nested block fails. With ``think_prefilled`` the prompt ended in
    ``<think>``, so the completion starts inside the thinking block.
    """
    s = (THINK_OPEN + text if think_prefilled else text).strip()
    if not (s.startswith(THINK_OPEN) and s.endswith(ANSWER_CLOSE)):
        return False
    close = s.find(THINK_CLOSE)
    if close < 0:
        return False
    think = s[len(THINK_OPEN):close]
    rest = s[close + len(THINK_CLOSE):].lstrip()
    if not rest.startswith(ANSWER_OPEN) or len(rest) < len(ANSWER_OPEN) + len(ANSWER_CLOSE):
        return False
    answer = rest[len(ANSWER_OPEN):-len(ANSWER_CLOSE)]
    if not answer.strip():
        return False
    return not any(tag in think or tag in answer for tag in _TAGS)


def format_reward(completions: list[Any], prompts: list[Any] | None = None, **_: Any) -> list[float]:
    """1.0 for a well-formatted completion (see :func:`is_well_formatted`), else 0.0.

    ``prompts`` (passed by the trainer, as TRL does) tells whether each prompt already opened ``<think>``.
    """
    if prompts is None:
        prompts = [""] * len(completions)
    return [
        1.0 if is_well_formatted(as_text(c), think_prefilled=prompt_opens_think(p)) else 0.0
        for c, p in zip(completions, prompts, strict=True)
    ]
