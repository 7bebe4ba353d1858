"""Base class for every wire message.

Knows msgspec only. Wire messages are frozen, keyword-only and tagged; they never forbid unknown
fields, so an older actor can read a newer message (new fields get defaults and go last).
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta


class WireMessage(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    """Root of the wire contract. Subclasses set ``tag="domain.event"``."""


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """How to sample one generation. Shared by rollout requests and the inference API."""

    temperature: Annotated[float, Meta(ge=0.0, le=10.0)] = 1.0
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    max_new_tokens: Annotated[int, Meta(ge=1, le=1_000_000)] = 64
    # Generation also stops when any of these strings has been produced (a turn always ends at the
    # model's end-of-turn ids; in a rollout, a turn cut by a stop string ends the rollout truncated).
    stop: Annotated[list[str], Meta(max_length=16)] = []
