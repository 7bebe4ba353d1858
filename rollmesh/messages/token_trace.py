"""TokenTrace: the one shape of a rollout's tokens, on the wire, in saved state and in training.

Knows msgspec only. One entry per token in four equal-length lists: the exact token ids, the loss
mask (1 = trained), the behaviour logprob and the weight version that produced the token. A token
the policy did not generate (prompt, tool output, tokens a chat template inserts) has version
``NO_VERSION`` (-1) and logprob 0.0: its logprob means nothing, and it is never stale. There is
no second "forced" or "unknown" version value. A generated token has a version >= 0 and usually
loss mask 1; it can have mask 0 when it must not be trained (a token sampled under a grammar).
A demonstration (warm start, SFT) may train a token it did not generate: mask 1, version -1.
The invariants are checked on construction and on decode (a violation is a ``TokenTraceError``,
which msgspec reports as a ``ValidationError`` with the reason when it comes off the wire).
"""

from __future__ import annotations

import math
from typing import Annotated

import msgspec
from msgspec import Meta

from rollmesh.messages.errors import MessageError

# The version of a token the policy did not generate.
NO_VERSION = -1

TokenId = Annotated[int, Meta(ge=0)]
Version = Annotated[int, Meta(ge=NO_VERSION)]


class TokenTraceError(MessageError, ValueError):
    """A TokenTrace breaks an invariant; ``position`` is the first offending token (-1: lengths)."""

    def __init__(self, reason: str, *, position: int = -1) -> None:
        super().__init__(reason if position < 0 else f"{reason} (token {position})")
        self.reason = reason
        self.position = position


class TokenTrace(msgspec.Struct, frozen=True, kw_only=True):
    """A rollout's tokens with their loss mask, behaviour logprobs and weight versions."""

    ids: list[TokenId] = []
    loss_mask: list[int] = []
    logprobs: list[float] = []
    versions: list[Version] = []

    def __post_init__(self) -> None:
        size = len(self.ids)
        if not len(self.loss_mask) == len(self.logprobs) == len(self.versions) == size:
            raise TokenTraceError(
                f"ids, loss_mask, logprobs and versions differ in length ({size}, {len(self.loss_mask)}, "
                f"{len(self.logprobs)}, {len(self.versions)})")
        if not set(self.loss_mask) <= {0, 1}:
            raise TokenTraceError("loss_mask holds a value other than 0 or 1",
                                  position=next(i for i, m in enumerate(self.loss_mask) if m not in (0, 1)))
        for position, (logprob, version) in enumerate(zip(self.logprobs, self.versions)):
            if version == NO_VERSION and logprob != 0.0:
                raise TokenTraceError("a token not generated (version -1) has a logprob other than 0.0",
                                      position=position)
            if math.isnan(logprob):
                raise TokenTraceError("a logprob is NaN", position=position)

    def __len__(self) -> int:
        return len(self.ids)

    @classmethod
    def forced(cls, ids: list[int]) -> TokenTrace:
        """Tokens the policy did not generate (a prompt, a tool's output): mask 0, version -1."""
        return cls(ids=list(ids), loss_mask=[0] * len(ids), logprobs=[0.0] * len(ids),
                   versions=[NO_VERSION] * len(ids))

    def generated_versions(self) -> list[int]:
        """The version of every generated token, in order."""
        return [version for version in self.versions if version != NO_VERSION]

    def last_version(self) -> int:
        """The version of the last generated token (``NO_VERSION`` when none was generated)."""
        return next((version for version in reversed(self.versions) if version != NO_VERSION), NO_VERSION)

    def tail(self, count: int) -> TokenTrace:
        """The last ``count`` tokens (a window of a long trace, e.g. to train on its end)."""
        start = max(0, len(self.ids) - count)
        return TokenTrace(ids=self.ids[start:], loss_mask=self.loss_mask[start:],
                          logprobs=self.logprobs[start:], versions=self.versions[start:])

    def concat(self, other: TokenTrace) -> TokenTrace:
        return TokenTrace(ids=self.ids + other.ids, loss_mask=self.loss_mask + other.loss_mask,
                          logprobs=self.logprobs + other.logprobs, versions=self.versions + other.versions)
