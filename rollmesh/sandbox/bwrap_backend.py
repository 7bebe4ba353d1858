"""The bubblewrap backend: every command is a fresh ``bwrap`` process around the tool.

Knows bwrap's command line and the limits runner; nothing of leases or messages. What one
command gets: the host root read-only, new user/pid/net/ipc/uts/cgroup namespaces (so only a
loopback with nothing on it), no capabilities, private /tmp, /dev and /proc, a clean environment,
and the lease's directory read-write as cwd. Every other lease's directory is hidden.

bwrap has no time or memory limits and cgroups are not ours to use, so the limits come from the
runner: RLIMIT_AS via prlimit, and SIGKILL to the process group, which holds bwrap's pid-namespace
init; when it dies the kernel kills everything left in the namespace, setsid or not.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from rollmesh.sandbox.backend_protocol import ExecResult, clean_environment
from rollmesh.sandbox.errors import BackendFailedError, BackendUnavailableError
from rollmesh.sandbox.limited_process import run_limited
from rollmesh.sandbox.tool_paths import TOOLS_DIR

SELF_TEST_TIMEOUT_S = 10.0


class BwrapBackend:
    """``workdir_mount``: where the lease's directory appears inside; None = at its host path.

    The host path is the default because tool scripts live in the rollmesh checkout, and a
    fixed mount such as ``/work`` hides them whenever the checkout sits below that path (as it
    does in our dev tree, /work/main). A fixed mount must already exist on the host: the root is
    read-only, so bwrap cannot create it.
    """

    name = "bwrap"
    isolated = True

    def __init__(self, *, bwrap: str | None = None, workdir_mount: str | None = None,
                 readonly_paths: Sequence[str] = ()) -> None:
        found = bwrap or shutil.which("bwrap")
        if not found:
            raise BackendUnavailableError("bubblewrap is not installed", backend=self.name, reason="no bwrap on PATH")
        if workdir_mount is not None and not Path(workdir_mount).is_dir():
            raise BackendUnavailableError(
                "workdir_mount must be an existing directory on the host",
                backend=self.name,
                reason=workdir_mount,
            )
        self.bwrap = found
        self.workdir_mount = workdir_mount
        # Our own tool scripts must stay visible wherever the project is installed, /tmp included
        # (a CI clone under /tmp would otherwise vanish under the sandbox's private /tmp).
        self.readonly_paths = [str(TOOLS_DIR), *(str(Path(p).resolve()) for p in readonly_paths)]

    def build_argv(
        self, argv: list[str], *, workdir: Path, network: bool, writable_root: bool, status_fd: int
    ) -> list[str]:
        inside = self.workdir_mount or str(workdir)
        # No --new-session: the runner already starts bwrap in a new session with no controlling
        # terminal (what --new-session guards against), and bwrap's --new-session would move the
        # sandbox's init out of the process group we kill. --die-with-parent alone is not
        # enough: a child killed early in its setup can miss it.
        wrapped = [self.bwrap, "--die-with-parent", "--unshare-all"]
        if network:
            wrapped.append("--share-net")
        # Capabilities would be confined to the new user namespace anyway; dropping them all
        # also stops tool code from mounting over what we set up.
        wrapped += ["--cap-drop", "ALL"]
        # writable_root writes through to the HOST root (bwrap 0.8 has no overlay); the broker
        # refuses it until a backend can give a private writable root.
        wrapped += ["--bind" if writable_root else "--ro-bind", "/", "/"]
        wrapped += ["--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp"]
        for path in self.readonly_paths:
            wrapped += ["--ro-bind-try", path, path]
        if workdir.parent != Path("/"):
            wrapped += ["--tmpfs", str(workdir.parent)]  # other leases live beside this one
        wrapped += ["--bind", str(workdir), inside, "--chdir", inside, "--clearenv"]
        for key, value in clean_environment(inside).items():
            wrapped += ["--setenv", key, value]
        wrapped += ["--json-status-fd", str(status_fd), "--", *argv]
        return wrapped

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
        status_read, status_write = os.pipe()
        try:
            wrapped = self.build_argv(
                argv, workdir=workdir, network=network, writable_root=writable_root, status_fd=status_write
            )
            try:
                result = await run_limited(
                    wrapped,
                    env=clean_environment(str(workdir)),
                    cwd=str(workdir),
                    stdin=stdin.encode(),
                    timeout_s=timeout_s,
                    max_output_bytes=max_output_bytes,
                    memory_limit_mb=memory_limit_mb,
                    pass_fds=(status_write,),
                )
            except OSError as exc:
                raise BackendFailedError(
                    "could not start bwrap", backend=self.name, reason=str(exc), argv0=argv[0]
                ) from exc
            os.close(status_write)
            status_write = -1
            status = _read_status(status_read)
        finally:
            os.close(status_read)
            if status_write >= 0:
                os.close(status_write)
        if result.timed_out or result.truncated:
            return result  # we killed it, so bwrap never got to report an exit
        if "exit-code" not in status:
            # bwrap failed before or at exec (bad mount, missing program): the sandbox failed,
            # not the tool, so this must not reach the rollout as an ordinary tool result.
            raise BackendFailedError(
                "bwrap did not run the command",
                backend=self.name,
                reason=result.stderr.strip()[-500:],
                argv0=argv[0],
            )
        return replace(result, exit_code=int(status["exit-code"]))

    def self_test(self) -> None:
        """Run ``true`` in a throwaway sandbox; raise BackendUnavailableError if that fails.

        Synchronous on purpose: it runs once, at start-up, before any event loop work.
        """
        with tempfile.TemporaryDirectory(prefix="rollmesh-bwrap-selftest-") as tmp:
            workdir = Path(tmp) / "lease"
            workdir.mkdir()
            argv = self.build_argv(["true"], workdir=workdir, network=False, writable_root=False, status_fd=1)
            try:
                done = subprocess.run(
                    argv,
                    env=clean_environment(str(workdir)),
                    cwd=workdir,
                    capture_output=True,
                    timeout=SELF_TEST_TIMEOUT_S,
                    check=False,
                )
            except (OSError, subprocess.TimeoutExpired) as exc:
                raise BackendUnavailableError("bwrap self-test failed", backend=self.name, reason=str(exc)) from exc
            if done.returncode != 0:
                reason = done.stderr.decode(errors="replace").strip()[-500:] or f"exit {done.returncode}"
                raise BackendUnavailableError("bwrap self-test failed", backend=self.name, reason=reason)


def _read_status(fd: int) -> dict[str, object]:
    """Merge bwrap's JSON status documents ({"child-pid": ...} then {"exit-code": ...}).

    Read without blocking: bwrap wrote everything before it exited, and a lingering sandboxed
    process must not make us wait for an EOF.
    """
    os.set_blocking(fd, False)
    data = b""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            break
        if not chunk:
            break
        data += chunk
    merged: dict[str, object] = {}
    decoder = json.JSONDecoder()
    text = data.decode(errors="replace")
    index = 0
    while index < len(text):
        while index < len(text) and text[index].isspace():
            index += 1
        if index >= len(text):
            break
        try:
            document, index = decoder.raw_decode(text, index)
        except json.JSONDecodeError:
            break
        if isinstance(document, dict):
            merged.update(document)
    return merged
