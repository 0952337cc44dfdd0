"""Timing helper shared by the reward tests' bounded-time checks."""

import math
import time


def timed(fn, *args) -> tuple[object, float]:
    """Result and the best of 3 wall times after a warm-up call.

    Best-of-3 keeps a busy CI core from failing the test, while a super-linear or unbounded path (which is
    slow every time) still fails it.
    """
    result = fn(*args)
    best = math.inf
    for _ in range(3):
        t0 = time.perf_counter()
        fn(*args)
        best = min(best, time.perf_counter() - t0)
    return result, best
