"""Waiting, in tests, for what announces itself with no event: a condition checked until it holds,
bounded by a generous timeout that only a broken test reaches (ROLLMESH_TEST_WAIT_S, default 60 s,
raises it on a slow machine). Where the code under test does set an event, wait on that instead.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable

WAIT_S = float(os.environ.get("ROLLMESH_TEST_WAIT_S", "60"))


async def wait_until(condition: Callable[[], object], what: str, *, timeout_s: float = WAIT_S,
                     interval_s: float = 0.01) -> None:
    """Return once ``condition()`` is truthy; fail naming ``what`` after ``timeout_s``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        if loop.time() >= deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(interval_s)  # polling the condition, not a fixed wait
