"""A trajectory under construction: a growing ``TokenTrace``.

Knows nothing of Ray, NATS or torch. Prompt and tool-output tokens are forced: loss mask 0,
logprob 0.0, version ``NO_VERSION`` (the TokenTrace convention for a token the policy did not
generate). Generated tokens keep the behaviour logprob and the weight version that produced them.
Nothing is ever re-tokenized: text is only derived from the ids. ``trace()`` freezes it into the
TokenTrace that the saved state, the completed message and the trainer carry.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rollmesh.messages import NO_VERSION, TokenTrace


@dataclass
class Trajectory:
    ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)

    @classmethod
    def from_trace(cls, trace: TokenTrace) -> Trajectory:
        return cls(list(trace.ids), list(trace.loss_mask), list(trace.logprobs), list(trace.versions))

    def trace(self) -> TokenTrace:
        """A checked, frozen copy (raises ``TokenTraceError`` on a broken invariant)."""
        return TokenTrace(ids=list(self.ids), loss_mask=list(self.loss_mask), logprobs=list(self.logprobs),
                          versions=list(self.versions))

    def append_forced(self, token_ids: list[int]) -> None:
        self.ids.extend(token_ids)
        self.loss_mask.extend([0] * len(token_ids))
        self.logprobs.extend([0.0] * len(token_ids))
        self.versions.extend([NO_VERSION] * len(token_ids))

    def append_generated(self, token_ids: list[int], logprobs: list[float], versions: list[int]) -> None:
        if not len(token_ids) == len(logprobs) == len(versions):
            raise ValueError("generated tokens, logprobs and versions differ in length")
        if any(version < 0 for version in versions):
            raise ValueError(f"a generated token has no weight version (versions {sorted(set(versions))})")
        self.ids.extend(token_ids)
        self.loss_mask.extend([1] * len(token_ids))
        self.logprobs.extend(logprobs)
        self.versions.extend(versions)

    def __len__(self) -> int:
        return len(self.ids)

    def generated_versions(self) -> list[int]:
        return [version for version in self.versions if version != NO_VERSION]
