"""The seam between the sandbox broker and the sandbox runtimes: what a backend creates (a live
``Sandbox`` with a persistent guest inside) and what each operation returns.

Knows the standard library only; nothing of leases, messages, NATS or Ray. The broker decides
what a result means for a lease or a rollout; a backend only reports what happened.

A sandbox lives from ``create`` to ``destroy``: one long-lived isolated process tree (for
bubblewrap: one ``bwrap`` whose command is the guest, ``guest.py``) whose workspace is private to
it. Exec, upload and download talk to that guest over pipes, so no call pays a process and
namespace start. A sandbox that died (its guest is gone) raises ``SandboxDiedError`` on every
later call.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Literal, Protocol

# How one exec ended. "exit": the command exited by itself (any code). "timeout": it ran past
# its wall-clock limit and was killed. "oom": the memory limit killed it. "signal": a signal
# ended it (exit_code None, signal N). "output_truncated": its output passed the cap and it was
# killed. "sandbox_died": the sandbox (guest) died under it. "infra_error": the runtime failed
# to run it at all (the command's fault is never reported as this).
ExecResultKind = Literal[
    "exit", "timeout", "oom", "signal", "output_truncated", "sandbox_died", "infra_error"
]
OutputStream = Literal["stdout", "stderr"]
# Called with each chunk of output as the command produces it (for progress streaming).
OutputCallback = Callable[[OutputStream, bytes], Awaitable[None] | None]


@dataclass(frozen=True, slots=True)
class SandboxLimits:
    """Per-sandbox limits. The defaults are the documented default profile; a lease may ask for
    more, up to the maxima in the broker's config."""

    memory_mb: int = 2048  # cgroup memory limit (or RLIMIT_AS where there are no cgroups)
    pids: int = 256  # cgroup pids.max (or RLIMIT_NPROC for the sandbox's own uid)
    workspace_mb: int = 2048  # workspace disk quota
    exec_timeout_s: float = 600.0  # default and maximum wall-clock time of one exec
    cpu_s: int = 600  # RLIMIT_CPU of each exec'd process
    file_size_mb: int = 1024  # RLIMIT_FSIZE
    max_output_bytes: int = 1024 * 1024  # stdout + stderr kept per exec; beyond: truncated


@dataclass(frozen=True, slots=True)
class ExecOutcome:
    result: ExecResultKind
    exit_code: int | None  # the command's exit code ("exit"), else None
    signal: int | None  # the signal that ended it ("signal", "oom" if known), else None
    truncated: bool
    stdout: bytes
    stderr: bytes
    duration_s: float
    cpu_s: float = 0.0
    detail: str = ""  # why, for infra_error / sandbox_died / oom


@dataclass(frozen=True, slots=True)
class FileTransfer:
    path: str  # inside the workspace, relative
    size: int
    sha256: str  # hex digest computed inside the sandbox of exactly the bytes stored / read


@dataclass(frozen=True, slots=True)
class SandboxInfo:
    sandbox_id: str
    backend: str
    isolated: bool
    limits: SandboxLimits
    enforcement: dict[str, str] = field(default_factory=dict)  # e.g. {"memory": "cgroup v1"}


class Sandbox(Protocol):
    info: SandboxInfo

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
        key: str = "",  # the exec's id: a supervised sandbox runs one key once (sandbox.md)
    ) -> ExecOutcome: ...

    # Checksums: the sandbox side hashes what it stored or read. With ``expected_sha256`` (the
    # sender's digest) a put compares against it and raises ``ChecksumMismatchError``; without,
    # the caller's copy is hashed here. ``verify=False`` skips hashing here, for a caller that
    # passes the sandbox's digest on to the other end, which checks it (end to end).

    async def put_file(self, path: str, data: bytes, *, mode: int = 0o644,
                       expected_sha256: str | None = None, verify: bool = True) -> FileTransfer: ...

    async def get_file(self, path: str, *, verify: bool = True) -> tuple[bytes, FileTransfer]: ...

    async def put_tar(self, path: str, tar_bytes: bytes, *, expected_sha256: str | None = None,
                      verify: bool = True) -> FileTransfer:
        """Extract a tar into ``path`` (a workspace directory), refusing absolute names, ``..``
        and links that point outside the workspace (``UnsafeArchiveError``)."""
        ...

    async def get_tar(self, path: str, *, verify: bool = True) -> tuple[bytes, FileTransfer]:
        """A tar of ``path`` (a workspace directory or file); "." is the whole workspace."""
        ...

    def alive(self) -> bool: ...

    async def destroy(self) -> None: ...


class SandboxBackend(Protocol):
    name: str
    isolated: bool

    async def create(self, sandbox_id: str, limits: SandboxLimits, *, network: bool = False,
                     profile: str = "default") -> Sandbox:
        """``profile``: whose image (root, Python environment, egress) the sandbox shows; a
        backend given no images for it shows its default root."""
        ...

    def self_test(self) -> None: ...
