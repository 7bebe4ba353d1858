"""Deprecated: the sandbox's in-sandbox helper process is the guest now (issue 24: "agent"
misled in a framework about LLM agents), so this module moved to ``rollmesh.sandbox.guest_streams``.
Importing a name from here warns; this module is removed in the next release.
"""

from rollmesh.moved_names import forward_moved_names

__getattr__ = forward_moved_names(__name__, {
    "STREAM_HIGH_WATER": "rollmesh.sandbox.guest_streams",
    "StreamedUploads": "rollmesh.sandbox.guest_streams",
})
