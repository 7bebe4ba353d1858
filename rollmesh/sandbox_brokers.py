"""Where the sandbox brokers run (``sandbox.brokers``), and spawning them there.

Knows Ray's node table and scheduling strategies and the broker actor's constructor; nothing of
what a broker does. ``"per_node"``: one broker on every live Ray node that offers the resources
named in ``ray.role_resources.sandbox`` (every live node when none are named), pinned to it. A
number: that many, placed by Ray like any role. One broker (the default) runs as a single broker
always did: no id, the shared subjects. Several get ids "0", "1", ... (their subjects
``rl.<ns>.sandbox.b.<id>.*``); a broker Ray re-creates keeps its id, so its leases' ids still
route to it.

Under security each of several brokers connects with its own credentials (NATS role
``sandbox_broker_<id>``: its own subjects and lease keys only), and is handed only those. The
embedded server's users are made before Ray is started or asked for its nodes, so it makes them
for every id a broker may get (``credential_broker_ids``: ``sandbox.max_brokers`` of them for
``"per_node"``); a cluster's NATS names them in ``security.credentials``, or names only
``sandbox_broker``, which all brokers then share (its rights cover every broker's subjects).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from rollmesh.actors.sandbox_broker import SandboxBrokerActor
from rollmesh.bus.errors import BusSecurityError
from rollmesh.bus.permissions import BROKER_ROLE_PREFIX, broker_role
from rollmesh.config import SandboxConfig
from rollmesh.mesh_address import MeshAddress
from rollmesh.moved_names import forward_moved_names

# Issue 24: MeshContext became MeshAddress, and so this function's name.
__getattr__ = forward_moved_names(__name__, {"broker_context": "rollmesh.sandbox_brokers:broker_address"})


class NoSandboxNodeError(RuntimeError):
    """``sandbox.brokers = "per_node"`` found no live Ray node offering the sandbox resources."""

    def __init__(self, resources: Mapping[str, float], nodes: int) -> None:
        self.resources = dict(resources)
        self.nodes = nodes
        super().__init__(f"sandbox.brokers = \"per_node\": none of the {nodes} live Ray nodes offers "
                         f"ray.role_resources.sandbox = {self.resources}; declare them on the sandbox "
                         "nodes (ray start --resources) or set sandbox.brokers to a number")


class TooManySandboxNodesError(RuntimeError):
    """``sandbox.brokers = "per_node"`` found more sandbox nodes than ``sandbox.max_brokers``."""

    def __init__(self, nodes: int, max_brokers: int) -> None:
        self.nodes = nodes
        self.max_brokers = max_brokers
        super().__init__(f"sandbox.brokers = \"per_node\": {nodes} live Ray nodes offer the sandbox resources, "
                         f"more than sandbox.max_brokers = {max_brokers}; raise sandbox.max_brokers")


@dataclass(frozen=True)
class BrokerSlot:
    name: str  # the actor's name
    broker_id: str  # "" for a single broker
    node_id: str = ""  # the Ray node it is pinned to; "": placed by Ray


def broker_name(index: int) -> str:
    # The first keeps the name a single broker always had (the dashboard and tools find it so).
    return "sandbox-broker" if index == 0 else f"sandbox-broker-{index}"


def credential_broker_ids(config: SandboxConfig) -> list[str]:
    """The ids of every broker the mesh may start, known before Ray is: none for one broker
    (it is ``sandbox_broker``), "0".."N-1" for a number, up to ``max_brokers`` for "per_node"."""
    if config.brokers == "per_node":
        return [str(index) for index in range(config.max_brokers)]
    return [] if config.brokers == 1 else [str(index) for index in range(config.brokers)]


def plan_brokers(brokers: Literal["per_node"] | int, nodes: Sequence[Mapping[str, Any]],
                 resources: Mapping[str, float], max_brokers: int = 64) -> list[BrokerSlot]:
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
    if len(offering) > max_brokers:
        raise TooManySandboxNodesError(len(offering), max_brokers)
    return [BrokerSlot(broker_name(index), str(index), node_id) for index, node_id in enumerate(offering)]


def broker_address(mesh: MeshAddress, broker_id: str) -> MeshAddress:
    """The mesh as broker ``broker_id`` sees it: with its own credentials when the mesh has
    per-broker ones (every broker must then have its own), else the shared ``sandbox_broker``."""
    shared = mesh.only("sandbox_broker")
    if not broker_id or not any(role.startswith(BROKER_ROLE_PREFIX) for role in mesh.credentials):
        return shared
    own = mesh.credentials.get(broker_role(broker_id))
    if own is None:
        raise BusSecurityError(f"sandbox broker {broker_id} has no NATS credentials of its own, and others "
                               f"have theirs: name [security.credentials.{broker_role(broker_id)}] too",
                               role=broker_role(broker_id))
    # Found under the actor's role; their own role names the user's inbox (_INBOX.<ns>.<role>).
    return replace(shared, credentials={"sandbox_broker": own})


def slot_options(slot: BrokerSlot, options: dict[str, Any]) -> dict[str, Any]:
    """Ray options for ``slot``'s actor: the role's, pinned to its node (never elsewhere: a
    broker is for its node's sandboxes, and a lost node's broker is not moved)."""
    if not slot.node_id:
        return options
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return {**options, "scheduling_strategy": NodeAffinitySchedulingStrategy(slot.node_id, soft=False)}


async def spawn_sandbox_brokers(spawn: Any, mesh: MeshAddress, config: SandboxConfig,
                                resources: Mapping[str, float], options: dict[str, Any]) -> list[BrokerSlot]:
    """Start the planned brokers at once (each runs its backend's self-test as it starts) with
    ``spawn`` (``MeshRuntime.spawn``); returns where they went."""
    nodes: list[Mapping[str, Any]] = []
    if config.brokers == "per_node":
        import ray

        nodes = ray.nodes()
    slots = plan_brokers(config.brokers, nodes, resources, config.max_brokers)
    addresses = [broker_address(mesh, slot.broker_id) for slot in slots]  # all found before any starts
    await asyncio.gather(*(
        spawn(slot.name, SandboxBrokerActor, address, config, slot.broker_id, slot.node_id,
              options=slot_options(slot, options))
        for slot, address in zip(slots, addresses)))
    return slots
