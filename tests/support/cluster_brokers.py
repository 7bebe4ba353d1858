"""Starts the sandbox brokers of ``sandbox.brokers = "per_node"`` on a running Ray cluster, as the
launcher does, for tests/test_sandbox_brokers_two_nodes.py (whose own process already has a Ray,
and one process joins one Ray only).

Usage: ``python cluster_brokers.py RAY_ADDRESS NATS_URL NAMESPACE RUN_DIR``. Prints one JSON line,
``{"head": <this node's id>, "brokers": {<broker id>: <node id>}}``, once every broker serves;
then holds them until its stdin closes, stops the ones still alive and exits.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import ray

from rollmesh.mesh_address import MeshAddress
from rollmesh.config import load_config
from rollmesh.mesh_runtime import MeshRuntime
from rollmesh.sandbox_brokers import spawn_sandbox_brokers

SANDBOX_RESOURCES = {"rollmesh_sandbox": 1.0}


async def main(ray_address: str, nats_url: str, namespace: str, run_dir: str) -> None:
    config = load_config(overrides={
        "namespace": namespace, "ray.address": ray_address, "nats.url": nats_url,
        "ray.role_resources": {"sandbox": SANDBOX_RESOURCES}, "telemetry.exporter": "none",
        # The bare process runtime: this is about placement, and it starts in milliseconds.
        "sandbox.backend": "process", "sandbox.brokers": "per_node", "sandbox.pool_interval_s": 0.5,
        # A node's supervisor is found by host name in the run directory: both "nodes" here are one
        # host and would share one, and the lost node would take the other's sandboxes with it.
        "sandbox.supervisor": False,
    }, environ={})
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    runtime = MeshRuntime(config, run_dir=Path(run_dir), ray_namespace=f"rollmesh-{namespace}")
    runtime.start_ray()
    mesh = MeshAddress(namespace=namespace, nats_url=nats_url, run_dir=run_dir,
                       telemetry=config.telemetry, nats=config.nats)
    try:
        slots = await spawn_sandbox_brokers(runtime.spawn, mesh, config.sandbox, SANDBOX_RESOURCES,
                                            {"resources": SANDBOX_RESOURCES})
        print(json.dumps({"head": ray.get_runtime_context().get_node_id(),
                          "brokers": {slot.broker_id: slot.node_id for slot in slots}}), flush=True)
        await asyncio.to_thread(sys.stdin.read)
    finally:
        for actor in runtime.actors.values():
            try:  # a broker whose node is gone cannot answer: it is only killed
                await asyncio.wait_for(actor.ready.remote(), 5.0)
                await asyncio.wait_for(actor.stop.remote(), 30.0)
            except Exception:  # noqa: BLE001
                pass
            ray.kill(actor)


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:5]))
