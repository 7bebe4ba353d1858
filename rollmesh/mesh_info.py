"""Deprecated: ``mesh.json`` and the run directories moved to ``rollmesh.mesh_address``, where
``MeshInfo`` became ``MeshAddress`` (one type for where a mesh is). Removed in the next release.
"""

from __future__ import annotations

from rollmesh.moved_names import forward_moved_names

__getattr__ = forward_moved_names(__name__, {
    "MeshInfo": "rollmesh.mesh_address:MeshAddress",
    "read_mesh_info": "rollmesh.mesh_address:read_mesh_address",
    "write_mesh_info": "rollmesh.mesh_address:write_mesh_address",
    "MESH_FILE": "rollmesh.mesh_address",
    "MeshNotFoundError": "rollmesh.mesh_address",
    "nats_url_for_clients": "rollmesh.mesh_address",
    "new_run_dir": "rollmesh.mesh_address",
    "latest_run_dir": "rollmesh.mesh_address",
})
