"""The asyncio loop that drives a DecodeEngine: one step whenever there is work.

Knows asyncio and the decode engine; not Ray, not NATS (the decode actor and LocalEngine both wrap
it). Steps run on the event loop thread and the loop yields (``sleep(0)``) between them, so
requests submitted meanwhile join the batch at the next step. A request is either a prompt (the
engine prefills it, reusing its session's KV) or a PrefillResult from a prefill worker. When
every slot or the KV pool is taken, new requests wait in FIFO order (the head is never
overtaken, so a long prompt cannot starve). The loop task belongs to this object: ``stop()``
cancels it and fails whatever is still in flight.

Streaming (``stream``): a streamed request has a queue; after every step and admission the loop
puts the tokens each streamed request sampled since its last piece on it (``token_stream``), so
they reach the consumer as they are produced. Requests nobody streams cost nothing extra.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field

import torch

from rollmesh.engine.decode import DecodeEngine, DecodeStats
from rollmesh.engine.errors import (
    DecodeStepError,
    DuplicateRequestError,
    EngineStoppedError,
)
from rollmesh.engine.prefill import PrefillResult
from rollmesh.engine.request_checks import validate_prompt
from rollmesh.engine.protocols import DEFAULT_OPTIONS, GenerateOptions, GenerationResult
from rollmesh.engine.token_stream import TokenDelta
from rollmesh.messages.base import SamplingParams
from rollmesh.telemetry.busy_clock import BusyClock

# What a request brings: its prompt's token ids, or the prefill a prefill worker made of it.
Work = list[int] | PrefillResult


@dataclass(slots=True)
class _Waiting:
    request_id: str
    work: Work
    sampling: SamplingParams
    options: GenerateOptions

    @property
    def prompt_len(self) -> int:
        return self.work.num_tokens if isinstance(self.work, PrefillResult) else len(self.work)


@dataclass(slots=True)
class _Listener:
    """A streamed request: its pieces, and how many of its tokens are already on the queue."""

    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    sent: int = 0


_END = object()  # on a listener's queue: the request's submit has returned or raised


class DecodeLoop:
    """Continuous batching over ``engine``: ``submit`` returns when the sequence finishes."""

    def __init__(self, engine: DecodeEngine, busy: BusyClock | None = None) -> None:
        self.engine = engine
        # Steps are the worker's compute (the GPU scheduler's busy time for decode).
        self.busy = busy or BusyClock()
        self._futures: dict[str, asyncio.Future[GenerationResult]] = {}
        self._waiting: deque[_Waiting] = deque()
        self._weight_waiters: list[tuple[int, asyncio.Future[int]]] = []
        self._listeners: dict[str, _Listener] = {}
        self._wake = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        """Start the loop task on the running event loop (idempotent)."""
        if self.running:
            return
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()  # an Event binds to the first loop that waits on it
        self._task = self._loop.create_task(self._run(), name="rollmesh-decode-loop")

    async def stop(self) -> None:
        """Cancel the loop task; fail in-flight requests and weight waiters with
        EngineStoppedError. Re-raises what crashed the loop, if something did."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            finally:
                self._fail_everything()

    async def submit(
        self,
        request_id: str,
        work: Work,
        sampling: SamplingParams,
        options: GenerateOptions = DEFAULT_OPTIONS,
    ) -> GenerationResult:
        """Add a request to the batch (or the queue) and wait for it to finish.

        Bad input raises at once (InvalidRequestError and subclasses); so does a ``min_version``
        the engine has not reached (VersionUnavailableError). Cancelling the caller aborts the
        request.
        """
        if not self.running:
            raise EngineStoppedError(request_id)
        if request_id in self._futures:
            raise DuplicateRequestError(request_id)
        waiting = _Waiting(request_id, work, sampling, options)
        if isinstance(work, PrefillResult):
            self.engine.validate_prefilled(request_id, work, sampling, options)
        else:
            waiting.work = validate_prompt(work, self.engine.model, request_id=request_id)
            self.engine.validate_request(request_id, len(waiting.work), sampling, options)
        future: asyncio.Future[GenerationResult] = asyncio.get_running_loop().create_future()
        self._futures[request_id] = future
        self._waiting.append(waiting)
        self._admit_waiting()
        self._wake.set()
        try:
            return await future
        except asyncio.CancelledError:
            # Unless already forgotten (a closed stream does it at once), and the id reused.
            if self._futures.get(request_id) is future:
                self._forget(request_id)
            raise

    async def stream(
        self,
        request_id: str,
        work: Work,
        sampling: SamplingParams,
        options: GenerateOptions = DEFAULT_OPTIONS,
    ) -> AsyncIterator[TokenDelta | GenerationResult]:
        """``submit``, yielding the request's tokens as they are sampled (``TokenDelta`` pieces,
        in order, no gaps), then the GenerationResult. Errors are ``submit``'s; closing the
        iterator before the end aborts the request."""
        if request_id in self._futures or request_id in self._listeners:
            raise DuplicateRequestError(request_id)
        listener = self._listeners[request_id] = _Listener()
        submitted = asyncio.ensure_future(self.submit(request_id, work, sampling, options))
        submitted.add_done_callback(lambda _: listener.queue.put_nowait(_END))
        try:
            while (piece := await listener.queue.get()) is not _END:
                yield piece
            finished = submitted.result()
            if len(finished.token_ids) > listener.sent:  # sampled in the step that finished it
                start = listener.sent
                top = finished.top_logprobs[start:] if finished.top_logprobs is not None else None
                yield TokenDelta(request_id, start, finished.token_ids[start:],
                                 finished.logprobs[start:], finished.versions[start:], top)
            yield finished
        finally:
            if self._listeners.get(request_id) is listener:
                del self._listeners[request_id]
            if not submitted.done():
                self._forget(request_id)  # abort now, not when the cancelled submit next runs
                submitted.cancel()

    def abort(self, request_id: str) -> GenerationResult | None:
        """Abort a request: its ``submit`` returns the partial output, finish_reason "abort"."""
        future = self._futures.pop(request_id, None)
        finished = self._drop(request_id)
        if finished is not None and future is not None and not future.done():
            future.set_result(finished)
        return finished

    def stage_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> bool:
        """Stage weights for the next step boundary; callable from any thread."""
        staged = self.engine.stage_weights(state_dict, version)
        if staged:
            self._wake_threadsafe()
        return staged

    async def wait_weights_activated(self, version: int) -> int:
        """Wait until ``version`` (or a newer one) is active; returns the active version."""
        current = self.engine.current_version
        if current >= version:
            return current
        if not self.running:
            raise EngineStoppedError()
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._weight_waiters.append((version, future))
        return await future

    def stats(self) -> DecodeStats:
        return self.engine.stats()

    def num_waiting(self) -> int:
        return len(self._waiting)

    # -- the loop --------------------------------------------------------------------------

    async def _run(self) -> None:
        try:
            while True:
                self._admit_waiting()
                if self.engine.has_work():
                    try:
                        with self.busy.busy():
                            finished = self.engine.step()
                    except Exception as exc:  # noqa: BLE001 - the batch fails, the loop goes on
                        self._fail_batch(exc)
                    else:
                        for sequence in finished:
                            self._resolve(sequence)
                # Also when idle: a prefill engine sharing the WeightStager may have activated.
                self._report_activation()
                self._admit_waiting()  # into the slots this step freed
                self._publish_tokens()
                if self.engine.has_work():
                    await asyncio.sleep(0)  # let new requests join before the next step
                else:
                    self._wake.clear()
                    await self._wake.wait()
        except asyncio.CancelledError:
            raise
        except BaseException:
            self._fail_everything()
            raise

    def _admit_waiting(self) -> None:
        while self._waiting:
            head = self._waiting[0]
            if not self.engine.can_admit(head.prompt_len, head.sampling, head.options.session_id):
                return
            waiting = self._waiting.popleft()
            try:
                if isinstance(waiting.work, PrefillResult):
                    self.engine.add_prefilled(waiting.request_id, waiting.work, waiting.sampling,
                                              waiting.options)
                else:
                    self.engine.add_prompt(waiting.request_id, waiting.work, waiting.sampling,
                                           waiting.options)
            except Exception as exc:  # noqa: BLE001 - that request fails, the others go on
                future = self._futures.pop(waiting.request_id, None)
                if future is not None and not future.done():
                    future.set_exception(exc)

    def _publish_tokens(self) -> None:
        """Each streamed request's tokens sampled since its last piece, onto its queue."""
        for request_id, listener in self._listeners.items():
            delta = self.engine.new_tokens(request_id, listener.sent)
            if delta is not None:
                listener.sent += len(delta.token_ids)
                listener.queue.put_nowait(delta)

    def _resolve(self, sequence: GenerationResult) -> None:
        future = self._futures.pop(sequence.request_id, None)
        if future is not None and not future.done():
            future.set_result(sequence)

    def _fail_batch(self, exc: Exception) -> None:
        """A step raised: its batch is lost (the cache may be half-written), the queue is not."""
        dropped = self.engine.abort_all()
        aborted = [s.request_id for s in dropped if s.finish_reason == "abort"]
        error = DecodeStepError(self.engine.current_version, aborted)
        error.__cause__ = exc
        for sequence in dropped:
            if sequence.finish_reason != "abort":  # finished at admission, before the failure
                self._resolve(sequence)
                continue
            future = self._futures.pop(sequence.request_id, None)
            if future is not None and not future.done():
                future.set_exception(error)

    def _report_activation(self) -> None:
        if self.engine.pop_activation() is None or not self._weight_waiters:
            return
        current = self.engine.current_version
        still_waiting = []
        for version, future in self._weight_waiters:
            if future.done():
                continue
            if version <= current:
                future.set_result(current)
            else:
                still_waiting.append((version, future))
        self._weight_waiters = still_waiting

    def _forget(self, request_id: str) -> None:
        self._futures.pop(request_id, None)
        self._drop(request_id)

    def _drop(self, request_id: str) -> GenerationResult | None:
        for index, waiting in enumerate(self._waiting):
            if waiting.request_id == request_id:
                del self._waiting[index]
                return GenerationResult([], [], [], "abort", waiting.prompt_len, request_id=request_id)
        return self.engine.abort(request_id)

    def _fail_everything(self) -> None:
        self.engine.abort_all()
        self._waiting.clear()
        futures, self._futures = self._futures, {}
        for request_id, future in futures.items():
            if not future.done():
                future.set_exception(EngineStoppedError(request_id))
        waiters, self._weight_waiters = self._weight_waiters, []
        for _, future in waiters:
            if not future.done():
                future.set_exception(EngineStoppedError())

    def _wake_threadsafe(self) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            self._wake.set()
        else:
            loop.call_soon_threadsafe(self._wake.set)
