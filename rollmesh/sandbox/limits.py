"""How a sandbox's resources are bounded on the host: per-sandbox cgroups (v2 or v1 memory +
pids), a dedicated host uid per sandbox, and the rlimits the guest applies where cgroups are
missing.

Knows /sys/fs/cgroup, /proc and file locks; nothing of bubblewrap or the guest's protocol.

Cgroups are made below the cgroup the broker itself is in (so the broker's own limits still
cover them), one directory per sandbox, and the sandbox's first process joins them itself
before it execs anything (``join_argv``), so no process of the sandbox ever runs outside. v2 is
used when the unified hierarchy offers both ``memory`` and ``pids``; else v1 ``memory`` + ``pids``
when both are mounted and writable; else none, and the caller falls back to rlimits.
"""

from __future__ import annotations

import uuid

import errno
import fcntl
import os
import re
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
OOM_KILL_LINE = re.compile(rb"^oom_kill (\d+)$", re.MULTILINE)  # in memory.events / memory.oom_control
GROUP_DIR = "rollmesh-sandboxes"
# The sandbox's first process runs this, as root, before it becomes the sandbox: it moves itself
# into each cgroup.procs named before "--", lowers its OOM score (so the guest outlives the
# commands it runs when memory runs out), then execs the rest.
JOIN_SCRIPT = (
    'while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; '
    'echo -900 > /proc/self/oom_score_adj 2>/dev/null; exec "$@"'
)


@dataclass
class SandboxCgroup:
    """One sandbox's cgroup directories (one per controller on v1, one on v2)."""

    version: str  # "v2" | "v1"
    dirs: list[Path]
    memory_dir: Path
    # The memory controller's events file, kept open: ``oom_kills`` runs before every exec, and
    # one pread costs a few microseconds where open + read + close cost some tens.
    _events_fd: int = field(default=-1, init=False, repr=False, compare=False)

    def join_argv(self) -> list[str]:
        procs = [str(d / "cgroup.procs") for d in self.dirs]
        return ["/bin/sh", "-c", JOIN_SCRIPT, "rollmesh-cgroup-join", *procs, "--"]

    def oom_kills(self) -> int:
        """How many processes the memory limit has killed here so far."""
        if self._events_fd < 0:
            name = "memory.events" if self.version == "v2" else "memory.oom_control"
            self._events_fd = os.open(self.memory_dir / name, os.O_RDONLY | os.O_CLOEXEC)
        try:
            text = os.pread(self._events_fd, 4096, 0)  # a cgroup file is read afresh at offset 0
        except OSError:
            self._close_events()
            raise
        match = OOM_KILL_LINE.search(text)
        return int(match.group(1)) if match else 0

    def _close_events(self) -> None:
        if self._events_fd >= 0:
            os.close(self._events_fd)
            self._events_fd = -1

    def pids(self) -> set[int]:
        found: set[int] = set()
        for directory in self.dirs:
            try:
                found.update(int(line) for line in (directory / "cgroup.procs").read_text().split())
            except OSError:
                pass
        return found

    def kill_all(self, deadline_s: float = 5.0) -> None:
        """SIGKILL every process in the cgroup until none is left (new forks included)."""
        kill_file = self.dirs[0] / "cgroup.kill"
        if self.version == "v2" and kill_file.exists():
            kill_file.write_text("1")
        give_up = time.monotonic() + deadline_s
        while (pids := self.pids()) and time.monotonic() < give_up:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.001)

    def remove(self) -> None:
        """Remove the sandbox's directories, and their parent once no sandbox is left in it
        (a leftover directory would keep the broker's own cgroup from being removed)."""
        self._close_events()
        for directory in self.dirs:
            for _ in range(200):  # a killed process leaves its cgroup a moment after it dies
                try:
                    directory.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError as exc:
                    if exc.errno != errno.EBUSY:
                        break
                    time.sleep(0.005)
            remove_if_empty(directory.parent)


class CgroupManager:
    """Makes per-sandbox cgroups; ``detect()`` says whether (and which) this host allows."""

    def __init__(self, version: str, parents: dict[str, Path]) -> None:
        self.version = version
        self.parents = parents  # controller ("memory", "pids"; "unified" on v2) -> parent dir

    @classmethod
    def detect(cls, root: Path = CGROUP_ROOT) -> tuple[CgroupManager | None, str]:
        """The manager, or None with the reason cgroups cannot be used here."""
        if os.geteuid() != 0:
            return None, "not root: cgroups are not ours to make"
        own = _own_cgroups()
        reasons = []
        for attempt in (cls._detect_v2, cls._detect_v1):
            manager, reason = attempt(root, own)
            if manager is not None:
                return manager, ""
            reasons.append(reason)
        return None, "; ".join(reasons)

    @classmethod
    def _detect_v2(cls, root: Path, own: dict[str, str]) -> tuple[CgroupManager | None, str]:
        mount = _mount_point("cgroup2", root)
        if mount is None or "" not in own:
            return None, "no cgroup v2 hierarchy"
        base = mount / own[""].lstrip("/")
        try:
            controllers = (base / "cgroup.controllers").read_text().split()
        except OSError as exc:
            return None, f"cgroup v2 unreadable: {exc}"
        if not {"memory", "pids"} <= set(controllers):
            return None, "cgroup v2 without memory+pids controllers"
        parent = base / GROUP_DIR
        try:
            # v2 lets controllers go to children only of a cgroup without processes: the broker
            # sits in ``base``, so sandboxes live one level down, in ``parent``.
            (base / "cgroup.subtree_control").write_text("+memory +pids")
            parent.mkdir(exist_ok=True)
            (parent / "cgroup.subtree_control").write_text("+memory +pids")
        except OSError as exc:
            return None, f"cgroup v2 not delegated to us: {exc}"
        return cls("v2", {"unified": parent}), ""

    @classmethod
    def _detect_v1(cls, root: Path, own: dict[str, str]) -> tuple[CgroupManager | None, str]:
        parents = {}
        for controller in ("memory", "pids"):
            mount = _mount_point(controller, root)
            if mount is None or controller not in own:
                return None, f"no cgroup v1 {controller} hierarchy"
            parent = mount / own[controller].lstrip("/") / GROUP_DIR
            try:
                parent.mkdir(exist_ok=True)
            except OSError as exc:
                return None, f"cgroup v1 {controller} not writable: {exc}"
            parents[controller] = parent
        for parent in parents.values():
            remove_if_empty(parent)  # made again by each create: nothing left behind when idle
        return cls("v1", parents), ""

    def create(self, name: str, *, memory_mb: int, pids: int) -> SandboxCgroup:
        try:
            return self._create(name, memory_mb=memory_mb, pids=pids)
        except FileNotFoundError:  # another broker removed the emptied parent just now
            return self._create(name, memory_mb=memory_mb, pids=pids)

    def _create(self, name: str, *, memory_mb: int, pids: int) -> SandboxCgroup:
        for parent in self.parents.values():
            parent.mkdir(exist_ok=True)
            if self.version == "v2":  # idempotent; a parent made again needs it again
                (parent / "cgroup.subtree_control").write_text("+memory +pids")
        memory = memory_mb * 1024 * 1024
        made: list[Path] = []
        try:
            if self.version == "v2":
                directory = self.parents["unified"] / name
                directory.mkdir()
                made.append(directory)
                (directory / "memory.max").write_text(str(memory))
                _write_if_present(directory / "memory.swap.max", "0")
                (directory / "pids.max").write_text(str(pids))
                return SandboxCgroup("v2", made, directory)
            memory_dir = self.parents["memory"] / name
            pids_dir = self.parents["pids"] / name
            for directory in (memory_dir, pids_dir):
                directory.mkdir()
                made.append(directory)
            (memory_dir / "memory.limit_in_bytes").write_text(str(memory))
            _write_if_present(memory_dir / "memory.memsw.limit_in_bytes", str(memory))  # no swap
            _write_if_present(memory_dir / "memory.swappiness", "0")
            (pids_dir / "pids.max").write_text(str(pids))
            return SandboxCgroup("v1", made, memory_dir)
        except OSError:
            SandboxCgroup(self.version, made, made[0] if made else Path()).remove()
            raise

    def sweep(self) -> int:
        """Remove sandbox cgroups left empty by a broker that died; returns how many.

        Only those whose owner (the pid in the name, see ``owned_cgroup_name``) is gone: another
        live broker on this host (a test run beside a mesh) creates its cgroup empty and joins it
        a moment later, and must not find it removed in between.
        """
        removed = 0
        for parent in self.parents.values():
            for child in parent.iterdir() if parent.is_dir() else ():
                if child.is_dir() and not _owner_alive(child.name):
                    try:
                        child.rmdir()  # refused (EBUSY) while any process is in it
                        removed += 1
                    except OSError:
                        pass
        return removed


_OWNER = re.compile(r"-p(\d+)-[0-9a-f]{8}$")


def owned_cgroup_name(sandbox_id: str) -> str:
    """A sandbox cgroup's name: the sandbox id, this process's pid (its owner) and a nonce."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", sandbox_id)[:64]
    return f"{safe}-p{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _owner_alive(name: str) -> bool:
    match = _OWNER.search(name)
    if match is None:
        return False  # not ours, or from before owners were named: empty ones may go
    try:
        os.kill(int(match.group(1)), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_if_empty(directory: Path) -> None:
    """rmdir a cgroup directory; refused (and ignored) while it has processes or children."""
    try:
        directory.rmdir()
    except OSError:
        pass


def _write_if_present(path: Path, value: str) -> None:
    if path.exists():
        try:
            path.write_text(value)
        except OSError:
            pass


def _own_cgroups() -> dict[str, str]:
    """Controller -> this process's cgroup path ("" is the v2 hierarchy)."""
    own: dict[str, str] = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") if controllers else [""]:
            own[controller] = path
    return own


def _mount_point(kind: str, root: Path) -> Path | None:
    """Where the v1 hierarchy holding ``kind`` (or "cgroup2") is mounted, with its mount root
    equal to the hierarchy's root (a namespaced or bind-mounted subtree is not used)."""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        dash = fields.index("-")
        fstype, options = fields[dash + 1], fields[dash + 3].split(",")
        mount_root, mount_point = fields[3], Path(fields[4])
        if root not in (mount_point, *mount_point.parents) or mount_root != "/":
            continue
        if kind == "cgroup2" and fstype == "cgroup2":
            return mount_point
        if fstype == "cgroup" and kind in options:
            return mount_point
    return None


@dataclass
class UidLease:
    """A host uid held by one sandbox, while ``fd`` (an flock'd file) stays open."""

    uid: int
    fd: int = field(repr=False)

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class UidPool:
    """Dedicated host uids for sandboxes, unique across every broker on the host: each taken uid
    is an exclusive flock on ``lock_dir/<uid>``, which the kernel drops when its holder dies."""

    def __init__(self, first: int = 2_100_000_000, count: int = 65536,
                 lock_dir: Path = Path("/run/rollmesh-sandbox-uids")) -> None:
        self.first, self.count, self.lock_dir = first, count, lock_dir
        self._next = int.from_bytes(os.urandom(2), "little") % count

    def acquire(self) -> UidLease:
        self.lock_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        for _ in range(self.count):
            uid = self.first + self._next
            self._next = (self._next + 1) % self.count
            fd = os.open(self.lock_dir / str(uid), os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            return UidLease(uid, fd)
        raise OSError(errno.EAGAIN, "every sandbox uid is taken")


def exec_rlimits(*, cpu_s: int, file_size_mb: int, memory_mb: int | None) -> dict[str, int | None]:
    """The per-exec rlimits the guest sets in each command it starts; ``memory_mb`` only where
    no cgroup bounds memory (RLIMIT_AS counts address space, a crude stand-in)."""
    return {
        "cpu": cpu_s,
        "fsize": file_size_mb * 1024 * 1024,
        "as": memory_mb * 1024 * 1024 if memory_mb is not None else None,
    }
