"""Deprecated: the sandbox's in-sandbox helper process is the guest now (issue 24: "agent"
misled in a framework about LLM agents), so this module moved to ``rollmesh.sandbox.guest_wire``.
Importing a name from here warns; this module is removed in the next release.
"""

from rollmesh.moved_names import forward_moved_names

__getattr__ = forward_moved_names(__name__, {
    "PREFIX": "rollmesh.sandbox.guest_wire",
    "CHUNK": "rollmesh.sandbox.guest_wire",
    "MAX_HEADER": "rollmesh.sandbox.guest_wire",
    "DIRECT_READ_AT": "rollmesh.sandbox.guest_wire",
    "READ_SIZE": "rollmesh.sandbox.guest_wire",
    "WireError": "rollmesh.sandbox.guest_wire",
    "encode_head": "rollmesh.sandbox.guest_wire",
    "FrameReader": "rollmesh.sandbox.guest_wire",
    "FrameWriter": "rollmesh.sandbox.guest_wire",
    "drop_written": "rollmesh.sandbox.guest_wire",
    "workspace_relative": "rollmesh.sandbox.guest_wire",
})
