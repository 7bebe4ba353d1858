"""The gVisor backend: one ``runsc run`` per sandbox (an OCI bundle), whose process is the guest.

Knows runsc's command line and the OCI runtime spec; nothing of leases. Tool code talks to
gVisor's user-space kernel, never to the host's. What a sandbox gets:

* ``--network=none`` (only loopback) unless the lease asks for network (``--network=sandbox``).
* A read-only root made once per backend: empty mount points, the merged-usr links, a few
  ``/etc`` files (copied, plus a synthesized passwd/group/hosts); ``/usr`` bound read-only, the
  tool scripts and ``readonly_paths`` bound read-only at their host paths, the guest's files at
  ``/.rollmesh``; ``/workspace`` and ``/tmp`` are gVisor tmpfs of ``workspace_mb`` each.
* uid/gid 1000 inside, no capabilities, ``noNewPrivileges``.
* Each exec gets RLIMIT_AS of ``memory_mb`` (lent by the guest, so exec stays on its fast
  path), so a runaway command fails alone. A host cgroup (the spec's ``cgroupsPath``) bounds the
  whole sandbox (sentry and gofer included) at ``memory_mb`` + 128 MiB: past it the host kills
  the sandbox, which the client reports as died. gVisor's ptrace platform needs host threads
  for every task, so that cgroup gets no pids limit; processes are bounded by RLIMIT_NPROC
  inside, which gVisor enforces.

Needs root (the OCI path of runsc; ``--rootless`` only supports ``runsc do``, which shows the
whole host filesystem). Checked with Debian 12's runsc (release 20221219, ptrace platform) on a
6.18 kernel: exec, files, limits and isolation work, at ~7 ms per exec; but listing any
directory (``ls /``, ``ls /workspace``) fails with EINVAL there, an incompatibility of that old
release with the new kernel, and a host pids cgroup limit crashes its sentry (so none is set).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import uuid
from collections.abc import Sequence
from pathlib import Path

from rollmesh.moved_names import forward_moved_names
from rollmesh.sandbox.backend_check import check_backend
from rollmesh.sandbox.errors import BackendFailedError, BackendUnavailableError
from rollmesh.sandbox.guest_client import START_TIMEOUT_S, GuestSandbox
from rollmesh.sandbox.limits import exec_rlimits, remove_if_empty
from rollmesh.sandbox.sandbox_protocol import SandboxInfo, SandboxLimits
from rollmesh.sandbox.tool_paths import GUEST_DIR, GUEST_ENV, GUEST_FILES, SANDBOX_PATH, SYSTEM_PYTHON, TOOLS_DIR

GUEST_MOUNT = "/.rollmesh"
WORKSPACE = "/workspace"
SANDBOX_UID = 1000
ETC_COPIES = ("ld.so.cache", "nsswitch.conf", "localtime")
RUNSC_TIMEOUT_S = 10.0
SENTRY_OVERHEAD_MB = 128  # the host cgroup holds gVisor's own memory too, on top of the sandbox's
DEFAULT_HOME = Path("/run/rollmesh-runsc")


class RunscBackend:
    name = "runsc"
    isolated = True

    def __init__(self, *, runsc: str | None = None, readonly_paths: Sequence[str] = (),
                 python: str = SYSTEM_PYTHON, state_dir: str | Path | None = None,
                 start_timeout_s: float = START_TIMEOUT_S) -> None:
        found = runsc or shutil.which("runsc")
        if not found:
            raise BackendUnavailableError("gVisor is not installed", backend=self.name, reason="no runsc on PATH")
        if os.geteuid() != 0:
            raise BackendUnavailableError("runsc needs root for OCI bundles", backend=self.name,
                                          reason="not running as root")
        self.runsc = found
        self.python = python
        self.start_timeout_s = start_timeout_s
        self.readonly_paths = [str(TOOLS_DIR), *(str(Path(p).resolve()) for p in readonly_paths)]
        # Shared by every backend on the host: runsc's state dir holds many containers, the
        # rootfs is the same for all (made again, idempotently), bundles are per container.
        self.home = Path(state_dir) if state_dir is not None else DEFAULT_HOME
        self.state = self.home / "state"
        self.state.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.rootfs = self.home / "rootfs"
        _make_rootfs(self.rootfs, [*self.readonly_paths, GUEST_MOUNT])
        # Sandbox cgroups go below the broker's own memory cgroup. runsc makes cgroupsPath in
        # every hierarchy, parents included, and removes only the leaf: the parents that do not
        # exist now are removed again once the last sandbox in them is gone.
        self._cgroup_base = f"{_own_cgroup('memory').rstrip('/')}/rollmesh-runsc"
        self._cgroup_parents = _missing_cgroup_dirs(self._cgroup_base)

    async def create(self, sandbox_id: str, limits: SandboxLimits, *, network: bool = False,
                     profile: str = "default") -> GuestSandbox:
        container = f"rollmesh-{re.sub(r'[^A-Za-z0-9_.-]', '_', sandbox_id)[:48]}-{uuid.uuid4().hex[:8]}"
        bundle = self.home / "bundles" / container
        bundle.mkdir(parents=True)
        cgroup_path = f"{self._cgroup_base}/{container}"
        (bundle / "config.json").write_text(json.dumps(self.spec(limits, cgroup_path)))
        argv = [self.runsc, f"--root={self.state}", f"--network={'sandbox' if network else 'none'}",
                "run", "--bundle", str(bundle), container]
        memory_dir = Path("/sys/fs/cgroup/memory") / cgroup_path.lstrip("/")
        info = SandboxInfo(sandbox_id=sandbox_id, backend=self.name, isolated=True, limits=limits,
                           enforcement=self.enforcement(limits, network=network))

        def oom_kills() -> int:
            text = (memory_dir / "memory.oom_control").read_text()
            match = re.search(r"^oom_kill (\d+)$", text, re.MULTILINE)
            return int(match.group(1)) if match else 0

        def kill_tree() -> None:
            self._runsc("kill", container, "KILL")

        def cleanup() -> None:
            self._runsc("delete", "-force", container)
            shutil.rmtree(bundle, ignore_errors=True)
            for directory in [*_missing_cgroup_dirs(cgroup_path, existing=True), *self._cgroup_parents]:
                remove_if_empty(directory)  # refused while another sandbox is still in it

        return await GuestSandbox.launch(
            info, argv, env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}, kill_tree=kill_tree, cleanup=cleanup,
            oom_kills=oom_kills if memory_dir.parent.parent.exists() else None,
            start_timeout_s=self.start_timeout_s,
        )

    def spec(self, limits: SandboxLimits, cgroup_path: str) -> dict:
        """The OCI runtime spec of one sandbox."""
        size = f"size={limits.workspace_mb}m"
        mounts = [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "mode=755", "size=1m"]},
            {"destination": "/usr", "type": "bind", "source": "/usr", "options": ["rbind", "ro"]},
            {"destination": WORKSPACE, "type": "tmpfs", "source": "tmpfs", "options": [size, "mode=755", f"uid={SANDBOX_UID}", f"gid={SANDBOX_UID}"]},
            {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs", "options": [size, "mode=1777"]},
        ]
        for name in GUEST_FILES:
            mounts.append({"destination": f"{GUEST_MOUNT}/{name}", "type": "bind",
                           "source": str(GUEST_DIR / name), "options": ["bind", "ro"]})
        for path in self.readonly_paths:
            if os.path.exists(path):
                mounts.append({"destination": path, "type": "bind", "source": path, "options": ["rbind", "ro"]})
        config = {
            "workspace": WORKSPACE,
            "spool": "/tmp",
            "path": SANDBOX_PATH,
            "max_output_bytes": limits.max_output_bytes,
            "exec_timeout_s": limits.exec_timeout_s,
            "exec_rlimits": exec_rlimits(cpu_s=limits.cpu_s, file_size_mb=limits.file_size_mb,
                                         memory_mb=limits.memory_mb),
            "nproc": limits.pids,
        }
        return {
            "ociVersion": "1.0.2",
            "process": {
                "terminal": False,
                "user": {"uid": SANDBOX_UID, "gid": SANDBOX_UID},
                "args": [self.python, "-I", "-S", f"{GUEST_MOUNT}/guest.py", json.dumps(config)],
                "env": [*(f"{k}={v}" for k, v in GUEST_ENV.items()), f"HOME={WORKSPACE}"],
                "cwd": WORKSPACE,
                "capabilities": {},
                "noNewPrivileges": True,
            },
            "root": {"path": str(self.rootfs), "readonly": True},
            "hostname": "sandbox",
            "mounts": mounts,
            "linux": {
                "namespaces": [{"type": t} for t in ("pid", "network", "ipc", "uts", "mount")],
                "resources": {"memory": {"limit": (limits.memory_mb + SENTRY_OVERHEAD_MB) * 1024 * 1024}},
                "cgroupsPath": cgroup_path,
            },
        }

    def enforcement(self, limits: SandboxLimits, *, network: bool) -> dict[str, str]:
        return {
            "isolation": "gVisor (runsc): user-space kernel, OCI bundle, read-only minimal root",
            "memory": "rlimit (RLIMIT_AS per exec) + cgroup on the whole sandbox (past it, the sandbox dies)",
            "pids": "rlimit (RLIMIT_NPROC inside gVisor)",
            "workspace": f"gVisor tmpfs quota {limits.workspace_mb} MiB",
            "cpu": "rlimit (RLIMIT_CPU per exec)",
            "file_size": "rlimit (RLIMIT_FSIZE per exec)",
            "uid": f"uid {SANDBOX_UID} inside gVisor",
            "network": "gVisor netstack with host network" if network else "none (--network=none)",
        }

    def _runsc(self, *args: str) -> None:
        try:
            subprocess.run([self.runsc, f"--root={self.state}", *args], capture_output=True,
                           timeout=RUNSC_TIMEOUT_S, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise BackendFailedError("runsc failed", backend=self.name, reason=str(exc), argv0=args[0]) from exc

    def self_test(self) -> None:
        """Start a sandbox, run ``true`` and read a tool script; BackendUnavailableError when
        any of that fails."""
        check_backend(self)


def _make_rootfs(rootfs: Path, mount_points: Sequence[str]) -> None:
    """The read-only root every sandbox of this backend shares."""
    for directory in ("usr", "proc", "dev", "tmp", "etc", WORKSPACE.lstrip("/"), GUEST_MOUNT.lstrip("/")):
        (rootfs / directory).mkdir(parents=True, exist_ok=True)
    for link in ("bin", "lib", "lib64", "sbin"):
        host = Path("/") / link
        if host.is_symlink() and not (rootfs / link).is_symlink():
            (rootfs / link).symlink_to(os.readlink(host))
    for path in mount_points:
        (rootfs / path.lstrip("/")).mkdir(parents=True, exist_ok=True)
    for name in GUEST_FILES:
        (rootfs / GUEST_MOUNT.lstrip("/") / name).touch()
    for name in ETC_COPIES:
        source = Path("/etc") / name
        if source.exists():
            shutil.copyfile(source, rootfs / "etc" / name)
    (rootfs / "etc" / "passwd").write_text(
        f"root:x:0:0:root:/nonexistent:/usr/sbin/nologin\nsandbox:x:{SANDBOX_UID}:{SANDBOX_UID}::{WORKSPACE}:/bin/sh\n")
    (rootfs / "etc" / "group").write_text(f"root:x:0:\nsandbox:x:{SANDBOX_UID}:\n")
    (rootfs / "etc" / "hosts").write_text("127.0.0.1 localhost\n::1 localhost\n")
    for path in rootfs.rglob("*"):
        if not path.is_symlink():
            path.chmod(0o755 if path.is_dir() else 0o644)
    rootfs.chmod(0o755)


def _missing_cgroup_dirs(cgroup_path: str, *, existing: bool = False) -> list[Path]:
    """``cgroup_path`` in every mounted hierarchy and those of its parents that do not exist
    (``existing``: the leaf in every hierarchy, whatever exists), deepest first."""
    found = []
    for hierarchy in Path("/sys/fs/cgroup").iterdir():
        if not (hierarchy / "cgroup.procs").exists():
            continue  # not a hierarchy (cgroup v2's files, a tmpfs leftover)
        directory = hierarchy / cgroup_path.lstrip("/")
        if existing:
            found.append(directory)
            continue
        while directory != hierarchy and not directory.exists():
            found.append(directory)
            directory = directory.parent
    return sorted(found, key=lambda d: len(d.parts), reverse=True)


def _own_cgroup(controller: str) -> str:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(","):
            return path
    return "/"


# Deprecated name (issue 24: the guest was "agent"), removed in the next release.
__getattr__ = forward_moved_names(__name__, {
    "AGENT_MOUNT": "rollmesh.sandbox.runsc_backend:GUEST_MOUNT",
})
