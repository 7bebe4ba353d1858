"""Aggregated inference in one process: one engine prefills and decodes, same model.

Knows the engine parts and asyncio; not Ray (the disaggregated version puts PrefillEngine and
DecodeLoop in separate actors and passes the PrefillResult through the object store, and the
aggregated actor mode wraps this same DecodeLoop). Prompts are prefilled by the decode engine
between steps, reusing their session's parked KV. Leaves ``torch.set_num_threads`` to the
process owner.

Lending its memory (``release_memory`` / ``resume_memory``, for the GPU scheduler): from the
release on, new requests are refused with the retryable ``MemoryReleasedError``, while those
already accepted finish; then the weights and parked KV go to host memory. Refused rather than
queued: the memory comes back only when the scheduler takes the accelerator back from a
simulation job (up to that job's preemption grace, minutes), and a request queued that long would
hold its caller invisibly, where a typed refusal lets the router send it to a worker that has
its memory (and a client retry).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping

import torch
from torch import nn

from rollmesh.config import InferenceConfig, ModelConfig
from rollmesh.engine.batch_loop import DecodeLoop
from rollmesh.engine.decode import DecodeEngine, DecodeStats
from rollmesh.engine.errors import EngineBusyError, MemoryReleasedError
from rollmesh.engine.memory_release import MemoryMoveStats
from rollmesh.engine.paged_model import build_inference_model, load_tokenizer
from rollmesh.engine.protocols import (
    DEFAULT_OPTIONS,
    Detokenizer,
    GenerateOptions,
    GenerationResult,
)
from rollmesh.engine.token_stream import TokenDelta
from rollmesh.messages.base import SamplingParams


def build_decode_engine(
    model: nn.Module,
    inference_config: InferenceConfig,
    *,
    seed: int = 0,
    tokenizer: Detokenizer | None = None,
    version: int = 0,
) -> DecodeEngine:
    return DecodeEngine(
        model,
        max_batch=inference_config.max_batch,
        seed=seed,
        tokenizer=tokenizer,
        version=version,
        block_size=inference_config.kv_block_size,
        num_blocks=inference_config.kv_blocks,
    )


class LocalEngine:
    """An ``InferenceEngine`` for tests, benchmarks and the CPU demo; the loop starts on first use.

    The model and its tokenizer come from the directory ``model_config.path``; a caller that
    passes its own ``model`` passes its ``tokenizer`` too (or none: see ``DecodeEngine``).
    """

    def __init__(
        self,
        model_config: ModelConfig,
        inference_config: InferenceConfig,
        *,
        model: nn.Module | None = None,
        tokenizer: Detokenizer | None = None,
        seed: int = 0,
        version: int = 0,
    ) -> None:
        if model is None:
            model = build_inference_model(model_config)
            tokenizer = tokenizer if tokenizer is not None else load_tokenizer(model_config)
        self.model = model
        self.decode_engine = build_decode_engine(
            self.model, inference_config, seed=seed, tokenizer=tokenizer, version=version
        )
        self.decode_loop = DecodeLoop(self.decode_engine)
        self._in_flight = 0
        self._idle: asyncio.Event | None = None  # made on first use: it binds to its loop
        self._releasing = False  # from the start of a release until the resume

    async def __aenter__(self) -> "LocalEngine":
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    async def start(self) -> None:
        self.decode_loop.start()

    async def stop(self) -> None:
        await self.decode_loop.stop()

    async def generate(
        self,
        input_ids: list[int],
        sampling: SamplingParams,
        *,
        request_id: str,
        options: GenerateOptions = DEFAULT_OPTIONS,
    ) -> GenerationResult:
        self._accept(request_id)
        self.decode_loop.start()
        try:
            finished = await self.decode_loop.submit(request_id, list(input_ids), sampling, options)
        finally:
            self._one_done()
        return finished

    async def generate_stream(
        self,
        input_ids: list[int],
        sampling: SamplingParams,
        *,
        request_id: str,
        options: GenerateOptions = DEFAULT_OPTIONS,
    ) -> AsyncIterator[TokenDelta | GenerationResult]:
        """``generate``, yielding the tokens as they are sampled (``rollmesh.engine.token_stream``)
        and the GenerationResult last; closing it early aborts the request."""
        self._accept(request_id)
        self.decode_loop.start()
        pieces = self.decode_loop.stream(request_id, list(input_ids), sampling, options)
        try:
            async for piece in pieces:
                yield piece
        finally:
            await pieces.aclose()
            self._one_done()

    # -- lending the memory ------------------------------------------------------------------

    @property
    def memory_released(self) -> bool:
        return self.decode_engine.memory_released

    async def release_memory(self) -> MemoryMoveStats:
        """Refuse new requests, let the accepted ones finish (and a staged weight update
        activate), then move the weights and parked KV to host memory."""
        self._releasing = True
        self.decode_loop.start()
        try:
            while True:
                await self._wait_idle()
                staged = self.decode_engine.weights.staged_version
                if staged is not None:  # work for the loop, which is awake for it
                    await self.decode_loop.wait_weights_activated(staged)
                    continue
                try:
                    return self.decode_engine.release_memory()
                except EngineBusyError:
                    continue  # staged from another thread meanwhile
        except BaseException:
            self._releasing = False
            raise

    async def resume_memory(self) -> MemoryMoveStats:
        """Weights and parked KV back on the device; requests accepted again. Weights published
        while released are staged now and activate at the next step."""
        stats = self.decode_engine.resume_memory()
        self._releasing = False
        deferred = self.decode_engine.take_deferred_weights()
        if deferred is not None:
            self.decode_loop.start()
            self.decode_loop.stage_weights(*deferred)
        return stats

    def _accept(self, request_id: str) -> None:
        if self._releasing:
            raise MemoryReleasedError(request_id=request_id)
        self._in_flight += 1
        if self._idle is not None:
            self._idle.clear()

    def _one_done(self) -> None:
        self._in_flight -= 1
        if self._in_flight == 0 and self._idle is not None:
            self._idle.set()

    async def _wait_idle(self) -> None:
        if self._in_flight == 0:
            return
        if self._idle is None:
            self._idle = asyncio.Event()
        await self._idle.wait()

    def stage_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> bool:
        """Stage weights for the next boundary; callable from any thread."""
        return self.decode_loop.stage_weights(state_dict, version)

    async def wait_weights_activated(self, version: int) -> int:
        self.decode_loop.start()
        return await self.decode_loop.wait_weights_activated(version)

    @property
    def current_version(self) -> int:
        return self.decode_engine.current_version

    def stats(self) -> DecodeStats:
        return self.decode_engine.stats()
