"""Deprecated: the sandbox's in-sandbox helper process is the guest now (issue 24: "agent"
misled in a framework about LLM agents), so this module moved to ``rollmesh.sandbox.guest``.
Importing a name from here warns; this module is removed in the next release.
"""

from rollmesh.moved_names import forward_moved_names

__getattr__ = forward_moved_names(__name__, {
    "MAX_REQUEST_PAYLOAD": "rollmesh.sandbox.guest",
    "HIGH_WATER": "rollmesh.sandbox.guest",
    "READ_SIZE": "rollmesh.sandbox.guest",
    "STRAGGLER_GRACE_S": "rollmesh.sandbox.guest",
    "SPAWN_FAULTS": "rollmesh.sandbox.guest",
    "PR_SET_DUMPABLE": "rollmesh.sandbox.guest",
    "RLIMITS": "rollmesh.sandbox.guest",
    "Exec": "rollmesh.sandbox.guest",
    "Agent": "rollmesh.sandbox.guest:Guest",
    "find_program": "rollmesh.sandbox.guest",
    "kill_group": "rollmesh.sandbox.guest",
    "harden_self": "rollmesh.sandbox.guest",
    "main": "rollmesh.sandbox.guest",
})
