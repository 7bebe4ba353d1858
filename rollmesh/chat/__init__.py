"""rollmesh.chat: each model's own tokenizer, chat template and tool-call format, token-exact.

Plain logic: imports neither ray nor nats, and knows no actor, bus or Serve app. ``model_dir``
loads a Hugging Face model directory (fast tokenizer, chat template rendering, end-of-turn ids,
valid token ids); ``errors`` holds the package's typed errors.
"""

from rollmesh.chat.errors import ChatError, ModelDirectoryError, TemplateRenderError
from rollmesh.chat.model_dir import KNOWN_END_OF_TURN_TOKENS, ModelDirectory

__all__ = [
    "KNOWN_END_OF_TURN_TOKENS",
    "ChatError",
    "ModelDirectory",
    "ModelDirectoryError",
    "TemplateRenderError",
]
