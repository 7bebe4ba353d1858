"""Per-token streaming out of the decode loop: the pieces a streamed request yields as its tokens
are sampled.

Knows the engine's result types; not torch, not Ray (the decode actor relays the pieces with a Ray
streaming generator, ``rollmesh.actors.inference_workers``). A stream (``DecodeLoop.stream``) yields
``TokenDelta`` pieces, each holding the tokens sampled since the previous piece (one per decode
step, or several when the consumer was slower than the loop), in order and without gaps, and ends
with the whole ``GenerationResult`` (every token again, with the finish reason, usage and routed
experts), so a consumer that only wants the end can skip the pieces. Closing the stream early
(the client went away) aborts the request in the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

from rollmesh.engine.protocols import TopLogprobs


@dataclass(frozen=True, slots=True)
class TokenDelta:
    """Tokens ``start .. start + len(token_ids)`` of a generation, as sampled."""

    request_id: str
    start: int  # index of the first of these tokens among the generated ones
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    top_logprobs: list[TopLogprobs] | None = None
