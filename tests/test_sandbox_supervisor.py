"""Sandboxes that outlive their broker: the per-node supervisor holds real bubblewrap sandboxes
(and their running execs) across the death of the process that spawned them, and a restarted
broker re-adopts its leases from the KV lease table (the session's real nats-server), reaping
those that expired while no broker was alive; a client resends an exec its restarted broker does
not know. The whole-mesh case (a broker actor SIGKILLed
mid tool call) is in test_mesh_recovery.py.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from support.sandbox_helpers import usable_bwrap
from rollmesh.bus.sandbox_leases import KvSandboxLeases
from rollmesh.config import SandboxConfig
from rollmesh.messages.sandbox import (
    SandboxExecReply,
    SandboxExecRequest,
    SandboxHeartbeatReply,
    SandboxLeaseRequest,
)
from rollmesh.sandbox import SandboxBroker, SandboxBrokerClient
from rollmesh.sandbox import guest_wire as wire
from rollmesh.sandbox.lease_store import LeaseJournal, readopt
from rollmesh.sandbox.sandbox_protocol import SandboxLimits
from rollmesh.sandbox.supervisor_client import SupervisorClient
from rollmesh.sandbox.supervisor_wire import recv_frame, send_frame

pytestmark = pytest.mark.timeout(120)

# Writes each step to the workspace as it goes: a second run would write every step twice.
STEPS = "for i in 1 2 3 4; do echo step $i >> log; sleep 0.4; done; cat log"

CHILD = textwrap.dedent("""
    import asyncio, os, signal, sys
    from rollmesh.sandbox.bwrap_backend import BwrapBackend
    from rollmesh.sandbox.sandbox_protocol import SandboxLimits
    from rollmesh.sandbox.supervisor_client import SupervisorClient

    async def main(run_dir, steps):
        backend = BwrapBackend()
        backend.supervisor = SupervisorClient(run_dir, broker="child", idle_exit_s=5)
        sandbox = await backend.create("outliver", SandboxLimits())
        running = asyncio.ensure_future(sandbox.exec(shell=steps, key="the-exec"))
        while b"step 1" not in (await sandbox.exec(shell="cat log 2>/dev/null")).stdout:
            pass  # polled: the command is under way once its first step is in the workspace
        assert not running.done()
        os.kill(os.getpid(), signal.SIGKILL)  # as a broker dies: no goodbye to anyone

    asyncio.run(main(sys.argv[1], sys.argv[2]))
""")


@pytest.mark.integration
async def test_a_sandbox_and_its_running_exec_outlive_the_process_that_spawned_them(tmp_path):
    usable_bwrap()
    child = await asyncio.to_thread(subprocess.run, [sys.executable, "-c", CHILD, str(tmp_path), STEPS],
                                    capture_output=True, timeout=60)
    assert child.returncode == -9, child.stderr.decode()[-2000:]
    client = SupervisorClient(tmp_path, broker="child", idle_exit_s=5)
    (entry,) = await asyncio.to_thread(client.held)
    assert entry["sandbox_id"] == "outliver" and entry["exit_code"] is None
    sandbox = await client.adopt(entry)
    try:
        # The same key attaches to the exec still running (or kept): its whole output, run once.
        again = await sandbox.exec(shell="echo this must not run", key="the-exec")
        assert (again.result, again.exit_code) == ("exit", 0)
        assert again.stdout.decode().split("\n") == ["step 1", "step 2", "step 3", "step 4", ""]
        after = await sandbox.exec(shell="cat log; echo $HOME", key="another")
        assert after.stdout.decode() == "step 1\nstep 2\nstep 3\nstep 4\n/workspace\n"
    finally:
        await sandbox.destroy()
    assert await asyncio.to_thread(client.held) == []
    cgroups = entry["record"]["cgroup"]
    assert cgroups is None or not any(Path(d).exists() for d in cgroups["dirs"])


EGRESS_CHILD = textwrap.dedent("""
    import asyncio, os, signal, sys
    from rollmesh.sandbox.bwrap_backend import BwrapBackend
    from rollmesh.sandbox.images import SandboxImage
    from rollmesh.sandbox.sandbox_protocol import SandboxLimits
    from rollmesh.sandbox.supervisor_client import SupervisorClient

    async def main(run_dir, allowed):
        backend = BwrapBackend(images={"lab": SandboxImage("lab", network_allow=(allowed,))})
        backend.supervisor = SupervisorClient(run_dir, broker="child", idle_exit_s=5)
        await backend.create("egressor", SandboxLimits(), profile="lab")
        os.kill(os.getpid(), signal.SIGKILL)  # as a broker dies: its event loop served nothing

    asyncio.run(main(sys.argv[1], sys.argv[2]))
""")

EGRESS_ASK = textwrap.dedent("""
    import socket, sys
    s = socket.socket(socket.AF_UNIX)
    s.connect("/.rollmesh/egress.sock")
    s.sendall(b"CONNECT " + sys.argv[1].encode() + b" HTTP/1.1\\r\\n\\r\\n")
    head = s.recv(64).split(b"\\r\\n")[0].decode()
    if " 200 " in head:
        s.sendall(b"ping")
        head += " " + s.recv(64).decode()
    print(head)
""")


@pytest.mark.integration
async def test_a_sandboxs_egress_allowlist_is_served_by_the_supervisor_and_outlives_its_broker(tmp_path):
    usable_bwrap()

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"pong:" + await reader.read(4))
        await writer.drain()
        writer.close()

    allowed, other = await asyncio.start_server(echo, "127.0.0.1", 0), await asyncio.start_server(echo, "127.0.0.1", 0)
    allowed_at, other_at = (f"127.0.0.1:{server.sockets[0].getsockname()[1]}" for server in (allowed, other))
    child = await asyncio.to_thread(subprocess.run, [sys.executable, "-c", EGRESS_CHILD, str(tmp_path), allowed_at],
                                    capture_output=True, timeout=60)
    assert child.returncode == -9, child.stderr.decode()[-2000:]
    client = SupervisorClient(tmp_path, broker="child", idle_exit_s=5)
    (entry,) = await asyncio.to_thread(client.held)
    egress_dir = Path(entry["record"]["egress"]["dir"])
    assert (egress_dir / "egress.sock").exists()
    sandbox = await client.adopt(entry)
    try:
        for target, answer in ((allowed_at, "HTTP/1.1 200 Connection established pong:ping"),
                               (other_at, "HTTP/1.1 403 Forbidden")):
            asked = await sandbox.exec(argv=["/usr/bin/python3", "-I", "-c", EGRESS_ASK, target])
            assert (asked.exit_code, asked.stdout.decode().strip()) == (0, answer), asked.stderr
    finally:
        await sandbox.destroy()
        allowed.close()
        other.close()
    assert not egress_dir.exists()  # the adopting broker's cleanup removed the forwarder's socket


@pytest.mark.integration
async def test_a_restarted_broker_readopts_its_leases_and_reaps_those_that_expired(tmp_path, nats_client,
                                                                                   namespace):
    now = [1000.0]
    config = SandboxConfig(backend="bwrap", reap_interval_s=1.0)
    store = KvSandboxLeases(nats_client.jetstream(), namespace)

    def broker_on(run_dir: Path) -> tuple[SandboxBroker, SupervisorClient, LeaseJournal]:
        backend = usable_bwrap()
        backend.supervisor = SupervisorClient(run_dir, broker="sandbox-broker", idle_exit_s=5)
        journal = LeaseJournal(store, "sandbox-broker", sync_interval_s=config.reap_interval_s)
        return (SandboxBroker(config, backend, snapshot_dir=run_dir / "snaps", journal=journal,
                              clock=lambda: now[0]), backend.supervisor, journal)

    first, _, _ = broker_on(tmp_path)
    kept = await first.lease(SandboxLeaseRequest(holder="rollout-kept", ttl_s=600.0))
    lapsing = await first.lease(SandboxLeaseRequest(holder="rollout-lapsing", ttl_s=8.0))
    assert not kept.error_kind and not lapsing.error_kind
    wrote = await first.exec(SandboxExecRequest(lease_id=kept.lease_id, shell="echo state > kept.txt"))
    assert wrote.exit_code == 0
    # The first broker crashes (never closed). Time passes past the short lease's TTL and slack
    # (8 / 4 + 1 s), within the long one's.
    now[0] += 60.0
    second, supervisor, journal = broker_on(tmp_path)
    stats = await readopt(second, supervisor, journal)
    assert (stats.adopted, stats.reaped, stats.orphans, stats.lost) == (2, 1, 0, 0)
    assert second.counts["leases_expired"] == 1
    reread = await second.exec(SandboxExecRequest(lease_id=kept.lease_id, shell="cat kept.txt"))
    assert (reread.result, reread.stdout) == ("exit", b"state\n")  # the same sandbox
    gone = await second.exec(SandboxExecRequest(lease_id=lapsing.lease_id, shell="true"))
    assert gone.error_kind == "unknown_lease"
    # A retried exec (same exec_id) while it runs waits for it: it runs once.
    twice = await asyncio.gather(*(second.exec(SandboxExecRequest(
        lease_id=kept.lease_id, exec_id="x1", shell="echo ran >> runs; sleep 0.3; cat runs")) for _ in range(2)))
    assert [reply.stdout for reply in twice] == [b"ran\n", b"ran\n"]
    assert [r.lease_id for r in await store.load("sandbox-broker")] == [kept.lease_id]
    await second.close()  # an orderly stop destroys what it holds and forgets its leases
    assert await store.load("sandbox-broker") == []
    assert await asyncio.to_thread(supervisor.held) == []


class RestartedBroker:
    """Fakes the bus (an edge) across a broker restart: the first exec request is never answered
    (its broker died with it), the probes reach a restarted broker that does not know that exec,
    and the exec sent again is answered (as the supervisor's kept result would be)."""

    def __init__(self) -> None:
        self.execs: list[str] = []
        self.probes: list[str] = []

    async def request(self, subject, message, timeout_s):
        if isinstance(message, SandboxExecRequest):
            self.execs.append(message.exec_id)
            if len(self.execs) == 1:
                await asyncio.Event().wait()  # no reply ever comes; the client gives up on it
            return SandboxExecReply(result="exit", exit_code=0, stdout=b"done", exec_id=message.exec_id)
        self.probes.append(message.exec_id)
        return SandboxHeartbeatReply(expires_at=1.0, exec_known=False)


@pytest.mark.unit
@pytest.mark.timeout(10)  # far below exec_attempt_s: the probe, not the attempt's end, resends it
async def test_an_exec_its_restarted_broker_does_not_know_is_sent_again_with_its_id():
    bus = RestartedBroker()
    client = SandboxBrokerClient(bus, exec_probe_s=0.05, exec_attempt_s=60.0)
    reply = await client.exec("lease-1", ["make", "simulation"], timeout_s=120.0)
    assert reply.stdout == b"done"
    assert len(bus.execs) == 2 and bus.execs[0] == bus.execs[1] != ""  # the same id, sent again
    assert bus.probes == bus.execs[:1]  # the probe named the exec it waited for


@pytest.mark.integration
async def test_a_broker_gone_mid_frame_and_mid_upload_leaves_the_guest_intact(tmp_path):
    backend = usable_bwrap()
    backend.supervisor = SupervisorClient(tmp_path, broker="torn", idle_exit_s=5)
    sandbox = await backend.create("torn", SandboxLimits())
    try:
        # A second broker connection starts an upload (the ping's answer says the guest has
        # it), then dies inside its next frame.
        _reply, fds, sock = await asyncio.to_thread(backend.supervisor.request, {"op": "attach", "sandbox_id": "torn"})
        for fd in fds:
            os.close(fd)
        send_frame(sock, {"id": 1, "op": "put_file", "path": "torn.bin", "size": 2 * wire.CHUNK, "last": False,
                          "mode": 0o644}, b"x" * 1000)
        send_frame(sock, {"id": 2, "op": "ping"})
        answers = [(await asyncio.to_thread(recv_frame, sock))[0] for _ in range(2)]
        assert [a.get("t") for a in answers] == ["ready", "ok"]
        sock.sendall(wire.encode_head({"id": 1, "op": "chunk", "last": True}, 5000) + b"y" * 100)
        sock.close()
        # The supervisor aborts the upload its broker will never finish: nothing half stored.
        async def workspace_empty() -> None:
            while (await sandbox.exec(shell="ls -A")).stdout:
                pass  # polled: the abort reaches the guest a moment after the connection's end

        await asyncio.wait_for(workspace_empty(), 30)
        # The half frame never reached the guest, whose stream still makes sense.
        stored = await sandbox.put_file("whole.bin", b"z" * 5000)
        assert stored.size == 5000
        assert (await sandbox.exec(shell="wc -c < whole.bin")).stdout == b"5000\n"
    finally:
        await sandbox.destroy()
