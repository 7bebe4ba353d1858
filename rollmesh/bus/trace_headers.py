"""Deprecated: the trace-header helpers moved to ``rollmesh.telemetry.trace_headers``, where the
engine's HTTP client and the inference router may import them without reaching for the bus.
Importing a name from here warns; this module is removed in the next release.
"""

from rollmesh.moved_names import forward_moved_names

__getattr__ = forward_moved_names(__name__, {
    "inject_trace_headers": "rollmesh.telemetry.trace_headers",
    "extract_trace_context": "rollmesh.telemetry.trace_headers",
})
