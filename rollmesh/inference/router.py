"""The inference router: pairs prefill and decode workers for each generate call.

Knows Ray actor handles (duck-typed ``.remote``), not how they were spawned; no nats.

- Disaggregated (prefill workers given): a new prompt is prefilled on the least busy prefill
  worker, which returns an ObjectRef to the PrefillResult; that ref is handed to the decode worker
  as an argument, so Ray moves the KV pages through its object store straight to decode.
- A session's later turns go to the decode worker that served its first turn, without a prefill
  worker: that worker holds the session's KV, so it computes only the new tokens (tool output,
  next user message). If the KV was evicted meanwhile, it prefills in full; the answer is the same.
- Aggregated (no prefill workers): decode workers prefill every prompt themselves.

New sessions and session-less calls go to the decode worker with the fewest requests in flight
from this router; prefill workers take new prompts in turn. Session stickiness is remembered for the most recent ``max_sessions``.

Streaming (``generate_stream``): the same pairing, but the decode worker's ``*_stream`` method is a
Ray streaming generator (``num_returns="streaming"``): each piece of tokens
(``rollmesh.engine.token_stream``) comes back as its own object while the sequence decodes, and
closing the stream early cancels the actor task, which aborts the request in the engine.

Lent memory: a worker whose accelerator the GPU scheduler lent refuses with the retryable
``MemoryReleasedError``; ``generate`` then tries another decode worker (a session moves there and
is prefilled in full), and when every one refused, waits ``memory_retry_s`` and tries them all
again, for up to ``memory_retry_timeout_s`` (the lending ends when the scheduler takes the
accelerator back, within a job's preemption grace). Streams are not retried (a piece may be out).

Cancelling ``generate`` (a caller's deadline, ``rollout.generate_timeout_s``, or a worker going
away) cancels the Ray tasks it started, prefill and decode alike: an awaited ObjectRef whose awaiter
is cancelled does not stop the actor task, which would otherwise keep its batch slot and KV on the
decode worker until the sequence ends, and refuse a retry of the same request id meanwhile.

Decode loans: workers the GPU scheduler lends to decode join with ``add_decode_worker`` and
leave with ``remove_decode_worker``, after which nothing new is sent to them; a session that was
there continues on another worker, which prefills it in full (its KV left with the worker).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import Any

import ray
import structlog
from opentelemetry import trace

from rollmesh.engine.errors import MemoryReleasedError
from rollmesh.engine.protocols import DEFAULT_OPTIONS, GenerateOptions, GenerationResult
from rollmesh.engine.token_stream import TokenDelta
from rollmesh.messages.base import SamplingParams
from rollmesh.telemetry import conventions
from rollmesh.telemetry.trace_headers import inject_trace_headers

_tracer = trace.get_tracer("rollmesh.inference")
_log = structlog.get_logger("rollmesh.inference")


def generation_attributes(result: GenerationResult) -> dict[str, object]:
    """``gen_ai.*`` usage and finish reason, and the first/last token's weight version."""
    attributes: dict[str, object] = {
        conventions.GEN_AI_USAGE_OUTPUT_TOKENS: len(result.token_ids),
        conventions.GEN_AI_RESPONSE_FINISH_REASONS: (str(result.finish_reason),),
    }
    if result.versions:
        attributes[conventions.RL_WEIGHT_VERSION_FIRST] = result.versions[0]
        attributes[conventions.RL_WEIGHT_VERSION_LAST] = result.versions[-1]
    return attributes

DEFAULT_MAX_SESSIONS = 100_000


class InferenceRouter:
    """Implements ``rollmesh.engine.protocols.InferenceEngine`` over Ray actor handles."""

    def __init__(self, prefill_workers: list[Any], decode_workers: list[Any], *,
                 max_sessions: int = DEFAULT_MAX_SESSIONS, model_name: str = "",
                 memory_retry_s: float = 1.0, memory_retry_timeout_s: float = 600.0,
                 cancel_task: Callable[[Any], object] = ray.cancel) -> None:
        """``model_name``: the served model, for the ``gen_ai.request.model`` span attribute.
        ``cancel_task``: cancels the actor task behind an ObjectRef (``ray.cancel``)."""
        if not decode_workers:
            raise ValueError("the router needs at least one decode worker")
        self.prefill_workers = list(prefill_workers)
        self.decode_workers: list[Any | None] = list(decode_workers)  # None: a worker that left
        self._decode_names: dict[str, int] = {}  # a lent worker's name -> its index
        self._next_prefill = itertools.cycle(range(len(self.prefill_workers) or 1))
        self._decode_in_flight = [0] * len(self.decode_workers)
        self._session_worker: OrderedDict[str, int] = OrderedDict()
        self._max_sessions = max_sessions
        self.model_name = model_name
        self.memory_retry_s = memory_retry_s
        self.memory_retry_timeout_s = memory_retry_timeout_s
        self._cancel_task = cancel_task

    @property
    def aggregated(self) -> bool:
        return not self.prefill_workers

    def decode_worker_for(self, session_id: str | None, refused: frozenset[int] = frozenset()) -> tuple[int, bool]:
        """(decode worker index, whether the session has been there before); not one of
        ``refused`` (their memory lent) while another is present."""
        if session_id and session_id in self._session_worker:
            if self.decode_workers[self._session_worker[session_id]] is not None \
                    and self._session_worker[session_id] not in refused:
                self._session_worker.move_to_end(session_id)
                return self._session_worker[session_id], True
        index = _least_loaded(self._decode_in_flight, self.decode_workers, refused)
        if session_id:
            self._session_worker[session_id] = index
            while len(self._session_worker) > self._max_sessions:
                self._session_worker.popitem(last=False)
        return index, False

    async def generate(
        self,
        input_ids: list[int],
        sampling: SamplingParams,
        *,
        request_id: str,
        options: GenerateOptions = DEFAULT_OPTIONS,
    ) -> GenerationResult:
        refused: set[int] = set()
        deadline = time.monotonic() + self.memory_retry_timeout_s
        while True:
            try:
                return await self._generate_once(input_ids, sampling, request_id, options, frozenset(refused))
            except MemoryReleasedError as exc:
                refused.add(exc.decode_worker)
                if refused >= {i for i, worker in enumerate(self.decode_workers) if worker is not None}:
                    if time.monotonic() + self.memory_retry_s > deadline:
                        raise
                    refused.clear()  # every worker's memory is lent: wait, then try them all again
                    await asyncio.sleep(self.memory_retry_s)

    async def _generate_once(self, input_ids, sampling, request_id, options, refused) -> GenerationResult:
        index, returning = self.decode_worker_for(options.session_id, refused)
        local_prefill = self.aggregated or returning
        with _tracer.start_as_current_span(
            conventions.SPAN_GENERATE,
            attributes={"request_id": request_id, "prompt_tokens": len(input_ids),
                        "decode_worker": index, "local_prefill": local_prefill,
                        conventions.GEN_AI_OPERATION_NAME: "text_completion",
                        conventions.GEN_AI_REQUEST_MODEL: self.model_name,
                        conventions.GEN_AI_USAGE_INPUT_TOKENS: len(input_ids),
                        conventions.GEN_AI_REQUEST_MAX_TOKENS: sampling.max_new_tokens,
                        conventions.GEN_AI_REQUEST_TEMPERATURE: sampling.temperature},
        ) as span:
            headers = inject_trace_headers({})
            decode = self.decode_workers[index]
            self._decode_in_flight[index] += 1
            try:
                if local_prefill:
                    finished = await self._await_cancelling(decode.generate_prompt.remote(
                        input_ids, sampling, request_id, headers, options), request_id)
                else:
                    finished = await self._prefill_then_decode(
                        decode, input_ids, sampling, request_id, headers, options)
            except MemoryReleasedError as exc:
                exc.decode_worker = index  # which worker refused (a prefill worker's refusal too)
                raise
            finally:
                self._decode_in_flight[index] -= 1
            span.set_attributes(generation_attributes(finished))
            return finished

    async def generate_stream(
        self,
        input_ids: list[int],
        sampling: SamplingParams,
        *,
        request_id: str,
        options: GenerateOptions = DEFAULT_OPTIONS,
    ) -> AsyncIterator[TokenDelta | GenerationResult]:
        """``generate``, yielding ``TokenDelta`` pieces as the decode worker samples them, then the
        GenerationResult; closing it early aborts the request on the worker."""
        index, returning = self.decode_worker_for(options.session_id)
        local_prefill = self.aggregated or returning
        # Not the current span: an async generator's context would leak into its consumer's.
        span = _tracer.start_span(
            conventions.SPAN_GENERATE,
            attributes={"request_id": request_id, "prompt_tokens": len(input_ids),
                        "decode_worker": index, "local_prefill": local_prefill, "stream": True,
                        conventions.GEN_AI_OPERATION_NAME: "text_completion",
                        conventions.GEN_AI_REQUEST_MODEL: self.model_name,
                        conventions.GEN_AI_USAGE_INPUT_TOKENS: len(input_ids),
                        conventions.GEN_AI_REQUEST_MAX_TOKENS: sampling.max_new_tokens,
                        conventions.GEN_AI_REQUEST_TEMPERATURE: sampling.temperature},
        )
        headers = inject_trace_headers({}, context=trace.set_span_in_context(span))
        decode = self.decode_workers[index]
        self._decode_in_flight[index] += 1
        if local_prefill:
            pieces = decode.generate_prompt_stream.options(num_returns="streaming").remote(
                input_ids, sampling, request_id, headers, options)
        else:
            kv_ref = self.prefill_workers[next(self._next_prefill)].prefill.remote(
                input_ids, request_id, headers)
            pieces = decode.generate_stream.options(num_returns="streaming").remote(
                kv_ref, sampling, request_id, headers, options)
        finished = False
        try:
            async for ref in pieces:
                piece = await ref
                if isinstance(piece, TokenDelta):
                    yield piece
                    continue
                span.set_attributes(generation_attributes(piece))
                finished = True
                yield piece
        finally:
            self._decode_in_flight[index] -= 1
            if not finished:
                self._cancel_task(pieces)  # the client went away: the worker aborts the request
            span.end()

    async def _prefill_then_decode(self, decode, input_ids, sampling, request_id, headers, options):
        # Prefill workers take prompts in turn: a prefill is one forward pass of known cost, and
        # the router never sees when it ends (the pages go straight to decode, not through here).
        chosen = next(self._next_prefill)
        kv_ref = self.prefill_workers[chosen].prefill.remote(input_ids, request_id, headers)
        return await self._await_cancelling(
            decode.generate.remote(kv_ref, sampling, request_id, headers, options), request_id, kv_ref)

    async def _await_cancelling(self, ref: Any, request_id: str, *upstream: Any) -> GenerationResult:
        """``await ref``; cancelled, cancel its actor task (and ``upstream`` ones it was fed), so
        the worker aborts the request and frees its slot (see the module docstring)."""
        try:
            return await ref
        except asyncio.CancelledError:
            for task_ref in (ref, *upstream):
                try:
                    self._cancel_task(task_ref)
                except Exception as exc:  # noqa: BLE001 - the caller's cancellation goes on regardless
                    _log.warning("generate_cancel_failed", request_id=request_id, error=repr(exc))
            raise


    def add_decode_worker(self, name: str, worker: Any) -> None:
        """A decode worker lent by the GPU scheduler joins (again: a no-op)."""
        if name in self._decode_names:
            return
        self._decode_names[name] = len(self.decode_workers)
        self.decode_workers.append(worker)
        self._decode_in_flight.append(0)

    def remove_decode_worker(self, name: str) -> bool:
        """A lent decode worker leaves: nothing new goes to it. False if it was not here."""
        index = self._decode_names.pop(name, None)
        if index is None:
            return False
        self.decode_workers[index] = None
        return True

    def lent_decode_workers(self) -> list[str]:
        return sorted(self._decode_names)


def _least_loaded(in_flight: list[int], workers: list[Any | None], refused: frozenset[int] = frozenset()) -> int:
    present = [index for index, worker in enumerate(workers) if worker is not None]
    return min([index for index in present if index not in refused] or present, key=in_flight.__getitem__)
