"""Host memory: keep freed tensor memory from staying resident in glibc's malloc heaps (Linux).

Torch's CPU allocator takes every tensor from malloc. glibc serves an allocation below its mmap threshold from a
heap, and keeps freed heap memory for later requests instead of returning it; the threshold starts at 128 KiB and,
each time a mapped block is freed, rises to that block's size (up to 32 MiB). After one training step nearly every
activation and gradient of a small model (a few MiB each) comes from the heaps, and their mix of sizes and
lifetimes fragments them. On the 108M-style benchmark model (benchmarks/RESULTS.md) malloc held 2.05 GB of freed
memory at the peak, 42% of the peak RSS of 4.90 GB.

A fixed threshold (``mallopt(M_MMAP_THRESHOLD)``, which also turns the rising threshold off) sends every
allocation of at least that size to its own mapping, returned to the system when the tensor is freed; the heaps
then hold small objects only. The cost is page faults on each new mapping, small next to the arithmetic that fills
such a tensor (measured in benchmarks/RESULTS.md).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

__all__ = ["MMAP_THRESHOLD_ENV", "set_malloc_mmap_threshold"]

MMAP_THRESHOLD_ENV = "MALLOC_MMAP_THRESHOLD_"
"""glibc's own environment variable for the threshold: when set, the user's value stands."""

_M_MMAP_THRESHOLD = -3  # mallopt parameter number (malloc.h)
_MAX_THRESHOLD = 32 << 20  # glibc's HEAP_MAX / DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: larger values are refused


def _glibc():
    """The C library when it is glibc (mallopt exists and means glibc's malloc), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018 (musl and others lack it)
        return libc
    except (OSError, AttributeError):
        return None


def set_malloc_mmap_threshold(nbytes: int) -> bool:
    """Serve malloc requests of at least ``nbytes`` from their own mappings, process-wide (see the module docstring).

    Returns True when it was set; False (and nothing changes) for ``nbytes`` 0, off glibc, or when the environment
    already sets ``MALLOC_MMAP_THRESHOLD_`` (glibc applied the user's value at start). Raises ValueError for a value
    glibc would refuse."""
    if nbytes < 0 or nbytes > _MAX_THRESHOLD:
        raise ValueError(f"malloc_mmap_threshold: must be in [0, {_MAX_THRESHOLD}] bytes, got {nbytes}")
    if nbytes == 0 or MMAP_THRESHOLD_ENV in os.environ:
        return False
    libc = _glibc()
    return bool(libc is not None and libc.mallopt(_M_MMAP_THRESHOLD, int(nbytes)))
