"""Deprecated: the sandbox's in-sandbox helper process is the guest now (issue 24: "agent"
misled in a framework about LLM agents), so this module moved to ``rollmesh.sandbox.guest_files``.
Importing a name from here warns; this module is removed in the next release.
"""

from rollmesh.moved_names import forward_moved_names

__getattr__ = forward_moved_names(__name__, {
    "sha256": "rollmesh.sandbox.guest_files",
    "check_digest": "rollmesh.sandbox.guest_files",
    "RequestError": "rollmesh.sandbox.guest_files",
    "path_refused": "rollmesh.sandbox.guest_files",
    "transfer_failed": "rollmesh.sandbox.guest_files",
    "unsafe_member": "rollmesh.sandbox.guest_files",
    "Workspace": "rollmesh.sandbox.guest_files",
    "Upload": "rollmesh.sandbox.guest_files",
    "unnamed_file": "rollmesh.sandbox.guest_files",
    "read_small": "rollmesh.sandbox.guest_files",
    "tar_members_check": "rollmesh.sandbox.guest_files",
    "extract_tar": "rollmesh.sandbox.guest_files",
    "build_tar": "rollmesh.sandbox.guest_files",
})
