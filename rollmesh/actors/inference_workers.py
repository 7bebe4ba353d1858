"""Prefill and decode worker actors: thin shells around the engine's PrefillEngine and DecodeLoop.

Knows Ray only through the launcher (no ray import here). The KV pages made by
``PrefillWorkerActor.prefill`` are returned as a PrefillResult; the router passes the resulting
ObjectRef straight to ``DecodeWorkerActor.generate``, so the KV travels through the Ray object
store, never through the caller. ``DecodeWorkerActor.generate_prompt`` prefills on the decode
worker itself: the aggregated mode, and the later turns of a session whose KV is parked there.
Both follow weight versions over NATS (``WeightFollower``), reading a version from the trainer's
shared memory when it is on their node (``weight_object_store``), else from its files. ``generate_stream`` and
``generate_prompt_stream`` are the same as async generators: called with
``num_returns="streaming"`` they send each piece of tokens (``rollmesh.engine.token_stream``) as it
is sampled, then the GenerationResult; cancelling the task aborts the request.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from opentelemetry import trace

from rollmesh.actors.role_base import RoleActor
from rollmesh.actors.role_memory import MemoryGate, lent_memory
from rollmesh.actors.weight_object_store import ObjectStoreWeightFetcher
from rollmesh.mesh_address import MeshAddress
from rollmesh.ports import ActorLogic, Publisher
from rollmesh.config import InferenceConfig, ModelConfig
from rollmesh.engine.errors import EngineBusyError
from rollmesh.engine.protocols import DEFAULT_OPTIONS, GenerateOptions, GenerationResult
from rollmesh.engine.token_stream import TokenDelta
from rollmesh.engine.weight_follower import StagesWeights, WeightFollower
from rollmesh.engine.weight_buckets import load_published
from rollmesh.inference.weight_adapters import DecodeWeights, PrefillWeights
from rollmesh.messages.base import SamplingParams
from rollmesh.telemetry import metrics, metrics_catalog
from rollmesh.telemetry.trace_headers import extract_trace_context

# The engine (torch, transformers) is imported in the constructors: the launcher imports this
# module for the actor classes it spawns, and must not pay seconds of torch import for them.
if TYPE_CHECKING:
    from rollmesh.engine.prefill import PrefillResult

_tracer = trace.get_tracer("rollmesh.inference")


class PrefillWorkerActor(RoleActor):
    role = "prefill"
    logic_class = WeightFollower  # the engine is the role's logic; the shell serves its weights
    holds_accelerators = True

    def __init__(self, name: str, mesh: MeshAddress, model_config: ModelConfig,
                 inference_config: InferenceConfig) -> None:
        super().__init__(name, mesh, torch_threads=inference_config.torch_threads)
        from rollmesh.engine.paged_model import build_inference_model
        from rollmesh.engine.prefill import PrefillEngine

        self.engine = PrefillEngine(build_inference_model(model_config),
                                    block_size=inference_config.kv_block_size)

    async def build_logic(self, publisher: Publisher) -> ActorLogic:
        return WeightFollower(PrefillWeights(self.engine), publisher, worker=self.name, role=self.role,
                              latest=self.shell.stores.latest_weights, memory=ObjectStoreWeightFetcher())

    async def prefill(self, input_ids: list[int], request_id: str = "",
                      trace_headers: dict[str, str] | None = None) -> PrefillResult:
        with _tracer.start_as_current_span(
            "prefill", context=extract_trace_context(trace_headers or {}),
            attributes={"request_id": request_id, "num_tokens": len(input_ids)},
        ):
            self.engine.apply_staged_weights()
            with self.busy.busy():
                return self.engine.prefill(input_ids, request_id=request_id or None)

    async def current_version(self) -> int:
        return self.engine.current_version

    async def weight_versions(self) -> dict[str, int | None]:
        """The active and the staged weight version (the HTTP API's ``GET /v1/admin/weights``)."""
        return {"current": self.engine.current_version,
                "staged": self.engine.weights.staged_version}

    async def update_weights_from_file(self, path: str, version: int) -> int:
        """Load a ``save_weights`` file or a bucket manifest, stage it as ``version`` and apply
        it; returns the active version (see ``update_weights_from_file`` below)."""
        return await update_weights_from_file(PrefillWeights(self.engine), path, version)

    async def release_memory(self) -> dict[str, Any]:
        """Lend the accelerator (``scheduler.lend_role_accelerators``): weights to host memory, the
        scratch KV freed; ``prefill`` refuses with the retryable MemoryReleasedError until resumed.
        Prefill calls never overlap on this event loop, so this runs between two of them."""
        return lent_memory(self.engine.release_memory())

    async def resume_memory(self) -> dict[str, Any]:
        return lent_memory(self.engine.resume_memory())


class DecodeWorkerActor(RoleActor):
    role = "decode"
    logic_class = WeightFollower  # the engine is the role's logic; the shell serves its weights
    holds_accelerators = True

    def __init__(self, name: str, mesh: MeshAddress, model_config: ModelConfig,
                 inference_config: InferenceConfig, seed: int = 0) -> None:
        super().__init__(name, mesh, torch_threads=inference_config.torch_threads)
        from rollmesh.engine.batch_loop import DecodeLoop
        from rollmesh.engine.local_engine import build_decode_engine
        from rollmesh.engine.paged_model import build_inference_model, load_tokenizer

        # The model directory's own tokenizer: its end-of-turn ids stop a turn, its stop strings
        # are matched in its text, and padded embedding rows past it are never sampled.
        engine = build_decode_engine(build_inference_model(model_config), inference_config,
                                     seed=seed, tokenizer=load_tokenizer(model_config))
        self.loop = DecodeLoop(engine, self.busy)
        self.memory_gate = MemoryGate()  # lending the accelerator: refuse, drain, then release

    async def build_logic(self, publisher: Publisher) -> ActorLogic:
        self.loop.start()
        metrics.observe(metrics_catalog.QUEUE_DEPTH, self, lambda actor: [
            (actor.loop.num_waiting(), {"queue": "decode", "worker": actor.name})])
        return WeightFollower(DecodeWeights(self.loop), publisher, worker=self.name, role=self.role,
                              latest=self.shell.stores.latest_weights, memory=ObjectStoreWeightFetcher())

    async def generate(self, prefill: PrefillResult, sampling: SamplingParams, request_id: str,
                       trace_headers: dict[str, str] | None = None,
                       options: GenerateOptions = DEFAULT_OPTIONS) -> GenerationResult:
        """Decode a prompt a prefill worker prefilled (its KV pages arrive with ``prefill``)."""
        with _tracer.start_as_current_span(
            "decode", context=extract_trace_context(trace_headers or {}),
            attributes={"request_id": request_id, "prompt_tokens": prefill.num_tokens},
        ):
            with self.memory_gate.accept(request_id):
                finished = await self.loop.submit(request_id, prefill, sampling, options)
            metrics.add(metrics_catalog.GENERATED_TOKENS, len(finished.token_ids), {"worker": self.name})
            return finished

    async def generate_prompt(self, input_ids: list[int], sampling: SamplingParams,
                              request_id: str, trace_headers: dict[str, str] | None = None,
                              options: GenerateOptions = DEFAULT_OPTIONS) -> GenerationResult:
        """Prefill here (reusing the session's parked KV), then decode."""
        with _tracer.start_as_current_span(
            "prefill_and_decode", context=extract_trace_context(trace_headers or {}),
            attributes={"request_id": request_id, "prompt_tokens": len(input_ids)},
        ) as span:
            with self.memory_gate.accept(request_id):
                finished = await self.loop.submit(request_id, input_ids, sampling, options)
            metrics.add(metrics_catalog.GENERATED_TOKENS, len(finished.token_ids), {"worker": self.name})
            span.set_attribute("cached_tokens", finished.cached_tokens)
            return finished

    async def generate_stream(self, prefill: PrefillResult, sampling: SamplingParams,
                              request_id: str, trace_headers: dict[str, str] | None = None,
                              options: GenerateOptions = DEFAULT_OPTIONS,
                              ) -> AsyncIterator[TokenDelta | GenerationResult]:
        """``generate``, sending the tokens as they are sampled."""
        async for piece in self._stream("decode", prefill, prefill.num_tokens, sampling,
                                        request_id, trace_headers, options):
            yield piece

    async def generate_prompt_stream(self, input_ids: list[int], sampling: SamplingParams,
                                     request_id: str, trace_headers: dict[str, str] | None = None,
                                     options: GenerateOptions = DEFAULT_OPTIONS,
                                     ) -> AsyncIterator[TokenDelta | GenerationResult]:
        """``generate_prompt``, sending the tokens as they are sampled."""
        async for piece in self._stream("prefill_and_decode", input_ids, len(input_ids), sampling,
                                        request_id, trace_headers, options):
            yield piece

    async def _stream(self, name, work, prompt_tokens, sampling, request_id, trace_headers, options):
        span = _tracer.start_span(name, context=extract_trace_context(trace_headers or {}),
                                  attributes={"request_id": request_id, "prompt_tokens": prompt_tokens,
                                              "stream": True})
        pieces = self.loop.stream(request_id, work, sampling, options)
        try:
            with self.memory_gate.accept(request_id):
                async for piece in pieces:
                    if isinstance(piece, GenerationResult):
                        metrics.add(metrics_catalog.GENERATED_TOKENS, len(piece.token_ids),
                                    {"worker": self.name})
                        span.set_attribute("cached_tokens", piece.cached_tokens)
                    yield piece
        finally:
            await pieces.aclose()  # before the end (cancelled): aborts the request
            span.end()

    async def drop_sessions(self) -> int:
        """Free every parked session's KV; returns the blocks freed."""
        return self.loop.engine.drop_sessions()

    async def release_memory(self) -> dict[str, Any]:
        """Lend the accelerator (``scheduler.lend_role_accelerators``): new requests are refused with
        the retryable MemoryReleasedError, those accepted finish (and staged weights activate),
        then the weights and parked KV go to host memory (as ``LocalEngine.release_memory``)."""
        self.memory_gate.releasing = True
        try:
            while True:
                await self.memory_gate.wait_idle()
                staged = self.loop.engine.weights.staged_version
                if staged is not None:  # work for the loop, which is awake for it
                    await self.loop.wait_weights_activated(staged)
                    continue
                try:
                    return lent_memory(self.loop.engine.release_memory())
                except EngineBusyError:
                    continue  # staged from the follower's thread meanwhile
        except BaseException:
            self.memory_gate.releasing = False
            raise

    async def resume_memory(self) -> dict[str, Any]:
        """Weights and parked KV back; requests accepted again; weights published meanwhile
        are staged now and activate at the next step."""
        stats = self.loop.engine.resume_memory()
        self.memory_gate.releasing = False
        deferred = self.loop.engine.take_deferred_weights()
        if deferred is not None:
            self.loop.stage_weights(*deferred)
        return lent_memory(stats)

    async def load(self) -> int:
        """Requests running or waiting here (the router balances on it)."""
        return self.loop.engine.num_active() + self.loop.num_waiting()

    async def current_version(self) -> int:
        return self.loop.engine.current_version

    async def weight_versions(self) -> dict[str, int | None]:
        """The active and the staged weight version (the HTTP API's ``GET /v1/admin/weights``)."""
        stats = self.loop.stats()
        return {"current": stats.current_version, "staged": stats.staged_version}

    async def update_weights_from_file(self, path: str, version: int) -> int:
        """Load a ``save_weights`` file or a bucket manifest, stage it as ``version`` and wait for
        the decode loop to swap it in at a step boundary; returns the active version."""
        return await update_weights_from_file(DecodeWeights(self.loop), path, version)

    async def stop(self) -> None:
        await super().stop()
        await self.loop.stop()

    async def stats(self) -> dict[str, Any]:
        return {**await super().stats(), "decode": self.loop.stats()}


async def update_weights_from_file(weights: StagesWeights, path: str, version: int) -> int:
    """The HTTP API's ``/update_weights_from_disk`` on one worker: load ``path`` (no checksum: the
    operator named the file), stage it as ``version`` and wait until it or a newer version is
    active. Unlike a trainer's update it is not announced on NATS, and a later
    ``WeightsPublished`` not newer than ``version`` is ignored by the follower."""
    # Read and stage (a checked copy) off the event loop, as the follower does: decoding goes on.
    await asyncio.to_thread(lambda: weights.stage_weights(load_published(path), version))
    return await weights.wait_weights_activated(version)
