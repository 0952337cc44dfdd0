"""Prompt templates: a row of a task -> the prompt text the policy continues.

Two templates (DataConfig.template):

- ``chat``: system message (DataConfig.system_prompt, omitted when empty) + the task's user message, rendered
  with the tokenizer's own chat template and the assistant turn opened (``add_generation_prompt=True``).
- ``base``: plain text for base models (TinyZero style): a short framing, the user message, and an
  assistant turn that has already opened ``<think>``. The ``format`` reward sees that the prompt ends in
  ``<think>`` and treats the completion as starting inside the thinking block. The system prompt is not used.
- ``compact``: the task's compact statement alone (Countdown: ``3 5 4 -> 32`` and a newline), no instructions
  and no chat turn: for the embedded tiny models, whose tokens are bytes, so every prompt byte costs compute,
  and which learn the answer format from SFT rather than from instructions.

Each task contributes one function row -> user message (USER_MESSAGES) and may contribute a compact statement
(COMPACT_MESSAGES, the whole prompt of the ``compact`` template); each template is one function (TEMPLATES).
Adding a task or template is one entry, not a branch.

Rows of any dataset (task ``prompt``) carry their prompt in a column (``prompt_column``): a string is the user
message, as above; a list of chat messages is rendered by the chat template exactly as given (no system prompt
added: the conversation is the dataset's), and is an error with the ``base`` template.
"""

from __future__ import annotations

from typing import Any, Callable

BASE_PREAMBLE = (
    "A chat between a User and an Assistant. The User poses a problem and the Assistant works it out: "
    "it reasons privately first, then states its answer."
)
BASE_ASSISTANT_OPENING = "Let me work through this step by step.\n<think>"


def countdown_user_message(row: dict[str, Any]) -> str:
    nums = ", ".join(str(n) for n in row["nums"])
    return (
        f"Make an equation that equals {row['target']} from the numbers [{nums}]. You may use +, -, * and / "
        "and parentheses, and each number must be used exactly once. Reason inside <think> </think> tags, "
        "then write only the final equation inside <answer> </answer> tags, for example "
        "<answer> (7 - 3) * 2 </answer>."
    )


def countdown_compact(row: dict[str, Any]) -> str:
    return f"{' '.join(str(n) for n in row['nums'])} -> {row['target']}\n"


def gsm8k_user_message(row: dict[str, Any]) -> str:
    return (
        f"{row['question']}\nReason inside <think> </think> tags, then write only the final number inside "
        "<answer> </answer> tags."
    )


def math_user_message(row: dict[str, Any]) -> str:
    return (
        f"{row['problem']}\nReason inside <think> </think> tags, then write only the final answer inside "
        "<answer> </answer> tags."
    )


def toy_user_message(row: dict[str, Any]) -> str:
    return row["prompt"]


def arithmetic_user_message(row: dict[str, Any]) -> str:
    return f"What is {row['a']} {row['op']} {row['b']}? Answer with just the number."


def arithmetic_compact(row: dict[str, Any]) -> str:
    return f"{row['a']} {row['op']} {row['b']} ="


USER_MESSAGES: dict[str, Callable[[dict[str, Any]], str]] = {
    "arithmetic": arithmetic_user_message,
    "countdown": countdown_user_message,
    "gsm8k": gsm8k_user_message,
    "math": math_user_message,
    "toy": toy_user_message,
}
"""Task name -> row -> user message."""

COMPACT_MESSAGES: dict[str, Callable[[dict[str, Any]], str]] = {
    "arithmetic": arithmetic_compact,
    "countdown": countdown_compact,
    "toy": toy_user_message,
}
"""Task name -> row -> the whole prompt of the ``compact`` template."""


def render_messages(messages: list[dict[str, str]], *, tokenizer: Any) -> str:
    """Chat messages -> prompt text, with the tokenizer's chat template and the assistant turn opened."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "data.template='chat' needs a tokenizer with a chat template; this one has none "
            "(use data.template='base' for base models)"
        )
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _render_chat(user: str, *, system_prompt: str, tokenizer: Any) -> str:
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
        {"role": "user", "content": user}
    ]
    return render_messages(messages, tokenizer=tokenizer)


def _render_base(user: str, *, system_prompt: str, tokenizer: Any) -> str:
    return f"{BASE_PREAMBLE}\nUser: {user}\nAssistant: {BASE_ASSISTANT_OPENING}"


def _render_compact(statement: str, *, system_prompt: str, tokenizer: Any) -> str:
    return statement  # the task's compact statement (COMPACT_MESSAGES) or a string prompt, as it is


TEMPLATES: dict[str, Callable[..., str]] = {"chat": _render_chat, "base": _render_base, "compact": _render_compact}
"""Template name -> (user message, system_prompt=, tokenizer=) -> prompt text (``compact``: the compact statement)."""


PROMPT_TASK = "prompt"
"""The task of rows whose prompt is a column (any dataset); see the module docstring."""


def render_prompt(
    row: dict[str, Any], *, template: str, system_prompt: str = "", tokenizer: Any = None, task: str | None = None,
    prompt_column: str = "prompt",
) -> str:
    """Prompt text for one row. ``task`` defaults to ``row["task"]`` (set by build_datasets)."""
    task = task if task is not None else row.get("task")
    if template not in TEMPLATES:
        raise ValueError(f"render_prompt: unknown template {template!r}; known templates: {sorted(TEMPLATES)}")
    if task == PROMPT_TASK:
        prompt = row[prompt_column]
        if not isinstance(prompt, str):  # chat messages, validated when the data was read
            if template != "chat":
                raise ValueError(f"data.template={template!r} needs string prompts; column {prompt_column!r} holds "
                                 "chat messages (use data.template='chat')")
            return render_messages(prompt, tokenizer=tokenizer)
        return TEMPLATES[template](prompt, system_prompt=system_prompt, tokenizer=tokenizer)
    messages = COMPACT_MESSAGES if template == "compact" else USER_MESSAGES  # compact: the bare problem
    if task not in messages:
        raise ValueError(f"render_prompt: unknown task {task!r} for data.template={template!r}; known tasks: "
                         f"{sorted(messages)} and {PROMPT_TASK!r} (a prompt column)")
    return TEMPLATES[template](messages[task](row), system_prompt=system_prompt, tokenizer=tokenizer)
