"""Deprecated: the sandbox's in-sandbox helper process is the guest now (issue 24: "agent"
misled in a framework about LLM agents), so this module moved to ``rollmesh.sandbox.guest_transfers``.
Importing a name from here warns; this module is removed in the next release.
"""

from rollmesh.moved_names import forward_moved_names

__getattr__ = forward_moved_names(__name__, {
    "PARALLEL_HASH_AT": "rollmesh.sandbox.guest_transfers",
    "FLUSH_STALL_S": "rollmesh.sandbox.guest_transfers",
    "HashThread": "rollmesh.sandbox.guest_transfers",
    "Download": "rollmesh.sandbox.guest_transfers",
    "Transfers": "rollmesh.sandbox.guest_transfers",
})
