"""A trajectory under construction: exact token ids with their loss mask, logprobs and versions.

Knows nothing of Ray, NATS or torch. Prompt and tool-output tokens are "forced": loss mask 0,
logprob 0.0, version -1. Generated tokens keep the behaviour logprob and the weight version that
produced them. Nothing is ever re-tokenized: text is only derived from the ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field

FORCED_VERSION = -1


@dataclass
class Trajectory:
    tokens: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)

    def append_forced(self, token_ids: list[int]) -> None:
        self.tokens.extend(token_ids)
        self.loss_mask.extend([0] * len(token_ids))
        self.logprobs.extend([0.0] * len(token_ids))
        self.versions.extend([FORCED_VERSION] * len(token_ids))

    def append_generated(self, token_ids: list[int], logprobs: list[float], versions: list[int]) -> None:
        if not len(token_ids) == len(logprobs) == len(versions):
            raise ValueError("generated tokens, logprobs and versions differ in length")
        self.tokens.extend(token_ids)
        self.loss_mask.extend([1] * len(token_ids))
        self.logprobs.extend(logprobs)
        self.versions.extend(versions)

    def __len__(self) -> int:
        return len(self.tokens)

    def generated_versions(self) -> list[int]:
        return [version for version in self.versions if version != FORCED_VERSION]
