"""The seams of the engine: what a generate backend offers and what a tokenizer must provide.

Knows the wire's SamplingParams and numpy (routed expert rows), nothing of torch, Ray or NATS, so
that the local torch engine, the disaggregated Ray engine and the SGLang backend all sit behind
the same ``InferenceEngine``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Sequence
from typing import Literal, Protocol, runtime_checkable

import numpy as np

from rollmesh.messages.base import SamplingParams

# "eos": the last token is one of the model's end-of-turn ids; "stop": a stop string; "length":
# the token budget or the context. "abort" only appears on sequences returned by an explicit abort
# (partial output is kept).
FinishReason = Literal["eos", "stop", "length", "abort"]

# How a grammar is written (``GrammarSpec.kind``); SGLang's sampling params take the same three
# under the same names.
GrammarKind = Literal["json_schema", "ebnf", "structural_tag"]


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """A grammar every generated token of one request must follow (guided decoding, xgrammar).

    - ``"json_schema"``: ``text`` is a JSON schema; the output is one JSON value matching it.
    - ``"ebnf"``: ``text`` is xgrammar's EBNF (GBNF) with a ``root`` rule.
    - ``"structural_tag"``: ``text`` is xgrammar's structural tag JSON
      (``{"type": "structural_tag", "format": {...}}``); the Serve app writes these for
      ``tool_choice`` and ``response_format`` (``rollmesh.serve_apps.tool_choice``).

    The grammar applies from the first generated token. When it is complete, the only tokens left
    are the model's end-of-turn ids (``end_ids`` when given: a subset of them, e.g. harmony's
    ``<|call|>`` after a forced call), sampled under the mask like any other token, so a
    constrained turn ends with an end-of-turn id the model generated and stays token-exact.
    """

    kind: GrammarKind
    text: str
    end_ids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class GenerateOptions:
    """What a caller may ask of one generate call beyond sampling.

    - ``session_id``: turns of one multi-turn conversation share it; the engine keeps the
      session's KV between turns (while its tool runs) and the next turn's prompt reuses it.
    - ``min_version``: the oldest weight version allowed to produce tokens; when the engine has
      not reached it the call fails with the retryable ``VersionUnavailableError``.
    - ``return_routed_experts`` / ``routed_experts_start_len``: for MoE models, return the
      routed expert rows of positions ``[start_len, seqlen - 1)`` (SGLang's absolute slice).
    - ``top_logprobs``: how many of the most likely ids (with their logprobs, from the
      distribution each token was drawn from) to return per generated token, 0 to
      ``MAX_TOP_LOGPROBS``; 0 costs nothing.
    - ``grammar``: constrain the generation (``GrammarSpec``); an invalid one raises
      ``InvalidGrammarError`` before anything is generated.
    """

    session_id: str | None = None
    min_version: int | None = None
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    top_logprobs: int = 0
    grammar: GrammarSpec | None = None


DEFAULT_OPTIONS = GenerateOptions()
# OpenAI's cap on chat top_logprobs.
MAX_TOP_LOGPROBS = 20
# One generated token's alternatives: (token id, logprob) pairs, most likely first.
TopLogprobs = list[tuple[int, float]]


@dataclass(frozen=True, slots=True)
class GenerationResult:
    """One generation: the generated tokens only, each with its behaviour logprob and version.

    ``routed_experts`` (MoE with ``return_routed_experts`` only) holds one row per forwarded
    position from ``routed_experts_start`` to ``prompt_len + len(token_ids) - 2``: shape
    [rows, sparse layers, top_k], uint8 for at most 256 experts, else uint16. ``cached_tokens``
    counts the prompt tokens whose KV was reused from the session rather than computed.
    ``top_logprobs`` (only when ``GenerateOptions.top_logprobs`` > 0): one list per generated
    token of its most likely alternatives.
    ``constrained`` (requests with a grammar only; empty otherwise) has one flag per generated
    token: True where the grammar's mask removed some token the model could have drawn. Such a
    token's logprob is that of the masked distribution it was drawn from, and trajectories give
    it loss mask 0 (it was not the policy's free choice).
    """

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: FinishReason
    prompt_len: int
    request_id: str = ""
    cached_tokens: int = 0
    routed_experts: np.ndarray | None = None
    routed_experts_start: int = 0
    top_logprobs: list[TopLogprobs] | None = None
    constrained: list[bool] = field(default_factory=list)


class Detokenizer(Protocol):
    """What the decode engine needs of the model's own tokenizer.

    - ``end_of_turn_ids``: every id that ends a generation (finish reason "eos"); a model may have
      several, e.g. Llama 3's ``<|eot_id|>`` and ``<|eom_id|>``, ChatML's ``<|im_end|>`` and
      ``<|endoftext|>``.
    - ``vocab_size``: ids below it are the tokenizer's; the engine never samples one at or above
      it (Qwen pads its embedding past the tokenizer).
    - ``decode``: ids -> text with special tokens kept, where stop strings are matched.

    ``rollmesh.chat.ModelDirectory`` and ``rollmesh.chat.ChatModel`` are Detokenizers.
    """

    @property
    def end_of_turn_ids(self) -> frozenset[int]: ...

    @property
    def vocab_size(self) -> int: ...

    def decode(self, ids: Sequence[int]) -> str: ...


@runtime_checkable
class InferenceEngine(Protocol):
    """A generate backend: token ids in, token ids with logprobs and weight versions out."""

    async def generate(
        self,
        input_ids: list[int],
        sampling: SamplingParams,
        *,
        request_id: str,
        options: GenerateOptions = DEFAULT_OPTIONS,
    ) -> GenerationResult: ...
