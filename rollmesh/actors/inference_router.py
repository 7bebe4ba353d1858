"""Deprecated: the inference router moved to ``rollmesh.inference.router`` (plain logic, imported
by the rollout workers and the Serve app, so the Serve app need not import the actors).
Importing a name from here warns; this module is removed in the next release.
"""

from rollmesh.moved_names import forward_moved_names

__getattr__ = forward_moved_names(__name__, {
    "InferenceRouter": "rollmesh.inference.router",
    "generation_attributes": "rollmesh.inference.router",
    "DEFAULT_MAX_SESSIONS": "rollmesh.inference.router",
})
