"""The broker's end of the sandbox supervisor: starts it (or finds it running) for the run dir,
spawns sandboxes through it, re-adopts them after a broker restart, and destroys them.

Knows the supervisor's protocol (``supervisor_wire``), ``GuestSandbox`` and what a backend needs
to clean up after a sandbox (cgroup, uid, directory: the ``record`` it is spawned with); nothing
of leases or the bus. A sandbox spawned here is a ``GuestSandbox`` whose "process" is a
connection to the supervisor (``SupervisedProcess``): the guest's frames travel over it, its
stderr is the guest's own pipe (passed over the socket), its exit is seen through a pidfd.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import select
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from rollmesh.sandbox.bulk_handoff import HandOffChannel, HandOffTarget
from rollmesh.sandbox.egress import EgressForwarder, remove_socket_dir
from rollmesh.sandbox.errors import SandboxError
from rollmesh.sandbox.guest_client import GuestSandbox
from rollmesh.sandbox.limits import SandboxCgroup, UidLease
from rollmesh.sandbox.process_backend import remove_tree
from rollmesh.sandbox.sandbox_protocol import SandboxInfo, SandboxLimits
from rollmesh.sandbox.supervisor_wire import (
    LOCK_NAME,
    LOG_NAME,
    RunDirPath,
    SupervisorProtocolError,
    recv_frame,
    send_frame,
    tune,
)

log = structlog.get_logger(__name__)
SUPERVISOR_SCRIPT = Path(__file__).resolve().parent / "supervisor.py"
START_WAIT_S = 20.0
# bwrap options whose argument is a file descriptor: the supervisor renumbers them.
_FD_OPTIONS = ("--ro-bind-data", "--bind-data", "--file", "--args", "--seccomp", "--add-seccomp-fd",
               "--block-fd", "--sync-fd", "--info-fd", "--json-status-fd", "--userns-block-fd")


class SupervisorError(SandboxError, OSError):
    """The supervisor refused a request or could not be reached or started."""


class SupervisorClient:
    """``broker`` names the broker whose sandboxes these are (several may share a node's
    supervisor); ``idle_exit_s`` and ``keep_s`` are passed to a supervisor this client starts."""

    def __init__(self, run_dir: str | Path, *, broker: str, idle_exit_s: float = 60.0,
                 keep_s: float = 600.0) -> None:
        self.run_dir = str(run_dir)
        self.broker = broker
        self.idle_exit_s = idle_exit_s
        self.keep_s = keep_s
        self._path = RunDirPath(self.run_dir)
        self._hand_off: HandOffChannel | None = None

    # -- blocking requests (run them in a thread from async code) ---------------------------

    def request(self, header: dict, fds: list[int] = (),  # type: ignore[assignment]
                *, start: bool = True) -> tuple[dict, list[int], socket.socket]:
        """Send one request; its reply, the descriptors that came with it, and the socket.
        ``start``: start the supervisor if none runs (else the connection error is raised)."""
        for attempt in range(3):
            sock = self._connect() if start else self._dial()
            try:
                send_frame(sock, header, fds=list(fds))
                reply, _payload, got = recv_frame(sock)
            except SupervisorProtocolError:
                sock.close()  # it was exiting (idle) as we connected: never served, so ask again
                if attempt == 2:
                    raise
                continue
            except OSError:
                sock.close()
                raise
            if reply.get("t") == "error":
                sock.close()
                for fd in got:
                    os.close(fd)
                raise SupervisorError(f"sandbox supervisor: {reply.get('message')}")
            return reply, got, sock
        raise AssertionError("unreachable")

    def held(self) -> list[dict]:
        """This broker's sandboxes the supervisor holds: sandbox_id, record, pid, exit_code."""
        reply, _fds, sock = self.request({"op": "list"})
        sock.close()
        return [entry for entry in reply["sandboxes"] if entry["record"].get("broker") == self.broker]

    def destroy(self, sandbox_id: str, graceful_s: float = 0.0) -> int | None:
        """End the sandbox's guest and forget it; None when it is not held (a supervisor that is
        gone took its sandboxes with it)."""
        try:
            reply, _fds, sock = self.request({"op": "destroy", "sandbox_id": sandbox_id, "graceful_s": graceful_s},
                                             start=False)
        except (FileNotFoundError, ConnectionRefusedError):
            return None
        sock.close()
        return reply.get("exit_code")

    def status(self, sandbox_id: str) -> tuple[bool, int | None]:
        """Whether the supervisor holds the sandbox, and its guest's exit code once it exited."""
        try:
            reply, _fds, sock = self.request({"op": "status", "sandbox_id": sandbox_id}, start=False)
        except (FileNotFoundError, ConnectionRefusedError):
            return False, None
        sock.close()
        return bool(reply.get("known")), reply.get("exit_code")

    def hand_off_channel(self) -> HandOffChannel:
        """This broker's standing connection for handing bulk uploads to the supervisor (opened
        at its first use)."""
        if self._hand_off is None:
            self._hand_off = HandOffChannel(self._path.address)
        return self._hand_off

    def ensure_running(self) -> None:
        self._connect().close()

    def _connect(self) -> socket.socket:
        try:
            return self._dial()
        except (FileNotFoundError, ConnectionRefusedError):
            pass
        lock = os.open(os.path.join(self.run_dir, LOCK_NAME), os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one starter per run dir; the others then connect
            try:
                return self._dial()
            except (FileNotFoundError, ConnectionRefusedError):
                self._start()
            give_up = time.monotonic() + START_WAIT_S
            while True:
                try:
                    return self._dial()
                except (FileNotFoundError, ConnectionRefusedError) as exc:
                    if time.monotonic() > give_up:
                        raise SupervisorError(f"the sandbox supervisor did not start within {START_WAIT_S:g} s; "
                                              f"see {os.path.join(self.run_dir, LOG_NAME)}") from exc
                    time.sleep(0.02)
        finally:
            os.close(lock)

    def _dial(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.connect(self._path.address)
        except OSError:
            sock.close()
            raise
        return sock

    def _start(self) -> None:
        """Start the supervisor in a session of its own, so it outlives this process (a broker
        killed with its process group or by SIGKILL leaves it, and its sandboxes, running)."""
        with open(os.path.join(self.run_dir, LOG_NAME), "ab") as log_file:
            subprocess.Popen(
                [sys.executable, "-s", "-E", str(SUPERVISOR_SCRIPT), "--run-dir", self.run_dir,
                 "--idle-exit-s", str(self.idle_exit_s), "--keep-s", str(self.keep_s)],
                stdin=subprocess.DEVNULL, stdout=log_file, stderr=log_file, start_new_session=True,
                close_fds=True, cwd="/")
        log.info("sandbox supervisor started", run_dir=self.run_dir)

    # -- sandboxes ---------------------------------------------------------------------------

    def launch_options(self, info: SandboxInfo, *, kill_tree: Callable[[], None] | None,
                       cleanup: Callable[[], None] | None, oom_kills: Callable[[], int] | None,
                       cgroup: SandboxCgroup | None = None, uid: UidLease | None = None,
                       home: str | None = None, graceful_exit_s: float = 0.0,
                       egress: EgressForwarder | None = None) -> dict[str, Any]:
        """``GuestSandbox.launch`` options for a sandbox spawned by the supervisor, which gets
        ``info`` and the cleanup facts as its record (so a restarted broker can re-adopt it),
        holds the uid's lock and serves the egress forwarder's socket (``egress``: listening,
        not served here). Destroying it asks the supervisor to end the guest first."""
        record = record_of(self.broker, info, cgroup=cgroup, uid=uid, home=home)
        record["graceful_exit_s"] = graceful_exit_s
        spawned: dict[str, SupervisedProcess] = {}
        keep, record["keep_fds"] = [], []  # the fds the supervisor holds, and what each is
        if uid is not None:
            keep.append(uid.fd)
            record["keep_fds"].append("uid")
        if egress is not None and egress.listener is not None:
            record["egress"] = {"allow": egress.targets, "dir": os.path.dirname(egress.socket_path),
                                "keep_index": len(keep)}
            keep.append(egress.listener.fileno())
            record["keep_fds"].append("egress")

        async def spawn(argv: list[str], *, env: dict[str, str], cwd: str | None,
                        pass_fds: tuple[int, ...]) -> SupervisedProcess:
            process = await asyncio.to_thread(self._spawn, info.sandbox_id, record, argv, env, cwd, pass_fds, keep)
            spawned["process"] = process
            if egress is not None and egress.listener is not None:
                egress.listener.close()  # the supervisor's copy is the one served
                egress.listener = None
            return process

        return {"spawn": spawn, "kill_tree": self._killer(info.sandbox_id, spawned, kill_tree, graceful_exit_s),
                "cleanup": cleanup, "oom_kills": oom_kills, "graceful_exit_s": 0.0}

    def _spawn(self, sandbox_id: str, record: dict, argv: list[str], env: dict[str, str], cwd: str | None,
               pass_fds: tuple[int, ...], keep_fds: list[int]) -> SupervisedProcess:
        numbers = {str(fd): index for index, fd in enumerate(pass_fds)}
        positions = [[i, numbers[arg]] for i, arg in enumerate(argv)
                     if i > 0 and argv[i - 1] in _FD_OPTIONS and arg in numbers]
        reply, fds, sock = self.request({
            "op": "spawn", "sandbox_id": sandbox_id, "argv": list(argv), "env": env, "cwd": cwd,
            "pass_fds": len(pass_fds), "fd_positions": positions, "record": record,
        }, fds=[*pass_fds, *keep_fds])
        return SupervisedProcess(self, sandbox_id, sock, fds[0], int(reply["pid"]))

    def _killer(self, sandbox_id: str, spawned: dict[str, SupervisedProcess],
                kill_tree: Callable[[], None] | None, graceful_s: float = 0.0) -> Callable[[], None]:
        def kill() -> None:
            try:
                code = self.destroy(sandbox_id, graceful_s)
            except OSError as exc:
                log.warning("sandbox supervisor destroy failed", sandbox_id=sandbox_id, error=repr(exc))
                code = None
            process = spawned.get("process")
            if process is not None:
                process.ended(code)
            if kill_tree is not None:
                kill_tree()  # what may be left in the sandbox's cgroup

        return kill

    async def adopt(self, entry: dict) -> GuestSandbox:
        """The live ``GuestSandbox`` of a sandbox a previous broker spawned (an entry of ``held``)."""
        record, sandbox_id = entry["record"], entry["sandbox_id"]
        info = info_of(sandbox_id, record)
        got: dict[str, Any] = {}

        async def attach(argv: list[str], *, env: dict[str, str], cwd: str | None,
                         pass_fds: tuple[int, ...]) -> SupervisedProcess:
            reply, fds, sock = await asyncio.to_thread(self.request, {"op": "attach", "sandbox_id": sandbox_id})
            # fds: its stderr, then what the supervisor holds for it (an older record: the uid's lock).
            names = record.get("keep_fds", ["uid"] if record.get("uid") is not None else [])
            for name, fd in zip(names, fds[1:]):
                if name == "uid":
                    got["uid_fd"] = fd
                else:
                    os.close(fd)  # the egress socket: the supervisor serves it
            process = SupervisedProcess(self, sandbox_id, sock, fds[0], int(reply["pid"]),
                                        returncode=reply.get("exit_code"))
            got["process"] = process
            return process

        cgroup = cgroup_of(record)
        uid_holder: list[UidLease] = []

        def cleanup() -> None:
            if cgroup is not None:
                cgroup.remove()
            for lease in uid_holder:
                lease.release()
            if record.get("home"):
                remove_tree(record["home"])
            if record.get("egress"):
                remove_socket_dir(record["egress"]["dir"])

        sandbox = await GuestSandbox.launch(
            info, [f"adopted:{sandbox_id}"], env={}, spawn=attach, start_timeout_s=10.0,
            kill_tree=self._killer(sandbox_id, got, cgroup.kill_all if cgroup is not None else None,
                                   float(record.get("graceful_exit_s") or 0.0)),
            cleanup=cleanup, oom_kills=cgroup.oom_kills if cgroup is not None else None)
        if record.get("uid") is not None and got.get("uid_fd", -1) >= 0:
            uid_holder.append(UidLease(int(record["uid"]), got["uid_fd"]))
        return sandbox


class SupervisedProcess:
    """What ``GuestPipes`` needs of a ``subprocess.Popen``, for a guest the supervisor holds:
    stdin and stdout are the relay socket, stderr is the guest's stderr pipe."""

    def __init__(self, client: SupervisorClient, sandbox_id: str, sock: socket.socket, stderr_fd: int,
                 pid: int, *, returncode: int | None = None) -> None:
        self._client = client
        self.sandbox_id = sandbox_id
        self.pid = pid
        self.returncode = returncode
        tune(sock)
        fd = sock.detach()
        self.stdin = open(os.dup(fd), "wb", buffering=0)  # noqa: SIM115 - closed by GuestSandbox
        self.stdout = open(fd, "rb", buffering=0)  # noqa: SIM115
        self.stderr = open(stderr_fd, "rb", buffering=0)  # noqa: SIM115
        try:
            self._pidfd = os.pidfd_open(pid)
        except OSError:  # already gone
            self._pidfd = -1

    def hand_off_target(self, backend: str) -> HandOffTarget:
        """Where this sandbox's bulk uploads go to skip the broker: its supervisor's socket."""
        return HandOffTarget(self._client.hand_off_channel(), self.sandbox_id, backend)

    def poll(self) -> int | None:
        if self.returncode is None and self._exited():
            try:
                known, code = self._client.status(self.sandbox_id)
            except OSError:  # never raised from here: GuestPipes polls while it marks a death
                known, code = False, None
            if code is not None or not known:
                self.ended(code if code is not None else 255)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        give_up = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None and (give_up is None or time.monotonic() < give_up):
            time.sleep(0.01)
        return self.returncode

    def ended(self, code: int | None) -> None:
        if self.returncode is None:
            self.returncode = code if code is not None else 255
        if self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1

    def _exited(self) -> bool:
        if self._pidfd < 0:
            return True
        poller = select.poll()
        poller.register(self._pidfd, select.POLLIN)
        return bool(poller.poll(0))

    def __del__(self) -> None:
        if getattr(self, "_pidfd", -1) >= 0:
            os.close(self._pidfd)


def record_of(broker: str, info: SandboxInfo, *, cgroup: SandboxCgroup | None, uid: UidLease | None,
              home: str | None) -> dict:
    """What a restarted broker needs to adopt and later clean up a sandbox (JSON)."""
    limits = {name: getattr(info.limits, name) for name in SandboxLimits.__dataclass_fields__}
    return {
        "broker": broker, "backend": info.backend, "isolated": info.isolated, "limits": limits,
        "enforcement": dict(info.enforcement), "uid": uid.uid if uid is not None else None, "home": home,
        "cgroup": None if cgroup is None else {"version": cgroup.version, "dirs": [str(d) for d in cgroup.dirs],
                                               "memory_dir": str(cgroup.memory_dir)},
    }


def info_of(sandbox_id: str, record: dict) -> SandboxInfo:
    return SandboxInfo(sandbox_id=sandbox_id, backend=str(record["backend"]), isolated=bool(record["isolated"]),
                       limits=SandboxLimits(**record["limits"]), enforcement=dict(record.get("enforcement") or {}))


def cgroup_of(record: dict) -> SandboxCgroup | None:
    found = record.get("cgroup")
    if not found:
        return None
    return SandboxCgroup(found["version"], [Path(d) for d in found["dirs"]], Path(found["memory_dir"]))
