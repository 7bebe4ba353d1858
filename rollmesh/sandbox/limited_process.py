"""Runs one subprocess under a wall-clock limit, an address-space limit and an output cap.

Knows asyncio subprocesses and POSIX process groups; nothing of isolation (the argv it gets may
already be wrapped in bwrap) and nothing of leases. Hand-rolled rather than ``subprocess.run``
because that blocks the event loop and cannot stop a command when its output passes a cap.
"""

from __future__ import annotations

import asyncio
import os
import resource
import shutil
import signal
import time
from collections.abc import Callable, Sequence
from contextlib import suppress

from rollmesh.sandbox.backend_protocol import ExecResult

# After a kill, how long to wait for the pipes to close. Only a process that left our process
# group (setsid) can hold them longer; we then stop reading rather than hang the caller.
KILL_GRACE_S = 2.0
_CHUNK = 64 * 1024


def memory_limit_launch(memory_limit_mb: int) -> tuple[list[str], Callable[[], None] | None]:
    """An argv prefix (``prlimit``) or, without prlimit, a preexec hook that sets RLIMIT_AS.

    prlimit is preferred: a preexec hook runs Python between fork and exec, which can deadlock
    when other threads exist (Ray's core worker has many).
    """
    limit = memory_limit_mb * 1024 * 1024
    prlimit = shutil.which("prlimit")
    if prlimit:
        return [prlimit, f"--as={limit}", "--core=0", "--"], None

    def set_limits() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    return [], set_limits


class _CappedOutput:
    """stdout and stderr share one byte budget, so the cap also bounds the reply's size."""

    def __init__(self, budget: int, on_overflow: Callable[[], None]) -> None:
        self.room = budget
        self.stdout = bytearray()
        self.stderr = bytearray()
        self.truncated = False
        self._on_overflow = on_overflow

    async def drain(self, reader: asyncio.StreamReader, sink: bytearray) -> None:
        # Keep reading after the cap (and discard): a paused pipe never reports EOF, and the
        # process is only reaped once every pipe has closed.
        while chunk := await reader.read(_CHUNK):
            if self.truncated:
                continue
            if len(chunk) > self.room:
                sink += chunk[: self.room]
                self.room = 0
                self.truncated = True
                self._on_overflow()
                continue
            sink += chunk
            self.room -= len(chunk)


async def _feed(writer: asyncio.StreamWriter, data: bytes) -> None:
    try:
        if data:
            writer.write(data)
            await writer.drain()
    except (BrokenPipeError, ConnectionResetError):
        pass  # the command exited without reading all of its stdin: its business
    finally:
        writer.close()


def _kill_group(pgid: int) -> None:
    # The group id cannot be recycled while any member lives, so this reaches stragglers even
    # after the leader has exited.
    with suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _shell_exit_code(returncode: int | None) -> int:
    if returncode is None:
        return 128 + signal.SIGKILL
    return 128 - returncode if returncode < 0 else returncode


async def run_limited(
    argv: Sequence[str],
    *,
    env: dict[str, str],
    cwd: str,
    stdin: bytes,
    timeout_s: float,
    max_output_bytes: int,
    memory_limit_mb: int,
    pass_fds: Sequence[int] = (),
) -> ExecResult:
    """Run ``argv`` in a new session and process group, which is killed when the call ends:
    at the timeout, at output overflow, on cancellation, and after a normal exit (stragglers).

    Raises OSError when the process cannot be started at all.
    """
    prefix, preexec = memory_limit_launch(memory_limit_mb)
    started = time.monotonic()
    spawning = asyncio.ensure_future(
        asyncio.create_subprocess_exec(
            *prefix,
            *argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
            cwd=cwd,
            start_new_session=True,
            preexec_fn=preexec,
            pass_fds=tuple(pass_fds),
        )
    )
    try:
        proc = await asyncio.shield(spawning)
    except asyncio.CancelledError:
        # Cancelled while starting: asyncio would kill only the leader, and a child that bwrap
        # has just forked can outlive it. Let the start finish, then kill the whole group.
        with suppress(Exception):
            late = await spawning
            _kill_group(late.pid)
            await asyncio.wait_for(late.wait(), KILL_GRACE_S)
        raise

    def kill_group() -> None:
        _kill_group(proc.pid)

    output = _CappedOutput(max_output_bytes, kill_group)
    assert proc.stdout is not None and proc.stderr is not None and proc.stdin is not None
    helpers = [
        asyncio.create_task(output.drain(proc.stdout, output.stdout)),
        asyncio.create_task(output.drain(proc.stderr, output.stderr)),
        asyncio.create_task(_feed(proc.stdin, stdin)),
    ]
    waiter = asyncio.create_task(proc.wait())
    try:
        done, _ = await asyncio.wait({waiter}, timeout=timeout_s)
        timed_out = not done
        if timed_out:
            kill_group()
        await asyncio.wait({waiter, *helpers}, timeout=KILL_GRACE_S)
    finally:
        # Also reached when our caller is cancelled. A command's whole group ends with it, on
        # every backend, so background children never outlive the call (bwrap's do anyway).
        kill_group()
        for task in (waiter, *helpers):
            task.cancel()
        await asyncio.gather(waiter, *helpers, return_exceptions=True)

    return ExecResult(
        exit_code=_shell_exit_code(proc.returncode),
        stdout=output.stdout.decode("utf-8", errors="replace"),
        stderr=output.stderr.decode("utf-8", errors="replace"),
        duration_s=time.monotonic() - started,
        timed_out=timed_out,
        truncated=output.truncated,
    )
