"""Starting a sandbox: every backend waits ``sandbox.start_timeout_s`` for its guest's hello, and
a start that fails says why, with the tail of what the guest (or bwrap, runsc) wrote on stderr."""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
from pathlib import Path

import pytest

from rollmesh.config import ConfigError, load_config
from rollmesh.sandbox import ProcessBackend, select_backend
from rollmesh.sandbox import bwrap_backend, runsc_backend
from rollmesh.sandbox.errors import BackendFailedError
from rollmesh.sandbox.guest_client import START_TIMEOUT_S, GuestSandbox
from rollmesh.sandbox.guest_start import bounded_tail
from rollmesh.sandbox.sandbox_protocol import SandboxInfo, SandboxLimits
from rollmesh.sandbox_config import SandboxConfig

pytestmark = [pytest.mark.timeout(60)]

LIMITS = SandboxLimits(memory_mb=256, pids=64, workspace_mb=32, exec_timeout_s=20.0)
INFO = SandboxInfo(sandbox_id="start-test", backend="test", isolated=False, limits=LIMITS, enforcement={})


async def _launch(script: str, **options) -> GuestSandbox:
    """A "guest" that is a shell script: it never says hello, so every start fails."""
    return await GuestSandbox.launch(INFO, ["/bin/sh", "-c", script], env={"PATH": "/usr/bin:/bin"}, **options)


@pytest.mark.unit
def test_start_timeout_defaults_to_60_s_in_the_config_and_in_every_backend() -> None:
    assert SandboxConfig().start_timeout_s == START_TIMEOUT_S == 60.0
    assert load_config().sandbox.start_timeout_s == 60.0
    assert ProcessBackend().start_timeout_s == 60.0


@pytest.mark.unit
def test_start_timeout_is_read_from_the_config_and_must_be_positive() -> None:
    assert load_config(overrides={"sandbox.start_timeout_s": 90}).sandbox.start_timeout_s == 90.0
    with pytest.raises(ConfigError) as refused:
        load_config(overrides={"sandbox.start_timeout_s": 0})
    assert refused.value.path == "sandbox.start_timeout_s"


@pytest.mark.unit
def test_select_backend_hands_the_start_timeout_to_the_backend() -> None:
    assert select_backend("process", start_timeout_s=12.5).start_timeout_s == 12.5


@pytest.mark.unit
def test_a_stderr_tail_is_bounded_in_lines_and_characters() -> None:
    many = b"".join(b"line %d\n" % i for i in range(100))
    assert bounded_tail(many).splitlines() == [f"line {i}" for i in range(80, 100)]
    assert bounded_tail(b"x" * 10_000 + b"\n") == "x" * 2048
    assert bounded_tail(b"\xff broken utf-8\n") == "\ufffd broken utf-8"
    assert bounded_tail(b"") == ""


@pytest.mark.integration
async def test_a_guest_that_exits_at_start_fails_with_its_status_and_stderr_tail() -> None:
    script = 'i=0; while [ $i -lt 100 ]; do echo "bwrap: line $i" >&2; i=$((i+1)); done; exit 3'
    with pytest.raises(BackendFailedError) as failed:
        await _launch(script)
    error = failed.value
    assert "exit status 3" in error.reason
    assert error.stderr_tail.splitlines() == [f"bwrap: line {i}" for i in range(80, 100)]
    assert str(error).startswith("the sandbox did not start: the guest exited")
    assert str(error).endswith("bwrap: line 99") and "bwrap: line 79" not in str(error)
    assert (error.backend, error.argv0) == ("test", "/bin/sh")


@pytest.mark.integration
async def test_a_guest_that_stays_silent_fails_after_the_start_timeout_with_its_stderr() -> None:
    # The script never answers whatever the machine's speed: the timeout is what ends it.
    with pytest.raises(BackendFailedError) as failed:
        await _launch("echo 'waiting for something' >&2; exec sleep 60", start_timeout_s=0.5)
    error = failed.value
    assert error.reason == "the guest did not say it was ready within 0.5 s (it was still running)"
    assert error.stderr_tail == "waiting for something"
    assert "waiting for something" in str(error)


@pytest.fixture
def recorded_launches(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """GuestSandbox.launch replaced by one that records its keyword arguments and refuses."""
    seen: list[dict] = []

    async def launch(cls, info, argv, **options):  # noqa: ANN001
        seen.append(options)
        if options.get("cleanup") is not None:
            options["cleanup"]()
        raise BackendFailedError("recorded", backend=info.backend)

    monkeypatch.setattr(GuestSandbox, "launch", classmethod(launch))
    return seen


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["process", "bwrap", "runsc"])
async def test_every_backend_waits_its_configured_start_timeout(kind: str, recorded_launches: list[dict],
                                                                tmp_path: Path) -> None:
    if kind == "process":
        backend = ProcessBackend(root_dir=tmp_path, start_timeout_s=12.5)
    elif kind == "bwrap":
        if shutil.which("bwrap") is None:
            pytest.skip("bubblewrap (bwrap) is not installed")
        backend = bwrap_backend.BwrapBackend(use_cgroups=False, start_timeout_s=12.5)
    else:
        if os.geteuid() != 0:
            pytest.skip("the runsc backend needs root")
        # No gVisor needed: the start is recorded, never run; "runsc" for cleanup is `true`.
        backend = runsc_backend.RunscBackend(runsc=shutil.which("true"), state_dir=tmp_path / "runsc",
                                             start_timeout_s=12.5)
    with pytest.raises(BackendFailedError, match="recorded"):
        await backend.create("timeout-check", LIMITS)
    assert [options["start_timeout_s"] for options in recorded_launches] == [12.5]


@pytest.mark.integration
async def test_tearing_a_sandbox_down_leaves_the_event_loop_free_for_other_sandboxes(tmp_path: Path) -> None:
    """Killing a cgroup's processes waits for them to die: the broker's loop must keep serving
    other leases meanwhile (run on the loop, one release held up every lease of the mesh)."""
    sandbox = await ProcessBackend(root_dir=tmp_path).create("teardown-check", LIMITS)
    kill_started, loop_answered = threading.Event(), threading.Event()
    answered_in_time: list[bool] = []
    kill_tree = sandbox._kill_tree

    def slow_kill_tree() -> None:
        # Returns once the event loop has answered; run on the loop itself, it waits in vain.
        kill_started.set()
        answered_in_time.append(loop_answered.wait(timeout=30))
        if kill_tree is not None:
            kill_tree()

    sandbox._kill_tree = slow_kill_tree
    destroying = asyncio.create_task(sandbox.destroy())
    await asyncio.to_thread(kill_started.wait, 60)
    loop_answered.set()
    await destroying
    assert answered_in_time == [True]
    assert not sandbox.alive()
