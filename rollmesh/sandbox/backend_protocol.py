"""What every sandbox backend promises: the ``SandboxBackend`` Protocol and its ``ExecResult``.

Knows the standard library only; nothing of leases, messages, NATS or Ray. A backend runs one
command to completion (or to its limits) and reports; it never decides what a failure means for a
rollout: that mapping belongs to the broker.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

# Tool code gets exactly these variables (plus HOME): nothing of the broker's environment, so
# API keys and tokens of the actor never reach it.
SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"
SANDBOX_LANG = "C.UTF-8"


def clean_environment(home: str) -> dict[str, str]:
    return {"PATH": SANDBOX_PATH, "HOME": home, "LANG": SANDBOX_LANG}


@dataclass(frozen=True, slots=True)
class ExecResult:
    """One command's outcome.

    ``exit_code`` follows the shell convention: 128 + N when a signal N ended the command (137
    after a kill). ``truncated``: the output went over ``max_output_bytes`` and the command was
    killed; stdout/stderr hold what came before the cap.
    """

    exit_code: int
    stdout: str
    stderr: str
    duration_s: float
    timed_out: bool = False
    truncated: bool = False


class SandboxBackend(Protocol):
    """Runs commands in a lease's private directory, with limits.

    ``workdir`` is the lease's own directory and the command's cwd. Its parent holds only other
    leases' directories, so an isolating backend hides the parent. Failing to run the command at
    all raises ``BackendFailedError``; anything the command itself does is an ``ExecResult``.
    """

    name: str
    isolated: bool

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
    ) -> ExecResult: ...
