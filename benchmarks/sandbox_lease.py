"""Sandbox lease latency end to end over NATS: from the warm pool vs a fresh sandbox per lease.

Two brokers run in this process on one embedded nats-server, with the runtime ``sandbox.backend
= "auto"`` picks here (bubblewrap where it works): one keeps a warm pool (``warm_min`` 2), the
other none, so every lease waits for a sandbox start. A client on its own NATS connection
alternates lease + release on the two; only the lease request is timed (request sent to reply
decoded). After each warm lease the pool is allowed to refill before the next one. ``ratio`` =
cold p50 / warm p50. Also reported on a warm lease: the ``true`` exec round trip and a 1 MiB
upload (sha256-verified), p50 and p99, against the broker's targets (warm lease <= 10 ms p50,
exec <= 5 ms, 1 MiB <= 10 ms).

    python benchmarks/sandbox_lease.py [--leases 100]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
from pathlib import Path

from common import atimed_ms, percentile
from rollmesh.sandbox.broker_logic import SandboxBrokerLogic
from rollmesh.actors.shell import ActorShell
from rollmesh.mesh_address import MeshAddress
from rollmesh.bus.connection import connect_bus
from rollmesh.bus.embedded_server import EmbeddedNatsServer
from rollmesh.bus.publisher import BusPublisher
from rollmesh.config import SandboxConfig, SandboxProfileConfig, TelemetryConfig
from rollmesh.sandbox import SandboxBroker, SandboxBrokerClient, select_backend


async def serve(url: str, namespace: str, run_dir: Path, warm: int) -> tuple[ActorShell, SandboxBroker]:
    config = SandboxConfig(profiles={"default": SandboxProfileConfig(warm_min=warm, warm_max=warm)},
                           pool_interval_s=0.05)
    shell = ActorShell(f"broker-{namespace}", MeshAddress(
        nats_url=url, namespace=namespace, run_dir=str(run_dir),
        telemetry=TelemetryConfig(exporter="none", log_level="warning")))
    publisher = await shell.connect()
    backend = await asyncio.to_thread(select_backend, "auto")
    broker = SandboxBroker(config, backend, snapshot_dir=run_dir / namespace, publisher=publisher)
    await shell.serve(SandboxBrokerLogic(broker))
    return shell, broker


async def wait_warm(broker: SandboxBroker, count: int) -> None:
    while broker.stats().warm_sandboxes.get("default", 0) < count:
        await asyncio.sleep(0.005)


async def run(leases: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="rollmesh-bench-") as scratch:
        root = Path(scratch)
        server = EmbeddedNatsServer(root / "nats")
        url = server.start()
        shells = []
        try:
            warm_shell, warm_broker = await serve(url, "warm", root, warm=2)
            cold_shell, cold_broker = await serve(url, "cold", root, warm=0)
            shells = [warm_shell, cold_shell]
            nc = await connect_bus(url, name="bench-client")
            warm = SandboxBrokerClient(BusPublisher(nc, nc.jetstream(), "warm"))
            cold = SandboxBrokerClient(BusPublisher(nc, nc.jetstream(), "cold"))
            warm_ms, cold_ms, exec_ms, upload_ms = [], [], [], []
            payload = os.urandom(1024 * 1024)
            for index in range(leases):
                await wait_warm(warm_broker, 2)
                elapsed, reply = await atimed_ms(warm.lease(f"w{index}"))
                assert reply.warm, "the warm pool was empty"
                warm_ms.append(elapsed)
                if index < 50:
                    for _ in range(4):
                        exec_ms.append((await atimed_ms(warm.exec(reply.lease_id, ["true"])))[0])
                    upload_ms.append((await atimed_ms(warm.upload(reply.lease_id, "blob", payload)))[0])
                await warm.release(reply.lease_id)
                elapsed, reply = await atimed_ms(cold.lease(f"c{index}"))
                assert not reply.warm
                cold_ms.append(elapsed)
                await cold.release(reply.lease_id)
            await nc.close()
            backend = warm_broker.backend.name
        finally:
            for shell in shells:
                await shell.stop()
            server.stop()
    warm_p50, cold_p50 = statistics.median(warm_ms), statistics.median(cold_ms)
    return {
        "benchmark": "sandbox_lease", "ours": round(warm_p50, 3), "baseline": round(cold_p50, 3),
        "unit": "ms lease p50 (end to end over NATS)", "ratio": round(cold_p50 / warm_p50, 3),
        "backend": backend, "leases": leases,
        "warm_p99_ms": round(percentile(warm_ms, 0.99), 3), "cold_p99_ms": round(percentile(cold_ms, 0.99), 3),
        "exec_true_p50_ms": round(statistics.median(exec_ms), 3),
        "exec_true_p99_ms": round(percentile(exec_ms, 0.99), 3),
        "upload_1mib_p50_ms": round(statistics.median(upload_ms), 3),
        "upload_1mib_p99_ms": round(percentile(upload_ms, 0.99), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--leases", type=int, default=100)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(run(args.leases))))


if __name__ == "__main__":
    main()
