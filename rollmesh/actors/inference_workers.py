"""Prefill and decode worker actors: thin shells around the engine's PrefillEngine and DecodeLoop.

Knows Ray only through the launcher (no ray import here). The KV made by ``PrefillWorkerActor.prefill``
is returned as a PrefillResult; the router passes the resulting ObjectRef straight to
``DecodeWorkerActor.generate``, so the KV travels through the Ray object store, never through the
caller. Both follow weight versions over NATS (``WeightFollower``).
"""

from __future__ import annotations

from typing import Any

from opentelemetry import trace

from rollmesh.actors.role_base import MeshContext, RoleActor
from rollmesh.ports import ActorLogic, Publisher
from rollmesh.bus.trace_headers import extract_trace_context
from rollmesh.config import InferenceConfig, ModelConfig
from rollmesh.engine.batch_loop import DecodeLoop
from rollmesh.engine.decode import DecodeEngine, FinishedSequence
from rollmesh.engine.model import build_model
from rollmesh.engine.prefill import PrefillEngine, PrefillResult
from rollmesh.engine.tokenizer import ByteTokenizer
from rollmesh.engine.weight_follower import WeightFollower
from rollmesh.messages.base import SamplingParams

_tracer = trace.get_tracer("rollmesh.inference")


class _PrefillWeights:
    """Adapts PrefillEngine to the follower: prefill calls never overlap on the actor's event
    loop, so between two calls is always a boundary and staged weights apply at once."""

    def __init__(self, engine: PrefillEngine) -> None:
        self.engine = engine

    @property
    def current_version(self) -> int:
        return self.engine.current_version

    def stage_weights(self, state_dict, version: int) -> bool:
        return self.engine.stage_weights(state_dict, version)

    async def wait_weights_activated(self, version: int) -> int:
        self.engine.apply_staged_weights()
        return self.engine.current_version

    def num_active(self) -> int:
        return 0


class _DecodeWeights:
    def __init__(self, loop: DecodeLoop) -> None:
        self.loop = loop

    @property
    def current_version(self) -> int:
        return self.loop.engine.current_version

    def stage_weights(self, state_dict, version: int) -> bool:
        return self.loop.stage_weights(state_dict, version)

    async def wait_weights_activated(self, version: int) -> int:
        return await self.loop.wait_weights_activated(version)

    def num_active(self) -> int:
        return self.loop.engine.num_active()


class PrefillWorkerActor(RoleActor):
    role = "prefill"

    def __init__(self, name: str, mesh: MeshContext, model_config: ModelConfig,
                 inference_config: InferenceConfig) -> None:
        super().__init__(name, mesh, torch_threads=inference_config.torch_threads)
        self.engine = PrefillEngine(build_model(model_config))

    async def build_logic(self, publisher: Publisher) -> ActorLogic:
        return WeightFollower(_PrefillWeights(self.engine), publisher, worker=self.name, role=self.role)

    async def prefill(self, input_ids: list[int], request_id: str = "",
                      trace_headers: dict[str, str] | None = None) -> PrefillResult:
        with _tracer.start_as_current_span(
            "prefill", context=extract_trace_context(trace_headers or {}),
            attributes={"request_id": request_id, "num_tokens": len(input_ids)},
        ):
            self.engine.apply_staged_weights()
            return self.engine.prefill(input_ids, request_id=request_id or None)

    async def current_version(self) -> int:
        return self.engine.current_version


class DecodeWorkerActor(RoleActor):
    role = "decode"

    def __init__(self, name: str, mesh: MeshContext, model_config: ModelConfig,
                 inference_config: InferenceConfig, seed: int = 0) -> None:
        super().__init__(name, mesh, torch_threads=inference_config.torch_threads)
        engine = DecodeEngine(build_model(model_config), max_batch=inference_config.max_batch,
                              seed=seed, tokenizer=ByteTokenizer(model_config.vocab_size))
        self.loop = DecodeLoop(engine)

    async def build_logic(self, publisher: Publisher) -> ActorLogic:
        self.loop.start()
        return WeightFollower(_DecodeWeights(self.loop), publisher, worker=self.name, role=self.role)

    async def generate(self, prefill: PrefillResult, sampling: SamplingParams, request_id: str,
                       trace_headers: dict[str, str] | None = None) -> FinishedSequence:
        with _tracer.start_as_current_span(
            "decode", context=extract_trace_context(trace_headers or {}),
            attributes={"request_id": request_id, "prompt_tokens": prefill.num_tokens},
        ):
            return await self.loop.submit(request_id, prefill, sampling)

    async def load(self) -> int:
        """Requests running or waiting here (the router balances on it)."""
        return self.loop.engine.num_active() + self.loop.num_waiting()

    async def current_version(self) -> int:
        return self.loop.engine.current_version

    async def stop(self) -> None:
        await super().stop()
        await self.loop.stop()

    async def stats(self) -> dict[str, Any]:
        return {**await super().stats(), "decode": self.loop.stats()}
