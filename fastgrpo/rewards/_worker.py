"""A reward worker process (see :mod:`fastgrpo.rewards.sandbox`, which starts it).

    python -m fastgrpo.rewards._worker FD PARENT_PID

The protocol, start-up and loop are :mod:`fastgrpo.runtime.worker`'s. A call is ``(i, kwargs, n)``: reward function
``i`` on the keyword arguments of ``n`` completions; its result is ``(values, bad)`` of
:func:`fastgrpo.rewards.calls.to_values` or a CallFailure. A job of several calls holds async functions only,
awaited concurrently on this worker's event loop. Everything a reward function raises (SystemExit included) is a
failure of its call.
"""

from __future__ import annotations

import asyncio
import sys

from fastgrpo.runtime.worker import Load, Run, serve


def _handlers() -> tuple[Load, Run]:
    # Imported after the watchdog starts: a parent killed while they load must still take this process with it.
    from fastgrpo.rewards.calls import CallFailure, call, gather, is_async, own_copy
    from fastgrpo.rewards.loader import resolve_spec

    loop = asyncio.new_event_loop()
    funcs: list = []
    everything = (BaseException,)

    def load(specs: list[str]) -> list[bool]:
        funcs[:] = [resolve_spec(s, catch=everything) for s in specs]
        return [is_async(f) for f in funcs]

    def run(calls: list, timeout_s: float) -> list:
        if len(calls) == 1 and not is_async(funcs[calls[0][0]]):
            i, kwargs, n = calls[0]
            try:
                return [call(funcs[i], kwargs, n, catch=everything, loop=loop)]
            except CallFailure as f:
                return [f]
        # the calls' arguments were pickled together and share their lists: all but the first get a copy
        return loop.run_until_complete(gather(
            [(funcs[i], kwargs if j == 0 else own_copy(kwargs), n) for j, (i, kwargs, n) in enumerate(calls)],
            timeout_s, catch=everything))

    return load, run


def main(argv: list[str]) -> None:
    serve(argv, _handlers)


if __name__ == "__main__":
    main(sys.argv[1:])
