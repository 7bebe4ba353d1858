"""Sandboxes that outlive their broker: 32 rollouts' tool calls while the broker is SIGKILLed twice.

A sandbox broker runs in its own process, as in the mesh (supervisor on, its lease table in the
KV bucket of an embedded nats-server), bubblewrap sandboxes. 32 rollouts each lease a sandbox
and run one tool call of 5 to 20 s whose command writes to the workspace as it goes (a line
every TICK_S: ``work.log``, plus a running sha256 chain in ``chain``) and prints the line count
at its end. Two passes run the same 32 calls: first without faults (the baseline), then with the
broker SIGKILLed twice mid-calls, each time started again at once (as Ray restarts an actor).

Figures: ``ours`` = tool seconds (the sum over rollouts of the wall time from the exec request
to its reply) with the kills, ``baseline`` the same without; ``ratio`` = baseline / ours
(target >= 0.9). ``lost``: rollouts that lost tool work (no reply, an error, or a line count
other than the command's own: lines lost, or written twice by a command run again; target 0).
``redone_tool_seconds``: tool seconds run twice (extra lines x TICK_S).

    python benchmarks/sandbox_broker_restart.py [--rollouts 32] [--kills 2] [--no-supervisor]

``--no-supervisor`` runs the broker as it was before (its sandboxes are its children, its leases
in memory): the check that this benchmark can fail.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import signal
import tempfile
import time
from pathlib import Path

from rollmesh.bus.connection import connect_bus
from rollmesh.bus.embedded_server import EmbeddedNatsServer
from rollmesh.bus.publisher import BusPublisher
from rollmesh.sandbox import SandboxBrokerClient, SandboxRequestError

NAMESPACE = "benchrestart"
TICK_S = 0.25
KILL_AT_S = (4.0, 11.0)  # into the faulty pass: both while most tools still run


def broker_process(url: str, run_dir: str, ready: multiprocessing.Event, stop: multiprocessing.Event,
                   supervised: bool) -> None:
    asyncio.run(_serve_broker(url, Path(run_dir), ready, stop, supervised))


async def _serve_broker(url: str, run_dir: Path, ready, stop, supervised: bool) -> None:
    from rollmesh.sandbox.broker_logic import SandboxBrokerLogic
    from rollmesh.actors.shell import ActorShell
    from rollmesh.mesh_address import MeshAddress
    from rollmesh.config import SandboxConfig, TelemetryConfig
    from rollmesh.sandbox import SandboxBroker, select_backend
    from rollmesh.sandbox.lease_store import LeaseJournal, readopt
    from rollmesh.sandbox.supervisor_client import SupervisorClient

    # What the broker actor does at start (actors/sandbox_broker.py), without Ray.
    config = SandboxConfig(backend="bwrap", pool_interval_s=0.2, reap_interval_s=1.0)
    shell = ActorShell("bench-broker", MeshAddress(
        nats_url=url, namespace=NAMESPACE, run_dir=str(run_dir),
        telemetry=TelemetryConfig(exporter="none", log_level="warning")))
    publisher = await shell.connect()
    backend = await asyncio.to_thread(select_backend, "bwrap")
    journal = None
    if supervised:
        supervisor = SupervisorClient(run_dir, broker="bench-broker", idle_exit_s=10)
        await asyncio.to_thread(supervisor.ensure_running)
        backend.supervisor = supervisor
        journal = LeaseJournal(shell.stores.sandbox_leases(), "bench-broker",
                               sync_interval_s=config.reap_interval_s)
    broker = SandboxBroker(config, backend, snapshot_dir=run_dir / "snapshots", publisher=publisher,
                           journal=journal)
    if supervised:
        await readopt(broker, supervisor, journal)
    service = SandboxBrokerLogic(broker)
    await shell.serve(service)
    ready.set()
    while not stop.is_set():  # until killed (SIGKILL: no stop, as a crash) or, at the end, stopped
        await asyncio.sleep(0.1)
    await shell.stop()  # an orderly stop: every sandbox destroyed


class BrokerProcess:
    def __init__(self, url: str, run_dir: str, *, supervised: bool) -> None:
        self.url, self.run_dir, self.supervised = url, run_dir, supervised
        self.context = multiprocessing.get_context("spawn")
        self.process = None
        self.restart_s: list[float] = []

    def start(self) -> None:
        ready, self.stop = self.context.Event(), self.context.Event()
        started = time.monotonic()
        self.process = self.context.Process(target=broker_process,
                                            args=(self.url, self.run_dir, ready, self.stop, self.supervised),
                                            daemon=True)
        self.process.start()
        if not ready.wait(120):
            raise SystemExit("the broker did not start")
        self.restart_s.append(time.monotonic() - started)

    def kill(self) -> None:
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(10)

    def shut_down(self) -> None:
        self.stop.set()
        self.process.join(60)


def durations(count: int) -> list[float]:
    """5 to 20 s, spread evenly, in whole ticks."""
    return [round((5.0 + 15.0 * index / max(1, count - 1)) / TICK_S) * TICK_S for index in range(count)]


def command(seconds: float) -> str:
    ticks = round(seconds / TICK_S)
    return (f"i=0; while [ $i -lt {ticks} ]; do i=$((i+1)); echo tick $i >> work.log; "
            f"echo $i $(cat chain 2>/dev/null) | sha256sum > chain; sleep {TICK_S}; done; wc -l < work.log")


async def rollout(client: SandboxBrokerClient, name: str, seconds: float) -> dict:
    lease = await client.lease(name, ttl_s=60.0, capacity_retries=5)
    started = time.monotonic()
    try:
        reply = await client.exec(lease.lease_id, shell=command(seconds), timeout_s=120.0)
    except SandboxRequestError as exc:
        return {"name": name, "seconds": time.monotonic() - started, "lines": None, "error": str(exc)}
    took = time.monotonic() - started
    lines = int(reply.stdout.strip() or -1) if reply.result == "exit" else None
    try:
        await client.release(lease.lease_id)
    except SandboxRequestError:
        pass
    return {"name": name, "seconds": took, "lines": lines, "error": reply.detail if lines is None else ""}


async def run_pass(url: str, broker: BrokerProcess, tag: str, count: int, kills: int) -> list[dict]:
    nc = await connect_bus(url, name=f"bench-{tag}")
    client = SandboxBrokerClient(BusPublisher(nc, nc.jetstream(), NAMESPACE))
    try:
        calls = [asyncio.ensure_future(rollout(client, f"{tag}-{i}", seconds))
                 for i, seconds in enumerate(durations(count))]
        begun = time.monotonic()
        for kill_at in KILL_AT_S[:kills]:
            await asyncio.sleep(max(0.0, begun + kill_at - time.monotonic()))
            broker.kill()
            await asyncio.to_thread(broker.start)
        return list(await asyncio.gather(*calls))
    finally:
        await nc.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=32)
    parser.add_argument("--kills", type=int, default=2)
    parser.add_argument("--no-supervisor", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rollmesh-bench-restart-") as scratch:
        server = EmbeddedNatsServer(Path(scratch) / "nats")
        url = server.start()
        broker = BrokerProcess(url, scratch, supervised=not args.no_supervisor)
        broker.start()
        try:
            baseline = asyncio.run(run_pass(url, broker, "calm", args.rollouts, 0))
            faulty = asyncio.run(run_pass(url, broker, "kill", args.rollouts, args.kills))
        finally:
            broker.shut_down()
            server.stop()
    expected = {f"{tag}-{i}": round(s / TICK_S) for tag in ("calm", "kill") for i, s in enumerate(durations(args.rollouts))}
    lost = [r for r in faulty if r["lines"] != expected[r["name"]]]
    redone = sum(max(0, (r["lines"] or 0) - expected[r["name"]]) for r in faulty) * TICK_S
    base_s = sum(r["seconds"] for r in baseline)
    ours_s = sum(r["seconds"] for r in faulty)
    for r in lost:
        print("lost:", json.dumps(r))
    print(json.dumps({
        "benchmark": "sandbox_broker_restart", "ours": round(ours_s, 1), "baseline": round(base_s, 1),
        "unit": "tool seconds (sum over rollouts, request to reply)", "ratio": round(base_s / ours_s, 3),
        "lost": len(lost), "redone_tool_seconds": round(redone, 2), "rollouts": args.rollouts,
        "kills": args.kills, "supervisor": not args.no_supervisor, "baseline_lost": sum(r["lines"] != expected[r["name"]] for r in baseline),
        "broker_start_s": [round(s, 2) for s in broker.restart_s],
        "max_tool_delay_s": round(max(f["seconds"] - b["seconds"] for f, b in zip(faulty, baseline)), 2),
    }))


if __name__ == "__main__":
    main()
