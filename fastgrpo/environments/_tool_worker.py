"""A tool worker process: the worker sandbox's protocol (:mod:`fastgrpo.runtime.worker`), running tools.

    python -m fastgrpo.environments._tool_worker FD PARENT_PID

Started by :class:`fastgrpo.environments.tools.ToolPool` (a :class:`fastgrpo.runtime.sandbox.WorkerPool`), which
gives every call a deadline and kills and replaces a worker past it. Tools (``path/to/file.py:function`` or
``module:qualname``) are imported once; all are reported as not async (an async tool is awaited here, one call per
job). A call is ``(i, arguments, max_chars)``; its result is ``(text, [])``, the tool's output as text (its printed
output, then its return value, cut to ``max_chars``), or a CallFailure.

Nothing a tool does ends this process's loop: exceptions (SystemExit included) are failures, printed output is
captured (at most ``max_chars`` of it is kept, so a tool that prints 10 MB costs the time to print, not the memory),
and a return value that cannot become text is a ``bad_output`` failure. Async tools are awaited here.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import sys
import traceback
from typing import Any

from fastgrpo.environments.tools import cut
from fastgrpo.runtime.plugins import resolve
from fastgrpo.runtime.sandbox import CallFailure
from fastgrpo.runtime.worker import Load, Run, serve


class _Bounded:
    """A text stream that keeps the first ``limit`` characters written and counts the rest."""

    def __init__(self, limit: int) -> None:
        self.limit, self.parts, self.kept, self.dropped = limit, [], 0, 0

    def write(self, text: str) -> int:
        text = str(text)
        room = self.limit - self.kept
        if room > 0:
            self.parts.append(text[:room])
            self.kept += min(room, len(text))
        self.dropped += max(0, len(text) - max(room, 0))
        return len(text)

    def flush(self) -> None:
        pass

    def text(self) -> str:
        return "".join(self.parts)


def as_tool_text(value: Any) -> str:
    """A tool's return value as the tool message's text: strings as they are, JSON for JSON data, else ``str``;
    ValueError when it has no usable text (``str`` raises or returns a non-string)."""
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    try:
        return json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        pass
    text = str(value)
    if not isinstance(text, str):
        raise ValueError(f"str() of the {type(value).__name__} it returned is not text")
    return text


def run_tool(fn: Any, arguments: dict[str, Any], max_chars: int, loop: asyncio.AbstractEventLoop,
             catch: tuple[type[BaseException], ...] = (BaseException,)) -> str:
    """Call one tool with its printed output captured; the text of the tool message (at most ``max_chars``).
    Raises CallFailure for an exception or a return value that is not text."""
    printed = _Bounded(max_chars)
    try:
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
            out = fn(**arguments)
            if inspect.isawaitable(out):
                out = loop.run_until_complete(_await(out))
    except catch as e:
        raise CallFailure("exception", cut(f"{type(e).__name__}: {e}", max_chars), traceback.format_exc()[-4000:]) \
            from None
    try:
        text = as_tool_text(out)
    except catch as e:
        raise CallFailure("bad_output", cut(f"returned a value with no text: {type(e).__name__}: {e}", max_chars)) \
            from None
    whole = printed.text() + text  # what was printed (its first max_chars characters), then the return value
    return cut(whole, max_chars, total=len(whole) + printed.dropped)


async def _await(awaitable: Any) -> Any:
    return await awaitable


def _handlers() -> tuple[Load, Run]:
    loop = asyncio.new_event_loop()
    tools: list[Any] = []

    def load(specs: list[str]) -> list[bool]:
        tools[:] = [resolve(s, what=f"tool {s!r}", catch=(BaseException,)) for s in specs]
        return [False] * len(tools)

    def run(calls: list, timeout_s: float) -> list:
        (i, arguments, max_chars), = calls
        try:
            return [(run_tool(tools[i], arguments, max_chars, loop), [])]
        except CallFailure as f:
            return [f]

    return load, run


def main(argv: list[str]) -> None:
    serve(argv, _handlers)


if __name__ == "__main__":
    main(sys.argv[1:])
