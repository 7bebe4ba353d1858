"""Where the sandbox brokers run (``sandbox.brokers``), and spawning them there.

Knows Ray's node table and scheduling strategies and the broker actor's constructor; nothing of
what a broker does. ``"per_node"``: one broker on every live Ray node that offers the resources
named in ``ray.role_resources.sandbox`` (every live node when none are named), pinned to it. A
number: that many, placed by Ray like any role. One broker (the default) runs as a single broker
always did: no id, the shared subjects. Several get ids "0", "1", ... (their subjects
``rl.<ns>.sandbox.b.<id>.*``); a broker Ray re-creates keeps its id, so its leases' ids still
route to it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from rollmesh.actors.role_base import MeshContext
from rollmesh.actors.sandbox_broker import SandboxBrokerActor
from rollmesh.config import SandboxConfig


class NoSandboxNodeError(RuntimeError):
    """``sandbox.brokers = "per_node"`` found no live Ray node offering the sandbox resources."""

    def __init__(self, resources: Mapping[str, float], nodes: int) -> None:
        self.resources = dict(resources)
        self.nodes = nodes
        super().__init__(f"sandbox.brokers = \"per_node\": none of the {nodes} live Ray nodes offers "
                         f"ray.role_resources.sandbox = {self.resources}; declare them on the sandbox "
                         "nodes (ray start --resources) or set sandbox.brokers to a number")


@dataclass(frozen=True)
class BrokerSlot:
    name: str  # the actor's name
    broker_id: str  # "" for a single broker
    node_id: str = ""  # the Ray node it is pinned to; "": placed by Ray


def broker_name(index: int) -> str:
    # The first keeps the name a single broker always had (the dashboard and tools find it so).
    return "sandbox-broker" if index == 0 else f"sandbox-broker-{index}"


def plan_brokers(brokers: Literal["per_node"] | int, nodes: Sequence[Mapping[str, Any]],
                 resources: Mapping[str, float]) -> list[BrokerSlot]:
    """The brokers to start, given ``ray.nodes()`` and the sandbox role's resources."""
    if brokers != "per_node":
        if brokers == 1:
            return [BrokerSlot(broker_name(0), "")]
        return [BrokerSlot(broker_name(index), str(index)) for index in range(brokers)]
    live = [node for node in nodes if node.get("Alive")]
    offering = sorted(node["NodeID"] for node in live
                      if all(node.get("Resources", {}).get(name, 0.0) >= amount for name, amount in resources.items()))
    if not offering:
        raise NoSandboxNodeError(resources, len(live))
    return [BrokerSlot(broker_name(index), str(index), node_id) for index, node_id in enumerate(offering)]


def slot_options(slot: BrokerSlot, options: dict[str, Any]) -> dict[str, Any]:
    """Ray options for ``slot``'s actor: the role's, pinned to its node (never elsewhere: a
    broker is for its node's sandboxes, and a lost node's broker is not moved)."""
    if not slot.node_id:
        return options
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return {**options, "scheduling_strategy": NodeAffinitySchedulingStrategy(slot.node_id, soft=False)}


async def spawn_sandbox_brokers(spawn: Any, mesh: MeshContext, config: SandboxConfig,
                                resources: Mapping[str, float], options: dict[str, Any]) -> list[BrokerSlot]:
    """Start the planned brokers at once (each runs its backend's self-test as it starts) with
    ``spawn`` (``MeshRuntime.spawn``); returns where they went."""
    nodes: list[Mapping[str, Any]] = []
    if config.brokers == "per_node":
        import ray

        nodes = ray.nodes()
    slots = plan_brokers(config.brokers, nodes, resources)
    await asyncio.gather(*(
        spawn(slot.name, SandboxBrokerActor, mesh.only("sandbox_broker"), config, slot.broker_id, slot.node_id,
              options=slot_options(slot, options))
        for slot in slots))
    return slots
