"""Keeps a Serve replica's inter-deployment gRPC server on loopback when its Ray node is.

Ray Serve 2.60 starts that server in every replica on ``[::]:0``, all interfaces, with no setting
to change it (ray-project/ray#64544); it requires Ray's token, but a local Ray that rollmesh starts
promises that nothing of it listens beyond loopback (rollmesh/local_ray.py). So on a node whose IP
is loopback, the replica's bind address becomes that IP: callers dial the node IP anyway. Elsewhere
(a cluster) nothing changes.

Knows the one name in Serve's replica module that binds it (``add_port_to_grpc_server``); called by
the deployment's constructor, which Serve runs in the replica's process before it starts that
server. If a Ray release renames it, this logs and does nothing, and tests/test_ray_loopback.py
fails on the listener it finds.
"""

from __future__ import annotations

from typing import Any

import ray
import structlog

from rollmesh.serve_apps.api_keys import is_loopback

_log = structlog.get_logger("rollmesh.serve.replica_loopback")
_ALL_INTERFACES = "[::]:"


def keep_replica_grpc_on_loopback() -> bool:
    """Bind this replica's inter-deployment gRPC server to the node IP when that is loopback;
    True when it will be."""
    from ray.serve._private import replica

    node_ip = ray.util.get_node_ip_address()
    if not is_loopback(node_ip):
        return False
    bind = getattr(replica, "add_port_to_grpc_server", None)
    if bind is None:
        _log.warning("serve_replica_grpc_bind_unknown", node_ip=node_ip,
                     reason="ray.serve._private.replica.add_port_to_grpc_server is gone")
        return False
    if getattr(bind, "keeps_loopback", False):
        return True
    host = f"[{node_ip}]" if ":" in node_ip else node_ip

    def bind_on_node_ip(server: Any, address: str) -> int:
        if address.startswith(_ALL_INTERFACES):
            address = host + ":" + address[len(_ALL_INTERFACES):]
        return bind(server, address)

    bind_on_node_ip.keeps_loopback = True  # type: ignore[attr-defined]
    replica.add_port_to_grpc_server = bind_on_node_ip
    return True
