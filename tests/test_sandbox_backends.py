"""Choosing a backend (auto falls back loudly, a named one never does), the process backend's
honest "isolates nothing", and gVisor where runsc is installed."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from rollmesh.sandbox import ProcessBackend, select_backend
from rollmesh.sandbox import bwrap_backend, runsc_backend
from rollmesh.sandbox.errors import BackendUnavailableError
from rollmesh.sandbox.sandbox_protocol import SandboxLimits

pytestmark = [pytest.mark.timeout(60)]

LIMITS = SandboxLimits(memory_mb=256, pids=64, workspace_mb=32, exec_timeout_s=20.0, cpu_s=20,
                       file_size_mb=64, max_output_bytes=64 * 1024)


@pytest.fixture
def broken_bwrap() -> Iterator[str]:
    """A "bwrap" that fails like one on a host without user namespaces (in a directory any
    sandbox uid may read, since the backend runs it as that uid)."""
    directory = Path(tempfile.mkdtemp(prefix="rollmesh-test-bwrap-", dir="/var/tmp"))
    directory.chmod(0o755)
    fake = directory / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
    fake.chmod(0o755)
    yield str(fake)
    shutil.rmtree(directory)


@pytest.mark.unit
def test_process_backend_is_not_isolated_and_says_so_loudly() -> None:
    with capture_logs() as logs:
        backend = select_backend("process")
    assert (backend.name, backend.isolated) == ("process", False)
    assert any(entry["log_level"] == "warning" and "isolates NOTHING" in entry["event"] for entry in logs)


@pytest.mark.integration
async def test_process_backend_sandboxes_say_nothing_is_isolated(tmp_path: Path) -> None:
    box = await ProcessBackend(root_dir=tmp_path).create("dev", LIMITS)
    try:
        assert box.info.isolated is False
        assert box.info.enforcement["isolation"].startswith("none")
        assert box.info.enforcement["network"] == "host network"
        done = await box.exec(["pwd"])
        assert done.stdout.decode().strip().startswith(str(tmp_path))
    finally:
        await box.destroy()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.unit
def test_naming_bwrap_without_bwrap_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bwrap_backend.shutil, "which", lambda name: None)
    with pytest.raises(BackendUnavailableError) as info:
        select_backend("bwrap")
    assert info.value.backend == "bwrap"


@pytest.mark.unit
def test_auto_falls_back_loudly_without_bwrap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bwrap_backend.shutil, "which", lambda name: None)
    with capture_logs() as logs:
        backend = select_backend("auto")
    assert (backend.name, backend.isolated) == ("process", False)
    assert any("falling back" in entry["event"] for entry in logs)


@pytest.mark.integration
def test_a_failing_self_test_makes_auto_fall_back_but_a_named_bwrap_raise(
    monkeypatch: pytest.MonkeyPatch, broken_bwrap: str
) -> None:
    real_which = shutil.which
    monkeypatch.setattr(bwrap_backend.shutil, "which", lambda name: broken_bwrap if name == "bwrap" else real_which(name))
    with pytest.raises(BackendUnavailableError, match="No permissions to create new namespace"):
        select_backend("bwrap")
    assert select_backend("auto").name == "process"


@pytest.mark.unit
def test_an_unknown_kind_raises() -> None:
    with pytest.raises(BackendUnavailableError):
        select_backend("docker")  # type: ignore[arg-type]


@pytest.mark.unit
def test_naming_runsc_without_runsc_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runsc_backend.shutil, "which", lambda name: None)
    with pytest.raises(BackendUnavailableError, match="not installed"):
        select_backend("runsc")


@pytest.fixture(scope="module")
def runsc() -> runsc_backend.RunscBackend:
    if shutil.which("runsc") is None:
        pytest.skip("gVisor (runsc) is not installed")
    if os.geteuid() != 0:
        pytest.skip("the runsc backend needs root (OCI bundles)")
    backend = runsc_backend.RunscBackend()
    try:
        backend.self_test()
    except BackendUnavailableError as exc:
        pytest.skip(f"runsc is installed but cannot run sandboxes here: {exc}")
    return backend


@pytest.mark.integration
async def test_runsc_sandbox_runs_tools_moves_files_and_hides_the_host(runsc, tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP-SECRET")
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        box = await runsc.create("gvisor", LIMITS)
        try:
            assert (box.info.backend, box.info.isolated) == ("runsc", True)
            tool = runsc_backend.TOOLS_DIR / "molar_mass.py"
            done = await box.exec(["/usr/bin/python3", "-I", "-S", str(tool), "H2O"])
            assert (done.result, done.stdout) == ("exit", b"18.015\n")
            stored = await box.put_file("data/x.bin", b"payload")
            assert (await box.get_file("data/x.bin")) == (b"payload", stored)
            hidden = await box.exec(["cat", str(secret)])
            assert hidden.exit_code != 0 and b"TOP-SECRET" not in hidden.stdout
            script = f"import socket\ntry:\n socket.create_connection(('127.0.0.1', {port}), timeout=2); print('connected')\nexcept OSError: print('blocked')"
            assert (await box.exec(["/usr/bin/python3", "-I", "-S", "-c", script])).stdout == b"blocked\n"
            assert (await box.exec(["sleep", "10"], timeout_s=0.3)).result == "timeout"
            hog = await box.exec(["/usr/bin/python3", "-I", "-S", "-c", "x = b'x' * (600 << 20)"])
            assert (hog.result, hog.exit_code) == ("exit", 1) and b"MemoryError" in hog.stderr
            assert box.alive()
        finally:
            await box.destroy()
    assert not box.alive()


@pytest.mark.unit
def test_a_sweep_spares_cgroups_whose_owner_still_runs() -> None:
    """Another live broker on the host (a test run beside a mesh) creates a cgroup empty and
    joins it a moment later: its cgroups carry its pid and are never swept while it lives."""
    from rollmesh.sandbox.limits import _owner_alive, owned_cgroup_name

    ours = owned_cgroup_name("lease/1")
    assert ours.startswith("lease_1-p") and _owner_alive(ours)
    dead = subprocess.Popen(["true"])
    dead.wait()
    assert not _owner_alive(f"x-p{dead.pid}-0123abcd")
    assert not _owner_alive("left-by-an-old-broker")


@pytest.mark.unit
def test_a_cgroups_oom_count_is_read_afresh_each_time_and_its_file_closed_on_removal(tmp_path: Path) -> None:
    """The memory events file stays open between execs (read with pread, not reopened): each
    read still sees the count as it is now, and removing the cgroup closes the file."""
    from rollmesh.sandbox.limits import SandboxCgroup

    memory_dir = tmp_path / "sandbox"
    memory_dir.mkdir()
    events = memory_dir / "memory.oom_control"
    events.write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 0\n")
    cgroup = SandboxCgroup("v1", [memory_dir], memory_dir)
    assert cgroup.oom_kills() == 0
    with open(events, "r+") as rewrite:  # in place, as the kernel's counter changes
        rewrite.write("oom_kill_disable 0\nunder_oom 0\noom_kill 3\n")
    assert cgroup.oom_kills() == 3
    held = len(os.listdir("/proc/self/fd"))
    cgroup.remove()  # (a plain directory with a file in it stays; a cgroup's would go)
    assert len(os.listdir("/proc/self/fd")) == held - 1
