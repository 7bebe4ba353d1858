"""Continuous-batching decode over a slot KV cache, with per-token logprobs and weight versions.

Knows torch, the model and the sampler; not Ray, not asyncio (``batch_loop`` drives it). Active
sequences stay compact in the first B slots of the cache [L, 2, max_batch, H, T_max, head_dim]:
when one leaves, the last active one moves into its slot, so each step hands ``decode_step`` the
view ``cache[:, :, :B]`` and never gathers. Staged weights are swapped in at the start of a step;
in-flight sequences keep their KV and continue, and every token records the version that made it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from rollmesh.engine.errors import (
    CapacityError,
    DuplicateRequestError,
    InvalidRequestError,
    PromptTooLongError,
)
from rollmesh.engine.model import TinyDecoder
from rollmesh.engine.prefill import PrefillResult
from rollmesh.engine.protocols import Detokenizer, FinishReason, GenerationResult
from rollmesh.engine.sampling import sample_tokens
from rollmesh.engine.stopping import StopChecker
from rollmesh.engine.tokenizer import ByteTokenizer
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

    def as_generation_result(self) -> GenerationResult:
        return GenerationResult(
            token_ids=self.token_ids, logprobs=self.logprobs, versions=self.versions,
            finish_reason=self.finish_reason, prompt_len=self.prompt_len, request_id=self.request_id,
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


class _Sequence:
    __slots__ = ("request_id", "prompt_len", "token_ids", "logprobs", "versions", "stopper")

    def __init__(self, request_id: str, prompt_len: int, stopper: StopChecker) -> None:
        self.request_id = request_id
        self.prompt_len = prompt_len
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.stopper = stopper

    @property
    def cached_len(self) -> int:
        # The newest token's KV is written by the next decode_step, so it is not cached yet.
        return self.prompt_len + len(self.token_ids) - 1

    def finish(self, reason: FinishReason) -> FinishedSequence:
        return FinishedSequence(
            self.request_id, self.token_ids, self.logprobs, self.versions, reason, self.prompt_len
        )


class DecodeEngine:
    """Owns the slot cache and the active sequences of one decode worker."""

    def __init__(
        self,
        model: TinyDecoder,
        *,
        max_batch: int,
        seed: int = 0,
        tokenizer: Detokenizer | None = None,
        weights: WeightStager | None = None,
        version: int = 0,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if weights is not None and weights.model is not model:
            raise ValueError("the WeightStager belongs to another model")
        self.model = model.eval()
        self.weights = weights or WeightStager(model, version=version)
        self.tokenizer = tokenizer or ByteTokenizer(model.shape.vocab_size)
        self.max_batch = max_batch
        shape = model.shape
        device = model.tok.weight.device
        self._cache = torch.zeros(
            shape.n_layers, 2, max_batch, shape.n_heads, shape.max_seq_len, shape.head_dim,
            device=device,
        )
        # Per-slot inputs of the next step, kept in the same compact order as the cache.
        self._tokens = torch.zeros(max_batch, dtype=torch.long, device=device)
        self._positions = torch.zeros(max_batch, dtype=torch.long, device=device)
        self._temperature = torch.ones(max_batch, device=device)
        self._top_p = torch.ones(max_batch, device=device)
        self._generator = torch.Generator(device=device).manual_seed(seed)
        self._slots: list[_Sequence] = []
        self._by_id: dict[str, _Sequence] = {}
        self._finished: list[FinishedSequence] = []  # finished at admission, reported next step
        self._steps = 0
        self._tokens_generated = 0

    # -- requests --------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prefill: PrefillResult,
        sampling: SamplingParams,
        tokenizer: Detokenizer | None = None,
    ) -> None:
        """Admit a prefilled prompt and sample its first token from the prefill's logits.

        ``max_new_tokens`` is clipped to what fits in the context, so such a request ends with
        finish_reason "length" at the context limit. A request whose first token already ends it
        is reported by the next ``step()``. Raises InvalidRequestError (and subclasses) or
        CapacityError, leaving the engine unchanged.
        """
        stopper = self.validate_request(request_id, prefill, sampling, tokenizer)
        if len(self._slots) >= self.max_batch:
            raise CapacityError(self.max_batch, request_id=request_id)
        prompt_len = prefill.num_tokens
        temperature = torch.tensor([sampling.temperature], device=self._tokens.device)
        top_p = torch.tensor([sampling.top_p], device=self._tokens.device)
        logits = prefill.last_logits.to(self._tokens.device)[None]
        token, logprob = sample_tokens(logits, temperature, top_p, self._generator)
        sequence = _Sequence(request_id, prompt_len, stopper)
        sequence.token_ids.append(int(token))
        sequence.logprobs.append(float(logprob))
        sequence.versions.append(prefill.weight_version)
        self._by_id[request_id] = sequence
        self._tokens_generated += 1
        reason = stopper.check(sequence.token_ids)
        if reason is not None:
            self._finished.append(sequence.finish(reason))
            return
        slot = len(self._slots)
        self._slots.append(sequence)
        self._cache[:, :, slot, :, :prompt_len].copy_(prefill.kv)
        self._tokens[slot] = sequence.token_ids[-1]
        self._positions[slot] = prompt_len
        self._temperature[slot] = sampling.temperature
        self._top_p[slot] = sampling.top_p

    def abort(self, request_id: str) -> FinishedSequence | None:
        """Drop a request; returns what it generated so far (finish_reason "abort"), or None if
        it is unknown. A request that had already finished is returned as it finished."""
        sequence = self._by_id.pop(request_id, None)
        if sequence is None:
            return None
        for index, finished in enumerate(self._finished):
            if finished.request_id == request_id:
                return self._finished.pop(index)
        return self._release(self._slots.index(sequence), "abort")

    def abort_all(self) -> list[FinishedSequence]:
        """Drop every request (active or finished but unreported), as ``abort`` does each."""
        dropped, self._finished = self._finished, []
        while self._slots:
            dropped.append(self._release(len(self._slots) - 1, "abort"))
        self._by_id.clear()
        return dropped

    # -- stepping --------------------------------------------------------------------------

    def step(self) -> list[FinishedSequence]:
        """Apply staged weights, decode one token for every active sequence, return those done."""
        self.weights.apply_staged()
        # Decode before taking the finished-at-admission list, so a step that raises loses nothing.
        decoded = self._decode(len(self._slots)) if self._slots else []
        finished, self._finished = self._finished, []
        finished.extend(decoded)
        for sequence in finished:
            del self._by_id[sequence.request_id]
        return finished

    def _decode(self, batch: int) -> list[FinishedSequence]:
        version = self.weights.current_version
        logits = self.model.decode_step(
            self._tokens[:batch], self._positions[:batch], self._cache[:, :, :batch]
        )
        tokens, logprobs = sample_tokens(
            logits, self._temperature[:batch], self._top_p[:batch], self._generator
        )
        self._tokens[:batch] = tokens
        self._positions[:batch] += 1
        self._steps += 1
        self._tokens_generated += batch
        done: list[tuple[int, FinishReason]] = []
        for slot, sequence, token, logprob in zip(
            range(batch), self._slots, tokens.tolist(), logprobs.tolist()
        ):
            sequence.token_ids.append(token)
            sequence.logprobs.append(logprob)
            sequence.versions.append(version)
            reason = sequence.stopper.check(sequence.token_ids)
            if reason is not None:
                done.append((slot, reason))
        # Highest slot first: the sequence moved into a freed slot is never one still to free.
        return [self._release(slot, reason) for slot, reason in reversed(done)]

    def _release(self, slot: int, reason: FinishReason) -> FinishedSequence:
        """Free ``slot`` and keep the active slots compact by moving the last one into it."""
        sequence = self._slots[slot]
        last = len(self._slots) - 1
        if slot != last:
            moved = self._slots[last]
            length = moved.cached_len
            self._cache[:, :, slot, :, :length].copy_(self._cache[:, :, last, :, :length])
            for per_slot in (self._tokens, self._positions, self._temperature, self._top_p):
                per_slot[slot] = per_slot[last]
            self._slots[slot] = moved
        self._slots.pop()
        return sequence.finish(reason)

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
        return bool(self._slots or self._finished) or self.weights.staged_version is not None

    def num_active(self) -> int:
        return len(self._slots)

    def num_free(self) -> int:
        return self.max_batch - len(self._slots)

    def stats(self) -> DecodeStats:
        return DecodeStats(
            active=len(self._slots),
            max_batch=self.max_batch,
            finished_unreported=len(self._finished),
            steps=self._steps,
            tokens_generated=self._tokens_generated,
            current_version=self.weights.current_version,
            staged_version=self.weights.staged_version,
        )

    def validate_request(
        self,
        request_id: str,
        prefill: PrefillResult,
        sampling: SamplingParams,
        tokenizer: Detokenizer | None = None,
    ) -> StopChecker:
        """Raise what ``add_request`` would raise for bad input (not for capacity); returns the
        request's stop checker, its token budget clipped to the context."""
        if request_id in self._by_id:
            raise DuplicateRequestError(request_id)
        prompt_len = self._validate_prefill(request_id, prefill)
        return StopChecker(
            stop=list(sampling.stop),
            max_new_tokens=min(sampling.max_new_tokens, self.model.shape.max_seq_len - prompt_len),
            detokenizer=tokenizer or self.tokenizer,
            request_id=request_id,
        )

    def _validate_prefill(self, request_id: str, prefill: PrefillResult) -> int:
        shape = self.model.shape
        prompt_len = prefill.num_tokens
        if prompt_len < 1:
            raise InvalidRequestError("empty prompt", field="prefill", request_id=request_id)
        if prompt_len > shape.max_seq_len - 1:
            raise PromptTooLongError(prompt_len, shape.max_seq_len - 1, request_id=request_id)
        expected = (shape.n_layers, 2, shape.n_heads, prompt_len, shape.head_dim)
        if tuple(prefill.kv.shape) != expected:
            raise InvalidRequestError(
                f"kv shape {tuple(prefill.kv.shape)}, expected {expected}",
                field="prefill.kv", request_id=request_id,
            )
        if tuple(prefill.last_logits.shape) != (shape.vocab_size,):
            raise InvalidRequestError(
                f"last_logits shape {tuple(prefill.last_logits.shape)}, expected "
                f"({shape.vocab_size},)",
                field="prefill.last_logits", request_id=request_id,
            )
        return prompt_len
