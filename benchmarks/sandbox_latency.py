"""Sandbox latency through the broker (warm sandbox, over NATS) vs a cold ``bwrap`` per call.

Ours: a sandbox broker in its own process (as the broker actor runs in the mesh, with its
defaults: its sandboxes held by the node's supervisor process, which relays every frame between
broker and guest, and its leases journaled in JetStream KV) serves a client in this process over
an embedded nats-server (max payload 8 MiB). The client leases a sandbox
from the warm pool, then times, end to end (request sent to reply decoded):
- exec of ``true``;
- a 1 MiB and a 16 MiB upload of random bytes, verified end to end by **sha256** (the client
  hashes what it sends, the guest inside the sandbox hashes what it stored and refuses other
  bytes). Above ``sandbox.bulk_threshold_bytes`` they take the bulk data path: a one-time ticket
  (over NATS for a lease's first upload, then the one each stored upload's Done frame brings),
  then the bytes over the broker's Unix socket, passed to the guest as they arrive.
Baseline: ``bwrap`` started once per call with the same namespaces and mounts as our sandbox
(the argv our bwrap backend builds, run as the broker's user, without the cgroup join and uid
switch), running ``true``, or ``sh -c 'cat > f && sha256sum f'`` with the bytes on stdin.
Calls alternate ours / baseline in blocks of 10 (see BLOCK). A second broker, holding its
sandboxes directly as before the supervisor (its own namespace and process), takes blocks of the
same exec and 1 MiB upload between ours and the baseline: ``exec_direct_ms`` and
``upload_1mib_direct_ms`` (and ``exec_ratio_direct``, ``ratio_direct``) show what the relay
costs. Also reported: lease from the warm
pool (p50), execs per second with 16 sandboxes running ``true`` concurrently, the same 1 MiB
upload with the bulk path off (all over NATS, as before it), and the floor of a 1 MiB upload on
this machine: hashing it at both ends plus one copy, in one process with nothing else.
``broker_scale``: leases per second with two brokers (ids "0" and "1", each in its own process,
as ``sandbox.brokers = 2`` runs them: placed through the shared lease subject) over one (a single
broker, as the default runs it), each with the warm pool above, fresh and filled before timing;
8 holders lease and release at once for BROKER_SCALE_SECONDS, BROKER_SCALE_ROUNDS rounds
alternating 1 and 2 (the median of each). A release ends its sandbox, so the rate is bound by
making new ones. Report only: on 2 cores the brokers' sandbox starts share the same CPUs, so this
cannot show scaling. ``--only-broker-scale`` measures it alone.

``ratio`` = baseline / ours for the 1 MiB upload p50 (target >= 4.5); ``ratio_16mib`` the same
for 16 MiB; ``exec_ratio`` the same for exec ``true`` (target >= 2.5); ``lease_p50_ms`` (target
<= 10); ``execs_per_s``; ``floor_1mib_ms``; ``broker_scale`` (report only).

    python benchmarks/sandbox_latency.py [--calls 200] [--only-broker-scale]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import multiprocessing
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from common import atimed_ms, percentile
from rollmesh.bus.connection import connect_bus
from rollmesh.bus.embedded_server import EmbeddedNatsServer
from rollmesh.bus.publisher import BusPublisher
from rollmesh.sandbox import SandboxBrokerClient
from rollmesh.sandbox.bwrap_backend import BwrapBackend
from rollmesh.sandbox.sandbox_protocol import SandboxLimits

NAMESPACE = "bench"
DIRECT_NAMESPACE = "bench-direct"  # the broker that holds its sandboxes itself, for comparison
PAYLOAD_BYTES = 1024 * 1024
LARGE_BYTES = 16 * 1024 * 1024
CONCURRENT_SANDBOXES = 16
# Ours and the baseline alternate in blocks of this many calls. A cold bwrap leaves work behind
# after it exits (the kernel tears its namespaces down asynchronously, in kworker threads): run
# call by call, that cleanup lands in the next call of ours. A short pause after each baseline
# block lets it finish; the baseline's own figure never included it.
BLOCK = 10
SETTLE_S = 0.05
THROUGHPUT_SECONDS = 5.0
BROKER_SCALE_SECONDS = 4.0
BROKER_SCALE_LEASERS = 8
BROKER_SCALE_ROUNDS = 3


def summary(samples: list[float]) -> dict[str, float]:
    return {"p50": round(statistics.median(samples), 3), "p99": round(percentile(samples, 0.99), 3)}


# -- the broker, in its own process -----------------------------------------------------------


def broker_process(url: str, run_dir: str, ready: multiprocessing.Event, stop: multiprocessing.Event,
                   broker_id: str = "", peers: int = 0, supervised: bool = False,
                   namespace: str = NAMESPACE) -> None:
    asyncio.run(_serve_broker(url, Path(run_dir), ready, stop, broker_id, peers, supervised, namespace))


async def _serve_broker(url: str, run_dir: Path, ready, stop, broker_id: str = "", peers: int = 0,
                        supervised: bool = False, namespace: str = NAMESPACE) -> None:
    """One broker; with ``broker_id`` one of ``peers`` (broker_scale), ready once its warm pool is
    full and it has heard every peer's load. ``supervised``: as the broker actor's default
    (``sandbox.supervisor``), the node's supervisor holds its sandboxes and its leases are
    journaled in JetStream KV."""
    from rollmesh.sandbox.broker_logic import SandboxBrokerLogic
    from rollmesh.actors.shell import ActorShell
    from rollmesh.mesh_address import MeshAddress
    from rollmesh.config import SandboxConfig, SandboxProfileConfig, TelemetryConfig
    from rollmesh.sandbox import SandboxBroker, select_backend
    from rollmesh.sandbox.placement import broker_ids
    from rollmesh.sandbox.lease_store import LeaseJournal, readopt
    from rollmesh.sandbox.supervisor_client import SupervisorClient

    config = SandboxConfig(
        backend="bwrap", pool_interval_s=0.05,
        profiles={"default": SandboxProfileConfig(warm_min=4, warm_max=CONCURRENT_SANDBOXES + 4)},
    )
    shell = ActorShell(f"bench-broker{broker_id}", MeshAddress(
        nats_url=url, namespace=namespace, run_dir=str(run_dir),
        telemetry=TelemetryConfig(exporter="none", log_level="warning")))
    publisher = await shell.connect()
    backend = await asyncio.to_thread(select_backend, "bwrap")
    ids = {"new_id": broker_ids(lambda: os.urandom(16).hex(), broker_id)} if broker_id else {}
    journal = supervisor = None
    if supervised:  # what the broker actor does at start with sandbox.supervisor (its default)
        supervisor = SupervisorClient(run_dir, broker=f"bench-broker{broker_id}", idle_exit_s=10,
                                      keep_s=config.exec_result_keep_s)
        await asyncio.to_thread(supervisor.ensure_running)
        backend.supervisor = supervisor
        journal = LeaseJournal(shell.stores.sandbox_leases(), f"bench-broker{broker_id}",
                               sync_interval_s=config.reap_interval_s)
    broker = SandboxBroker(config, backend, snapshot_dir=run_dir / f"snapshots{broker_id}", publisher=publisher,
                           journal=journal, **ids)
    if supervisor is not None and journal is not None:
        await readopt(broker, supervisor, journal)
    service = SandboxBrokerLogic(broker, broker_id=broker_id, publisher=publisher)
    await shell.serve(service)
    if peers:
        warm_min = config.profiles["default"].warm_min
        while (broker.stats().warm_sandboxes.get("default", 0) < warm_min
               or (service.directory is not None and len(service.directory.live()) < peers)):
            await asyncio.sleep(0.05)
    ready.set()
    while not stop.is_set():
        await asyncio.sleep(0.05)
    await shell.stop()


# -- the baseline: one cold bwrap per call ----------------------------------------------------


class ColdBwrap:
    def __init__(self) -> None:
        self.backend = BwrapBackend(use_cgroups=False)
        self.limits = SandboxLimits()

    def run(self, command: list[str], stdin: bytes = b"") -> bytes:
        argv, fds = self.backend.build_argv(self.limits, network=False, uid=os.getuid(), cgroup=None)
        try:
            argv = argv[argv.index(self.backend.bwrap):]  # no cgroup join, no uid switch
            argv = argv[: len(argv) - argv[::-1].index("--")] + command  # the command, not the guest
            done = subprocess.run(argv, input=stdin, capture_output=True, pass_fds=fds, check=True)
        finally:
            for fd in fds:
                os.close(fd)
        return done.stdout


def timed_ms(call) -> tuple[float, object]:
    start = time.perf_counter()
    value = call()
    return (time.perf_counter() - start) * 1000, value


# -- the run ----------------------------------------------------------------------------------


def upload_floor_ms(payload: bytes, repeats: int = 50) -> float:
    """Hashing ``payload`` at both ends plus one copy between them, nothing else (p50)."""
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        sent = hashlib.sha256(payload).hexdigest()
        copy = bytearray(payload)
        assert hashlib.sha256(copy).hexdigest() == sent
        samples.append((time.perf_counter() - start) * 1000)
    return statistics.median(samples)


async def measure(url: str, calls: int) -> dict:
    nc = await connect_bus(url, name="bench-client")
    client = SandboxBrokerClient(BusPublisher(nc, nc.jetstream(), NAMESPACE))
    over_nats = SandboxBrokerClient(BusPublisher(nc, nc.jetstream(), NAMESPACE), bulk_threshold_bytes=None)
    direct = SandboxBrokerClient(BusPublisher(nc, nc.jetstream(), DIRECT_NAMESPACE))
    cold = ColdBwrap()
    payload, large = os.urandom(PAYLOAD_BYTES), os.urandom(LARGE_BYTES)
    digest, large_digest = hashlib.sha256(payload).hexdigest(), hashlib.sha256(large).hexdigest()
    results: dict[str, list[float]] = {k: [] for k in (
        "exec", "exec_base", "upload", "upload_base", "upload_nats", "large", "large_base", "lease",
        "exec_direct", "upload_direct")}
    try:
        lease = await client.lease("bench-main", capacity_retries=3)
        direct_lease = await direct.lease("bench-direct", capacity_retries=3)
        # Supervised and direct take turns going first, so neither always follows the baseline.
        sides = [(client, lease.lease_id, ""), (direct, direct_lease.lease_id, "_direct")]
        for block in range(max(1, calls // BLOCK)):
            for side, lease_id, suffix in sides[::1 if block % 2 == 0 else -1]:
                for _ in range(BLOCK):
                    elapsed, reply = await atimed_ms(side.exec(lease_id, ["true"]))
                    assert reply.result == "exit" and reply.exit_code == 0, reply
                    results["exec" + suffix].append(elapsed)
            for _ in range(BLOCK):
                results["exec_base"].append(timed_ms(lambda: cold.run(["true"]))[0])
            await asyncio.sleep(SETTLE_S)
            for side, lease_id, suffix in sides[::1 if block % 2 == 0 else -1]:
                for index in range(BLOCK):
                    elapsed, reply = await atimed_ms(side.upload(lease_id, f"blob{index % 4}", payload))
                    assert reply.complete and reply.sha256 == digest, reply
                    results["upload" + suffix].append(elapsed)
            for _ in range(BLOCK):
                elapsed, out = timed_ms(lambda: cold.run(["sh", "-c", "cat > f && sha256sum f"], payload))
                assert out.split()[0].decode() == digest
                results["upload_base"].append(elapsed)
            await asyncio.sleep(SETTLE_S)
            if block % 2 == 0:  # the bulk path off: the same upload over NATS, for comparison
                for index in range(BLOCK):
                    elapsed, reply = await atimed_ms(over_nats.upload(lease.lease_id, f"nats{index % 4}", payload))
                    assert reply.complete and reply.sha256 == digest, reply
                    results["upload_nats"].append(elapsed)
            if block % 5 == 0:  # 16 MiB: a tenth as many calls
                for index in range(BLOCK // 2):
                    elapsed, reply = await atimed_ms(client.upload(lease.lease_id, f"large{index % 2}", large))
                    assert reply.complete and reply.sha256 == large_digest, reply
                    results["large"].append(elapsed)
                for _ in range(BLOCK // 2):
                    elapsed, out = timed_ms(lambda: cold.run(["sh", "-c", "cat > f && sha256sum f"], large))
                    assert out.split()[0].decode() == large_digest
                    results["large_base"].append(elapsed)
                await asyncio.sleep(SETTLE_S)
        await client.release(lease.lease_id)
        await direct.release(direct_lease.lease_id)
        cold_leases = 0
        for index in range(min(calls, 100)):
            for attempt in range(20):
                # Let the pool refill: time a lease that finds one waiting (on a loaded machine the
                # refill can take longer; a lease that found none is not counted, but reported).
                await asyncio.sleep(0.1 * (attempt + 1))
                elapsed, reply = await atimed_ms(client.lease(f"bench-lease-{index}-{attempt}"))
                await client.release(reply.lease_id)
                if reply.warm:
                    results["lease"].append(elapsed)
                    break
                cold_leases += 1
            else:
                raise SystemExit("the warm pool stayed empty")
        execs_per_s = await throughput(client)
    finally:
        await nc.close()
    exec_ours, exec_base = summary(results["exec"]), summary(results["exec_base"])
    up_ours, up_base = summary(results["upload"]), summary(results["upload_base"])
    large_ours, large_base = summary(results["large"]), summary(results["large_base"])
    exec_direct, up_direct = summary(results["exec_direct"]), summary(results["upload_direct"])
    return {
        "benchmark": "sandbox_latency",
        "ours": up_ours["p50"], "baseline": up_base["p50"],
        "unit": "ms, 1 MiB upload p50 (sha256-verified; lower is better)",
        "ratio": round(up_base["p50"] / up_ours["p50"], 3),
        "ratio_16mib": round(large_base["p50"] / large_ours["p50"], 3),
        "exec_ratio": round(exec_base["p50"] / exec_ours["p50"], 3),
        "lease_p50_ms": summary(results["lease"])["p50"],
        "execs_per_s": round(execs_per_s, 1),
        "floor_1mib_ms": round(upload_floor_ms(payload), 3),
        "exec_true_ms": exec_ours, "exec_true_baseline_ms": exec_base,
        "upload_1mib_ms": up_ours, "upload_1mib_baseline_ms": up_base,
        "upload_1mib_over_nats_ms": summary(results["upload_nats"]),
        "upload_16mib_ms": large_ours, "upload_16mib_baseline_ms": large_base,
        "lease_ms": summary(results["lease"]), "leases_found_cold": cold_leases, "checksum": "sha256",
        "calls": calls, "concurrent_sandboxes": CONCURRENT_SANDBOXES,
        # The same calls to a broker holding its sandboxes itself (no supervisor's relay).
        "exec_direct_ms": exec_direct, "upload_1mib_direct_ms": up_direct,
        "exec_ratio_direct": round(exec_base["p50"] / exec_direct["p50"], 3),
        "ratio_direct": round(up_base["p50"] / up_direct["p50"], 3),
        "supervised": True,
    }


async def throughput(client: SandboxBrokerClient) -> float:
    leases = [await client.lease(f"bench-par-{i}", capacity_retries=10) for i in range(CONCURRENT_SANDBOXES)]
    done = 0
    deadline = time.perf_counter() + THROUGHPUT_SECONDS

    async def loop(lease_id: str) -> None:
        nonlocal done
        while time.perf_counter() < deadline:
            reply = await client.exec(lease_id, ["true"])
            assert reply.result == "exit"
            done += 1

    start = time.perf_counter()
    await asyncio.gather(*(loop(lease.lease_id) for lease in leases))
    rate = done / (time.perf_counter() - start)
    for lease in leases:
        await client.release(lease.lease_id)
    return rate


async def lease_rate(url: str, brokers: int) -> tuple[float, float]:
    """Leases per second (and the share found warm) with BROKER_SCALE_LEASERS holders leasing and
    releasing at once for BROKER_SCALE_SECONDS."""
    nc = await connect_bus(url, name="bench-scale-client")
    client = SandboxBrokerClient(BusPublisher(nc, nc.jetstream(), NAMESPACE))
    leased = warm = 0
    deadline = time.perf_counter() + BROKER_SCALE_SECONDS

    async def loop(index: int) -> None:
        nonlocal leased, warm
        turn = 0
        while time.perf_counter() < deadline:
            reply = await client.lease(f"scale-{brokers}-{index}-{turn}", capacity_retries=10)
            await client.release(reply.lease_id)
            leased, warm, turn = leased + 1, warm + int(reply.warm), turn + 1

    try:
        start = time.perf_counter()
        await asyncio.gather(*(loop(index) for index in range(BROKER_SCALE_LEASERS)))
        return leased / (time.perf_counter() - start), warm / max(leased, 1)
    finally:
        await nc.close()


def broker_scale(context, url: str, scratch: str) -> dict:
    """Leases per second over 2 brokers vs 1, fresh brokers each round, rounds alternating."""
    rates: dict[int, list[float]] = {1: [], 2: []}
    warm: dict[int, list[float]] = {1: [], 2: []}
    for _ in range(BROKER_SCALE_ROUNDS):
        for brokers in (1, 2):
            ids = [""] if brokers == 1 else [str(index) for index in range(brokers)]
            processes = []
            for broker_id in ids:
                ready, stop = context.Event(), context.Event()
                process = context.Process(target=broker_process, daemon=True,
                                          args=(url, scratch, ready, stop, broker_id, len(ids)))
                process.start()
                processes.append((process, ready, stop))
            try:
                for _, ready, _ in processes:
                    if not ready.wait(120):
                        raise SystemExit("a broker of broker_scale did not start")
                rate, warm_share = asyncio.run(lease_rate(url, brokers))
            finally:
                for process, _, stop in processes:
                    stop.set()
                for process, _, _ in processes:
                    process.join(30)
            rates[brokers].append(rate)
            warm[brokers].append(warm_share)
    one, two = statistics.median(rates[1]), statistics.median(rates[2])
    return {"broker_scale": round(two / one, 3), "broker_scale_leases_per_s": {
        "1": round(one, 1), "2": round(two, 1), "rounds": {str(k): [round(r, 1) for r in v] for k, v in rates.items()},
        "warm_share": {str(k): round(statistics.median(v), 3) for k, v in warm.items()},
        "holders": BROKER_SCALE_LEASERS, "seconds": BROKER_SCALE_SECONDS}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--only-broker-scale", action="store_true", help="measure broker_scale alone")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rollmesh-bench-sandbox-") as scratch:
        server = EmbeddedNatsServer(Path(scratch) / "nats")
        url = server.start()
        context = multiprocessing.get_context("spawn")
        ready, stop = context.Event(), context.Event()
        result: dict = {"benchmark": "sandbox_latency"}
        try:
            if not args.only_broker_scale:
                # Ours as the mesh runs it (supervised), and one holding its sandboxes directly.
                direct_dir = Path(scratch) / "direct"
                direct_dir.mkdir()
                direct_ready, direct_stop = context.Event(), context.Event()
                brokers = [
                    (context.Process(target=broker_process, args=(url, scratch, ready, stop),
                                     kwargs={"supervised": True}, daemon=True), ready, stop),
                    (context.Process(target=broker_process, args=(url, str(direct_dir), direct_ready, direct_stop),
                                     kwargs={"namespace": DIRECT_NAMESPACE}, daemon=True), direct_ready, direct_stop),
                ]
                for broker, _, _ in brokers:
                    broker.start()
                try:
                    for _, started, _ in brokers:
                        if not started.wait(60):
                            raise SystemExit("a broker did not start")
                    result = asyncio.run(measure(url, args.calls))
                finally:
                    for _, _, stopping in brokers:
                        stopping.set()
                    for broker, _, _ in brokers:
                        broker.join(30)
            result.update(broker_scale(context, url, scratch))  # after the main broker is gone
        finally:
            server.stop()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
