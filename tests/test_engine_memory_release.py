"""The local engine lends its memory: weights and parked KV to host memory and back, requests
refused (typed, retryable) meanwhile, accepted ones drained first, weight updates kept for the
resume. On the demo model directory, CPU (the weights' move is a no-op there; the KV pool is
really copied out and freed); the CUDA check is marked gpu."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from support.engine_models import babbling_model, model_tokenizer, prefer_tokens
from rollmesh.config import InferenceConfig, ModelConfig
from rollmesh.engine.errors import MemoryReleasedError, StaleWeightsError, WeightsMismatchError
from rollmesh.engine.local_engine import LocalEngine
from rollmesh.engine.prefill import PrefillEngine
from rollmesh.engine.protocols import GenerateOptions
from rollmesh.messages.base import SamplingParams

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8)


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make_engine(model_dir: Path, device: str = "cpu") -> LocalEngine:
    tokenizer = model_tokenizer(model_dir)
    model = prefer_tokens(babbling_model(model_dir), sorted(tokenizer.end_of_turn_ids), by=-100.0).to(device)
    return LocalEngine(ModelConfig(path=str(model_dir)), InferenceConfig(max_batch=4), model=model,
                       tokenizer=tokenizer)


async def test_released_engine_refuses_requests_and_resumes_with_its_sessions_kv(demo_model_dir) -> None:
    async with make_engine(demo_model_dir) as engine:
        session = GenerateOptions(session_id="s")
        first = await engine.generate(list(range(5, 25)), GREEDY, request_id="a", options=session)
        before = await engine.generate(list(range(40, 50)), GREEDY, request_id="b")
        pool = engine.decode_engine.pool

        released = await engine.release_memory()
        assert engine.memory_released and pool.kv.numel() == 0  # the pool is freed, not kept
        assert released.bytes_moved > 0  # the session's parked blocks went to the host
        with pytest.raises(MemoryReleasedError) as refused:
            await engine.generate([1, 2, 3], GREEDY, request_id="refused")
        assert refused.value.retryable and refused.value.request_id == "refused"

        resumed = await engine.resume_memory()
        assert not engine.memory_released and resumed.bytes_moved == released.bytes_moved
        hits = engine.stats().session_hits
        turn = list(range(5, 25)) + first.token_ids + [7, 8]
        second = await engine.generate(turn, GREEDY, request_id="c", options=session)
        assert engine.stats().session_hits == hits + 1  # its prefix KV came back with the pool
        again = await engine.generate(list(range(40, 50)), GREEDY, request_id="d")
        assert again.token_ids == before.token_ids
        assert len(second.token_ids) == GREEDY.max_new_tokens


async def test_release_lets_accepted_requests_finish_and_refuses_new_ones(demo_model_dir) -> None:
    async with make_engine(demo_model_dir) as engine:
        long = SamplingParams(temperature=1.0, max_new_tokens=30)
        running = asyncio.create_task(engine.generate([3, 4, 5], long, request_id="running"))
        while engine.stats().tokens_generated < 2:
            await asyncio.sleep(0)
        release = asyncio.create_task(engine.release_memory())
        await asyncio.sleep(0)
        with pytest.raises(MemoryReleasedError):
            await engine.generate([1, 2], GREEDY, request_id="late")
        finished = await asyncio.wait_for(running, 30)
        assert finished.finish_reason == "length" and len(finished.token_ids) == 30
        await asyncio.wait_for(release, 30)
        assert engine.memory_released
        await engine.resume_memory()


async def test_weights_published_while_released_activate_after_the_resume(demo_model_dir) -> None:
    async with make_engine(demo_model_dir) as engine:
        await engine.release_memory()
        weights = babbling_model(demo_model_dir, seed=3).state_dict()
        assert engine.stage_weights(weights, version=2)
        assert not engine.stage_weights(weights, version=1)  # older than what waits: dropped
        assert engine.current_version == 0
        with pytest.raises(WeightsMismatchError):
            engine.stage_weights({"nope": torch.zeros(1)}, version=5)
        await engine.resume_memory()
        assert await asyncio.wait_for(engine.wait_weights_activated(2), 10) == 2
        result = await engine.generate([5, 6, 7], GREEDY, request_id="new")
        assert set(result.versions) == {2}
        await engine.release_memory()
        with pytest.raises(StaleWeightsError):
            engine.stage_weights(weights, version=1)
        await engine.resume_memory()


def test_prefill_engine_releases_and_resumes(demo_model_dir) -> None:
    engine = PrefillEngine(babbling_model(demo_model_dir), block_size=16)
    before = engine.prefill(list(range(3, 20)))
    engine.release_memory()
    with pytest.raises(MemoryReleasedError):
        engine.prefill([1, 2, 3], request_id="r")
    engine.resume_memory()
    after = engine.prefill(list(range(3, 20)))
    assert torch.equal(before.last_logits, after.last_logits)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: device memory is given back only there")
async def test_released_engine_gives_its_device_memory_back_on_cuda(demo_model_dir) -> None:
    async with make_engine(demo_model_dir, device="cuda") as engine:
        before = await engine.generate([5, 6, 7], GREEDY, request_id="a")
        resident = torch.cuda.memory_allocated()
        await engine.release_memory()
        assert torch.cuda.memory_allocated() < resident / 4
        await engine.resume_memory()
        after = await engine.generate([5, 6, 7], GREEDY, request_id="b")
        assert after.token_ids == before.token_ids
