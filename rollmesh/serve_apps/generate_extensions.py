"""rollmesh's extensions to the OpenAI and SGLang request bodies: what they ask of the engine
(session, minimum weight version, routed experts) and how the routed experts come back.

Knows the HTTP shapes, the engine's GenerateOptions and numpy; not Ray, not FastAPI. The fields
are the same on every generate route (``http_shapes.EngineOptionFields``), so one function
checks them for all three.
"""

from __future__ import annotations

import base64
from typing import TYPE_CHECKING

import numpy as np

from rollmesh.engine.protocols import GenerateOptions, GenerationResult
from rollmesh.serve_apps.errors import InvalidApiRequestError
from rollmesh.serve_apps.http_shapes import EngineOptionFields, RoutedExperts, RoutedExpertsDtype

if TYPE_CHECKING:  # generation_requests imports this module
    from rollmesh.serve_apps.generation_requests import ServedModel

# Longest session_id or rid: the router remembers up to 100k sessions, so ids are bounded too.
MAX_ID_CHARS = 256


def generate_options(
    request: EngineOptionFields, *, prompt_len: int, served: ServedModel
) -> GenerateOptions:
    """The engine options the request's rollmesh fields ask for; raises InvalidApiRequestError
    with the field's name for each value the engine would refuse."""
    session_id = request.session_id
    if session_id is not None and not 1 <= len(session_id) <= MAX_ID_CHARS:
        raise InvalidApiRequestError(
            f"session_id must be 1 to {MAX_ID_CHARS} characters (got {len(session_id)})",
            code="invalid_value", param="session_id",
        )
    min_version = request.min_weight_version
    if min_version is not None and min_version < 0:
        raise InvalidApiRequestError(
            f"min_weight_version must be at least 0 (got {min_version})",
            code="invalid_value", param="min_weight_version",
        )
    start = request.routed_experts_start_len
    if not 0 <= start <= prompt_len:
        raise InvalidApiRequestError(
            f"routed_experts_start_len must be between 0 and the prompt's length {prompt_len} "
            f"(got {start})",
            code="invalid_value", param="routed_experts_start_len",
        )
    if request.return_routed_experts and served.routes_experts is False:
        raise InvalidApiRequestError(
            f"the model {served.name!r} is dense: it routes no experts, so it has none to return",
            code="unsupported_value", param="return_routed_experts",
        )
    return GenerateOptions(
        session_id=session_id, min_version=min_version,
        return_routed_experts=request.return_routed_experts, routed_experts_start_len=start,
    )


def encode_routed_experts(
    result: GenerationResult, dtype: RoutedExpertsDtype
) -> RoutedExperts | None:
    """The result's routed expert rows as base64 of a C-order little-endian array, compact
    (the engine's uint8/uint16) or int32 (SGLang's encoding); None when it carries none."""
    rows = result.routed_experts
    if rows is None:
        return None
    if dtype == "int32":
        encoded = np.ascontiguousarray(rows, dtype="<i4")
        name = "int32"
    else:
        encoded = np.ascontiguousarray(rows, dtype=rows.dtype.newbyteorder("<"))
        name = encoded.dtype.name
        if name not in ("uint8", "uint16"):
            raise ValueError(f"the engine returned routed experts as {name}, not uint8/uint16")
    return RoutedExperts(
        routed_experts=base64.b64encode(encoded.tobytes()).decode("ascii"),
        routed_experts_dtype=name,
        routed_experts_shape=list(encoded.shape),
        routed_experts_start_len=result.routed_experts_start,
    )
