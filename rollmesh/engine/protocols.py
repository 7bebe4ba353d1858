"""The seams of the engine: what a generate backend offers and what a tokenizer must provide.

Knows the wire's SamplingParams and nothing of torch, Ray or NATS, so that the local torch engine,
the disaggregated Ray engine and an SGLang backend all sit behind the same ``InferenceEngine``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Literal, Protocol, runtime_checkable

from rollmesh.messages.base import SamplingParams

# "abort" only appears on sequences returned by an explicit abort (partial output is kept).
FinishReason = Literal["eos", "stop", "length", "abort"]


@dataclass(frozen=True, slots=True)
class GenerationResult:
    """One generation: the generated tokens only, each with its behaviour logprob and version."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: FinishReason
    prompt_len: int
    request_id: str = ""


class Detokenizer(Protocol):
    """What the decode engine needs of a tokenizer: the EOS id and ids -> text for stop strings."""

    eos_id: int

    def decode(self, ids: Iterable[int]) -> str: ...


@runtime_checkable
class InferenceEngine(Protocol):
    """A generate backend: token ids in, token ids with logprobs and weight versions out."""

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, *, request_id: str
    ) -> GenerationResult: ...
