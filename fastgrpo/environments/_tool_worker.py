"""A tool worker process: the reward sandbox's worker protocol (:mod:`fastgrpo.rewards._worker`), running tools.

    python -m fastgrpo.environments._tool_worker FD PARENT_PID

Started by :class:`fastgrpo.environments.tools.ToolPool` (a :class:`fastgrpo.rewards.sandbox.WorkerPool`), which
gives every call a deadline and kills and replaces a worker past it. Messages:

- ``("load", specs)`` -> ``("importing",)``, then ``("loaded", [False, ...])`` or ``("load_error", message)``:
  import each tool (``path/to/file.py:function`` or ``module:qualname``) once;
- ``("call", [(i, arguments, max_chars)], timeout_s, call_id)`` -> ``("done", [result], call_id, pid)``:
  ``("ok", text, [])`` with the tool's output as text (its printed output, then its return value, cut to
  ``max_chars``), or ``("fail", kind, message, traceback)``. A process the tool forked ends instead of answering.

Nothing a tool does ends this process's loop: exceptions (SystemExit included) are failures, printed output is
captured (at most ``max_chars`` of it is kept, so a tool that prints 10 MB costs the time to print, not the memory),
and a return value that cannot become text is a ``bad_output`` failure. Async tools are awaited here.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import os
import sys
import traceback
from typing import Any

from fastgrpo.environments.tools import cut


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
    from fastgrpo.rewards.calls import CallFailure

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


def main(argv: list[str]) -> None:
    from fastgrpo.rewards._worker import answer, start_worker

    conn = start_worker(argv)
    me = os.getpid()
    # Imported after the watchdog starts, as in the reward worker.
    from fastgrpo.rewards.calls import CallFailure
    from fastgrpo.rewards.loader import resolve_spec

    loop = asyncio.new_event_loop()
    tools: list[Any] = []
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg[0] == "load":
            conn.send(("importing",))
            try:
                tools = [resolve_spec(s, catch=(BaseException,)) for s in msg[1]]
            except ValueError as e:
                conn.send(("load_error", str(e)))
                continue
            conn.send(("loaded", [False] * len(tools)))  # async tools are awaited here, one call per job
        elif msg[0] == "call":
            (i, arguments, max_chars), = msg[1]
            call_id = msg[3]
            try:
                out = [("ok", run_tool(tools[i], arguments, max_chars, loop), [])]
            except CallFailure as f:
                out = [("fail", f.kind, f.message, f.tb)]
            try:
                answer(conn, out, call_id, me)
            except (BrokenPipeError, OSError):
                return


if __name__ == "__main__":
    main(sys.argv[1:])
