"""The building blocks of the config tree: its base Struct and the constrained number types.

Knows msgspec only. Every section forbids unknown fields (a typo is an error, not a silent
default) and is frozen (nothing mutates config).
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta


class ConfigSection(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    pass


PositiveInt = Annotated[int, Meta(ge=1)]
NonNegInt = Annotated[int, Meta(ge=0)]
PositiveFloat = Annotated[float, Meta(gt=0)]
NonNegFloat = Annotated[float, Meta(ge=0)]

MiB = 1024 * 1024
