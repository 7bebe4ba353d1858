"""Why a sandbox's guest did not start: its exit, or its silence and what the host can still see
of its stdout, and the tail of what it (or bwrap, runsc) wrote on stderr, bounded.

Knows processes, pipes and asyncio; nothing of backends or the frame protocol. The guest client
(``guest_client``) calls these when a start fails, before it destroys the sandbox.
"""

from __future__ import annotations

import asyncio
import os
import select
import subprocess
import time

TAIL_LINES, TAIL_CHARS = 20, 2048  # what an error quotes of a stderr


def bounded_tail(data: bytes, *, max_lines: int = TAIL_LINES, max_chars: int = TAIL_CHARS) -> str:
    """The end of a process's stderr as text: at most ``max_lines`` lines and ``max_chars``."""
    lines = data.decode(errors="replace").strip().splitlines()[-max_lines:]
    return "\n".join(lines)[-max_chars:]


async def exit_reason(process: subprocess.Popen, cause: str, *, wait_s: float) -> str:
    """``cause`` (the guest's stdout ended) with its exit status, once it has one: the pipe
    closes a moment before the process exits."""
    give_up = time.monotonic() + wait_s
    while process.poll() is None and time.monotonic() < give_up:
        await asyncio.sleep(0.002)
    if process.returncode is None or "exit status" in cause:
        return cause
    return f"{cause}; exit status {process.returncode}"


def silence_reason(process: subprocess.Popen, out_fd: int, out_inode: int, timeout_s: float) -> str:
    """Why no hello came within ``timeout_s``: the process's state, and whether the host's end
    of its stdout was lost (closed or reused by someone else) or holds data the event loop
    never reported (its registration was lost)."""
    code = process.poll()
    reason = f"the guest did not say it was ready within {timeout_s:g} s"
    reason += f" (exit status {code})" if code is not None else " (it was still running)"
    try:
        if os.fstat(out_fd).st_ino != out_inode:
            return f"{reason}; its stdout's descriptor now names another file (closed by someone else)"
    except OSError:
        return f"{reason}; its stdout's descriptor was closed by someone else"
    poller = select.poll()
    poller.register(out_fd, select.POLLIN)
    if any(events & select.POLLIN for _, events in poller.poll(0)):
        reason += "; its stdout had data the event loop never reported"
    return reason
