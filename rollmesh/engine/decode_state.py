"""What the decode engine keeps per sequence and what it reports: a running sequence's state
(``ActiveSequence``), its report when finished (``ActiveSequence.finished``: the engine's
``GenerationResult``, what every caller reads), and the engine's ``DecodeStats``.

Knows torch and numpy (routed expert rows) and the engine's result types; not the model, the KV
pool, grammars or sampling: ``decode`` fills these records, ``batch_sampler`` appends to them.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch

from rollmesh.engine.protocols import FinishReason, GenerateOptions, GenerationResult, TopLogprobs
from rollmesh.engine.stopping import StopChecker
from rollmesh.messages.base import SamplingParams


@dataclass(frozen=True, slots=True)
class DecodeStats:
    active: int
    max_batch: int
    finished_unreported: int
    steps: int
    tokens_generated: int
    current_version: int
    staged_version: int | None
    kv_blocks_total: int
    kv_blocks_free: int
    sessions_parked: int
    session_hits: int
    session_misses: int
    prefix_tokens_reused: int
    session_evictions: int


class ActiveSequence:
    """A sequence in the batch: its prompt, what it generated so far, and its KV blocks."""

    __slots__ = ("request_id", "input_ids", "token_ids", "logprobs", "versions", "stopper",
                 "blocks", "options", "temperature", "top_p", "cached_tokens", "routes",
                 "top", "matcher", "constrained")

    def __init__(self, request_id: str, input_ids: list[int], blocks: list[int],
                 sampling: SamplingParams, stopper: StopChecker, options: GenerateOptions,
                 cached_tokens: int) -> None:
        self.request_id = request_id
        self.input_ids = input_ids
        self.blocks = blocks
        self.stopper = stopper
        self.options = options
        self.temperature = sampling.temperature
        self.top_p = sampling.top_p
        self.cached_tokens = cached_tokens
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.routes: list[torch.Tensor] = []  # chunks of routed expert rows, position order
        # Each token's alternatives, only for a request that asked (options.top_logprobs).
        self.top: list[TopLogprobs] | None = [] if options.top_logprobs else None
        self.matcher: Any = None  # the grammar's xgrammar matcher, with options.grammar only
        self.constrained: list[bool] = []  # per token, with options.grammar only

    @property
    def prompt_len(self) -> int:
        return len(self.input_ids)

    @property
    def cached_len(self) -> int:
        # The newest token's KV is written by the next step, so it is not in the pool yet.
        return self.prompt_len + len(self.token_ids) - 1

    def finished(self, reason: FinishReason, routes: torch.Tensor | None) -> GenerationResult:
        """The report of this sequence; ``routes``: its routed expert rows [0, cached_len)."""
        routed, start = None, 0
        if self.options.return_routed_experts and routes is not None:
            start = self.options.routed_experts_start_len
            routed = routes[start:].numpy().copy()
        return GenerationResult(
            token_ids=self.token_ids, logprobs=self.logprobs, versions=self.versions,
            finish_reason=reason, prompt_len=self.prompt_len, request_id=self.request_id,
            cached_tokens=self.cached_tokens, routed_experts=routed, routed_experts_start=start,
            top_logprobs=self.top, constrained=self.constrained,
        )


def __getattr__(name: str) -> Any:
    # Deprecated: the engine reported a FinishedSequence that callers converted into an identical
    # GenerationResult; it now reports the GenerationResult. The old name goes after one release.
    if name == "FinishedSequence":
        warnings.warn("rollmesh.engine FinishedSequence is deprecated; the engine returns "
                      "rollmesh.engine.protocols.GenerationResult", DeprecationWarning, stacklevel=2)
        return GenerationResult
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
