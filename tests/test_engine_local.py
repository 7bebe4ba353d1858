"""LocalEngine and DecodeLoop on the demo model directory: concurrent generates batch together,
wait for free slots, keep going across weight swaps, and cancel or stop cleanly."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from support.engine_models import babbling_model, model_tokenizer, prefer_tokens
from rollmesh.config import InferenceConfig, ModelConfig
from rollmesh.engine.errors import (
    DuplicateRequestError,
    EngineStoppedError,
    InvalidRequestError,
    PromptTooLongError,
)
from rollmesh.engine.local_engine import LocalEngine
from rollmesh.engine.protocols import InferenceEngine
from rollmesh.messages.base import SamplingParams

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12)


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Tiny tensors on a shared 2-core machine: a second torch thread only spins."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def local_engine(demo_model_dir: Path):
    """LocalEngine(max_batch) on the demo directory's tokenizer and a babbling model that never
    ends its turn, so sampled generations run to the budget the tests give them."""

    def make(max_batch: int = 8) -> LocalEngine:
        tokenizer = model_tokenizer(demo_model_dir)
        model = prefer_tokens(babbling_model(demo_model_dir), sorted(tokenizer.end_of_turn_ids), by=-100.0)
        return LocalEngine(ModelConfig(path=str(demo_model_dir)), InferenceConfig(max_batch=max_batch),
                           model=model, tokenizer=tokenizer)

    return make


def new_weights(model_dir: Path, seed: int) -> dict[str, torch.Tensor]:
    return babbling_model(model_dir, seed).state_dict()


def prompt(length: int, offset: int = 0) -> list[int]:
    return [(offset + 5 * i) % 256 for i in range(length)]


async def wait_until(condition, timeout_s: float = 10.0) -> None:
    async def poll() -> None:
        while not condition():
            await asyncio.sleep(0)

    await asyncio.wait_for(poll(), timeout_s)


async def test_local_engine_is_an_inference_engine_and_batches_concurrent_generates(local_engine) -> None:
    async with local_engine(max_batch=3) as engine:
        assert isinstance(engine, InferenceEngine)
        prompts = {f"r{i}": prompt(3 + 4 * i, i) for i in range(6)}  # 6 requests, 3 slots
        together = await asyncio.gather(
            *(engine.generate(ids, GREEDY, request_id=rid) for rid, ids in prompts.items())
        )
        assert engine.stats().active == 0
        for (rid, ids), result in zip(prompts.items(), together):
            alone = await engine.generate(ids, GREEDY, request_id=f"{rid}-alone")
            assert result.token_ids == alone.token_ids and result.request_id == rid
            assert result.prompt_len == len(ids)
            assert len(result.token_ids) == len(result.logprobs) == len(result.versions)


async def test_local_engine_keeps_a_generation_across_a_weight_swap(local_engine, demo_model_dir) -> None:
    async with local_engine() as engine:
        sampling = SamplingParams(temperature=1.0, max_new_tokens=40)
        task = asyncio.create_task(engine.generate(prompt(4), sampling, request_id="long"))
        await wait_until(lambda: engine.stats().tokens_generated >= 5)
        assert engine.stage_weights(new_weights(demo_model_dir, seed=1), version=1)
        assert await asyncio.wait_for(engine.wait_weights_activated(1), 10) == 1
        result = await asyncio.wait_for(task, 10)
        assert result.versions == sorted(result.versions)
        assert set(result.versions) == {0, 1}
        late = await engine.generate(prompt(4), GREEDY, request_id="late")
        assert set(late.versions) == {1}  # the first token comes from prefill, also at 1


async def test_weight_activation_is_reported_when_the_engine_is_idle(local_engine, demo_model_dir) -> None:
    async with local_engine() as engine:
        engine.stage_weights(new_weights(demo_model_dir, seed=0), version=4)
        assert await asyncio.wait_for(engine.wait_weights_activated(2), 10) == 4


async def test_cancelling_a_generate_aborts_its_request(local_engine) -> None:
    async with local_engine() as engine:
        sampling = SamplingParams(temperature=1.0, max_new_tokens=50)
        task = asyncio.create_task(engine.generate(prompt(4), sampling, request_id="c"))
        await wait_until(lambda: engine.stats().active == 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert engine.stats().active == 0
        result = await engine.generate(prompt(4), GREEDY, request_id="c")  # the id is free again
        assert result.finish_reason == "length"


async def test_stopping_fails_generates_in_flight_with_engine_stopped(local_engine) -> None:
    engine = local_engine(max_batch=1)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=50)
    running = asyncio.create_task(engine.generate(prompt(4), sampling, request_id="a"))
    queued = asyncio.create_task(engine.generate(prompt(4), sampling, request_id="b"))
    await wait_until(lambda: engine.decode_loop.num_waiting() == 1)
    await engine.stop()
    for task in (running, queued):
        with pytest.raises(EngineStoppedError):
            await task


async def test_local_engine_rejects_bad_requests_with_typed_errors(local_engine) -> None:
    async with local_engine() as engine:
        with pytest.raises(PromptTooLongError):
            await engine.generate([5] * engine.model.max_seq_len, GREEDY, request_id="long")
        with pytest.raises(InvalidRequestError):
            await engine.generate([engine.model.vocab_size], GREEDY, request_id="vocab")
        sampling = SamplingParams(temperature=1.0, max_new_tokens=30)
        task = asyncio.create_task(engine.generate(prompt(3), sampling, request_id="dup"))
        await wait_until(lambda: engine.stats().active == 1)
        with pytest.raises(DuplicateRequestError):
            await engine.generate(prompt(3), GREEDY, request_id="dup")
        await asyncio.wait_for(task, 10)


async def test_weights_staged_from_another_thread_activate_without_traffic(local_engine, demo_model_dir) -> None:
    async with local_engine() as engine:
        assert await asyncio.to_thread(engine.stage_weights, new_weights(demo_model_dir, seed=2), 3)
        assert await asyncio.wait_for(engine.wait_weights_activated(3), 10) == 3
        result = await engine.generate(prompt(3), GREEDY, request_id="after")
        assert set(result.versions) == {3}
