"""Deprecated: the sandbox's in-sandbox helper process is the guest now (issue 24: "agent"
misled in a framework about LLM agents), so this module moved to ``rollmesh.sandbox.guest_client``.
Importing a name from here warns; this module is removed in the next release.
"""

from rollmesh.moved_names import forward_moved_names

__getattr__ = forward_moved_names(__name__, {
    "HIGH_WATER": "rollmesh.sandbox.guest_client",
    "ANSWER_GRACE_S": "rollmesh.sandbox.guest_client",
    "START_TIMEOUT_S": "rollmesh.sandbox.guest_client",
    "EXIT_WAIT_S": "rollmesh.sandbox.guest_client",
    "AgentSandbox": "rollmesh.sandbox.guest_client:GuestSandbox",
})
