"""The bare process backend: a plain subprocess in the lease's directory. Development only.

Knows the limits runner and structlog; nothing of leases. It keeps the limits (time, memory,
output, clean environment) but isolates NOTHING: tool code can read and write anything the broker
can and use the network. It ignores ``network`` and ``writable_root``: both are always "yes".
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import structlog

from rollmesh.sandbox.backend_protocol import SANDBOX_PATH, ExecResult, clean_environment
from rollmesh.sandbox.errors import BackendFailedError
from rollmesh.sandbox.limited_process import run_limited

log = structlog.get_logger(__name__)


class ProcessBackend:
    name = "process"
    isolated = False

    def __init__(self) -> None:
        log.warning("process sandbox backend isolates NOTHING: development only", backend=self.name)

    async def run(
        self,
        argv: list[str],
        *,
        stdin: str,
        timeout_s: float,
        workdir: Path,
        network: bool,
        writable_root: bool,
        max_output_bytes: int,
        memory_limit_mb: int,
    ) -> ExecResult:
        # Checked here because prlimit would report a missing program as exit 127, while bwrap
        # reports it as a sandbox failure; both backends must agree.
        if not _is_runnable(argv[0], workdir):
            raise BackendFailedError(
                "no such program in the sandbox", backend=self.name, reason=argv[0], argv0=argv[0]
            )
        try:
            return await run_limited(
                argv,
                env=clean_environment(str(workdir)),
                cwd=str(workdir),
                stdin=stdin.encode(),
                timeout_s=timeout_s,
                max_output_bytes=max_output_bytes,
                memory_limit_mb=memory_limit_mb,
            )
        except OSError as exc:
            raise BackendFailedError(
                "could not start the command", backend=self.name, reason=str(exc), argv0=argv[0]
            ) from exc


def _is_runnable(program: str, workdir: Path) -> bool:
    if "/" not in program:
        return shutil.which(program, path=SANDBOX_PATH) is not None
    path = workdir / program  # an absolute program replaces workdir in the join
    return path.is_file() and os.access(path, os.X_OK)
