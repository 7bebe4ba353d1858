"""The host's end of a sandbox: spawns the guest process a backend describes, implements the
``Sandbox`` protocol (exec, transfers, ping) over its pipes (``guest_pipes``), and tears it down.

Knows asyncio, the frame codec and the sandbox protocol; nothing of bubblewrap, cgroups or
leases (a backend hands in the argv and its own ``kill_tree`` / ``cleanup`` / ``oom_kills``).
What the guest answers is untrusted (``guest_pipes`` bounds every frame); sizes and digests of
transfers are checked here.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import os
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from rollmesh.sandbox import guest_wire as wire
from rollmesh.sandbox.errors import (
    BackendFailedError,
    ChecksumMismatchError,
    TransferError,
    WorkspacePathError,
)
from rollmesh.sandbox.guest_pipes import DIED, GuestPipes
from rollmesh.sandbox.guest_start import exit_reason, silence_reason
from rollmesh.sandbox.guest_streams import StreamedUploads
from rollmesh.sandbox.sandbox_protocol import ExecOutcome, FileTransfer, OutputCallback, SandboxInfo

if TYPE_CHECKING:
    from rollmesh.sandbox.bulk_handoff import HandOffTarget

HIGH_WATER = 2 * wire.CHUNK  # a chunked upload waits while this much is still unwritten
ANSWER_GRACE_S = 30.0  # past an exec's timeout: how long the guest may take to report it
# How long a new guest may take to say it is ready: the default of sandbox.start_timeout_s.
# Generous, because a start on a loaded host (namespaces, a Python, page faults) is slow.
START_TIMEOUT_S = 60.0
EXIT_WAIT_S = 5.0


class GuestSandbox(GuestPipes, StreamedUploads):
    """A live sandbox whose guest this object spawned and owns. Use ``launch``."""

    def __init__(
        self,
        info: SandboxInfo,
        process: subprocess.Popen,
        *,
        kill_tree: Callable[[], None] | None = None,
        cleanup: Callable[[], None] | None = None,
        oom_kills: Callable[[], int] | None = None,
        graceful_exit_s: float = 0.0,
    ) -> None:
        super().__init__(info, process, oom_kills=oom_kills)
        self._graceful_exit_s = graceful_exit_s
        self._kill_tree = kill_tree
        self._cleanup = cleanup

    @classmethod
    async def launch(
        cls,
        info: SandboxInfo,
        argv: Sequence[str],
        *,
        env: dict[str, str],
        cwd: str | None = None,
        pass_fds: Sequence[int] = (),
        start_timeout_s: float = START_TIMEOUT_S,
        kill_tree: Callable[[], None] | None = None,
        cleanup: Callable[[], None] | None = None,
        oom_kills: Callable[[], int] | None = None,
        graceful_exit_s: float = 0.0,
        spawn: Callable[..., Awaitable[Any]] | None = None,
    ) -> GuestSandbox:
        """Spawn the guest (``argv``, which already holds every wrapper) and wait up to
        ``start_timeout_s`` for its hello; BackendFailedError (with the tail of what it said on
        stderr) when it exits or stays silent.

        No ``preexec_fn``: the broker runs inside a Ray actor, which has threads. The guest gets
        a session of its own so no signal meant for the broker's group reaches it. ``spawn``
        replaces the fork here (the sandbox supervisor's: ``supervisor_client``); it returns
        what ``subprocess.Popen`` would.
        """
        try:
            process = await (spawn or _spawn)(list(argv), env=env, cwd=cwd, pass_fds=tuple(pass_fds))
        except OSError as exc:
            if cleanup is not None:
                cleanup()
            raise BackendFailedError("could not start the sandbox", backend=info.backend, reason=str(exc),
                                     argv0=str(argv[0])) from exc
        sandbox = cls(info, process, kill_tree=kill_tree, cleanup=cleanup, oom_kills=oom_kills,
                      graceful_exit_s=graceful_exit_s)
        try:
            hello = await sandbox._calls[0].next(start_timeout_s)
        except asyncio.TimeoutError:
            hello = None
        except BaseException:
            await sandbox.destroy()
            raise
        del sandbox._calls[0]
        if hello is DIED or not isinstance(hello, tuple) or hello[0].get("t") != "ready":
            if hello is DIED:
                reason = await exit_reason(process, sandbox._dead_cause, wait_s=EXIT_WAIT_S)
            elif isinstance(hello, tuple):
                reason = "the guest's first message was not its hello"
            else:
                reason = silence_reason(process, sandbox._out_fd, sandbox._out_inode, start_timeout_s)
            await sandbox.destroy()  # reads what is left of its stderr
            raise BackendFailedError("the sandbox did not start", backend=info.backend, reason=reason,
                                     argv0=str(argv[0]), stderr_tail=sandbox.stderr_tail())
        return sandbox

    # ---- Sandbox protocol --------------------------------------------------------------------

    async def exec(
        self,
        argv: list[str] | None = None,
        *,
        shell: str | None = None,
        stdin: bytes = b"",
        timeout_s: float | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        on_output: OutputCallback | None = None,
        key: str = "",
    ) -> ExecOutcome:
        if (argv is None) == (shell is None):
            raise ValueError("exec takes exactly one of argv and shell")
        if argv is not None and (not argv or not all(isinstance(a, str) for a in argv)):
            raise ValueError("argv must be a non-empty list of strings")
        if cwd not in (None, "", "."):
            _relative(str(cwd))
        limit = self.info.limits.exec_timeout_s
        timeout = limit if timeout_s is None else max(0.001, min(float(timeout_s), limit))
        started = time.monotonic()
        oom_before = self._count_oom()
        rid, call = self._open()
        header: dict[str, object] = {"id": rid, "op": "exec", "timeout_s": timeout, "stream": on_output is not None}
        if argv is not None:
            header["argv"] = list(argv)
        else:
            header["shell"] = shell
        if env:
            header["env"] = {str(k): str(v) for k, v in env.items()}
        if cwd not in (None, "", "."):
            header["cwd"] = cwd
        if key:  # a supervisor attaches a second exec with this key to the first (the guest ignores it)
            header["key"] = key
        out, err = bytearray(), bytearray()
        try:
            self._send(header, stdin)
            while True:
                try:
                    frame = await call.next(timeout + ANSWER_GRACE_S)
                except asyncio.TimeoutError:
                    return _outcome("infra_error", out, err, started, detail="the guest did not report the exec")
                if frame is DIED:
                    return _outcome("sandbox_died", out, err, started, detail=self._dead_reason)
                fields = self._raise_for(frame)
                payload = frame[1]  # type: ignore[index]
                if fields.get("t") == "out":
                    (out if fields.get("s") == "stdout" else err).extend(payload)
                    if on_output is not None:
                        maybe = on_output("stdout" if fields.get("s") == "stdout" else "stderr", bytes(payload))
                        if inspect.isawaitable(maybe):
                            await maybe
                    continue
                if fields.get("t") == "done":
                    return self._finish_exec(fields, payload, out, err, oom_before, on_output)
        except BaseException:  # cancelled, or on_output raised: the command must not run on
            if not self._dead_reason:
                self._send({"id": 0, "op": "cancel", "target": rid})
            raise
        finally:
            self._calls.pop(rid, None)

    def _finish_exec(self, fields: dict, payload: bytes, out: bytearray, err: bytearray,
                     oom_before: int | None, on_output: OutputCallback | None) -> ExecOutcome:
        n_stdout = min(int(fields.get("n_stdout") or 0), len(payload))
        out += payload[:n_stdout]
        err += payload[n_stdout:]
        result = str(fields.get("result", "infra_error"))
        exit_code, signum = fields.get("exit_code"), fields.get("signal")
        detail = str(fields.get("detail", ""))
        killed = signum == signal.SIGKILL or (result == "exit" and exit_code == 128 + signal.SIGKILL)
        if result in ("signal", "exit") and killed and oom_before is not None:
            if (self._count_oom() or 0) > oom_before:
                result, exit_code, signum = "oom", None, int(signal.SIGKILL)
                detail = "the sandbox's memory limit killed it"
        return ExecOutcome(
            result=result,  # type: ignore[arg-type]
            exit_code=exit_code if isinstance(exit_code, int) else None,
            signal=signum if isinstance(signum, int) else None,
            truncated=bool(fields.get("truncated")),
            stdout=bytes(out),
            stderr=bytes(err),
            duration_s=float(fields.get("duration_s") or 0.0),
            cpu_s=float(fields.get("cpu_s") or 0.0),
            detail=detail,
        )

    def _count_oom(self) -> int | None:
        if self._oom_kills is None:
            return None
        try:
            return self._oom_kills()
        except OSError:
            return None

    async def put_file(self, path: str, data: bytes, *, mode: int = 0o644,
                       expected_sha256: str | None = None, verify: bool = True) -> FileTransfer:
        return await self._upload("put_file", path, data, {"mode": int(mode)}, expected_sha256=expected_sha256,
                                  verify=verify)

    async def put_tar(self, path: str, tar_bytes: bytes, *, expected_sha256: str | None = None,
                      verify: bool = True) -> FileTransfer:
        return await self._upload("put_tar", path, tar_bytes, {}, allow_root=True,
                                  expected_sha256=expected_sha256, verify=verify)

    async def get_file(self, path: str, *, verify: bool = True) -> tuple[bytes, FileTransfer]:
        return await self._download("get_file", path, verify=verify)

    async def get_tar(self, path: str, *, verify: bool = True) -> tuple[bytes, FileTransfer]:
        return await self._download("get_tar", path, allow_root=True, verify=verify)

    async def _upload(self, op: str, path: str, data: bytes, extra: dict[str, object],
                      *, allow_root: bool = False, expected_sha256: str | None = None,
                      verify: bool = True) -> FileTransfer:
        """With ``expected_sha256`` (the sender's digest, checked end to end) the guest's digest
        is compared with it and nothing is hashed here; without it we hash our copy, unless
        ``verify=False`` (the caller hands the guest's digest to a sender that checks it)."""
        rel = _relative(path, allow_root=allow_root)
        view = memoryview(data).cast("B")
        rid, call = self._open()
        hasher = hashlib.sha256() if expected_sha256 is None and verify else None
        try:
            first = view[:wire.CHUNK]
            expect = {} if expected_sha256 is None else {"sha256": expected_sha256}
            self._send({"id": rid, "op": op, "path": rel, "size": len(view), "last": len(view) <= wire.CHUNK,
                        **expect, **extra}, first)
            # Hash our copy while the guest stores (and hashes) its own; but first let the pipe
            # take the frame, else the guest would wait for its tail while we hash.
            await self._wait_drained(0 if len(view) <= wire.CHUNK else HIGH_WATER)
            if hasher is not None:
                await _hash(hasher, first)
            for start in range(wire.CHUNK, len(view), wire.CHUNK):
                await self._wait_drained(HIGH_WATER)
                if call.frames:  # refused early (a bad path, a full disk): stop sending
                    self._send({"id": rid, "op": "chunk", "last": True, "abort": True})
                    break
                chunk = view[start:start + wire.CHUNK]
                self._send({"id": rid, "op": "chunk", "last": start + wire.CHUNK >= len(view)}, chunk)
                if hasher is not None:
                    await _hash(hasher, chunk)
            fields = self._raise_for(await call.next())
        finally:
            self._calls.pop(rid, None)
        transfer = FileTransfer(path=rel, size=int(fields.get("size", -1)), sha256=str(fields.get("sha256", "")))
        if transfer.size != len(view):
            raise TransferError("the sandbox stored different bytes", path=rel, reason="size mismatch")
        expected = expected_sha256 if hasher is None else hasher.hexdigest()
        if expected is not None and transfer.sha256 != expected:
            raise ChecksumMismatchError(f"the sandbox stored {rel!r} with sha256 {transfer.sha256}, "
                                        f"not {expected}", path=rel)
        return transfer

    async def _download(self, op: str, path: str, *, allow_root: bool = False,
                        verify: bool = True) -> tuple[bytes, FileTransfer]:
        """``verify=False`` when the bytes go on to a receiver that checks the guest's digest
        itself (end to end), so they are not hashed twice."""
        rel = _relative(path, allow_root=allow_root)
        rid, call = self._open()
        hasher = hashlib.sha256() if verify else None
        parts: list[bytes | bytearray] = []
        try:
            self._send({"id": rid, "op": op, "path": rel})
            while True:
                frame = await call.next()
                fields = self._raise_for(frame)
                payload = frame[1]  # type: ignore[index]
                if len(payload):
                    parts.append(payload)
                    if hasher is not None:
                        await _hash(hasher, payload)
                if fields.get("t") == "ok":
                    break
        finally:
            self._calls.pop(rid, None)
        data = parts[0] if len(parts) == 1 and isinstance(parts[0], bytes) else b"".join(parts)
        transfer = FileTransfer(path=rel, size=int(fields.get("size", -1)), sha256=str(fields.get("sha256", "")))
        if transfer.size != len(data) or (hasher is not None and transfer.sha256 != hasher.hexdigest()):
            raise TransferError("the bytes read differ from what the sandbox sent", path=rel,
                                reason="size or sha256 mismatch")
        return data, transfer

    async def ping(self) -> float:
        """One round trip to the guest, in seconds."""
        started = time.perf_counter()
        rid, call = self._open()
        try:
            self._send({"id": rid, "op": "ping"})
            self._raise_for(await call.next())
        finally:
            self._calls.pop(rid, None)
        return time.perf_counter() - started

    def hand_off_target(self) -> HandOffTarget | None:
        """Where a bulk upload's client socket can be handed so its bytes skip the broker (the
        supervisor holding this sandbox); None when this broker's own child is the guest."""
        hand_off = getattr(self._process, "hand_off_target", None)
        return None if hand_off is None else hand_off(self.info.backend)

    def alive(self) -> bool:
        return not self._dead_reason and self._process.poll() is None

    async def destroy(self) -> None:
        """Kill the whole process tree and remove what the backend made for it. Idempotent."""
        if self._destroyed:
            return
        self._destroyed = True
        self._mark_dead("the sandbox was destroyed")
        self._unwatch_pipes()
        try:
            self._process.stdin.close()  # type: ignore[union-attr]  # the guest kills its commands and exits
        except OSError:
            pass
        give_up = time.monotonic() + self._graceful_exit_s
        while self._process.poll() is None and time.monotonic() < give_up:
            await asyncio.sleep(0.002)
        if self._kill_tree is not None:
            # Killing a cgroup waits for its processes to be gone: in a thread, so the broker's
            # event loop serves other sandboxes meanwhile (one release blocked every lease before).
            await asyncio.to_thread(self._kill_tree)
        elif self._process.poll() is None:
            # Only while it is unreaped: a reaped pid (and group id) may already be another's.
            try:
                os.killpg(self._process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        give_up = time.monotonic() + EXIT_WAIT_S
        while self._process.poll() is None and time.monotonic() < give_up:
            await asyncio.sleep(0.002)
        for pipe in (self._process.stdout, self._process.stderr):
            if pipe is not None:
                pipe.close()
        if self._cleanup is not None:
            await asyncio.to_thread(self._cleanup)  # removing a cgroup retries while it drains


async def _spawn(argv: list[str], *, env: dict[str, str], cwd: str | None, pass_fds: tuple[int, ...]) -> subprocess.Popen:
    """Start the guest in its own session. The fork and exec run in a thread: on a busy host
    they take milliseconds, and the broker's event loop serves every other sandbox meanwhile.
    Cancelled while the thread runs, the process it started is killed once it exists."""
    spawning = asyncio.ensure_future(asyncio.to_thread(
        subprocess.Popen, argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env=env, cwd=cwd, pass_fds=pass_fds, start_new_session=True, bufsize=0))
    try:
        return await asyncio.shield(spawning)
    except asyncio.CancelledError:
        spawning.add_done_callback(_kill_orphan)
        raise


def _kill_orphan(spawning: asyncio.Future) -> None:
    if spawning.cancelled() or spawning.exception() is not None:
        return
    process: subprocess.Popen = spawning.result()
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    process.wait()
    for pipe in (process.stdin, process.stdout, process.stderr):
        if pipe is not None:
            pipe.close()


async def _hash(hasher: hashlib._Hash, data: bytes | bytearray | memoryview) -> None:
    # hashlib drops the GIL on large buffers: hash big chunks in a thread so the event loop
    # (other sandboxes' pipes) keeps going. Small ones are cheaper inline.
    if len(data) > 1024 * 1024:
        await asyncio.to_thread(hasher.update, data)
    else:
        hasher.update(data)


def _relative(path: str, *, allow_root: bool = False) -> str:
    try:
        return wire.workspace_relative(path, allow_root=allow_root)
    except ValueError as exc:
        raise WorkspacePathError(f"path {path!r} refused: {exc}", path=str(path)) from None


def _outcome(result: str, out: bytearray, err: bytearray, started: float, *, detail: str) -> ExecOutcome:
    return ExecOutcome(result=result, exit_code=None, signal=None, truncated=False,  # type: ignore[arg-type]
                       stdout=bytes(out), stderr=bytes(err), duration_s=time.monotonic() - started, detail=detail)

