"""The process backend (limits without isolation) and backend selection."""

from __future__ import annotations

import asyncio
import os
import random
import sys
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from rollmesh.sandbox import BackendFailedError, BackendUnavailableError, ProcessBackend, select_backend
from rollmesh.sandbox import bwrap_backend

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

LIMITS = {"network": False, "writable_root": False, "max_output_bytes": 4096, "memory_limit_mb": 512}


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    path = tmp_path / "leases" / "lease-a"
    path.mkdir(parents=True)
    return path


def test_process_backend_is_not_isolated_and_says_so_loudly() -> None:
    with capture_logs() as logs:
        backend = ProcessBackend()
    assert backend.isolated is False
    assert backend.name == "process"
    assert any(
        entry["log_level"] == "warning" and "isolates NOTHING" in entry["event"] for entry in logs
    )


async def test_process_backend_runs_in_the_workdir_with_a_clean_environment(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ROLLMESH_API_KEY", "secret")
    result = await ProcessBackend().run(
        ["sh", "-c", "pwd; env; cat"], stdin="from-stdin", timeout_s=10.0, workdir=workdir, **LIMITS
    )
    assert result.exit_code == 0
    lines = result.stdout.splitlines()
    assert lines[0] == str(workdir)
    assert "secret" not in result.stdout
    assert "ROLLMESH_API_KEY" not in result.stdout
    assert f"HOME={workdir}" in lines
    assert result.stdout.endswith("from-stdin")


async def test_process_backend_kills_on_timeout(workdir: Path) -> None:
    result = await ProcessBackend().run(["sleep", "30"], stdin="", timeout_s=0.3, workdir=workdir, **LIMITS)
    assert result.timed_out
    assert result.exit_code == 137
    assert result.duration_s < 5.0


async def test_process_backend_ends_background_children_with_the_command(workdir: Path) -> None:
    marker = f"30.{random.randrange(10**6):06d}"
    result = await ProcessBackend().run(
        ["sh", "-c", f"sleep {marker} >/dev/null 2>&1 </dev/null & echo started"],
        stdin="",
        timeout_s=10.0,
        workdir=workdir,
        **LIMITS,
    )
    assert (result.exit_code, result.stdout, result.timed_out) == (0, "started\n", False)
    assert await wait_no_process_with(marker)


async def wait_no_process_with(marker: str, deadline_s: float = 10.0) -> bool:
    """Poll /proc until no command line holds ``marker`` (SIGKILL is sent, not yet delivered)."""
    loop = asyncio.get_running_loop()
    give_up = loop.time() + deadline_s
    while loop.time() < give_up:
        if not [pid for pid in os.listdir("/proc") if pid.isdigit() and marker in _cmdline(pid)]:
            return True
        await asyncio.sleep(0.02)
    return False


def _cmdline(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


async def test_process_backend_reports_a_missing_program_as_a_backend_failure(workdir: Path) -> None:
    with pytest.raises(BackendFailedError) as info:
        await ProcessBackend().run(["no-such-program-xyz"], stdin="", timeout_s=5.0, workdir=workdir, **LIMITS)
    assert info.value.argv0 == "no-such-program-xyz"


async def test_process_backend_reports_signals_with_the_shell_convention(workdir: Path) -> None:
    result = await ProcessBackend().run(
        [sys.executable, "-I", "-S", "-c", "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"],
        stdin="",
        timeout_s=10.0,
        workdir=workdir,
        **LIMITS,
    )
    assert result.exit_code == 128 + 15


def test_select_process_backend_by_name() -> None:
    assert select_backend("process").name == "process"


def test_requesting_bwrap_without_bwrap_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bwrap_backend.shutil, "which", lambda name: None)
    with pytest.raises(BackendUnavailableError) as info:
        select_backend("bwrap")
    assert info.value.backend == "bwrap"


def test_auto_falls_back_to_the_process_backend_without_bwrap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bwrap_backend.shutil, "which", lambda name: None)
    with capture_logs() as logs:
        backend = select_backend("auto")
    assert (backend.name, backend.isolated) == ("process", False)
    assert any("isolates NOTHING" in entry["event"] for entry in logs)


def test_auto_falls_back_when_the_bwrap_self_test_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    broken = tmp_path / "bwrap"
    broken.write_text("#!/bin/sh\necho 'bwrap: no user namespaces' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setattr(bwrap_backend.shutil, "which", lambda name: str(broken))
    with pytest.raises(BackendUnavailableError, match="no user namespaces"):
        select_backend("bwrap")
    assert select_backend("auto").name == "process"
