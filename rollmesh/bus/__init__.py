"""rollmesh.bus: the embedded nats-server, connections, JetStream layout, publish and consume.

Everything here knows nats-py. What logic classes use instead lives in ``rollmesh.ports``
(re-exported below for the shell's convenience); the names are loaded lazily, so importing this
package's lighter modules never drags nats-py in.
"""

from __future__ import annotations


from rollmesh.moved_names import lazy_exports

_EXPORTS = {
    "ActorLogic": "rollmesh.ports",
    "MessageContext": "rollmesh.ports",
    "Publisher": "rollmesh.ports",
    "PublishAck": "rollmesh.ports",
    "Subscription": "rollmesh.ports",
    "BusPublisher": "rollmesh.bus.publisher",
    "BusWatcher": "rollmesh.bus.watcher",
    "MeshStores": "rollmesh.bus.mesh_stores",
    "EmbeddedNatsServer": "rollmesh.bus.embedded_server",
    "connect_bus": "rollmesh.bus.connection",
    "flush_to_server": "rollmesh.bus.connection",
    "ensure_streams": "rollmesh.bus.streams",
    "stream_for": "rollmesh.bus.streams",
    "rollout_requests_stream": "rollmesh.bus.streams",
    "rollout_results_stream": "rollmesh.bus.streams",
    "weights_stream": "rollmesh.bus.streams",
    "dead_letter_stream": "rollmesh.bus.streams",
    "checkpoints_stream": "rollmesh.bus.streams",
    "scheduling_stream": "rollmesh.bus.streams",
    "rollout_state_bucket": "rollmesh.bus.streams",
    "BusError": "rollmesh.bus.errors",
    "BusConnectError": "rollmesh.bus.errors",
    "BusSecurityError": "rollmesh.bus.errors",
    "BusTlsError": "rollmesh.bus.errors",
    "BusCredentials": "rollmesh.bus.security",
    "role_permissions": "rollmesh.bus.permissions",
    "render_authorization": "rollmesh.bus.permissions",
    "BusRequestError": "rollmesh.bus.errors",
    "NatsServerError": "rollmesh.bus.errors",
    "NatsServerNotFoundError": "rollmesh.bus.errors",
    "NatsServerStartError": "rollmesh.bus.errors",
    "NoRespondersError": "rollmesh.bus.errors",
    "PublishError": "rollmesh.bus.errors",
    "ReplyDecodeError": "rollmesh.bus.errors",
    "RequestTimeoutError": "rollmesh.bus.errors",
    "StreamSetupError": "rollmesh.bus.errors",
}

__all__ = sorted(_EXPORTS)

# Moved out of the bus (issue 24): plain code that sends trace context over HTTP needs them too.
__getattr__ = lazy_exports(__name__, _EXPORTS, moved={
    "inject_trace_headers": "rollmesh.telemetry.trace_headers",
    "extract_trace_context": "rollmesh.telemetry.trace_headers",
})


def __dir__() -> list[str]:
    return __all__
