"""The bubblewrap backend: one long-lived ``bwrap`` per sandbox, whose command is the guest.

Knows bwrap's command line, the host's cgroups and uids (``limits``) and the guest's config;
nothing of leases. What a sandbox gets, and why:

* ``--unshare-all`` (user, pid, net, ipc, uts, cgroup namespaces; ``--share-net`` only when the
  lease asks for network), ``--die-with-parent``, ``--new-session``, ``--cap-drop ALL``, and
  ``--as-pid-1``: the guest is the sandbox's init, so signals from inside cannot kill it, no
  bwrap process inside holds the host's pipes (where same-uid code could ptrace it), and when
  the guest dies the kernel ends everything in the sandbox.
* A minimal read-only root built on bwrap's own tmpfs, never the host's ``/``: ``/usr``
  read-only, the merged-usr links (``/bin``, ``/lib``, ``/lib64``, ``/sbin``) as they are on the
  host, a few ``/etc`` files (the loader cache, nsswitch, localtime, alternatives; a synthesized
  passwd, group and hosts; with network also resolv.conf and the CA store), fresh ``/proc`` and
  ``/dev``, then ``/`` and ``/dev`` remounted read-only (writes fail with EROFS). A profile with
  an image root (``dir:``/``oci:``, ``images.py``) shows that root instead, entry by entry
  (``bwrap_mounts``), and runs the guest with the host's Python bound at ``/.rollmesh/python``
  (``host_python``), since the root may have none; its Python environment is bound read-only at
  ``/.rollmesh/venv`` and first on PATH.
* ``network_allow``: still no network namespace access; a forwarder outside (``egress``) listens
  on a Unix socket bound at ``/.rollmesh/egress.sock`` and connects only to the allowed pairs.
* Writable only: ``/workspace`` (the cwd and HOME), a tmpfs of ``workspace_mb`` (the quota:
  ENOSPC past it), ``/tmp`` (as large, also the guest's tar spool) and ``/dev/shm`` (small).
  tmpfs pages are charged to the sandbox's memory cgroup, so files count as memory there.
* Read-only at their host paths: the tool scripts (``TOOLS_DIR``) and the configured
  ``readonly_paths``; the guest's files at ``/.rollmesh``. They must be readable by the
  sandbox's uid (world-readable), which ``self_test`` checks.
* When the broker runs as root: each sandbox runs as its own host uid (``setpriv``, an argv
  prefix rather than a ``preexec_fn``, because the broker's Ray actor has threads), so
  RLIMIT_NPROC and file ownership are per sandbox. Not root: the broker's uid.
* Per-sandbox cgroup (v2, else v1 memory + pids) with ``memory_mb`` and ``pids``; the OOM-kill
  counter lets the client report "oom". Without usable cgroups: RLIMIT_AS per exec and
  RLIMIT_NPROC on the guest (counted per user namespace, hence per sandbox).
  ``SandboxInfo.enforcement`` records which. On this project's dev host (Debian 12, root,
  cgroup v1 memory + pids mounted, a v2 hierarchy without controllers) that is cgroup v1.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from rollmesh.moved_names import forward_moved_names
from rollmesh.sandbox.backend_check import check_backend
from rollmesh.sandbox.bwrap_mounts import host_root_args, image_root_args, shown_in_image
from rollmesh.sandbox.egress import EGRESS_SOCKET, EgressForwarder
from rollmesh.sandbox.errors import BackendFailedError, BackendUnavailableError, SandboxError
from rollmesh.sandbox.guest_client import START_TIMEOUT_S, GuestSandbox
from rollmesh.sandbox.host_python import HostPython, host_python
from rollmesh.sandbox.images import SandboxImage
from rollmesh.sandbox.limits import (
    CgroupManager,
    SandboxCgroup,
    UidLease,
    UidPool,
    exec_rlimits,
    owned_cgroup_name,
)
from rollmesh.sandbox.python_env import ENV_MOUNT
from rollmesh.sandbox.sandbox_protocol import SandboxInfo, SandboxLimits
from rollmesh.sandbox.tool_paths import GUEST_DIR, GUEST_ENV, GUEST_FILES, SANDBOX_PATH, SYSTEM_PYTHON, TOOLS_DIR

if TYPE_CHECKING:
    from rollmesh.sandbox.supervisor_client import SupervisorClient

GUEST_MOUNT = "/.rollmesh"
WORKSPACE = "/workspace"
SHM_MB = 64


class BwrapBackend:
    name = "bwrap"
    isolated = True
    supervisor: SupervisorClient | None = None  # set: sandboxes are spawned and held by it

    def __init__(self, *, bwrap: str | None = None, readonly_paths: Sequence[str] = (),
                 python: str = SYSTEM_PYTHON, use_cgroups: bool = True, uid_pool: UidPool | None = None,
                 start_timeout_s: float = START_TIMEOUT_S, images: Mapping[str, SandboxImage] | None = None) -> None:
        found = bwrap or shutil.which("bwrap")
        if not found:
            raise BackendUnavailableError("bubblewrap is not installed", backend=self.name, reason="no bwrap on PATH")
        self.bwrap = found
        self.python = python
        self.start_timeout_s = start_timeout_s
        self.readonly_paths = [str(TOOLS_DIR), *(str(Path(p).resolve()) for p in readonly_paths)]
        # Per profile (those with an image; the others get today's host view), prepared before
        # any lease: the root's arguments are computed here once, not per sandbox.
        self.images = dict(images or {})
        self._root_args = {(name, network): image_root_args(image.root_dir, network=network)
                           for name, image in self.images.items() if image.root_dir is not None
                           for network in (False, True)}
        self._image_paths = {name: shown_in_image(image.root_dir, self.readonly_paths)
                             for name, image in self.images.items() if image.root_dir is not None}
        self.host_python: HostPython | None = (
            host_python(python) if any(i.root_dir is not None for i in self.images.values()) else None)
        self.cgroups: CgroupManager | None = None
        self.cgroup_reason = "disabled"
        if use_cgroups:
            self.cgroups, self.cgroup_reason = CgroupManager.detect()
            if self.cgroups is not None:
                self.cgroups.sweep()
        self.setpriv: str | None = None
        self.uids: UidPool | None = None
        if os.geteuid() == 0:
            self.setpriv = shutil.which("setpriv")
            if self.setpriv is None:
                raise BackendUnavailableError(
                    "running as root needs setpriv (util-linux) to give each sandbox its own uid",
                    backend=self.name, reason="no setpriv on PATH")
            self.uids = uid_pool or UidPool()

    # ---- create ------------------------------------------------------------------------------

    async def create(self, sandbox_id: str, limits: SandboxLimits, *, network: bool = False,
                     profile: str = "default") -> GuestSandbox:
        image = self.images.get(profile)
        uid = self.uids.acquire() if self.uids is not None else None
        cgroup: SandboxCgroup | None = None
        egress: EgressForwarder | None = None
        data_fds: list[int] = []
        try:
            if image is not None and image.network_allow and not network:
                egress = EgressForwarder(image.network_allow)
                if self.supervisor is not None:
                    egress.listen()  # the supervisor serves it: the allowlist outlives this broker
                else:
                    await egress.start()
            if self.cgroups is not None:
                cgroup = self.cgroups.create(owned_cgroup_name(sandbox_id), memory_mb=limits.memory_mb, pids=limits.pids)
            sandbox_uid = uid.uid if uid is not None else os.getuid()
            argv, data_fds = self.build_argv(limits, network=network, uid=sandbox_uid, cgroup=cgroup, image=image,
                                             egress_socket=egress.socket_path if egress is not None else None)
        except (OSError, SandboxError) as exc:
            _release(cgroup, uid, egress)
            raise BackendFailedError("could not prepare the sandbox", backend=self.name, reason=str(exc)) from exc
        info = SandboxInfo(sandbox_id=sandbox_id, backend=self.name, isolated=True, limits=limits,
                           enforcement=self.enforcement(limits, network=network, cgroup=cgroup, uid=uid,
                                                        image=image, egress=egress is not None))
        try:
            # Without a cgroup, killing bwrap's session is enough: its pid-namespace init dies
            # with it (--die-with-parent) and takes every process in the namespace along.
            options: dict = {"kill_tree": cgroup.kill_all if cgroup is not None else None,
                             "cleanup": lambda: _release(cgroup, uid, egress),
                             "oom_kills": cgroup.oom_kills if cgroup is not None else None}
            if self.supervisor is not None:
                options = self.supervisor.launch_options(info, cgroup=cgroup, uid=uid, egress=egress, **options)
            sandbox = await GuestSandbox.launch(
                info, argv, env={"PATH": SANDBOX_PATH}, pass_fds=data_fds, start_timeout_s=self.start_timeout_s,
                **options)
        finally:
            for fd in data_fds:
                os.close(fd)
        return sandbox

    def build_argv(self, limits: SandboxLimits, *, network: bool, uid: int, cgroup: SandboxCgroup | None,
                   image: SandboxImage | None = None, egress_socket: str | None = None) -> tuple[list[str], list[int]]:
        """The full command line (cgroup join, uid switch, bwrap, guest) and the fds it reads
        synthesized files from (the caller closes them once the sandbox started). ``image``: the
        profile's (None: the host's minimal view, no environment)."""
        fds: list[int] = []

        def data(name: str, text: str) -> str:
            # Close-on-exec like every fd we open: pass_fds hands it to this sandbox's bwrap
            # only, never to a process another thread starts meanwhile.
            fd = os.memfd_create(f"rollmesh-{name}")
            os.write(fd, text.encode())
            os.lseek(fd, 0, os.SEEK_SET)
            fds.append(fd)
            return str(fd)

        prefix: list[str] = []
        if cgroup is not None:
            prefix += cgroup.join_argv()
        if self.setpriv is not None:
            prefix += [self.setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]
        args = [self.bwrap, "--unshare-all"]
        if network:
            args.append("--share-net")
        # --as-pid-1: the guest is the namespace's init, so no bwrap process inside holds the
        # host's pipes where code in the sandbox (same uid) could ptrace it, signals from inside
        # cannot kill the guest, and when it dies everything in the sandbox dies with it.
        args += ["--as-pid-1", "--die-with-parent", "--new-session", "--cap-drop", "ALL"]
        image_root = image is not None and image.root_dir is not None
        if image_root:
            args += self._root_args[(image.profile, network)]  # type: ignore[union-attr]
        else:
            args += host_root_args(network=network)
        args += ["--perms", "0644", "--ro-bind-data", data("passwd", _passwd(uid)), "/etc/passwd"]
        args += ["--perms", "0644", "--ro-bind-data", data("group", _group(uid)), "/etc/group"]
        if not network:
            args += ["--perms", "0644", "--ro-bind-data", data("hosts", "127.0.0.1 localhost\n::1 localhost\n"),
                     "/etc/hosts"]
        workspace_bytes = str(limits.workspace_mb * 1024 * 1024)
        args += ["--proc", "/proc", "--dev", "/dev",
                 "--size", str(min(SHM_MB, limits.workspace_mb) * 1024 * 1024), "--tmpfs", "/dev/shm",
                 "--size", workspace_bytes, "--perms", "1777", "--tmpfs", "/tmp",
                 "--size", workspace_bytes, "--perms", "0755", "--tmpfs", WORKSPACE]
        args += ["--perms", "0755", "--dir", GUEST_MOUNT]
        for name in GUEST_FILES:
            args += ["--ro-bind", str(GUEST_DIR / name), f"{GUEST_MOUNT}/{name}"]
        python = [self.python]
        if image_root:
            assert self.host_python is not None
            for source, inside in self.host_python.binds:
                args += ["--ro-bind", source, inside]
            python = list(self.host_python.argv)
        command_path = SANDBOX_PATH
        if image is not None and image.venv is not None:
            args += ["--ro-bind", str(image.venv), ENV_MOUNT]
            command_path = f"{ENV_MOUNT}/bin:{SANDBOX_PATH}"
        if egress_socket is not None:
            args += ["--bind", egress_socket, EGRESS_SOCKET]
        for path in self._image_paths[image.profile] if image_root else self.readonly_paths:  # type: ignore[union-attr]
            args += ["--ro-bind-try", path, path]
        args += ["--remount-ro", "/", "--remount-ro", "/dev", "--chdir", WORKSPACE, "--clearenv"]
        for key, value in GUEST_ENV.items():
            args += ["--setenv", key, value]
        args += ["--setenv", "HOME", WORKSPACE]
        config = {
            "workspace": WORKSPACE,
            "spool": "/tmp",
            "path": command_path,
            "max_output_bytes": limits.max_output_bytes,
            "exec_timeout_s": limits.exec_timeout_s,
            "exec_rlimits": exec_rlimits(cpu_s=limits.cpu_s, file_size_mb=limits.file_size_mb,
                                         memory_mb=None if cgroup is not None else limits.memory_mb),
            "nproc": limits.pids,
            "child_oom_score_adj": 1000,
        }
        args += ["--", *python, "-I", "-S", f"{GUEST_MOUNT}/guest.py", json.dumps(config)]
        return prefix + args, fds

    def enforcement(self, limits: SandboxLimits, *, network: bool, cgroup: SandboxCgroup | None,
                    uid: UidLease | None, image: SandboxImage | None = None, egress: bool = False) -> dict[str, str]:
        by_cgroup = f"cgroup {cgroup.version}" if cgroup is not None else ""
        root = f"read-only image root ({image.describe()})" if image is not None else "read-only minimal root"
        if egress:
            assert image is not None
            net = f"none (own network namespace); egress forwarder outside to {', '.join(image.network_allow)}"
        else:
            net = "host network" if network else "none (own network namespace)"
        return {
            "isolation": f"bubblewrap namespaces (user, pid, net, ipc, uts, cgroup), {root}",
            "memory": by_cgroup or "rlimit (RLIMIT_AS per exec)",
            "pids": by_cgroup or "rlimit (RLIMIT_NPROC per sandbox user namespace)",
            "cgroups": by_cgroup or f"none: {self.cgroup_reason}",
            "workspace": f"tmpfs quota {limits.workspace_mb} MiB",
            "cpu": "rlimit (RLIMIT_CPU per exec)",
            "file_size": "rlimit (RLIMIT_FSIZE per exec)",
            "uid": f"dedicated host uid {uid.uid}" if uid is not None else "the broker's uid",
            "network": net,
        }

    def self_test(self) -> None:
        """Start a sandbox, run ``true`` and read a tool script; BackendUnavailableError when
        any of that fails. Synchronous: it runs once, at start-up."""
        check_backend(self)


def _release(cgroup: SandboxCgroup | None, uid: UidLease | None, egress: EgressForwarder | None = None) -> None:
    if egress is not None:
        egress.close()
    if cgroup is not None:
        cgroup.kill_all()
        cgroup.remove()
    if uid is not None:
        uid.release()


def _passwd(uid: int) -> str:
    return (f"root:x:0:0:root:/nonexistent:/usr/sbin/nologin\nsandbox:x:{uid}:{uid}:sandbox:{WORKSPACE}:/bin/sh\n"
            "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n")


def _group(uid: int) -> str:
    return f"root:x:0:\nsandbox:x:{uid}:\nnogroup:x:65534:\n"


# Deprecated name (issue 24: the guest was "agent"), removed in the next release.
__getattr__ = forward_moved_names(__name__, {
    "AGENT_MOUNT": "rollmesh.sandbox.bwrap_backend:GUEST_MOUNT",
})
