"""Continuous-batching decode over a paged KV cache, with per-token logprobs, weight versions and
routed experts, and per-session prefix reuse.

Knows torch, the model, the KV pool and the sampler; not Ray, not asyncio (``batch_loop`` drives
it). Requests join at any step, either prefilled elsewhere (``add_prefilled``: KV pages from a
prefill worker) or prefilled here (``add_prompt``: the aggregated mode, and a session's later
turns, which reuse the KV its earlier turns left in the pool). Each step decodes one token for
every active sequence and lets finished ones leave.

Memory: a request reserves the blocks of its whole budget (prompt + max_new_tokens, clipped to
the context) when it is admitted, so a running sequence never runs out of KV and is never
preempted; a request that does not fit yet waits. Finished turns of a session stay parked in the
pool (``SessionCache``) and are evicted, oldest first, only when an admission needs their blocks.

Weights: staged weights are swapped in at the start of a step or an admission; in-flight
sequences keep their KV and continue, and every token records the version that made it.

Tokens: the model directory's tokenizer (a ``Detokenizer``) says which ids end a turn and which
ids exist; ids past it (padded embedding rows) are never sampled. Without one (tests of bare
checkpoints) the model's config eos ends a turn, every row may be sampled, and stop strings and
grammars are refused.

Top logprobs (``GenerateOptions.top_logprobs``): the sampler returns each asking row's most
likely ids from the distribution it samples from (after a grammar's mask); a step computes them
only when some row of its batch asks. ``new_tokens`` hands a running sequence's latest tokens to
the loop that streams them (``batch_loop``, ``token_stream``).

Grammars (``GenerateOptions.grammar``, ``guided_decoding``): a constrained sequence's row of the
logits is masked before sampling, from its first token to its end-of-turn id; a step whose batch
holds no grammar does no grammar work.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from rollmesh.engine.errors import (
    CapacityError,
    DuplicateRequestError,
    InvalidRequestError,
    KvCapacityError,
    PromptTooLongError,
    VersionUnavailableError,
)
from rollmesh.engine.guided_decoding import GuidedDecoder, accept
from rollmesh.engine.kv_pages import KvBlockPool, OutOfBlocksError, PagedAttention
from rollmesh.engine.paged_model import model_device
from rollmesh.engine.prefill import PrefillResult, run_prefill
from rollmesh.engine.protocols import (
    DEFAULT_OPTIONS,
    MAX_TOP_LOGPROBS,
    Detokenizer,
    FinishReason,
    GenerateOptions,
    GenerationResult,
    TopLogprobs,
)
from rollmesh.engine.request_checks import validate_prompt
from rollmesh.engine.sampling import sample_tokens
from rollmesh.engine.session_cache import CachedSession, SessionCache, common_prefix_length
from rollmesh.engine.stopping import StopChecker
from rollmesh.engine.token_stream import TokenDelta
from rollmesh.engine.weight_staging import WeightStager
from rollmesh.messages.base import SamplingParams


@dataclass(slots=True)
class FinishedSequence:
    request_id: str
    token_ids: list[int]  # generated tokens only
    logprobs: list[float]  # behaviour logprobs (see sampling.py)
    versions: list[int]  # weight version that produced each token
    finish_reason: FinishReason
    prompt_len: int
    cached_tokens: int = 0
    routed_experts: np.ndarray | None = None  # rows [routed_experts_start, seqlen - 1)
    routed_experts_start: int = 0
    top_logprobs: list[TopLogprobs] | None = None  # with GenerateOptions.top_logprobs > 0
    constrained: list[bool] = field(default_factory=list)  # with a grammar: one flag per token

    def as_generation_result(self) -> GenerationResult:
        return GenerationResult(
            token_ids=self.token_ids, logprobs=self.logprobs, versions=self.versions,
            finish_reason=self.finish_reason, prompt_len=self.prompt_len, request_id=self.request_id,
            cached_tokens=self.cached_tokens, routed_experts=self.routed_experts,
            routed_experts_start=self.routed_experts_start, top_logprobs=self.top_logprobs,
            constrained=self.constrained,
        )


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


class _Sequence:
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
        self.matcher = None  # the grammar's xgrammar matcher, with options.grammar only
        self.constrained: list[bool] = []  # per token, with options.grammar only

    @property
    def prompt_len(self) -> int:
        return len(self.input_ids)

    @property
    def cached_len(self) -> int:
        # The newest token's KV is written by the next step, so it is not in the pool yet.
        return self.prompt_len + len(self.token_ids) - 1


class DecodeEngine:
    """Owns the KV pool, the parked sessions and the active sequences of one worker."""

    def __init__(
        self,
        model: nn.Module,
        *,
        max_batch: int,
        seed: int = 0,
        tokenizer: Detokenizer | None = None,
        weights: WeightStager | None = None,
        version: int = 0,
        block_size: int = 16,
        num_blocks: int = 0,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if weights is not None and weights.model is not model:
            raise ValueError("the WeightStager belongs to another model")
        self.model = model.eval()
        self.weights = weights or WeightStager(model, version=version)
        self.tokenizer = tokenizer
        self.end_of_turn_ids = (tokenizer.end_of_turn_ids if tokenizer is not None
                                else frozenset({model.eos_token_id} - {-1}))
        # Ids the engine may sample: the tokenizer's, never the padded rows past them.
        self.sampled_vocab_size = min(model.vocab_size,
                                      tokenizer.vocab_size if tokenizer is not None else model.vocab_size)
        self.max_batch = max_batch
        blocks_per_context = -(-model.max_seq_len // block_size)
        self.pool = KvBlockPool(
            model.kv_layout(), num_blocks=num_blocks or max_batch * blocks_per_context,
            block_size=block_size, device=model_device(model),
        )
        self.sessions = SessionCache()
        self._device = model_device(model)
        self._generator = torch.Generator(device=self._device).manual_seed(seed)
        self._active: list[_Sequence] = []
        self._by_id: dict[str, _Sequence] = {}
        self._finished: list[FinishedSequence] = []  # finished at admission, reported next step
        self._steps = 0
        self._tokens_generated = 0
        # Grammars (guided_decoding.py): built on the first request that brings one; a step masks
        # logits only while some active sequence has one, so free requests pay nothing.
        self.guided = GuidedDecoder(tokenizer, vocab_size=self.sampled_vocab_size,
                                    end_of_turn_ids=self.end_of_turn_ids)
        self._constrained_active = 0

    # -- requests --------------------------------------------------------------------------

    @torch.inference_mode()
    def add_prompt(
        self,
        request_id: str,
        input_ids: list[int],
        sampling: SamplingParams,
        options: GenerateOptions = DEFAULT_OPTIONS,
    ) -> None:
        """Prefill here, reusing the KV the session's last turn parked, then join the batch.

        Raises InvalidRequestError (and subclasses) or VersionUnavailableError leaving the engine
        unchanged, or CapacityError when called without ``can_admit`` saying yes (the session's
        parked KV is then freed: it would only be recomputed).
        """
        input_ids = validate_prompt(input_ids, self.model, request_id=request_id)
        stopper = self.validate_request(request_id, len(input_ids), sampling, options)
        self.weights.apply_staged()  # between steps: a boundary
        self._check_version(options.min_version, self.weights.current_version, request_id)
        needed = self.blocks_needed(len(input_ids), sampling)
        if len(self._active) >= self.max_batch:
            raise CapacityError(self.max_batch, request_id=request_id)
        session = self.sessions.take(options.session_id)
        reused, blocks, prefix_routes = self._reuse(session, input_ids)
        try:
            blocks += self._allocate(needed - len(blocks), request_id)
        except CapacityError:
            self.pool.free(blocks)
            raise
        try:
            last_logits, routes = run_prefill(self.model, self.pool, blocks, input_ids, reused)
        except Exception:
            self.pool.free(blocks)
            raise
        sequence = _Sequence(request_id, input_ids, blocks, sampling, stopper, options, reused)
        if prefix_routes is not None and reused:
            sequence.routes.append(prefix_routes[:reused])
        if routes is not None:
            sequence.routes.append(routes)
        self._admit(sequence, last_logits, self.weights.current_version)

    def add_prefilled(
        self,
        request_id: str,
        prefill: PrefillResult,
        sampling: SamplingParams,
        options: GenerateOptions = DEFAULT_OPTIONS,
    ) -> None:
        """Store KV pages made by a prefill worker and sample the first token from its logits."""
        stopper = self.validate_prefilled(request_id, prefill, sampling, options)
        self.weights.apply_staged()
        # The first token comes from the prefill worker's weights, the rest from ours.
        self._check_version(options.min_version,
                            min(prefill.weight_version, self.weights.current_version), request_id)
        if len(self._active) >= self.max_batch:
            raise CapacityError(self.max_batch, request_id=request_id)
        blocks = self._allocate(self.blocks_needed(prefill.num_tokens, sampling), request_id)
        self.pool.write_pages(blocks[: prefill.pages.shape[2]], prefill.pages)
        sequence = _Sequence(request_id, list(prefill.input_ids), blocks, sampling, stopper,
                             options, 0)
        if prefill.routes is not None:
            sequence.routes.append(prefill.routes)
        self._admit(sequence, prefill.last_logits.to(self._device), prefill.weight_version)

    def can_admit(
        self, prompt_len: int, sampling: SamplingParams, session_id: str | None = None
    ) -> bool:
        """True when a batch slot is free and the request's blocks are (after evicting other
        parked sessions if it must; the request's own session counts as room)."""
        if len(self._active) >= self.max_batch:
            return False
        own = self.sessions.blocks_of(session_id)
        return self._make_room(self.blocks_needed(prompt_len, sampling) - own, keep=session_id)

    def blocks_needed(self, prompt_len: int, sampling: SamplingParams) -> int:
        total = min(prompt_len + sampling.max_new_tokens, self.model.max_seq_len)
        return self.pool.blocks_for(total)

    def abort(self, request_id: str) -> FinishedSequence | None:
        """Drop a request; returns what it generated so far (finish_reason "abort"), or None if
        it is unknown. A request that had already finished is returned as it finished."""
        sequence = self._by_id.pop(request_id, None)
        if sequence is None:
            return None
        for index, finished in enumerate(self._finished):
            if finished.request_id == request_id:
                return self._finished.pop(index)
        self._active.remove(sequence)
        return self._finish(sequence, "abort")

    def abort_all(self) -> list[FinishedSequence]:
        """Drop every request (active or finished but unreported), as ``abort`` does each."""
        dropped, self._finished = self._finished, []
        active, self._active = self._active, []
        dropped.extend(self._finish(sequence, "abort") for sequence in active)
        self._by_id.clear()
        return dropped

    # -- stepping --------------------------------------------------------------------------

    def step(self) -> list[FinishedSequence]:
        """Apply staged weights, decode one token for every active sequence, return those done."""
        self.weights.apply_staged()
        # Decode before taking the finished-at-admission list, so a step that raises loses nothing.
        decoded = self._decode() if self._active else []
        finished, self._finished = self._finished, []
        finished.extend(decoded)
        for sequence in finished:
            del self._by_id[sequence.request_id]
        return finished

    @torch.inference_mode()
    def _decode(self) -> list[FinishedSequence]:
        batch = self._active
        version = self.weights.current_version
        tokens = torch.tensor([[s.token_ids[-1]] for s in batch], dtype=torch.long, device=self._device)
        paged = PagedAttention(self.pool, [s.blocks for s in batch], [s.cached_len for s in batch],
                               1, sliding_window=self.model.sliding_window)
        logits, routes = self.model.forward_paged(tokens, paged)
        step_logits, constrained = logits[:, 0], None
        if self._constrained_active:
            step_logits, constrained = self._mask_grammars(batch, step_logits)
        temperature = torch.tensor([s.temperature for s in batch], device=self._device)
        top_p = torch.tensor([s.top_p for s in batch], device=self._device)
        top_n = max(s.options.top_logprobs for s in batch)
        chosen, logprobs, *top = sample_tokens(step_logits, temperature, top_p, self._generator,
                                               vocab_size=self.sampled_vocab_size, top_n=top_n)
        if top:
            _keep_top(batch, *top[0])
        self._steps += 1
        self._tokens_generated += len(batch)
        still_active: list[_Sequence] = []
        done: list[FinishedSequence] = []
        for row, (sequence, token, logprob) in enumerate(zip(batch, chosen.tolist(), logprobs.tolist())):
            sequence.token_ids.append(token)
            sequence.logprobs.append(logprob)
            sequence.versions.append(version)
            if routes is not None:
                sequence.routes.append(routes[row])
            if constrained is not None:
                self._advance_grammar(sequence, token, constrained[row])
            reason = sequence.stopper.check(sequence.token_ids)
            if reason is None:
                still_active.append(sequence)
            else:
                done.append(self._finish(sequence, reason))
        self._active = still_active
        return done

    def _admit(self, sequence: _Sequence, last_logits: torch.Tensor, version: int) -> None:
        first_logits, constrained = last_logits[None], None
        if sequence.options.grammar is not None:  # compiled (and cached) by validate_request
            sequence.matcher = self.guided.matcher(sequence.options.grammar,
                                                   request_id=sequence.request_id)
            self._constrained_active += 1
            first_logits, constrained = self._mask_grammars([sequence], first_logits)
        temperature = torch.tensor([sequence.temperature], device=self._device)
        top_p = torch.tensor([sequence.top_p], device=self._device)
        token, logprob, *top = sample_tokens(first_logits, temperature, top_p, self._generator,
                                             vocab_size=self.sampled_vocab_size,
                                             top_n=sequence.options.top_logprobs)
        if top:
            _keep_top([sequence], *top[0])
        sequence.token_ids.append(int(token))
        sequence.logprobs.append(float(logprob))
        sequence.versions.append(version)
        if constrained is not None:
            self._advance_grammar(sequence, int(token), constrained[0])
        self._by_id[sequence.request_id] = sequence
        self._tokens_generated += 1
        reason = sequence.stopper.check(sequence.token_ids)
        if reason is not None:
            self._finished.append(self._finish(sequence, reason))
        else:
            self._active.append(sequence)

    def _mask_grammars(self, batch: list[_Sequence], logits: torch.Tensor):
        """(logits with each constrained row masked in place, per row: was it constrained)."""
        logits = logits.float()  # the mask goes into the very tensor sample_tokens normalises
        return logits, self.guided.mask(logits, [s.matcher for s in batch])

    def _advance_grammar(self, sequence: _Sequence, token: int, constrained: bool) -> None:
        if sequence.matcher is None:
            return
        sequence.constrained.append(constrained)
        if not accept(sequence.matcher, token):
            # Cannot happen for a masked row; should it, the rest of the turn goes unconstrained
            # (its flags say so, see _finish) rather than failing the whole batch's step.
            self._drop_grammar(sequence)

    def _drop_grammar(self, sequence: _Sequence) -> None:
        if sequence.matcher is not None:
            sequence.matcher = None
            self._constrained_active -= 1

    def _finish(self, sequence: _Sequence, reason: FinishReason) -> FinishedSequence:
        """Report ``sequence``; park its KV under its session, or free it."""
        self._drop_grammar(sequence)
        if sequence.options.grammar is not None:  # one flag per token, also after a dropped grammar
            sequence.constrained += [False] * (len(sequence.token_ids) - len(sequence.constrained))
        cached_len = sequence.cached_len
        routes = torch.cat(sequence.routes)[:cached_len] if sequence.routes else None
        keep = self.pool.blocks_for(cached_len)
        session_id = sequence.options.session_id
        if session_id:
            self.pool.free(sequence.blocks[keep:])
            tokens = (sequence.input_ids + sequence.token_ids)[:cached_len]
            replaced = self.sessions.park(session_id, CachedSession(tokens, sequence.blocks[:keep], routes))
            self.pool.free(replaced)
        else:
            self.pool.free(sequence.blocks)
        sequence.blocks = []
        routed, start = None, 0
        if sequence.options.return_routed_experts and routes is not None:
            start = sequence.options.routed_experts_start_len
            routed = routes[start:].numpy().copy()
        return FinishedSequence(
            sequence.request_id, sequence.token_ids, sequence.logprobs, sequence.versions, reason,
            sequence.prompt_len, sequence.cached_tokens, routed, start, sequence.top,
            constrained=sequence.constrained,
        )

    def new_tokens(self, request_id: str, start: int) -> TokenDelta | None:
        """The tokens a running (or finished, not yet reported) request sampled from index
        ``start`` on, or None when there are none (or the request is not here)."""
        sequence = self._by_id.get(request_id)
        if sequence is None or len(sequence.token_ids) <= start:
            return None
        top = sequence.top[start:] if sequence.top is not None else None
        return TokenDelta(request_id, start, sequence.token_ids[start:], sequence.logprobs[start:],
                          sequence.versions[start:], top)

    # -- memory ----------------------------------------------------------------------------

    def _reuse(self, session: CachedSession | None, input_ids: list[int]):
        """(reused tokens, the blocks holding them, the session's routes) from a taken session;
        blocks past the common prefix go back to the pool."""
        if session is None:
            return 0, [], None
        # At least the last prompt token is recomputed: its logits start the generation.
        reused = min(common_prefix_length(session.token_ids, input_ids), len(input_ids) - 1)
        keep = self.pool.blocks_for(reused)
        self.pool.free(session.blocks[keep:])
        self.sessions.reused_tokens += reused
        return reused, session.blocks[:keep], session.routes

    def _allocate(self, count: int, request_id: str) -> list[int]:
        if not self._make_room(count):
            raise CapacityError(self.max_batch, request_id=request_id)
        try:
            return self.pool.allocate(count)
        except OutOfBlocksError as exc:  # _make_room said yes; kept for a clear error anyway
            raise CapacityError(self.max_batch, request_id=request_id) from exc

    def _make_room(self, blocks: int, keep: str | None = None) -> bool:
        while self.pool.num_free() < blocks:
            evicted = self.sessions.evict_oldest(keep=keep)
            if not evicted:
                break
            self.pool.free(evicted)
        return self.pool.num_free() >= blocks

    def drop_sessions(self) -> int:
        """Free every parked session's KV (e.g. an operator's cache flush); blocks freed."""
        blocks = self.sessions.drop_all()
        self.pool.free(blocks)
        return len(blocks)

    # -- weights ---------------------------------------------------------------------------

    @property
    def current_version(self) -> int:
        return self.weights.current_version

    def stage_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> bool:
        """Keep new weights for the next step boundary (any thread); see WeightStager.stage."""
        return self.weights.stage(state_dict, version)

    def pop_activation(self) -> int | None:
        """The newest weight version activated since the last call (by a step), or None."""
        return self.weights.pop_activation()

    # -- introspection ---------------------------------------------------------------------

    def has_work(self) -> bool:
        """True while a step would do something: decode, report a finish, or swap weights."""
        return bool(self._active or self._finished) or self.weights.staged_version is not None

    def num_active(self) -> int:
        return len(self._active)

    def num_free(self) -> int:
        return self.max_batch - len(self._active)

    def stats(self) -> DecodeStats:
        return DecodeStats(
            active=len(self._active),
            max_batch=self.max_batch,
            finished_unreported=len(self._finished),
            steps=self._steps,
            tokens_generated=self._tokens_generated,
            current_version=self.weights.current_version,
            staged_version=self.weights.staged_version,
            kv_blocks_total=self.pool.num_blocks,
            kv_blocks_free=self.pool.num_free(),
            sessions_parked=len(self.sessions),
            session_hits=self.sessions.hits,
            session_misses=self.sessions.misses,
            prefix_tokens_reused=self.sessions.reused_tokens,
            session_evictions=self.sessions.evictions,
        )

    # -- validation ------------------------------------------------------------------------

    def validate_request(
        self,
        request_id: str,
        prompt_len: int,
        sampling: SamplingParams,
        options: GenerateOptions = DEFAULT_OPTIONS,
    ) -> StopChecker:
        """Raise what admitting the request would raise for bad input (not for capacity or
        version); returns its stop checker, its token budget clipped to the context."""
        if request_id in self._by_id:
            raise DuplicateRequestError(request_id)
        max_seq_len = self.model.max_seq_len
        if prompt_len > max_seq_len - 1:
            raise PromptTooLongError(prompt_len, max_seq_len - 1, request_id=request_id)
        if not 0 <= options.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError(
                f"{options.top_logprobs} is outside [0, {MAX_TOP_LOGPROBS}]", field="top_logprobs",
                request_id=request_id,
            )
        start = options.routed_experts_start_len
        if not 0 <= start <= prompt_len:
            raise InvalidRequestError(
                f"{start} is outside [0, {prompt_len}] (the prompt's length)",
                field="routed_experts_start_len", request_id=request_id,
            )
        if options.return_routed_experts and self.model.routing_shape is None:
            raise InvalidRequestError(
                "the model is dense: it routes no experts", field="return_routed_experts",
                request_id=request_id,
            )
        if options.grammar is not None:  # an invalid grammar fails here, before any admission
            self.guided.compile(options.grammar, request_id=request_id)
        needed = self.blocks_needed(prompt_len, sampling)
        if needed > self.pool.num_blocks:
            raise KvCapacityError(needed, self.pool.num_blocks, request_id=request_id)
        return StopChecker(
            stop=list(sampling.stop),
            max_new_tokens=min(sampling.max_new_tokens, max_seq_len - prompt_len),
            end_of_turn_ids=self.end_of_turn_ids,
            detokenizer=self.tokenizer,
            request_id=request_id,
        )

    def validate_prefilled(
        self,
        request_id: str,
        prefill: PrefillResult,
        sampling: SamplingParams,
        options: GenerateOptions = DEFAULT_OPTIONS,
    ) -> StopChecker:
        stopper = self.validate_request(request_id, prefill.num_tokens, sampling, options)
        if prefill.num_tokens < 1:
            raise InvalidRequestError("empty prompt", field="prefill", request_id=request_id)
        layout = self.model.kv_layout()
        expected = (layout.num_layers, 2, self.pool.blocks_for(prefill.num_tokens),
                    self.pool.block_size, layout.num_kv_heads, layout.head_dim)
        if tuple(prefill.pages.shape) != expected:
            raise InvalidRequestError(
                f"KV pages of shape {tuple(prefill.pages.shape)}, expected {expected}",
                field="prefill.pages", request_id=request_id,
            )
        if tuple(prefill.last_logits.shape) != (self.model.vocab_size,):
            raise InvalidRequestError(
                f"last_logits shape {tuple(prefill.last_logits.shape)}, expected "
                f"({self.model.vocab_size},)",
                field="prefill.last_logits", request_id=request_id,
            )
        return stopper

    @staticmethod
    def _check_version(min_version: int | None, version: int, request_id: str) -> None:
        if min_version is not None and version < min_version:
            raise VersionUnavailableError(min_version, version, request_id=request_id)


def _keep_top(batch: list[_Sequence], ids: torch.Tensor, values: torch.Tensor) -> None:
    """Each asking row's first ``options.top_logprobs`` alternatives (the batch computed as many
    as its hungriest row asked for)."""
    for sequence, row_ids, row_values in zip(batch, ids.tolist(), values.tolist()):
        if sequence.top is not None:
            n = sequence.options.top_logprobs
            sequence.top.append(list(zip(row_ids[:n], row_values[:n])))
