"""Aggregated inference in one process: one engine prefills and decodes, same model.

Knows the engine parts and asyncio; not Ray (the disaggregated version puts PrefillEngine and
DecodeLoop in separate actors and passes the PrefillResult through the object store, and the
aggregated actor mode wraps this same DecodeLoop). Prompts are prefilled by the decode engine
between steps, reusing their session's parked KV. Leaves ``torch.set_num_threads`` to the
process owner.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping

import torch
from torch import nn

from rollmesh.config import InferenceConfig, ModelConfig
from rollmesh.engine.batch_loop import DecodeLoop
from rollmesh.engine.decode import DecodeEngine, DecodeStats
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
        self.decode_loop.start()
        finished = await self.decode_loop.submit(request_id, list(input_ids), sampling, options)
        return finished.as_generation_result()

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
        self.decode_loop.start()
        pieces = self.decode_loop.stream(request_id, list(input_ids), sampling, options)
        try:
            async for piece in pieces:
                yield piece if isinstance(piece, TokenDelta) else piece.as_generation_result()
        finally:
            await pieces.aclose()

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
