"""The host's end of a sandbox guest's pipes: frames written with backpressure, frames read and
handed to the ``Call`` of their request id, the tail of the guest's stderr kept, and the guest's
death noticed and told to every open call.

Knows asyncio, the frame codec and processes; nothing of the ``Sandbox`` protocol's operations
(``guest_client.GuestSandbox`` builds exec and transfers on these) nor of backends. Everything read
from the guest is untrusted: code in the sandbox runs as the guest's uid, so the reader bounds every
frame, and a pipe that stops making sense counts as a dead sandbox.

Latency matters (a tool call is one exec round trip): the pipes are plain non-blocking fds on
the event loop (``add_reader``), no asyncio transports or threads, and 1 MiB large so a 1 MiB
upload is one write.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import subprocess
from collections.abc import Callable

from rollmesh.sandbox import guest_wire as wire
from rollmesh.sandbox.errors import SandboxDiedError
from rollmesh.sandbox.guest_calls import Call, error_from_frame
from rollmesh.sandbox.guest_start import bounded_tail
from rollmesh.sandbox.sandbox_protocol import SandboxInfo

F_SETPIPE_SZ = 1031
PIPE_SIZE = 1024 * 1024
MAX_REPLY_PAYLOAD = wire.CHUNK + 64 * 1024  # the guest never sends more in one frame
STDERR_TAIL = 4096  # bytes of the guest's stderr kept (an error quotes less: guest_start)
DIED = object()  # pushed to every open call when the sandbox dies


class GuestPipes:
    """The pipes of one guest process, multiplexed by request id. ``GuestSandbox`` is one."""

    def __init__(
        self,
        info: SandboxInfo,
        process: subprocess.Popen,
        *,
        oom_kills: Callable[[], int] | None = None,
    ) -> None:
        self.info = info
        self._process = process
        self._oom_kills = oom_kills
        self._loop = asyncio.get_running_loop()
        self._reader = wire.FrameReader(MAX_REPLY_PAYLOAD, reuse=True)
        assert process.stdin is not None and process.stdout is not None and process.stderr is not None
        self._in_fd, self._out_fd, self._err_fd = process.stdin.fileno(), process.stdout.fileno(), process.stderr.fileno()
        self._out_inode = os.fstat(self._out_fd).st_ino  # to tell if the fd was closed under us
        self._writer = wire.FrameWriter(self._in_fd)
        self._calls: dict[int, Call] = {0: Call()}  # id 0: the guest's "ready" hello
        self._next_id = 1
        self._drain_waiters: list[tuple[int, asyncio.Future]] = []
        self._writing = False  # the loop watches stdin for room: changed only when that changes
        self._stderr_tail = bytearray()
        self._dead_cause = ""  # why the guest is gone, without its stderr
        self._dead_reason = ""  # the same with the tail of its stderr
        self._destroyed = False  # set by the owner's teardown: the backend's oom count may be gone
        for fd in (self._in_fd, self._out_fd, self._err_fd):
            os.set_blocking(fd, False)
        for fd in (self._in_fd, self._out_fd):
            try:
                fcntl.fcntl(fd, F_SETPIPE_SZ, PIPE_SIZE)
            except OSError:
                pass  # over the per-user pipe budget: still correct, only slower
        self._loop.add_reader(self._out_fd, self._on_readable)
        self._loop.add_reader(self._err_fd, self._on_stderr)

    def stderr_tail(self) -> str:
        """The last lines the guest (or bwrap, runsc) wrote on stderr, bounded."""
        return bounded_tail(bytes(self._stderr_tail))

    def _on_readable(self) -> None:
        try:
            frames = self._reader.read(self._out_fd)
        except BlockingIOError:
            return
        except EOFError:
            self._mark_dead("the guest exited")
            return
        except (wire.WireError, OSError) as exc:
            self._mark_dead(f"the guest's pipe broke: {exc}")
            return
        for header, payload in frames:
            call = self._calls.get(header.get("id", 0) if header.get("t") != "ready" else 0)
            if call is not None:  # else: a call cancelled while its reply was on the way
                # A large payload is a view of the reader's scratch buffer: the one copy it gets
                # (the bytes the caller receives) is made here, before the next read.
                call.push((header, payload if isinstance(payload, bytes) else bytes(payload)))

    def _on_stderr(self) -> bool:
        """Keep the tail of what the guest (or bwrap, runsc) says on stderr; False at its end."""
        try:
            data = os.read(self._err_fd, 65536)
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            data = b""
        if not data:
            self._loop.remove_reader(self._err_fd)
            return False
        self._stderr_tail += data
        del self._stderr_tail[:-STDERR_TAIL]
        return True

    def _on_writable(self) -> None:
        self._flush()

    def _flush(self) -> None:
        try:
            done = self._writer.flush()
        except OSError as exc:  # BrokenPipeError: the guest is gone
            self._mark_dead(f"cannot write to the guest: {exc}")
            return
        if done:
            if self._writing:
                self._loop.remove_writer(self._in_fd)
                self._writing = False
        elif not self._writing:
            self._loop.add_writer(self._in_fd, self._on_writable)
            self._writing = True
        if self._drain_waiters:
            waiting = []
            for level, waiter in self._drain_waiters:
                if self._writer.pending > level:
                    waiting.append((level, waiter))
                elif not waiter.done():
                    waiter.set_result(None)
            self._drain_waiters = waiting

    def _send(self, header: dict[str, object], payload: bytes | memoryview = b"") -> None:
        if self._dead_reason:
            return  # the guest is gone; after destroy its fd number may belong to another pipe
        self._writer.send(header, payload)
        self._flush()

    async def _wait_drained(self, level: int) -> None:
        """Until at most ``level`` bytes are still waiting for the pipe."""
        while self._writer.pending > level and not self._dead_reason:
            waiter = self._loop.create_future()
            self._drain_waiters.append((level, waiter))
            await waiter

    def _mark_dead(self, reason: str) -> None:
        if self._dead_reason:
            return
        if self._oom_kills is not None and not self._destroyed:
            try:
                if self._oom_kills() > 0:
                    reason += " (the memory limit killed a process in this sandbox)"
            except OSError:
                pass
        code = self._process.poll()
        if code is not None:
            reason += f"; exit status {code}"
        for _ in range(16):  # what it said last (why it died) may still be in the pipe
            if not self._on_stderr():
                break
        tail = self.stderr_tail()
        self._dead_cause = reason
        self._dead_reason = f"{reason}: {tail}" if tail else reason
        self._unwatch_pipes()
        for call in self._calls.values():
            call.push(DIED)
        for _, waiter in self._drain_waiters:
            if not waiter.done():
                waiter.set_result(None)

    def _unwatch_pipes(self) -> None:
        """Take the pipes off the event loop. Before they are closed, always: a closed fd left
        registered makes the loop ignore whatever pipe reuses its number next (another
        sandbox's, whose hello would then never be read)."""
        for fd in (self._out_fd, self._err_fd):
            self._loop.remove_reader(fd)
        self._loop.remove_writer(self._in_fd)
        self._writing = False

    def _open(self) -> tuple[int, Call]:
        if self._dead_reason:
            raise SandboxDiedError("the sandbox is gone", backend=self.info.backend,
                                   sandbox_id=self.info.sandbox_id, reason=self._dead_reason)
        rid = self._next_id
        self._next_id += 1
        call = self._calls[rid] = Call()
        return rid, call

    def _died(self) -> SandboxDiedError:
        return SandboxDiedError("the sandbox died", backend=self.info.backend,
                                sandbox_id=self.info.sandbox_id, reason=self._dead_reason)

    def _raise_for(self, frame: object) -> dict:
        """The header of an answer frame; raises what an error frame (or death) means."""
        if frame is DIED:
            raise self._died()
        header = frame[0]  # type: ignore[index]
        if header.get("t") != "error":
            return header
        raise error_from_frame(header, backend=self.info.backend)
