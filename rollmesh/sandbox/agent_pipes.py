"""Deprecated: the sandbox's in-sandbox helper process is the guest now (issue 24: "agent"
misled in a framework about LLM agents), so this module moved to ``rollmesh.sandbox.guest_pipes``.
Importing a name from here warns; this module is removed in the next release.
"""

from rollmesh.moved_names import forward_moved_names

__getattr__ = forward_moved_names(__name__, {
    "F_SETPIPE_SZ": "rollmesh.sandbox.guest_pipes",
    "PIPE_SIZE": "rollmesh.sandbox.guest_pipes",
    "MAX_REPLY_PAYLOAD": "rollmesh.sandbox.guest_pipes",
    "STDERR_TAIL": "rollmesh.sandbox.guest_pipes",
    "DIED": "rollmesh.sandbox.guest_pipes",
    "AgentPipes": "rollmesh.sandbox.guest_pipes:GuestPipes",
})
