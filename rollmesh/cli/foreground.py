"""Run something in the foreground until SIGINT or SIGTERM: start it, say it is ready, stop it.

Knows asyncio and signals; not what is being run (``up --foreground`` runs a mesh, ``serve`` the
inference service). A stop asked for while starting gives up on the start; whatever happens, the
stop function runs.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable
from typing import TypeVar

from rollmesh.cli.errors import EXIT_OK

T = TypeVar("T")


async def run_until_signalled(
    start: Callable[[], Awaitable[T]],
    stop: Callable[[], Awaitable[None]],
    *,
    ready: Callable[[T], str],
    gave_up: str,
    stopping: str,
    stopped: str,
) -> int:
    """Print ``ready(started)`` once up, ``stopping`` on a signal, ``stopped`` at the end."""
    loop = asyncio.get_running_loop()
    stop_requested = asyncio.Event()

    def handle_stop_signals() -> None:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop_requested.set)

    handle_stop_signals()
    try:
        starting = asyncio.ensure_future(start())
        waiting = asyncio.ensure_future(stop_requested.wait())
        await asyncio.wait({starting, waiting}, return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():  # asked to stop while starting: give up on the start
            starting.cancel()
            await asyncio.gather(starting, return_exceptions=True)
            print(gave_up, flush=True)
            return EXIT_OK
        started = starting.result()
        # ray.init installs its own SIGTERM handler (it exits at once): take the signals back.
        handle_stop_signals()
        print(ready(started), flush=True)
        await waiting
        print(stopping, flush=True)
        return EXIT_OK
    finally:
        await stop()
        print(stopped, flush=True)
