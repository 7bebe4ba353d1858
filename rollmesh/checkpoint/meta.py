"""What every checkpoint reader returns beside the tensors: step, weight version, model config.

Knows msgspec only. Unknown fields are tolerated, so a newer writer's ``meta.json`` still reads.
"""

from __future__ import annotations

from typing import Any

import msgspec


class CheckpointMeta(msgspec.Struct, frozen=True, kw_only=True):
    step: int
    weight_version: int
    model_config: dict[str, Any] = {}
