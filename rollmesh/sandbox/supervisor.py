"""The per-node sandbox supervisor: holds the sandboxes' processes so they outlive a broker crash.

Like a container runtime's shim: a small process started detached from the broker (its own
session), which spawns each sandbox's agent (``bwrap ... agent.py`` or a bare ``agent.py``),
keeps its pipes open and relays frames between the agent and whichever broker is attached. It
never runs tool code itself and never decides anything about leases; the broker tells it what to
spawn and when to kill, and keeps the cleanup of cgroups, uids and directories itself (it hands
its uid lock here so the uid stays taken while no broker lives).

Standard library only (run as a script: ``python supervisor.py --run-dir D``). Listens on
``D/sandbox-supervisor.sock`` (mode 0600). Frames are ``agent_wire``'s. A relay rewrites request
ids (each broker connection numbers its own) and stays frame-aligned, so a broker killed
mid-frame leaves the agent's stream intact. An exec that carries ``key`` (the broker's
``exec_id``) is remembered with all its frames until ``--keep-s`` after it ended: an exec sent
again with the same key attaches to it (its frames so far are replayed) instead of running twice.
It exits once it holds no sandbox and no client was connected for ``--idle-exit-s``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import sys
import time

if __package__:
    from rollmesh.sandbox import agent_wire as wire
    from rollmesh.sandbox.supervisor_wire import RunDirPath, recv_frame, send_frame, tune
else:  # run as a script: its own directory is on sys.path
    import agent_wire as wire  # type: ignore[no-redef]
    from supervisor_wire import RunDirPath, recv_frame, send_frame, tune  # type: ignore[no-redef]

TERMINAL = ("done", "ok", "error")  # an agent answer that ends its request
UPLOADS = ("put_file", "put_tar")
HANDSHAKE_TIMEOUT_S = 30.0


class Conn:
    """One attached broker connection to one sandbox: its request ids -> the agent's."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.ids: dict[int, int] = {}
        self.alive = True

    def send(self, header: dict, payload: bytes) -> None:
        if not self.alive:
            return
        try:
            self.writer.write(wire.encode_head(header, len(payload)))
            if payload:
                self.writer.write(payload)
        except (OSError, RuntimeError):
            self.alive = False


class Kept:
    """A keyed exec: every frame the agent sent for it, until ``keep_s`` after it ended."""

    def __init__(self, aid: int) -> None:
        self.aid = aid
        self.frames: list[tuple[dict, bytes]] = []
        self.ended_at: float | None = None


class Held:
    def __init__(self, sandbox_id: str, record: dict, process: asyncio.subprocess.Process,
                 stderr_fd: int, keep_fds: list[int]) -> None:
        self.sandbox_id = sandbox_id
        self.record = record
        self.process = process
        self.stderr_fd = stderr_fd
        self.keep_fds = keep_fds
        self.routes: dict[int, list[tuple[Conn, int]]] = {}
        self.keyed: dict[str, Kept] = {}
        self.kept: dict[int, Kept] = {}
        self.uploads: set[int] = set()
        self.conns: set[Conn] = set()
        self.next_aid = 1
        self.hello: dict | None = None
        self.exit_code: int | None = None
        self.exited = asyncio.Event()

    def new_aid(self) -> int:
        aid = self.next_aid
        self.next_aid += 1
        return aid


class Supervisor:
    def __init__(self, run_dir: str, *, idle_exit_s: float, keep_s: float) -> None:
        self.run_dir = run_dir
        self.idle_exit_s = idle_exit_s
        self.keep_s = keep_s
        self.held: dict[str, Held] = {}
        self.clients = 0
        self.last_client = time.monotonic()
        self.tasks: set[asyncio.Task] = set()

    async def serve(self) -> None:
        path = RunDirPath(self.run_dir)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o077)  # the socket file is born 0600: only the broker's uid connects
        try:
            try:
                os.unlink(path.address)
            except FileNotFoundError:
                pass
            listener.bind(path.address)
        finally:
            os.umask(old_umask)
        os.chmod(path.address, 0o600)
        inode = os.stat(path.address).st_ino
        listener.listen(256)
        listener.setblocking(False)
        loop = asyncio.get_running_loop()
        accepting = asyncio.ensure_future(self._accept(loop, listener))
        try:
            while not self._idle():
                await asyncio.sleep(min(1.0, self.idle_exit_s / 4))
                self._expire_kept()
        finally:
            accepting.cancel()
            try:
                if os.stat(path.address).st_ino == inode:  # not a successor's socket
                    os.unlink(path.address)
            except OSError:
                pass
            listener.close()
            path.close()

    def _idle(self) -> bool:
        if self.held or self.clients:
            self.last_client = time.monotonic() if self.clients else self.last_client
            return False
        return time.monotonic() - self.last_client >= self.idle_exit_s

    def _expire_kept(self) -> None:
        now = time.monotonic()
        for held in self.held.values():
            for key, kept in list(held.keyed.items()):
                if kept.ended_at is not None and now - kept.ended_at > self.keep_s:
                    del held.keyed[key]
                    held.kept.pop(kept.aid, None)

    async def _accept(self, loop: asyncio.AbstractEventLoop, listener: socket.socket) -> None:
        while True:
            sock, _ = await loop.sock_accept(listener)
            task = asyncio.ensure_future(self._client(sock))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _client(self, sock: socket.socket) -> None:
        self.clients += 1
        self.last_client = time.monotonic()
        try:
            sock.setblocking(True)
            sock.settimeout(HANDSHAKE_TIMEOUT_S)
            try:
                header, _payload, fds = await asyncio.to_thread(recv_frame, sock)
            except OSError:
                sock.close()
                return
            op = header.get("op")
            try:
                if op == "spawn":
                    await self._spawn(sock, header, fds)
                elif op == "attach":
                    await self._attach(sock, header)
                elif op == "list":
                    send_frame(sock, {"t": "list", "sandboxes": [
                        {"sandbox_id": h.sandbox_id, "record": h.record, "pid": h.process.pid,
                         "exit_code": h.exit_code} for h in self.held.values()]})
                    sock.close()
                elif op == "destroy":
                    code = await self._destroy(str(header.get("sandbox_id")), float(header.get("graceful_s") or 0))
                    send_frame(sock, {"t": "destroyed", "exit_code": code})
                    sock.close()
                elif op == "status":
                    held = self.held.get(str(header.get("sandbox_id")))
                    send_frame(sock, {"t": "status", "known": held is not None,
                                      "exit_code": None if held is None else held.exit_code})
                    sock.close()
                else:
                    send_frame(sock, {"t": "error", "message": f"unknown op {op!r}"})
                    sock.close()
            except OSError:
                sock.close()
        finally:
            self.clients -= 1
            self.last_client = time.monotonic()

    # -- sandboxes -------------------------------------------------------------------------

    async def _spawn(self, sock: socket.socket, header: dict, fds: list[int]) -> None:
        sandbox_id = str(header["sandbox_id"])
        n_pass = int(header.get("pass_fds", 0))
        pass_fds, keep_fds = fds[:n_pass], fds[n_pass:]
        argv = [str(a) for a in header["argv"]]
        for index, which in header.get("fd_positions", []):
            argv[int(index)] = str(pass_fds[int(which)])  # the broker's fd numbers are not ours
        if sandbox_id in self.held:
            _close(fds)
            send_frame(sock, {"t": "error", "message": f"sandbox {sandbox_id!r} already exists"})
            sock.close()
            return
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        try:
            process = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=err_w,
                env={str(k): str(v) for k, v in (header.get("env") or {}).items()},
                cwd=header.get("cwd") or None, pass_fds=tuple(pass_fds), start_new_session=True,
                limit=wire.CHUNK + 65536)
        except OSError as exc:
            _close([err_r, *keep_fds])
            send_frame(sock, {"t": "error", "message": f"{type(exc).__name__}: {exc}"})
            sock.close()
            return
        finally:
            _close([err_w, *pass_fds])
        held = Held(sandbox_id, dict(header.get("record") or {}), process, err_r, keep_fds)
        self.held[sandbox_id] = held
        reader = asyncio.ensure_future(self._read_agent(held))
        self.tasks.add(reader)
        reader.add_done_callback(self.tasks.discard)
        send_frame(sock, {"t": "spawned", "pid": process.pid}, fds=[err_r])
        await self._relay(held, sock, hello=None)

    async def _attach(self, sock: socket.socket, header: dict) -> None:
        held = self.held.get(str(header.get("sandbox_id")))
        if held is None:
            send_frame(sock, {"t": "error", "message": "no such sandbox"})
            sock.close()
            return
        send_frame(sock, {"t": "attached", "pid": held.process.pid, "record": held.record,
                          "exit_code": held.exit_code}, fds=[held.stderr_fd, *held.keep_fds])
        if held.exit_code is not None:
            sock.close()  # the broker sees its agent gone at once
            return
        await self._relay(held, sock, hello={"t": "ready", "pid": held.process.pid, "attached": True})

    async def _read_agent(self, held: Held) -> None:
        stdout = held.process.stdout
        assert stdout is not None
        while True:
            try:
                prefix = await stdout.readexactly(wire.PREFIX.size)
                header_len, payload_len = wire.PREFIX.unpack(prefix)
                header = json.loads(await stdout.readexactly(header_len))
                payload = await stdout.readexactly(payload_len) if payload_len else b""
            except (asyncio.IncompleteReadError, ValueError, OSError):
                break
            self._from_agent(held, header, payload)
        held.exit_code = await held.process.wait()
        held.exited.set()
        for conn in list(held.conns):  # each attached broker sees its sandbox gone
            conn.alive = False
            conn.writer.close()

    def _from_agent(self, held: Held, header: dict, payload: bytes) -> None:
        if header.get("t") == "ready":
            held.hello = header
            for conn in held.conns:
                conn.send(header, payload)
            return
        aid = header.get("id")
        ended = header.get("t") in TERMINAL
        kept = held.kept.get(aid)  # type: ignore[arg-type]
        if kept is not None:
            kept.frames.append((header, payload))
            if ended:
                kept.ended_at = time.monotonic()
        routes = held.routes.pop(aid, []) if ended else held.routes.get(aid, [])  # type: ignore[arg-type]
        for conn, rid in routes:
            conn.send({**header, "id": rid}, payload)
            if ended:
                conn.ids.pop(rid, None)
        if ended:
            held.uploads.discard(aid)  # type: ignore[arg-type]

    async def _relay(self, held: Held, sock: socket.socket, *, hello: dict | None) -> None:
        sock.settimeout(None)
        sock.setblocking(False)
        tune(sock)
        reader, writer = await asyncio.open_unix_connection(sock=sock, limit=wire.CHUNK + 65536)
        conn = Conn(writer)
        held.conns.add(conn)
        hello = hello or held.hello  # a spawned agent's own hello, if it came before this
        if hello is not None:
            conn.send(hello, b"")
        stdin = held.process.stdin
        assert stdin is not None
        try:
            while True:
                prefix = await reader.readexactly(wire.PREFIX.size)
                header_len, payload_len = wire.PREFIX.unpack(prefix)
                if header_len > wire.MAX_HEADER or payload_len > wire.CHUNK + 65536:
                    break
                header = json.loads(await reader.readexactly(header_len))
                payload = await reader.readexactly(payload_len) if payload_len else b""
                out = self._to_agent(held, conn, header, payload)
                if out is not None and held.exit_code is None:
                    stdin.write(wire.encode_head(out, len(payload)))
                    if payload:
                        stdin.write(payload)
                    await stdin.drain()
        except (asyncio.IncompleteReadError, ValueError, OSError):
            pass  # the broker hung up (or died): its sandbox lives on
        finally:
            self._detach(held, conn)
            writer.close()

    def _to_agent(self, held: Held, conn: Conn, header: dict, payload: bytes) -> dict | None:
        """The frame to send the agent (ids rewritten), or None when nothing goes to it."""
        rid, op = header.get("id"), header.get("op")
        if op == "chunk":
            aid = conn.ids.get(rid)  # type: ignore[arg-type]
            if aid is None:
                return None
            if header.get("last"):
                held.uploads.discard(aid)
            return {**header, "id": aid}
        if op == "cancel":
            target = conn.ids.get(header.get("target"))  # type: ignore[arg-type]
            return None if target is None else {**header, "target": target}
        key = header.pop("key", None) if op == "exec" else None
        if key and key in held.keyed:  # the same exec again: attach to it
            kept = held.keyed[key]
            for old, data in kept.frames:
                conn.send({**old, "id": rid}, data)
            if kept.ended_at is None:
                conn.ids[rid] = kept.aid  # type: ignore[index]
                held.routes.setdefault(kept.aid, []).append((conn, rid))  # type: ignore[arg-type]
            return None
        aid = held.new_aid()
        conn.ids[rid] = aid  # type: ignore[index]
        held.routes[aid] = [(conn, rid)]  # type: ignore[list-item]
        if key:
            held.keyed[key] = held.kept[aid] = Kept(aid)
        if op in UPLOADS and not header.get("last"):
            held.uploads.add(aid)
        return {**header, "id": aid}

    def _detach(self, held: Held, conn: Conn) -> None:
        conn.alive = False
        held.conns.discard(conn)
        for aid in set(conn.ids.values()):
            routes = [route for route in held.routes.get(aid, []) if route[0] is not conn]
            if routes:
                held.routes[aid] = routes
            else:
                held.routes.pop(aid, None)
            if aid in held.uploads and held.exit_code is None:
                # An upload its broker will never finish: the agent drops what it received.
                held.uploads.discard(aid)
                stdin = held.process.stdin
                if stdin is not None:
                    stdin.write(wire.encode_head({"id": aid, "op": "chunk", "last": True, "abort": True}))
        conn.ids.clear()

    async def _destroy(self, sandbox_id: str, graceful_s: float) -> int | None:
        held = self.held.get(sandbox_id)
        if held is None:
            return None
        process = held.process
        if process.stdin is not None:
            process.stdin.close()  # the agent kills its commands and exits
        try:
            await asyncio.wait_for(held.exited.wait(), graceful_s)
        except TimeoutError:
            pass
        if process.returncode is None:  # unreaped, so the group id is still its own
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            await asyncio.wait_for(held.exited.wait(), 30.0)
        except TimeoutError:
            pass
        self.held.pop(sandbox_id, None)
        _close([held.stderr_fd, *held.keep_fds])
        return held.exit_code


def _close(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--idle-exit-s", type=float, default=60.0)
    parser.add_argument("--keep-s", type=float, default=600.0)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C meant for the broker's terminal
    asyncio.run(Supervisor(args.run_dir, idle_exit_s=args.idle_exit_s, keep_s=args.keep_s).serve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
