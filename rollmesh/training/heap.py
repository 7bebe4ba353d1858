"""Giving freed heap memory back to the operating system after a training step.

Knows ctypes and glibc; nothing of torch. A training step allocates and frees hundreds of MiB of
activations and gradients; glibc keeps freed chunks in its arenas, so a long-lived trainer's RSS
creeps up in jumps though nothing leaks (benchmarks/soak.py showed the trainer growing 47 MiB
early, and the rest of the mesh 1-4 MiB). ``malloc_trim(0)`` returns the free pages at the top of
each arena; it costs a few milliseconds. Elsewhere than glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from functools import cache


@cache
def _malloc_trim():
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS)
        return None


def return_freed_memory() -> bool:
    """True when the allocator could give memory back (glibc's ``malloc_trim``)."""
    trim = _malloc_trim()
    return bool(trim is not None and trim(0))
