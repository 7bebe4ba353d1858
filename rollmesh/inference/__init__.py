"""rollmesh.inference: what links engines to each other, used by the rollout workers and Serve.

The router pairs prefill and decode workers for each generate call (``router``), the decode-loan
roster adds and removes the decode workers the GPU scheduler lends (``decode_loans``), and the
weight adapters give a prefill engine or a decode loop the face a weight follower stages through
(``weight_adapters``). Plain logic: knows Ray actor handles (duck-typed ``.remote``) but never
imports the actors, the bus or the Serve apps; the actors and the Serve app import it.
Names load lazily, as in ``rollmesh.bus``: importing the package alone imports none of its modules.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "InferenceRouter": "rollmesh.inference.router",
    "generation_attributes": "rollmesh.inference.router",
    "DecodeLoanRoster": "rollmesh.inference.decode_loans",
    "PrefillWeights": "rollmesh.inference.weight_adapters",
    "DecodeWeights": "rollmesh.inference.weight_adapters",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'rollmesh.inference' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return __all__
