"""Real bubblewrap: the isolation the broker promises, checked from inside a sandbox."""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollmesh.config import SandboxConfig
from rollmesh.messages.sandbox import SandboxExecRequest, SandboxLeaseRequest, SandboxReleaseRequest
from rollmesh.sandbox import (
    BackendFailedError,
    BwrapBackend,
    ProcessBackend,
    SandboxBroker,
    python_for_sandbox,
    select_backend,
    tool_script_path,
)

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(60),
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed"),
]

LIMITS = {"network": False, "writable_root": False, "max_output_bytes": 64 * 1024, "memory_limit_mb": 512}
PY = [python_for_sandbox(), "-I", "-S", "-c"]


@pytest.fixture(scope="module")
def bwrap() -> BwrapBackend:
    backend = BwrapBackend()
    backend.self_test()
    return backend


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    path = tmp_path / "leases" / "lease-a"
    path.mkdir(parents=True)
    return path


@pytest.fixture
def listening_port() -> Iterator[int]:
    """A TCP port this test process listens on, so a refused connect means isolation."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        yield server.getsockname()[1]


def connect_script(port: int) -> str:
    return (
        "import socket\n"
        "try:\n"
        f"    socket.create_connection(('127.0.0.1', {port}), timeout=2).close()\n"
        "    print('connected')\n"
        "except OSError as exc:\n"
        "    print('blocked', type(exc).__name__)\n"
    )


async def test_molar_mass_tool_runs_in_the_sandbox(bwrap: BwrapBackend, workdir: Path) -> None:
    argv = [python_for_sandbox(), "-I", "-S", str(tool_script_path("molar_mass")), "K2NaN2"]
    result = await bwrap.run(argv, stdin="", timeout_s=20.0, workdir=workdir, **LIMITS)
    assert (result.exit_code, result.stdout, result.stderr) == (0, "129.200\n", "")


async def test_configured_readonly_paths_under_tmp_are_visible_and_read_only(workdir: Path, tmp_path: Path) -> None:
    """The sandbox's private /tmp would hide host paths under /tmp (a CI clone, a dataset)."""
    data = tmp_path / "dataset"
    data.mkdir()
    (data / "table.txt").write_text("42\n")
    backend = BwrapBackend(readonly_paths=[str(data)])
    script = f"cat {data}/table.txt; touch {data}/new 2>/dev/null && echo writable || echo read-only"
    result = await backend.run(["sh", "-c", script], stdin="", timeout_s=20.0, workdir=workdir, **LIMITS)
    assert result.stdout == "42\nread-only\n"
    hidden = await BwrapBackend().run(["cat", f"{data}/table.txt"], stdin="", timeout_s=20.0,
                                      workdir=workdir, **LIMITS)
    assert hidden.exit_code != 0  # without the setting, the private /tmp hides it


async def test_sandbox_has_no_network(bwrap: BwrapBackend, workdir: Path, listening_port: int) -> None:
    result = await bwrap.run([*PY, connect_script(listening_port)], stdin="", timeout_s=20.0, workdir=workdir, **LIMITS)
    assert result.stdout.startswith("blocked"), result
    # Control: the same probe without isolation does reach the port.
    control = await ProcessBackend().run(
        [*PY, connect_script(listening_port)], stdin="", timeout_s=20.0, workdir=workdir, **LIMITS
    )
    assert control.stdout == "connected\n"


async def test_root_is_read_only_while_the_workdir_is_writable(bwrap: BwrapBackend, workdir: Path) -> None:
    probe = f"rollmesh-probe-{random.getrandbits(32):x}"
    script = f"touch /usr/{probe}; echo usr=$?; touch /etc/{probe}; echo etc=$?; echo kept > out.txt; echo work=$?"
    result = await bwrap.run(["sh", "-c", script], stdin="", timeout_s=20.0, workdir=workdir, **LIMITS)
    assert "usr=1" in result.stdout and "etc=1" in result.stdout and "work=0" in result.stdout, result
    assert "Read-only file system" in result.stderr
    assert not Path(f"/usr/{probe}").exists() and not Path(f"/etc/{probe}").exists()
    assert (workdir / "out.txt").read_text() == "kept\n"


async def test_other_leases_are_hidden(bwrap: BwrapBackend) -> None:
    # Not under /tmp: the sandbox's private /tmp would hide the neighbour for the wrong reason.
    root = Path(tempfile.mkdtemp(prefix="rollmesh-test-leases-", dir="/var/tmp"))
    try:
        own, neighbour = root / "lease-a", root / "lease-b"
        own.mkdir()
        neighbour.mkdir()
        (neighbour / "answer.txt").write_text("42")
        script = ["sh", "-c", f"ls -A ..; cat {neighbour}/answer.txt"]
        result = await bwrap.run(script, stdin="", timeout_s=20.0, workdir=own, **LIMITS)
        assert result.stdout.split() == ["lease-a"]
        # Control: without isolation the neighbour's answer is right there.
        control = await ProcessBackend().run(script, stdin="", timeout_s=20.0, workdir=own, **LIMITS)
        assert "42" in control.stdout
    finally:
        shutil.rmtree(root)


async def test_timeout_kills_the_whole_process_tree(bwrap: BwrapBackend, workdir: Path) -> None:
    marker = f"30.{random.randrange(10**6):06d}"
    result = await bwrap.run(
        ["sh", "-c", f"sleep {marker} & sleep {marker}"], stdin="", timeout_s=0.5, workdir=workdir, **LIMITS
    )
    assert result.timed_out
    assert result.exit_code == 137
    assert result.duration_s < 5.0
    assert await wait_processes_with(marker, present=False)


async def test_cancelling_a_run_kills_the_command(bwrap: BwrapBackend, workdir: Path) -> None:
    marker = f"30.{random.randrange(10**6):06d}"
    task = asyncio.create_task(
        bwrap.run(["sleep", marker], stdin="", timeout_s=20.0, workdir=workdir, **LIMITS)
    )
    assert await wait_processes_with(marker, present=True)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await wait_processes_with(marker, present=False)


async def wait_processes_with(marker: str, *, present: bool, deadline_s: float = 10.0) -> bool:
    """Poll /proc until a process whose command line holds ``marker`` exists (or none does)."""
    loop = asyncio.get_running_loop()
    give_up = loop.time() + deadline_s
    while loop.time() < give_up:
        if bool(_pids_with(marker)) == present:
            return True
        await asyncio.sleep(0.02)
    return False


def _pids_with(marker: str) -> list[str]:
    return [pid for pid in os.listdir("/proc") if pid.isdigit() and marker in _cmdline(pid)]


def _cmdline(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


async def test_environment_does_not_leak(bwrap: BwrapBackend, workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLMESH_API_KEY", "secret")
    result = await bwrap.run(["env"], stdin="", timeout_s=20.0, workdir=workdir, **LIMITS)
    assert result.exit_code == 0
    assert "ROLLMESH_API_KEY" not in result.stdout and "secret" not in result.stdout
    assert sorted(line.split("=")[0] for line in result.stdout.splitlines()) == ["HOME", "LANG", "PATH", "PWD"]


async def test_output_over_the_cap_is_truncated_and_stopped(bwrap: BwrapBackend, workdir: Path) -> None:
    limits = {**LIMITS, "max_output_bytes": 1000}
    result = await bwrap.run(
        [*PY, "import sys\nwhile True: sys.stdout.write('x' * 4096)"], stdin="", timeout_s=20.0, workdir=workdir, **limits
    )
    assert result.truncated
    assert not result.timed_out
    assert result.stdout == "x" * 1000
    assert result.duration_s < 10.0


async def test_memory_limit_stops_large_allocations(bwrap: BwrapBackend, workdir: Path) -> None:
    limits = {**LIMITS, "memory_limit_mb": 128}
    result = await bwrap.run(
        [*PY, "b = bytearray(512 * 1024 * 1024)"], stdin="", timeout_s=20.0, workdir=workdir, **limits
    )
    assert result.exit_code == 1
    assert "MemoryError" in result.stderr


async def test_stdin_and_exit_code_pass_through(bwrap: BwrapBackend, workdir: Path) -> None:
    result = await bwrap.run(["sh", "-c", "cat; exit 7"], stdin="hello", timeout_s=20.0, workdir=workdir, **LIMITS)
    assert (result.exit_code, result.stdout) == (7, "hello")


async def test_a_missing_program_is_a_backend_failure(bwrap: BwrapBackend, workdir: Path) -> None:
    with pytest.raises(BackendFailedError, match="no-such-program"):
        await bwrap.run(["no-such-program-xyz"], stdin="", timeout_s=20.0, workdir=workdir, **LIMITS)


def test_auto_selects_bubblewrap_when_it_works() -> None:
    backend = select_backend("auto")
    assert (backend.name, backend.isolated) == ("bwrap", True)


async def test_broker_leases_execs_and_releases_with_bubblewrap(bwrap: BwrapBackend, tmp_path: Path) -> None:
    broker = SandboxBroker(SandboxConfig(), bwrap, root_dir=tmp_path / "leases")
    lease = await broker.lease(SandboxLeaseRequest(holder="rollout-1"))
    assert (lease.error_kind, lease.backend, lease.isolated) == ("", "bwrap", True)
    argv = [python_for_sandbox(), "-I", "-S", str(tool_script_path("molar_mass")), "CaCl2"]
    reply = await broker.exec(SandboxExecRequest(lease_id=lease.lease_id, argv=argv))
    assert (reply.exit_code, reply.stdout, reply.error_kind) == (0, "110.978\n", "")
    bad = await broker.exec(SandboxExecRequest(lease_id=lease.lease_id, argv=[*argv[:-1], "Xx"]))
    assert (bad.exit_code, bad.error_kind) == (2, "")
    slow = await broker.exec(SandboxExecRequest(lease_id=lease.lease_id, argv=["sleep", "30"], timeout_s=0.3))
    assert (slow.timed_out, slow.error_kind) == (True, "timeout")
    released = await broker.release(SandboxReleaseRequest(lease_id=lease.lease_id))
    assert released.released
    assert not (tmp_path / "leases" / lease.lease_id).exists()
