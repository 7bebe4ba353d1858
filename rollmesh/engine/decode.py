"""Continuous-batching decode over a paged KV cache, with per-token logprobs, weight versions and
routed experts, and per-session prefix reuse.

Knows torch, the model, the KV pool and the sampler; not Ray, not asyncio (``batch_loop`` drives
it). Requests join at any step, either prefilled elsewhere (``add_prefilled``: KV pages from a
prefill worker) or prefilled here (``add_prompt``: the aggregated mode, and a session's later
turns, which reuse the KV its earlier turns left in the pool). Each step decodes one token for
every active sequence and lets finished ones leave. The pieces live beside it: the records it
keeps and reports (``decode_state``), request checks (``request_checks``), KV blocks for
admissions (``kv_allocation``) and turning logits into tokens (``batch_sampler``).

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

Top logprobs and grammars (``GenerateOptions.top_logprobs``, ``GenerateOptions.grammar``) are
applied where logits become tokens (``batch_sampler``): top logprobs come from the distribution
sampled from, after a grammar's mask, and a step whose batch holds no grammar does no grammar
work. ``new_tokens`` hands a running sequence's latest tokens to the loop that streams them
(``batch_loop``, ``token_stream``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from rollmesh.engine.batch_sampler import BatchSampler
# DecodeStats is also imported from here (rollmesh.engine.decode) by callers.
from rollmesh.engine.decode_state import ActiveSequence, DecodeStats
from rollmesh.engine.errors import (
    CapacityError,
    DuplicateRequestError,
    EngineBusyError,
    KvCapacityError,
    MemoryReleasedError,
)
from rollmesh.engine.guided_decoding import GuidedDecoder
from rollmesh.engine.kv_allocation import KvAllocator
from rollmesh.engine.kv_pages import KvBlockPool, PagedAttention
from rollmesh.engine.memory_release import MemoryMoveStats, ReleasableWeights
from rollmesh.engine.paged_model import model_device
from rollmesh.engine.prefill import PrefillResult, run_prefill
from rollmesh.engine.protocols import (
    DEFAULT_OPTIONS,
    Detokenizer,
    FinishReason,
    GenerateOptions,
    GenerationResult,
)
from rollmesh.engine.request_checks import (
    check_min_version,
    check_options,
    check_prefill,
    validate_prompt,
)
from rollmesh.engine.session_cache import SessionCache
from rollmesh.engine.stopping import StopChecker
from rollmesh.engine.token_stream import TokenDelta
from rollmesh.engine.weight_staging import WeightStager
from rollmesh.messages.base import SamplingParams


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
        self.kv = KvAllocator(self.pool, self.sessions, max_batch=max_batch)
        self.memory = ReleasableWeights(model, self.weights, self.pool)
        self._device = model_device(model)
        self._active: list[ActiveSequence] = []
        self._by_id: dict[str, ActiveSequence] = {}
        self._finished: list[GenerationResult] = []  # finished at admission, reported next step
        self._steps = 0
        self._tokens_generated = 0
        # Grammars (guided_decoding.py): built on the first request that brings one; a step masks
        # logits only while some active sequence has one, so free requests pay nothing.
        self.guided = GuidedDecoder(tokenizer, vocab_size=self.sampled_vocab_size,
                                    end_of_turn_ids=self.end_of_turn_ids)
        self.sampler = BatchSampler(
            self.guided, vocab_size=self.sampled_vocab_size, device=self._device,
            generator=torch.Generator(device=self._device).manual_seed(seed),
        )

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
        check_min_version(options.min_version, self.weights.current_version, request_id=request_id)
        needed = self.blocks_needed(len(input_ids), sampling)
        if len(self._active) >= self.max_batch:
            raise CapacityError(self.max_batch, request_id=request_id)
        reused, blocks, prefix_routes = self.kv.reuse(options.session_id, input_ids)
        try:
            blocks += self.kv.allocate(needed - len(blocks), request_id)
        except CapacityError:
            self.pool.free(blocks)
            raise
        try:
            last_logits, routes = run_prefill(self.model, self.pool, blocks, input_ids, reused)
        except Exception:
            self.pool.free(blocks)
            raise
        sequence = ActiveSequence(request_id, input_ids, blocks, sampling, stopper, options,
                                  reused)
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
        check_min_version(options.min_version,
                          min(prefill.weight_version, self.weights.current_version),
                          request_id=request_id)
        if len(self._active) >= self.max_batch:
            raise CapacityError(self.max_batch, request_id=request_id)
        blocks = self.kv.allocate(self.blocks_needed(prefill.num_tokens, sampling), request_id)
        self.pool.write_pages(blocks[: prefill.pages.shape[2]], prefill.pages)
        sequence = ActiveSequence(request_id, list(prefill.input_ids), blocks, sampling, stopper,
                                  options, 0)
        if prefill.routes is not None:
            sequence.routes.append(prefill.routes)
        self._admit(sequence, prefill.last_logits.to(self._device), prefill.weight_version)

    def can_admit(
        self, prompt_len: int, sampling: SamplingParams, session_id: str | None = None
    ) -> bool:
        """True when a batch slot is free and the request's blocks are (after evicting other
        parked sessions if it must; the request's own session counts as room). Also True while
        the memory is released: admitting then fails the request with the retryable
        MemoryReleasedError instead of keeping it waiting for as long as the loan lasts."""
        if self.memory.released:
            return True
        if len(self._active) >= self.max_batch:
            return False
        own = self.sessions.blocks_of(session_id)
        return self.kv.make_room(self.blocks_needed(prompt_len, sampling) - own, keep=session_id)

    def blocks_needed(self, prompt_len: int, sampling: SamplingParams) -> int:
        total = min(prompt_len + sampling.max_new_tokens, self.model.max_seq_len)
        return self.pool.blocks_for(total)

    def abort(self, request_id: str) -> GenerationResult | None:
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

    def abort_all(self) -> list[GenerationResult]:
        """Drop every request (active or finished but unreported), as ``abort`` does each."""
        dropped, self._finished = self._finished, []
        active, self._active = self._active, []
        dropped.extend(self._finish(sequence, "abort") for sequence in active)
        self._by_id.clear()
        return dropped

    # -- stepping --------------------------------------------------------------------------

    def step(self) -> list[GenerationResult]:
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
    def _decode(self) -> list[GenerationResult]:
        batch = self._active
        version = self.weights.current_version
        tokens = torch.tensor([[s.token_ids[-1]] for s in batch], dtype=torch.long, device=self._device)
        paged = PagedAttention(self.pool, [s.blocks for s in batch], [s.cached_len for s in batch],
                               1, sliding_window=self.model.sliding_window)
        logits, routes = self.model.forward_paged(tokens, paged)
        chosen, logprobs, constrained = self.sampler.sample(
            batch, logits[:, 0], masked=bool(self.sampler.constrained_active))
        self._steps += 1
        self._tokens_generated += len(batch)
        still_active: list[ActiveSequence] = []
        done: list[GenerationResult] = []
        for row, (sequence, token, logprob) in enumerate(zip(batch, chosen, logprobs)):
            sequence.token_ids.append(token)
            sequence.logprobs.append(logprob)
            sequence.versions.append(version)
            if routes is not None:
                sequence.routes.append(routes[row])
            if constrained is not None:
                self.sampler.advance_grammar(sequence, token, constrained[row])
            reason = sequence.stopper.check(sequence.token_ids)
            if reason is None:
                still_active.append(sequence)
            else:
                done.append(self._finish(sequence, reason))
        self._active = still_active
        return done

    def _admit(self, sequence: ActiveSequence, last_logits: torch.Tensor, version: int) -> None:
        constrain = sequence.options.grammar is not None
        try:
            if constrain:  # compiled (and cached) by validate_request
                self.sampler.start_grammar(sequence)
            (token,), (logprob,), constrained = self.sampler.sample([sequence], last_logits[None],
                                                                    masked=constrain)
        except Exception:
            # Not admitted (NaN logits make sampling raise): its blocks, the session's taken KV
            # among them, go back to the pool. Lost, they would shrink the pool for good until a
            # request waits for room that never comes, on an idle engine nothing wakes.
            self.sampler.end_grammar(sequence)
            self.pool.free(sequence.blocks)
            sequence.blocks = []
            raise
        sequence.token_ids.append(token)
        sequence.logprobs.append(logprob)
        sequence.versions.append(version)
        if constrained is not None:
            self.sampler.advance_grammar(sequence, token, constrained[0])
        self._by_id[sequence.request_id] = sequence
        self._tokens_generated += 1
        reason = sequence.stopper.check(sequence.token_ids)
        if reason is not None:
            self._finished.append(self._finish(sequence, reason))
        else:
            self._active.append(sequence)

    def _finish(self, sequence: ActiveSequence, reason: FinishReason) -> GenerationResult:
        """Report ``sequence``; park its KV under its session, or free it."""
        self.sampler.end_grammar(sequence)
        cached_len = sequence.cached_len
        routes = torch.cat(sequence.routes)[:cached_len] if sequence.routes else None
        session_id = sequence.options.session_id
        if session_id:
            tokens = (sequence.input_ids + sequence.token_ids)[:cached_len]
            self.kv.park(session_id, tokens, sequence.blocks, routes)
        else:
            self.pool.free(sequence.blocks)
        sequence.blocks = []
        return sequence.finished(reason, routes)

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

    def drop_sessions(self) -> int:
        """Free every parked session's KV (e.g. an operator's cache flush); blocks freed."""
        return self.kv.drop_sessions()

    @property
    def memory_released(self) -> bool:
        return self.memory.released

    def release_memory(self) -> MemoryMoveStats:
        """Move the weights and the parked sessions' KV to host memory and free the device's
        (the GPU scheduler lends the accelerator). Only between steps of an idle engine
        (``EngineBusyError`` otherwise: ``LocalEngine.release_memory`` drains first); until
        ``resume_memory`` every request is refused with the retryable MemoryReleasedError."""
        if self._active or self._finished:
            raise EngineBusyError(len(self._active) + len(self._finished), "requests in flight")
        return self.memory.release()

    def resume_memory(self) -> MemoryMoveStats:
        """Bring the weights and parked KV back (sessions keep their prefixes). Weights staged
        while released wait in ``take_deferred_weights`` for the caller to stage them."""
        return self.memory.resume()

    def take_deferred_weights(self) -> tuple[dict[str, torch.Tensor], int] | None:
        return self.memory.take_deferred()

    # -- weights ---------------------------------------------------------------------------

    @property
    def current_version(self) -> int:
        return self.weights.current_version

    def stage_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> bool:
        """Keep new weights for the next step boundary (any thread); see WeightStager.stage.
        While the memory is released they wait on the host until ``resume_memory``."""
        return self.memory.stage(state_dict, version)

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
        if self.memory.released:
            raise MemoryReleasedError(request_id=request_id)
        check_options(options, prompt_len, self.model, request_id=request_id)
        if options.grammar is not None:  # an invalid grammar fails here, before any admission
            self.guided.compile(options.grammar, request_id=request_id)
        needed = self.blocks_needed(prompt_len, sampling)
        if needed > self.pool.num_blocks:
            raise KvCapacityError(needed, self.pool.num_blocks, request_id=request_id)
        return StopChecker(
            stop=list(sampling.stop),
            max_new_tokens=min(sampling.max_new_tokens, self.model.max_seq_len - prompt_len),
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
        check_prefill(prefill, self.model, self.pool, request_id=request_id)
        return stopper


def __getattr__(name: str) -> Any:
    # Deprecated alias of GenerationResult (rollmesh.engine.decode_state says why); goes after one release.
    if name == "FinishedSequence":
        from rollmesh.engine import decode_state

        return decode_state.__getattr__(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
