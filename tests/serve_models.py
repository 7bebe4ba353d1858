"""What the Serve app's unit tests share: the demo model as the app serves it, a tool and a question.

Knows the Serve app's ``ServedModel`` and ``rollmesh.chat``; test data only.
"""

from __future__ import annotations

from pathlib import Path

from rollmesh.chat import ChatModel
from rollmesh.config import ModelConfig
from rollmesh.serve_apps import ServedModel

CALC = {"type": "function", "function": {
    "name": "calc", "description": "molar mass of a formula",
    "parameters": {"type": "object", "properties": {"formula": {"type": "string"}},
                   "required": ["formula"]}}}
QUESTION = {"role": "user", "content": "molar mass of H2O?"}


def demo_served_model(demo_model_dir: Path) -> ServedModel:
    """The demo model directory as a Serve replica holds it (its context: 256 positions)."""
    chat = ChatModel.from_config(ModelConfig(path=str(demo_model_dir)))
    return ServedModel(name="demo", max_seq_len=256, vocab_size=chat.vocab_size, chat=chat)
