"""The SGLang backend's fixes for what the real SGLang does and the first version did not expect.

Against ``FakeSGLang`` (tests/support/sglang_fake.py), which does what SGLang does on each point, with the
upstream source cited there: stop strings under ``--skip-tokenizer-init`` (a 400, sglang#27882),
a cache flush while paused requests wait (the scheduler's ``assert flush_cache_success`` kills it),
routed-expert rows ``num_hidden_layers`` wide with dense layers in them, and the stop edge's one
extra row. The same three regression cases run against a real SGLang in
tests/test_engine_sglang_gpu.py (scripts/gpu/check_sglang.sh).
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
import pytest_asyncio

from rollmesh.engine.errors import InvalidRequestError
from rollmesh.engine.models.hf_config import parse_hf_config
from rollmesh.engine.protocols import GenerateOptions
from rollmesh.engine.sglang_backend import SGLangEngine
from rollmesh.engine.sglang_client import SGLangClient, SGLangHTTPError, SGLangUnavailableError
from rollmesh.engine.sglang_routes import RoutedExpertsShape, decode_routed_experts
from rollmesh.messages.base import SamplingParams
from support.sglang_fake import EOS, SHAPE, FakeSGLang, encode_rows, expert

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

PROMPT = [1, 5, 6, 7, 8, 9]
# A toy tokenizer for stop strings: token 100 + i is the letter chr(ord("a") + i), "</t>" is 50.
VOCAB = {50: "</t>", **{100 + i: chr(ord("a") + i) for i in range(26)}}


def decode(ids: list[int]) -> str:
    return "".join(VOCAB.get(t, "?") for t in ids)


def encode(text: str) -> list[int]:
    inverse = {v: k for k, v in VOCAB.items()}
    return [inverse[text]] if text in inverse else [inverse[c] for c in text]


@pytest_asyncio.fixture
async def servers() -> Any:
    started: list[FakeSGLang] = []

    async def start(**kwargs: Any) -> FakeSGLang:
        server = FakeSGLang(**kwargs)
        await server.start()
        started.append(server)
        return server

    yield start
    for server in started:
        await server.stop()


# -- stop strings and --skip-tokenizer-init -------------------------------------------------


async def test_a_stop_string_sent_to_a_server_without_tokenizer_is_refused_as_sglang_does(servers):
    """The regression: the agent loop's stop strings against --skip-tokenizer-init."""
    fake = await servers(skip_tokenizer_init=True)
    async with SGLangEngine([fake.url]) as naive:
        with pytest.raises(InvalidRequestError, match="unavailable when skip_tokenizer_init=True"):
            await naive.generate(PROMPT, SamplingParams(stop=["</t>"]), request_id="s-1")


async def test_under_skip_tokenizer_init_stop_strings_go_as_token_ids_and_finish_as_stop(servers):
    fake = await servers(skip_tokenizer_init=True, responder=lambda prompt: [100, 101, 50, 102, EOS])
    async with SGLangEngine([fake.url], skip_tokenizer_init=True, encode=encode,
                            end_of_turn_ids=[EOS]) as engine:
        result = await engine.generate(PROMPT, SamplingParams(stop=["</t>"]), request_id="s-2")
    [body] = fake.bodies("/generate")
    assert "stop" not in body["sampling_params"]
    assert body["sampling_params"]["stop_token_ids"] == [EOS, 50]
    assert (result.token_ids, result.finish_reason) == ([100, 101, 50], "stop")


async def test_under_skip_tokenizer_init_a_stop_string_of_several_tokens_is_refused_before_sglang(servers):
    fake = await servers(skip_tokenizer_init=True)
    async with SGLangEngine([fake.url], skip_tokenizer_init=True, encode=encode) as engine:
        with pytest.raises(InvalidRequestError, match="is 2 tokens") as info:
            await engine.generate(PROMPT, SamplingParams(stop=["ab"]), request_id="s-3")
    assert info.value.field == "sampling.stop" and fake.bodies("/generate") == []


async def test_with_a_tokenizer_stop_strings_match_text_and_end_of_turn_ids_stop_a_turn(servers):
    fake = await servers(decode=decode, responder=lambda prompt: [100, 101, 102, 103, EOS])
    async with SGLangEngine([fake.url], end_of_turn_ids=[EOS, 7]) as engine:
        stopped = await engine.generate(PROMPT, SamplingParams(stop=["bc"]), request_id="s-4")
        ended = await engine.generate(PROMPT, SamplingParams(), request_id="s-5")
    first, _ = fake.bodies("/generate")
    assert first["sampling_params"]["stop"] == ["bc"]
    assert first["sampling_params"]["stop_token_ids"] == [EOS, 7]  # as the local engine stops
    assert (stopped.token_ids, stopped.finish_reason) == ([100, 101, 102], "stop")
    assert (ended.token_ids, ended.finish_reason) == ([100, 101, 102, 103, EOS], "eos")


# -- pause, flush and weight updates under load ---------------------------------------------


async def _held_requests(engine: SGLangEngine, fake: FakeSGLang, count: int) -> list[asyncio.Task]:
    fake.hold = True
    tasks = [asyncio.create_task(engine.generate(PROMPT, SamplingParams(max_new_tokens=8), request_id=f"h-{i}"))
             for i in range(count)]
    while fake.pending < count:
        await asyncio.sleep(0.01)  # polls the fake's count; the requests arriving are the signal
    return tasks


async def test_retract_then_update_with_flush_kills_sglang_as_upstream_does(servers, tmp_path):
    """What the first version did by default (pause("retract"), then flush_cache=True): the fake
    server dies as SGLang's scheduler does, and the client sees it unavailable."""
    fake = await servers()
    async with SGLangEngine([fake.url], generate_timeout_s=30) as engine:
        tasks = await _held_requests(engine, fake, 2)
        await engine.pause("retract")
        raw = SGLangClient(fake.url, engine._http)
        with pytest.raises(SGLangUnavailableError):
            await raw.update_weights_from_disk(str(tmp_path), 1, flush_cache=True)
        assert fake.crashed
        with pytest.raises(SGLangUnavailableError):
            await raw.weight_version()
        for task in tasks:
            task.cancel()


async def test_default_pause_and_update_keep_sglang_alive_and_held_requests_finish_on_new_weights(
        servers, tmp_path):
    fake = await servers()
    async with SGLangEngine([fake.url], generate_timeout_s=30) as engine:
        tasks = await _held_requests(engine, fake, 3)
        await engine.pause()
        fake.release()  # they run on, but stay paused (waiting, in SGLang) until continue
        await engine.update_weights_from_disk(str(tmp_path), 4)
        await engine.resume()
        results = await asyncio.gather(*tasks)
    assert not fake.crashed
    assert [p for p, _ in fake.requests if p != "/generate"] == [
        "/pause_generation", "/update_weights_from_disk", "/continue_generation"]
    assert fake.bodies("/pause_generation") == [{"mode": "in_place"}]
    assert fake.bodies("/update_weights_from_disk")[0]["flush_cache"] is False
    assert all(set(r.versions) == {4} and r.finish_reason == "eos" for r in results)


async def test_a_flush_asked_while_paused_requests_wait_is_refused_here(servers, tmp_path):
    fake = await servers()
    async with SGLangEngine([fake.url], generate_timeout_s=30) as engine:
        tasks = await _held_requests(engine, fake, 1)
        await engine.pause("in_place")
        with pytest.raises(InvalidRequestError, match="flush_cache_success") as info:
            await engine.update_weights_from_disk(str(tmp_path), 2, flush_cache=True)
        assert info.value.field == "flush_cache"
        assert fake.bodies("/update_weights_from_disk") == []
        # SGLang's own /flush_cache refuses (400) rather than dying.
        with pytest.raises(SGLangHTTPError) as refused:
            await engine.flush_cache()
        assert refused.value.status == 400
        fake.release()
        await engine.resume()
        await asyncio.gather(*tasks)
        await engine.flush_cache()  # idle now: flushed


# -- routed experts: sparse layers and the stop edge ----------------------------------------


def test_the_shape_of_a_model_with_dense_layers_names_its_sparse_layers():
    config = parse_hf_config({
        "model_type": "qwen3_moe", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
        "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
        "max_position_embeddings": 64, "num_experts": 8, "num_experts_per_tok": 2,
        "moe_intermediate_size": 8, "mlp_only_layers": [1], "decoder_sparse_step": 1,
    })
    shape = RoutedExpertsShape.of_model(config)
    assert shape == RoutedExpertsShape(num_layers=3, top_k=2, num_experts=8, sparse_layers=(0, 2, 3),
                                       num_hidden_layers=4)
    assert shape.wire_layers == 4


def _wire_rows(positions: range, shape: RoutedExpertsShape = SHAPE) -> np.ndarray:
    sparse = set(shape.sparse_layers)
    return np.array([[[expert(p, layer, k) if layer in sparse else 0 for k in range(shape.top_k)]
                      for layer in range(shape.wire_layers)] for p in positions])


def _sparse_rows(positions: range, shape: RoutedExpertsShape = SHAPE) -> list:
    return [[[expert(p, layer, k) for k in range(shape.top_k)] for layer in shape.sparse_layers]
            for p in positions]


@pytest.mark.parametrize(("sent", "start", "ignored"), [
    (range(0, 7), 0, False),  # as asked: positions [0, seqlen - 1)
    (range(0, 8), 0, False),  # the stop edge: one row more
    (range(3, 7), 3, False),
    (range(3, 8), 3, False),  # the stop edge after a start
    (range(0, 7), 3, True),   # the start ignored
    (range(0, 8), 3, True),   # the start ignored, and the stop edge
])
def test_full_width_rows_are_cut_to_the_sparse_layers_and_the_stop_edge_row_is_dropped(sent, start, ignored):
    rows, start_ignored = decode_routed_experts(encode_rows(_wire_rows(sent)), SHAPE, seqlen=8, start_len=start)
    assert rows.tolist() == _sparse_rows(range(start, 7))
    assert start_ignored is ignored


def test_rows_a_build_sends_only_for_the_sparse_layers_are_read_as_they_are():
    sparse_only = np.array(_sparse_rows(range(2, 8)))  # the stop edge too
    rows, _ = decode_routed_experts(encode_rows(sparse_only), SHAPE, seqlen=8, start_len=2)
    assert rows.tolist() == _sparse_rows(range(2, 7))


async def test_a_stopped_request_with_the_stop_edge_row_decodes_through_the_engine(servers):
    fake = await servers(stop_edge=True)
    async with SGLangEngine([fake.url], routed_experts_shape=SHAPE) as engine:
        result = await engine.generate(PROMPT, SamplingParams(max_new_tokens=16), request_id="r-edge",
                                       options=GenerateOptions(return_routed_experts=True,
                                                               routed_experts_start_len=2))
    end = len(PROMPT) + len(result.token_ids) - 1
    assert result.finish_reason == "eos"
    assert result.routed_experts.tolist() == _sparse_rows(range(2, end))


async def test_behind_a_pd_router_requests_go_to_the_router_and_versions_and_pauses_to_its_servers(servers, tmp_path):
    # A real router answers with the label of the server that decoded: here all three say 3.
    router, prefill, decode = [await servers(label="3") for _ in range(3)]
    async with SGLangEngine([router.url], admin_urls=[prefill.url, decode.url]) as engine:
        result = await engine.generate(PROMPT, SamplingParams(), request_id="pd-1",
                                       options=GenerateOptions(min_version=3))
        await engine.swap_weights_from_disk(str(tmp_path), 4)
        assert await engine.current_version() == 4
    assert result.token_ids and len(router.bodies("/generate")) == 1
    assert router.bodies("/update_weights_from_disk") == [] and router.bodies("/pause_generation") == []
    for server in (prefill, decode):
        assert server.bodies("/generate") == []
        assert [p for p, _ in server.requests] == ["/pause_generation", "/update_weights_from_disk",
                                                   "/continue_generation"]
