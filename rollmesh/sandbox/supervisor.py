"""The per-node sandbox supervisor: holds the sandboxes' processes so they outlive a broker crash.

Like a container runtime's shim: a small process started detached from the broker (its own
session), which spawns each sandbox's guest (``bwrap ... guest.py`` or a bare ``guest.py``),
keeps its pipes open and relays frames between the guest and whichever broker is attached, and
serves the egress forwarder of a sandbox whose profile has ``network_allow`` (``egress``), so
the allowlist outlives the broker too. It never runs tool code itself and never decides anything
about leases; the broker tells it what to spawn and when to kill, and keeps the cleanup of
cgroups, uids and directories itself (it hands its uid lock here so the uid stays taken while no
broker lives).

Standard library only (run as a script: ``python supervisor.py --run-dir D``). Listens on
``D/sandbox-supervisor.<host>.sock`` (mode 0600); each connection starts with one request frame
(``guest_wire``'s): spawn, attach, bulk_channel, list, destroy or status. After a spawn or an
attach it carries the sandbox's frames (``supervisor_relay``: frame-aligned, ids rewritten, an
exec with a ``key`` kept ``--keep-s`` after it ended so the same key attaches to it instead of
running it twice). A bulk_channel carries a broker's bulk uploads, each with its client's socket, whose
bytes go into the guest from here (``supervisor_bulk``), the broker having checked its token.
It exits once it holds no sandbox and no client was connected for ``--idle-exit-s``, and
destroys what it holds when the run directory is removed (the run is over).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import time

if __package__:
    from rollmesh.sandbox.egress import EgressForwarder
    from rollmesh.sandbox.supervisor_bulk import HandOffChannel
    from rollmesh.sandbox.supervisor_relay import Conn, Held
    from rollmesh.sandbox.supervisor_wire import RunDirPath, recv_frame, send_frame, tune
else:  # run as a script: its own directory is on sys.path
    from egress import EgressForwarder  # type: ignore[no-redef]
    from supervisor_bulk import HandOffChannel  # type: ignore[no-redef]
    from supervisor_relay import Conn, Held  # type: ignore[no-redef]
    from supervisor_wire import RunDirPath, recv_frame, send_frame, tune  # type: ignore[no-redef]

HANDSHAKE_TIMEOUT_S = 30.0


class Supervisor:
    def __init__(self, run_dir: str, *, idle_exit_s: float, keep_s: float) -> None:
        self.run_dir = run_dir
        self.idle_exit_s = idle_exit_s
        self.keep_s = keep_s
        self.held: dict[str, Held] = {}
        self.clients = 0
        self.last_client = time.monotonic()
        self.tasks: set[asyncio.Task] = set()
        self.channels: set[HandOffChannel] = set()  # brokers' hand-off connections (bulk uploads)

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
                if not os.path.isdir(self.run_dir):  # the run is over (its directory removed)
                    for sandbox_id in list(self.held):
                        await self._destroy(sandbox_id, 0.0)
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
        for held in self.held.values():
            held.expire(self.keep_s)

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
                elif op == "bulk_channel":
                    self._bulk_channel(sock, fds)
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
        record = dict(header.get("record") or {})
        forwarder = None
        if record.get("egress"):  # its egress allowlist is served here, so it outlives the broker
            try:
                forwarder = EgressForwarder(record["egress"]["allow"])
                await forwarder.serve(socket.socket(fileno=os.dup(keep_fds[int(record["egress"]["keep_index"])])))
            except (OSError, ValueError, KeyError, IndexError, TypeError) as exc:
                _close(fds)
                send_frame(sock, {"t": "error", "message": f"its egress forwarder: {type(exc).__name__}: {exc}"})
                sock.close()
                return
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        try:
            # Forked in a thread: the relays of every other sandbox go on meanwhile.
            process = await asyncio.to_thread(
                subprocess.Popen, argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err_w,
                env={str(k): str(v) for k, v in (header.get("env") or {}).items()},
                cwd=header.get("cwd") or None, pass_fds=tuple(pass_fds), start_new_session=True, bufsize=0)
        except OSError as exc:
            _close([err_r, *keep_fds])
            if forwarder is not None:
                forwarder.close()
            send_frame(sock, {"t": "error", "message": f"{type(exc).__name__}: {exc}"})
            sock.close()
            return
        finally:
            _close([err_w, *pass_fds])
        held = self.held[sandbox_id] = Held(sandbox_id, record, process, err_r, keep_fds)
        held.egress = forwarder
        send_frame(sock, {"t": "spawned", "pid": process.pid}, fds=[err_r])
        self._relay(held, sock, hello=None)

    async def _attach(self, sock: socket.socket, header: dict) -> None:
        held = self.held.get(str(header.get("sandbox_id")))
        if held is None:
            send_frame(sock, {"t": "error", "message": "no such sandbox"})
            sock.close()
            return
        send_frame(sock, {"t": "attached", "pid": held.process.pid, "record": held.record,
                          "exit_code": held.exit_code}, fds=[held.stderr_fd, *held.keep_fds])
        if held.exit_code is not None or held.guest_eof:
            sock.close()  # the broker sees its guest gone at once
            return
        self._relay(held, sock, hello={"t": "ready", "pid": held.process.pid, "attached": True})

    def _bulk_channel(self, sock: socket.socket, fds: list[int]) -> None:
        """A broker's standing connection for handing over bulk uploads: each comes with its
        client's socket (the token checked there), and its bytes go from that socket into the
        guest (``supervisor_bulk``); each gets one outcome frame back."""
        _close(fds)
        send_frame(sock, {"t": "channel"})  # only then does the broker send what has sockets attached
        sock.settimeout(None)
        sock.setblocking(False)
        channel = HandOffChannel(sock, self._live, on_close=lambda: self.channels.discard(channel))
        self.channels.add(channel)

    def _live(self, sandbox_id: str) -> Held | None:
        held = self.held.get(sandbox_id)
        if held is None or held.stdin_closed or held.guest_eof or held.exit_code is not None:
            return None
        return held

    def _relay(self, held: Held, sock: socket.socket, *, hello: dict | None) -> None:
        sock.settimeout(None)
        sock.setblocking(False)
        tune(sock)
        held.attach(Conn(held, sock), hello)

    async def _destroy(self, sandbox_id: str, graceful_s: float) -> int | None:
        held = self.held.get(sandbox_id)
        if held is None:
            return None
        held.close_stdin()  # the guest kills its commands and exits
        try:
            await asyncio.wait_for(held.exited.wait(), graceful_s)
        except TimeoutError:
            pass
        if held.process.poll() is None:  # unreaped, so the group id is still its own
            try:
                os.killpg(held.process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            await asyncio.wait_for(held.exited.wait(), 30.0)
        except TimeoutError:
            pass
        self.held.pop(sandbox_id, None)
        held.forget()
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
