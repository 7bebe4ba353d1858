"""Answers from a sandbox's guest: the frames that arrive for one request id, and what an error
frame means as a typed error.

Knows asyncio and the sandbox errors; the host's end of the guest's pipes (``guest_pipes``) hands
each frame to the ``Call`` of its request id.
"""

from __future__ import annotations

import asyncio
from collections import deque

from rollmesh.sandbox.errors import (
    BackendFailedError,
    ChecksumMismatchError,
    SandboxError,
    TransferError,
    UnsafeArchiveError,
    WorkspacePathError,
)


class Call:
    """The frames that arrived for one request id, and whoever waits for the next."""

    __slots__ = ("frames", "waiter")

    def __init__(self) -> None:
        self.frames: deque = deque()
        self.waiter: asyncio.Future | None = None

    def push(self, frame: object) -> None:
        self.frames.append(frame)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def next(self, timeout_s: float | None = None) -> object:
        """The next frame; asyncio.TimeoutError after ``timeout_s`` without one."""
        while not self.frames:
            loop = asyncio.get_running_loop()
            waiter = self.waiter = loop.create_future()
            timer = None if timeout_s is None else loop.call_later(timeout_s, expire, waiter)
            try:
                await waiter
            finally:
                if timer is not None:
                    timer.cancel()
        return self.frames.popleft()


def expire(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_exception(asyncio.TimeoutError())


def error_from_frame(header: dict, *, backend: str) -> SandboxError:
    """The typed error a guest's error frame stands for."""
    kind, message = header.get("kind"), str(header.get("message", ""))
    if kind == "workspace_path":
        return WorkspacePathError(message, path=str(header.get("path", "")))
    if kind == "unsafe_archive":
        return UnsafeArchiveError(message, member=str(header.get("member", "")))
    if kind == "transfer":
        return TransferError(message, path=str(header.get("path", "")), reason=str(header.get("reason", "")))
    if kind == "checksum_mismatch":
        return ChecksumMismatchError(message, path=str(header.get("path", "")))
    return BackendFailedError("the guest refused a request", backend=backend, reason=message)
