"""The task input of the built-in ``dataset`` task (rollmesh/rollout/dataset_task.py) for one
prompt row: what an RL stage's feeder and an evaluation both publish.

Knows ``PromptRow`` and the reward specs; nothing of NATS, files or the reading order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from rollmesh.data import PromptRow
from rollmesh.run_config import RewardSpec

# The built-in task that speaks dataset rows.
DATASET_TASK = "dataset"


def reward_entries(specs: Sequence[RewardSpec]) -> list[dict[str, Any]]:
    """The rewards as a request carries them (plain JSON: a request is data)."""
    return [msgspec.to_builtins(spec) for spec in specs]


def dataset_task_input(row: PromptRow, *, system_prompt: str,
                       rewards: list[dict[str, Any]]) -> dict[str, Any]:
    """``{"messages", "row", "answer", "rewards"}`` for ``row``: its messages after
    ``system_prompt``, unless the row brings its own system message (never two)."""
    messages = row.messages
    if system_prompt and not (messages and messages[0].get("role") == "system"):
        messages = [{"role": "system", "content": system_prompt}, *messages]
    return {"messages": messages, "row": row.raw, "answer": row.answer, "rewards": rewards}
