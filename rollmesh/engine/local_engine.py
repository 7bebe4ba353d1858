"""Aggregated inference in one process: prefill, then continuous-batched decode, same model.

Knows the engine parts and asyncio; not Ray (the disaggregated version puts PrefillEngine and
DecodeLoop in separate actors and passes the PrefillResult through the object store). Prefill and
decode share one model and one WeightStager, so a swap made at either boundary is seen by both.
Leaves ``torch.set_num_threads`` to the process owner.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from rollmesh.config import InferenceConfig, ModelConfig
from rollmesh.engine.batch_loop import DecodeLoop
from rollmesh.engine.decode import DecodeEngine, DecodeStats
from rollmesh.engine.model import TinyDecoder, build_model
from rollmesh.engine.prefill import PrefillEngine
from rollmesh.engine.protocols import Detokenizer, GenerationResult
from rollmesh.engine.weight_staging import WeightStager
from rollmesh.messages.base import SamplingParams


class LocalEngine:
    """An ``InferenceEngine`` for tests and the CPU demo; the loop starts on first use."""

    def __init__(
        self,
        model_config: ModelConfig,
        inference_config: InferenceConfig,
        *,
        model: TinyDecoder | None = None,
        tokenizer: Detokenizer | None = None,
        seed: int = 0,
        version: int = 0,
    ) -> None:
        self.model = model if model is not None else build_model(model_config)
        weights = WeightStager(self.model, version=version)
        self.prefill_engine = PrefillEngine(self.model, weights=weights)
        self.decode_engine = DecodeEngine(
            self.model,
            max_batch=inference_config.max_batch,
            seed=seed,
            tokenizer=tokenizer,
            weights=weights,
        )
        self.decode_loop = DecodeLoop(self.decode_engine)

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
        self, input_ids: list[int], sampling: SamplingParams, *, request_id: str
    ) -> GenerationResult:
        self.decode_loop.start()
        # Runs on the event loop thread between decode steps, so it is a boundary for both.
        prefill = self.prefill_engine.prefill(input_ids, request_id=request_id)
        finished = await self.decode_loop.submit(request_id, prefill, sampling)
        return finished.as_generation_result()

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
