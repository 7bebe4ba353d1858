"""Deprecated: the prompt names moved to ``rollmesh.training.prompt_ids``, where the supervised
trainer (a domain package, which must not import this job package) may import them too.
Importing a name from here warns; this module is removed in the next release.
"""

from rollmesh.moved_names import forward_moved_names

__getattr__ = forward_moved_names(__name__, {
    "PromptRef": "rollmesh.training.prompt_ids",
    "parse_group_id": "rollmesh.training.prompt_ids",
})
