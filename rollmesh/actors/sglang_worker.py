"""A decode worker whose engine is SGLang: the thin shell around ``SGLangEngine``.

Knows Ray only through the launcher (no ray import here). With ``inference.backend = "sglang"``
the launcher spawns these under the decode workers' names (``decode-<i>``), so the inference
router, the rollout workers and the Serve app call them exactly as they call the torch engine's
``DecodeWorkerActor``: ``generate_prompt`` (token ids in; tokens, logprobs, weight versions and
routed experts out), its ``_stream`` form, ``load``, the weight admin calls. There is no prefill
actor: SGLang prefills itself, or disaggregates with its own router (``disaggregation = "pd"``).

Each worker launches its SGLang server(s) from the launch plan (``sglang_launch``) or attaches to
``inference.sglang.urls[index]``, waits until healthy, and stops what it launched when it stops.
It follows ``WeightsPublished`` over NATS by writing each version as a model directory SGLang
loads from disk (``SGLangDiskWeights``), paused ``in_place`` and without a cache flush, unless
the trainer already pushed that version into its servers (``trainer.weight_sync = "nccl"`` or
``"ipc"``; the trainer finds the servers through ``weight_sync_target``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import structlog
from opentelemetry import trace

from rollmesh.actors.role_base import RoleActor
from rollmesh.config import InferenceConfig, ModelConfig
from rollmesh.engine.errors import InvalidRequestError
from rollmesh.engine.protocols import DEFAULT_OPTIONS, GenerateOptions, GenerationResult
from rollmesh.engine.sglang_backend import SGLangEngine
from rollmesh.engine.sglang_launch import launch_plan, other_node_commands
from rollmesh.engine.sglang_routes import RoutedExpertsShape
from rollmesh.engine.sglang_server import SGLangServer, pick_free_port
from rollmesh.engine.sglang_weights import SGLangDiskWeights, write_hf_weights
from rollmesh.engine.token_stream import TokenDelta
from rollmesh.engine.weight_follower import WeightFollower
from rollmesh.engine.weight_buckets import load_published
from rollmesh.mesh_address import MeshAddress
from rollmesh.messages.base import SamplingParams
from rollmesh.ports import ActorLogic, Publisher
from rollmesh.telemetry import metrics, metrics_catalog
from rollmesh.telemetry.trace_headers import extract_trace_context

_log = structlog.get_logger("rollmesh.actors.sglang_worker")
_tracer = trace.get_tracer("rollmesh.inference")


class SGLangWorkerActor(RoleActor):
    role = "decode"
    logic_class = WeightFollower  # the SGLang servers are the role's logic; the shell serves its weights
    holds_accelerators = True

    def __init__(self, name: str, mesh: MeshAddress, model_config: ModelConfig,
                 inference_config: InferenceConfig, index: int = 0) -> None:
        super().__init__(name, mesh)
        from rollmesh.engine.models import read_hf_config
        from rollmesh.engine.paged_model import load_tokenizer

        self.config = inference_config.sglang
        self._in_flight = 0  # generate calls this worker has at SGLang now
        tokenizer = load_tokenizer(model_config)
        shape = RoutedExpertsShape.of_model(read_hf_config(Path(model_config.path) / "config.json"))
        self.plan = launch_plan(self.config, index=index, model_path=model_config.path,
                                routed_experts=shape is not None, pick_port=pick_free_port)
        logs = Path(mesh.run_dir) / "logs" / "sglang"
        self.processes = [SGLangServer(spec, logs / f"{name}-{i}.log") for i, spec in enumerate(self.plan.servers)]
        if self.plan.router is not None:
            self.processes.append(SGLangServer(self.plan.router, logs / f"{name}-router.log"))
        # The same end-of-turn ids the torch engine stops at, and the tokenizer for stop strings
        # sent as ids under --skip-tokenizer-init.
        self.engine = SGLangEngine(
            [self.plan.generate_url], admin_urls=self.plan.admin_urls, routed_experts_shape=shape,
            generate_timeout_s=self.config.generate_timeout_s, end_of_turn_ids=tokenizer.end_of_turn_ids,
            encode=tokenizer.encode, skip_tokenizer_init=self.config.skip_tokenizer_init)
        self.weights = SGLangDiskWeights(
            self.engine, model_dir=self.config.model_path or model_config.path,
            out_root=self.config.weights_dir or Path(mesh.run_dir) / "sglang-weights" / name,
            pause_mode=self.config.pause_mode, in_flight=lambda: self._in_flight,
            pushed_version=self.engine.current_version)

    async def build_logic(self, publisher: Publisher) -> ActorLogic:
        for process in self.processes:  # servers before their router: it checks them at start
            if not process.running:
                await process.start()
        for command in other_node_commands(self.plan, self.config):
            _log.warning("sglang_start_other_node_rank", worker=self.name, command=" ".join(command))
        self.weights.set_current_version(await self.engine.current_version())
        metrics.observe(metrics_catalog.QUEUE_DEPTH, self, lambda actor: [
            (actor._in_flight, {"queue": "decode", "worker": actor.name})])
        return WeightFollower(self.weights, publisher, worker=self.name, role=self.role,
                              latest=self.shell.stores.latest_weights)

    async def generate_prompt(self, input_ids: list[int], sampling: SamplingParams,
                              request_id: str, trace_headers: dict[str, str] | None = None,
                              options: GenerateOptions = DEFAULT_OPTIONS) -> GenerationResult:
        """Token ids in; SGLang prefills (reusing its radix cache) and decodes."""
        with _tracer.start_as_current_span(
            "sglang_generate", context=extract_trace_context(trace_headers or {}),
            attributes={"request_id": request_id, "prompt_tokens": len(input_ids),
                        "url": self.plan.generate_url},
        ) as span:
            self._in_flight += 1
            try:
                with self.busy.busy():
                    result = await self.engine.generate(input_ids, sampling, request_id=request_id,
                                                        options=options)
            finally:
                self._in_flight -= 1
            metrics.add(metrics_catalog.GENERATED_TOKENS, len(result.token_ids), {"worker": self.name})
            span.set_attribute("cached_tokens", result.cached_tokens)
            return result

    async def generate_prompt_stream(self, input_ids: list[int], sampling: SamplingParams,
                                     request_id: str, trace_headers: dict[str, str] | None = None,
                                     options: GenerateOptions = DEFAULT_OPTIONS,
                                     ) -> AsyncIterator[TokenDelta | GenerationResult]:
        """``generate_prompt`` as one piece: SGLang is asked whole (``build_generate_payload``)."""
        finished = await self.generate_prompt(input_ids, sampling, request_id, trace_headers, options)
        yield TokenDelta(request_id=request_id, start=0, token_ids=finished.token_ids,
                         logprobs=finished.logprobs, versions=finished.versions,
                         top_logprobs=finished.top_logprobs)
        yield finished

    async def generate(self, prefill: Any, *args: Any, **kwargs: Any) -> GenerationResult:
        raise InvalidRequestError("an SGLang worker takes prompts, not prefilled KV "
                                  "(inference.backend = 'sglang' spawns no prefill workers)", field="prefill")

    async def drop_sessions(self) -> int:
        """SGLang's radix cache has no sessions to drop; nothing is freed here."""
        return 0

    async def load(self) -> int:
        return self._in_flight

    async def current_version(self) -> int:
        return self.weights.current_version

    async def weight_sync_target(self) -> dict[str, Any]:
        """What a trainer pushing versions without files needs (``trainer.weight_sync = "nccl"``
        or ``"ipc"``): the servers' admin URLs, the GPUs of each (its weight-update group ranks:
        SGLang's TP ranks) and the pause mode."""
        return {"urls": list(self.plan.admin_urls), "gpus_per_server": self.config.tp_size,
                "pause_mode": self.config.pause_mode}

    async def weight_versions(self) -> dict[str, int | None]:
        return {"current": self.weights.current_version, "staged": None}

    async def update_weights_from_file(self, path: str, version: int) -> int:
        """The HTTP API's ``/update_weights_from_disk``: a ``save_weights`` file or bucket manifest,
        written as a model directory and loaded by the servers (not announced on NATS)."""
        state = await asyncio.to_thread(load_published, path)
        target = await asyncio.to_thread(
            write_hf_weights, state, model_dir=self.weights.model_dir, out_root=self.weights.out_root,
            version=version)
        await self.engine.swap_weights_from_disk(str(target), version, pause_mode=self.config.pause_mode)
        self.weights.set_current_version(version)
        return version

    async def stop(self) -> None:
        await super().stop()
        await self.engine.aclose()
        for process in reversed(self.processes):
            await asyncio.to_thread(process.stop)

    async def stats(self) -> dict[str, Any]:
        stats = self.engine.statistics()
        return {**await super().stats(), "sglang": {
            "url": self.plan.generate_url, "requests": stats.requests, "in_flight": self._in_flight,
            "start_len_ignored": stats.start_len_ignored, "version": self.weights.current_version}}

