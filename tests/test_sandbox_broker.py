"""SandboxBroker logic against a fake backend: leases, exec outcomes, release, reaping, stats."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from fakes import FakeSandboxBackend, ManualClock

from rollmesh.config import SandboxConfig
from rollmesh.messages.sandbox import (
    SandboxExecRequest,
    SandboxLeaseRequest,
    SandboxReleaseRequest,
)
from rollmesh.sandbox import BackendFailedError, ExecResult, SandboxBroker

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def make_broker(
    tmp_path: Path, backend: FakeSandboxBackend | None = None, **config: object
) -> tuple[SandboxBroker, FakeSandboxBackend, ManualClock]:
    backend = backend or FakeSandboxBackend()
    clock = ManualClock()
    ids = (f"lease{n}" for n in itertools.count())
    broker = SandboxBroker(
        SandboxConfig(**config), backend, root_dir=tmp_path / "leases", clock=clock, new_id=lambda: next(ids)
    )
    return broker, backend, clock


async def test_lease_creates_a_private_workdir_and_reports_the_backend(tmp_path: Path) -> None:
    broker, _, clock = make_broker(tmp_path)
    reply = await broker.lease(SandboxLeaseRequest(holder="rollout-1", ttl_s=30.0))
    assert reply.error_kind == ""
    assert reply.lease_id == "lease0"
    assert (reply.backend, reply.isolated) == ("fake", True)
    assert reply.expires_at == clock.now + 30.0
    workdir = tmp_path / "leases" / "lease0"
    assert workdir.is_dir()
    assert workdir.stat().st_mode & 0o777 == 0o700


async def test_lease_refuses_network_because_no_config_allows_it(tmp_path: Path) -> None:
    broker, _, _ = make_broker(tmp_path)
    reply = await broker.lease(SandboxLeaseRequest(holder="r", network=True))
    assert reply.error_kind == "invalid_request"
    assert "network" in reply.error
    assert reply.lease_id == ""
    assert broker.stats().active_leases == 0


async def test_lease_refuses_a_writable_root(tmp_path: Path) -> None:
    broker, _, _ = make_broker(tmp_path)
    reply = await broker.lease(SandboxLeaseRequest(holder="r", writable_root=True))
    assert reply.error_kind == "invalid_request"
    assert "writable root" in reply.error


async def test_lease_refuses_with_capacity_over_max_leases(tmp_path: Path) -> None:
    broker, _, _ = make_broker(tmp_path, max_leases=2)
    for index in range(2):
        assert (await broker.lease(SandboxLeaseRequest(holder=f"r{index}"))).error_kind == ""
    reply = await broker.lease(SandboxLeaseRequest(holder="r2"))
    assert reply.error_kind == "capacity"
    assert broker.stats().leases_refused == 1


async def test_expired_leases_do_not_count_against_capacity(tmp_path: Path) -> None:
    broker, _, clock = make_broker(tmp_path, max_leases=1)
    await broker.lease(SandboxLeaseRequest(holder="r", ttl_s=5.0))
    clock.advance(6.0)
    reply = await broker.lease(SandboxLeaseRequest(holder="r"))
    assert reply.error_kind == ""
    assert not (tmp_path / "leases" / "lease0").exists()


async def test_lease_reports_backend_error_when_the_workdir_cannot_be_made(tmp_path: Path) -> None:
    (tmp_path / "leases").write_text("a file where the root directory should be")
    broker, _, _ = make_broker(tmp_path)
    reply = await broker.lease(SandboxLeaseRequest(holder="r"))
    assert reply.error_kind == "backend_error"
    assert broker.stats().active_leases == 0


async def test_exec_runs_in_the_lease_workdir_with_configured_limits(tmp_path: Path) -> None:
    backend = FakeSandboxBackend([ExecResult(3, "out", "err", 0.25)])
    broker, _, _ = make_broker(tmp_path, backend, max_output_bytes=1000, memory_limit_mb=64)
    lease = await broker.lease(SandboxLeaseRequest(holder="r"))
    reply = await broker.exec(SandboxExecRequest(lease_id=lease.lease_id, argv=["tool", "x"], stdin="in", timeout_s=2.5))
    assert (reply.exit_code, reply.stdout, reply.stderr, reply.duration_s) == (3, "out", "err", 0.25)
    assert (reply.timed_out, reply.error_kind) == (False, "")
    (call,) = backend.calls
    assert call["argv"] == ["tool", "x"]
    assert call["workdir"] == tmp_path / "leases" / lease.lease_id
    assert call["workdir_existed"]
    assert (call["stdin"], call["timeout_s"]) == ("in", 2.5)
    assert (call["network"], call["writable_root"]) == (False, False)
    assert (call["max_output_bytes"], call["memory_limit_mb"]) == (1000, 64)


async def test_exec_on_an_unknown_lease_replies_unknown_lease(tmp_path: Path) -> None:
    broker, backend, _ = make_broker(tmp_path)
    reply = await broker.exec(SandboxExecRequest(lease_id="nope", argv=["true"]))
    assert reply.error_kind == "unknown_lease"
    assert backend.calls == []


async def test_exec_on_an_expired_lease_replies_lease_expired_and_frees_it(tmp_path: Path) -> None:
    broker, backend, clock = make_broker(tmp_path)
    lease = await broker.lease(SandboxLeaseRequest(holder="r", ttl_s=10.0))
    clock.advance(10.0)
    reply = await broker.exec(SandboxExecRequest(lease_id=lease.lease_id, argv=["true"]))
    assert reply.error_kind == "lease_expired"
    assert backend.calls == []
    assert not (tmp_path / "leases" / lease.lease_id).exists()
    again = await broker.exec(SandboxExecRequest(lease_id=lease.lease_id, argv=["true"]))
    assert again.error_kind == "unknown_lease"


async def test_exec_timeout_is_reported_with_the_partial_output(tmp_path: Path) -> None:
    backend = FakeSandboxBackend([ExecResult(137, "partial", "", 1.0, timed_out=True)])
    broker, _, _ = make_broker(tmp_path, backend)
    lease = await broker.lease(SandboxLeaseRequest(holder="r"))
    reply = await broker.exec(SandboxExecRequest(lease_id=lease.lease_id, argv=["sleep", "9"], timeout_s=1.0))
    assert (reply.timed_out, reply.error_kind, reply.exit_code, reply.stdout) == (True, "timeout", 137, "partial")
    assert broker.stats().exec_timeouts == 1


async def test_exec_over_the_output_cap_is_output_too_large_with_the_first_bytes(tmp_path: Path) -> None:
    backend = FakeSandboxBackend([ExecResult(137, "y\n" * 8, "", 0.1, truncated=True)])
    broker, _, _ = make_broker(tmp_path, backend, max_output_bytes=16)
    lease = await broker.lease(SandboxLeaseRequest(holder="r"))
    reply = await broker.exec(SandboxExecRequest(lease_id=lease.lease_id, argv=["yes"]))
    assert reply.error_kind == "output_too_large"
    assert reply.stdout == "y\n" * 8
    assert not reply.timed_out


@pytest.mark.parametrize(
    "failure",
    [BackendFailedError("bwrap did not run the command", backend="fake"), RuntimeError("boom")],
)
async def test_backend_failures_become_backend_error_replies(tmp_path: Path, failure: Exception) -> None:
    broker, _, _ = make_broker(tmp_path, FakeSandboxBackend([failure]))
    lease = await broker.lease(SandboxLeaseRequest(holder="r"))
    reply = await broker.exec(SandboxExecRequest(lease_id=lease.lease_id, argv=["x"]))
    assert reply.error_kind == "backend_error"
    assert str(failure) in reply.error
    assert broker.stats().exec_backend_errors == 1


async def test_release_removes_the_workdir_and_a_second_release_is_unknown(tmp_path: Path) -> None:
    broker, _, _ = make_broker(tmp_path)
    lease = await broker.lease(SandboxLeaseRequest(holder="r"))
    workdir = tmp_path / "leases" / lease.lease_id
    (workdir / "sub").mkdir()
    (workdir / "sub" / "file").write_text("x")
    first = await broker.release(SandboxReleaseRequest(lease_id=lease.lease_id))
    assert (first.released, first.error_kind) == (True, "")
    assert not workdir.exists()
    second = await broker.release(SandboxReleaseRequest(lease_id=lease.lease_id))
    assert (second.released, second.error_kind) == (False, "unknown_lease")
    exec_after = await broker.exec(SandboxExecRequest(lease_id=lease.lease_id, argv=["true"]))
    assert exec_after.error_kind == "unknown_lease"


async def test_reap_expired_drops_only_expired_leases(tmp_path: Path) -> None:
    broker, _, clock = make_broker(tmp_path)
    short = await broker.lease(SandboxLeaseRequest(holder="r-short", ttl_s=5.0))
    long = await broker.lease(SandboxLeaseRequest(holder="r-long", ttl_s=50.0))
    assert await broker.reap_expired() == 0
    clock.advance(5.0)
    assert await broker.reap_expired() == 1
    assert not (tmp_path / "leases" / short.lease_id).exists()
    assert (tmp_path / "leases" / long.lease_id).is_dir()
    assert (await broker.exec(SandboxExecRequest(lease_id=long.lease_id, argv=["true"]))).error_kind == ""


async def test_stats_count_what_happened(tmp_path: Path) -> None:
    backend = FakeSandboxBackend([ExecResult(0, "", "", 0.0), ExecResult(137, "", "", 1.0, timed_out=True)])
    broker, _, clock = make_broker(tmp_path, backend, max_leases=7)
    a = await broker.lease(SandboxLeaseRequest(holder="r-a"))
    await broker.lease(SandboxLeaseRequest(holder="r-b", ttl_s=1.0))
    await broker.lease(SandboxLeaseRequest(holder="r-c", network=True))
    await broker.exec(SandboxExecRequest(lease_id=a.lease_id, argv=["true"]))
    await broker.exec(SandboxExecRequest(lease_id=a.lease_id, argv=["sleep"]))
    await broker.release(SandboxReleaseRequest(lease_id=a.lease_id))
    clock.advance(2.0)
    await broker.reap_expired()
    stats = broker.stats()
    assert (stats.backend, stats.isolated, stats.max_leases, stats.active_leases) == ("fake", True, 7, 0)
    assert (stats.leases_granted, stats.leases_refused, stats.leases_released, stats.leases_expired) == (2, 1, 1, 1)
    assert (stats.execs, stats.exec_timeouts, stats.exec_backend_errors) == (2, 1, 0)


@pytest.mark.unit
async def test_broker_lease_is_idempotent_by_holder(tmp_path):
    from rollmesh.messages import SandboxLeaseRequest, SandboxReleaseRequest

    broker = SandboxBroker(SandboxConfig(max_leases=4), FakeSandboxBackend(), root_dir=tmp_path)
    first = await broker.lease(SandboxLeaseRequest(holder="rollout-1"))
    again = await broker.lease(SandboxLeaseRequest(holder="rollout-1"))
    other = await broker.lease(SandboxLeaseRequest(holder="rollout-2"))
    assert first.lease_id == again.lease_id != other.lease_id
    assert broker.stats().active_leases == 2
    await broker.release(SandboxReleaseRequest(lease_id=first.lease_id))
    fresh = await broker.lease(SandboxLeaseRequest(holder="rollout-1"))
    assert fresh.lease_id not in (first.lease_id, other.lease_id)
