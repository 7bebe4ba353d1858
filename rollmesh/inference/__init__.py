"""rollmesh.inference: what links engines to each other, used by the rollout workers and Serve.

The router pairs prefill and decode workers for each generate call (``router``), the decode-loan
roster adds and removes the decode workers the GPU scheduler lends (``decode_loans``), and the
weight adapters give a prefill engine or a decode loop the face a weight follower stages through
(``weight_adapters``). Plain logic: knows Ray actor handles (duck-typed ``.remote``) but never
imports the actors, the bus or the Serve apps; the actors and the Serve app import it.
Names load lazily, as in ``rollmesh.bus``: importing the package alone imports none of its modules.
"""

from __future__ import annotations

from rollmesh.moved_names import lazy_exports

_EXPORTS = {
    "InferenceRouter": "rollmesh.inference.router",
    "generation_attributes": "rollmesh.inference.router",
    "DecodeLoanRoster": "rollmesh.inference.decode_loans",
    "PrefillWeights": "rollmesh.inference.weight_adapters",
    "DecodeWeights": "rollmesh.inference.weight_adapters",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_exports(__name__, _EXPORTS)


def __dir__() -> list[str]:
    return __all__
