"""The bare process backend: the guest as a plain subprocess, its workspace a host temp
directory. Development only.

Knows the guest's config and structlog; nothing of leases. It keeps the per-exec limits (time,
output, RLIMIT_CPU / FSIZE / AS, a clean environment) and the workspace path checks, but
isolates NOTHING: tool code can read and write anything the broker can, signal the broker's
processes and use the network; there is no workspace quota and no process limit.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from rollmesh.sandbox.guest_client import START_TIMEOUT_S, GuestSandbox
from rollmesh.sandbox.limits import exec_rlimits
from rollmesh.sandbox.sandbox_protocol import SandboxInfo, SandboxLimits
from rollmesh.sandbox.tool_paths import GUEST_DIR, GUEST_ENV, SANDBOX_PATH, python_for_sandbox

if TYPE_CHECKING:
    from rollmesh.sandbox.supervisor_client import SupervisorClient

log = structlog.get_logger(__name__)

ENFORCEMENT = {
    "isolation": "none: a plain host process (development only)",
    "memory": "rlimit (RLIMIT_AS per exec)",
    "pids": "none",
    "workspace": "none: a host directory without quota",
    "cpu": "rlimit (RLIMIT_CPU per exec)",
    "file_size": "rlimit (RLIMIT_FSIZE per exec)",
    "uid": "the broker's uid",
    "network": "host network",
}


class ProcessBackend:
    name = "process"
    isolated = False
    supervisor: SupervisorClient | None = None  # set: sandboxes are spawned and held by it

    def __init__(self, *, root_dir: str | Path | None = None, start_timeout_s: float = START_TIMEOUT_S) -> None:
        self.root_dir = str(root_dir) if root_dir is not None else None
        self.start_timeout_s = start_timeout_s
        log.warning("process sandbox backend isolates NOTHING: development only", backend=self.name)

    async def create(self, sandbox_id: str, limits: SandboxLimits, *, network: bool = False,
                     profile: str = "default") -> GuestSandbox:
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", sandbox_id)[:64]
        if self.root_dir is not None:
            os.makedirs(self.root_dir, exist_ok=True)
        home = tempfile.mkdtemp(prefix=f"rollmesh-sandbox-{safe}-", dir=self.root_dir)
        workspace, spool = os.path.join(home, "workspace"), os.path.join(home, "spool")
        os.mkdir(workspace)
        os.mkdir(spool, 0o700)
        config = {
            "workspace": workspace,
            "spool": spool,
            "path": SANDBOX_PATH,
            "max_output_bytes": limits.max_output_bytes,
            "exec_timeout_s": limits.exec_timeout_s,
            "exec_rlimits": exec_rlimits(cpu_s=limits.cpu_s, file_size_mb=limits.file_size_mb,
                                         memory_mb=limits.memory_mb),
        }
        info = SandboxInfo(sandbox_id=sandbox_id, backend=self.name, isolated=False, limits=limits,
                           enforcement=dict(ENFORCEMENT))
        argv = [python_for_sandbox(), "-I", "-S", str(GUEST_DIR / "guest.py"), json.dumps(config)]
        options: dict = {"cleanup": lambda: remove_tree(home), "graceful_exit_s": 1.0}
        if self.supervisor is not None:
            options = self.supervisor.launch_options(info, kill_tree=None, oom_kills=None, home=home, **options)
        return await GuestSandbox.launch(info, argv, env=dict(GUEST_ENV), cwd=workspace,
                                         start_timeout_s=self.start_timeout_s, **options)

    def self_test(self) -> None:
        """Nothing to check: a plain subprocess always works."""


def remove_tree(path: str) -> None:
    """Remove ``path`` even where a command left directories without write permission."""

    def make_writable_and_retry(function, failed_path, _exc_info) -> None:  # noqa: ANN001
        parent = os.path.dirname(failed_path)
        try:
            os.chmod(parent, os.stat(parent).st_mode | stat.S_IRWXU)
            if os.path.isdir(failed_path) and not os.path.islink(failed_path):
                os.chmod(failed_path, os.stat(failed_path).st_mode | stat.S_IRWXU)
            function(failed_path)
        except OSError:
            pass

    shutil.rmtree(path, onerror=make_writable_and_retry)
