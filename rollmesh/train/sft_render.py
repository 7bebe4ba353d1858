"""Deprecated: supervised-example rendering moved to ``rollmesh.training.sft_render``, next to the
supervised trainer that uses it (a domain package, which must not import this job package).
Importing a name from here warns; this module is removed in the next release.
"""

from rollmesh.moved_names import forward_moved_names

__getattr__ = forward_moved_names(__name__, {
    name: "rollmesh.training.sft_render"
    for name in ("SftExample", "render_text_example", "render_chat_example")
})
