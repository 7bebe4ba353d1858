"""The dead-letter event. Knows msgspec only."""

from __future__ import annotations

from rollmesh.messages.base import WireMessage


class DeadLettered(WireMessage, frozen=True, tag="dlq.dead_lettered"):
    """A message a consumer could not decode or validate; the consumer went on."""

    subject: str
    consumer: str
    reason: str
    # The first bytes of the offending payload, base64-encoded (bounded, never the whole thing).
    payload_b64: str = ""
    payload_size: int = 0
    received_at: float = 0.0
