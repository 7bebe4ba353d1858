"""Deprecated: moved to ``rollmesh.rollout.saved_state`` (this name sat beside the bus's
``rollout_states.py``, the JetStream store). Importing a name from here warns; this module is
removed in the next release.
"""

from rollmesh.moved_names import forward_moved_names

__getattr__ = forward_moved_names(__name__, {
    "conversation_of": "rollmesh.rollout.saved_state",
    "with_progress": "rollmesh.rollout.saved_state",
    "InMemoryRolloutStates": "rollmesh.rollout.saved_state",
})
