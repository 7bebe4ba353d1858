"""The paged KV engine on the Hugging Face families: exactness against the full forward, routed
experts (aggregated and spliced from a prefill worker), session prefix reuse and eviction,
KV-capacity waiting, minimum versions, and weight swaps that keep parameters and ties."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch

from rollmesh.chat.model_dir import ModelDirectory
from rollmesh.config import InferenceConfig, ModelConfig
from rollmesh.engine.batch_loop import DecodeLoop
from rollmesh.engine.decode import DecodeEngine
from rollmesh.engine.errors import InvalidRequestError, KvCapacityError, VersionUnavailableError
from rollmesh.engine.kv_pages import KvBlockPool, KvLayout, OutOfBlocksError, PagedAttention
from rollmesh.engine.local_engine import LocalEngine
from rollmesh.engine.models import load_hf_model
from rollmesh.engine.prefill import PrefillEngine
from rollmesh.engine.protocols import GenerateOptions, GenerationResult
from rollmesh.messages.base import SamplingParams
from test_engine_hf_models import CASES, _hf_model, _save

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12)
FAMILIES = ["llama-untied", "qwen2-tied", "qwen3_moe-raw-topk-mixed-layers", "mixtral-sliding-window"]


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("paged-models")
    paths = {}
    for case in FAMILIES:
        kind, overrides = CASES[case]
        paths[case] = _save(_hf_model(kind, **overrides), root / case)
    return paths


def prompt(length: int, offset: int = 0) -> list[int]:
    return [(offset + 13 * i) % 300 for i in range(length)]


def run_to_completion(engine: DecodeEngine) -> dict[str, GenerationResult]:
    done: dict[str, GenerationResult] = {}
    while engine.has_work():
        done.update((s.request_id, s) for s in engine.step())
    return done


@torch.no_grad()
def greedy_reference(model, ids: list[int], n: int, end_ids: frozenset[int] | None = None) -> list[int]:
    """Greedy tokens by recomputing the whole sequence each step, ending at an end-of-turn id
    (default: the model config's eos, as an engine given no tokenizer stops)."""
    end_ids = frozenset({model.eos_token_id}) if end_ids is None else end_ids
    ids = list(ids)
    out = []
    for _ in range(n):
        token = int(model(torch.tensor([ids]))[0, -1].argmax())
        out.append(token)
        ids.append(token)
        if token in end_ids:
            break
    return out


# -- the pool ---------------------------------------------------------------------------------


def test_pool_hands_out_and_takes_back_blocks_and_maps_positions_to_slots() -> None:
    pool = KvBlockPool(KvLayout(num_layers=1, num_kv_heads=1, head_dim=2), num_blocks=4, block_size=3)
    first = pool.allocate(2)
    second = pool.allocate(2)
    assert sorted(first + second) == [0, 1, 2, 3] and pool.num_free() == 0
    with pytest.raises(OutOfBlocksError):
        pool.allocate(1)
    # Position p lives in block p // 3 of the page table, at offset p % 3.
    assert pool.slots([3, 1], 0, 5).tolist() == [9, 10, 11, 3, 4]
    pool.free(first)
    assert pool.num_free() == 2 and pool.blocks_for(7) == 3


def test_pages_copied_out_and_in_land_in_the_new_blocks() -> None:
    layout = KvLayout(num_layers=2, num_kv_heads=2, head_dim=4)
    source = KvBlockPool(layout, num_blocks=3, block_size=4)
    source.kv.normal_()
    pages = source.read_pages([2, 0])
    target = KvBlockPool(layout, num_blocks=5, block_size=4)
    target.write_pages([4, 1], pages)
    torch.testing.assert_close(target.kv[:, :, target.slots([4, 1], 0, 8)],
                               source.kv[:, :, source.slots([2, 0], 0, 8)])


@pytest.mark.parametrize("case", FAMILIES)
def test_paged_forward_in_chunks_matches_the_full_forward(case: str, checkpoints) -> None:
    model = load_hf_model(checkpoints[case])
    ids = prompt(21, 5)
    full = model(torch.tensor([ids]))[0]
    pool = KvBlockPool(model.kv_layout(), num_blocks=8, block_size=4)
    blocks = pool.allocate(6)
    pieces = []
    # A prompt in three chunks (as a session's turns arrive), then one token at a time.
    for start, stop in ((0, 9), (9, 16), (16, 19), (19, 20), (20, 21)):
        paged = PagedAttention(pool, [blocks], [start], stop - start,
                               sliding_window=model.sliding_window)
        with torch.no_grad():
            logits, _ = model.forward_paged(torch.tensor([ids[start:stop]]), paged)
        pieces.append(logits[0])
    torch.testing.assert_close(torch.cat(pieces), full, atol=1e-4, rtol=0)


# -- the engine on HF families ----------------------------------------------------------------


@pytest.mark.parametrize("case", FAMILIES)
def test_batched_greedy_decode_matches_full_forward_and_routes_match(case: str, checkpoints) -> None:
    model = load_hf_model(checkpoints[case])
    moe = model.routing_shape is not None
    engine = DecodeEngine(model, max_batch=4, block_size=4)
    prompts = {f"r{i}": prompt(3 + 5 * i, i) for i in range(4)}
    options = GenerateOptions(return_routed_experts=moe, routed_experts_start_len=2)
    for request_id, ids in prompts.items():
        engine.add_prompt(request_id, ids, GREEDY, options)
    done = run_to_completion(engine)
    for request_id, ids in prompts.items():
        result = done[request_id]
        assert result.token_ids == greedy_reference(model, ids, GREEDY.max_new_tokens), request_id
        if not moe:
            assert result.routed_experts is None
            continue
        _, routes = model.forward_with_routes(torch.tensor([ids + result.token_ids]))
        seqlen = len(ids) + len(result.token_ids)
        # SGLang's slice: rows [start_len, seqlen - 1), the last token never being forwarded.
        assert result.routed_experts.shape == (seqlen - 1 - 2, *model.routing_shape)
        assert result.routed_experts.dtype == np.uint8
        np.testing.assert_array_equal(result.routed_experts, routes[0, 2:seqlen - 1].numpy())


def test_prefill_worker_pages_and_prompt_routes_splice_with_decode_routes(checkpoints) -> None:
    model = load_hf_model(checkpoints["qwen3_moe-raw-topk-mixed-layers"])
    prefill = PrefillEngine(model, block_size=4).prefill(prompt(10))
    assert prefill.routes is not None and prefill.routes.shape[0] == 10
    engine = DecodeEngine(model, max_batch=2, block_size=4)
    engine.add_prefilled("pd", prefill, GREEDY, GenerateOptions(return_routed_experts=True))
    result = run_to_completion(engine)["pd"]
    assert result.token_ids == greedy_reference(model, prompt(10), GREEDY.max_new_tokens)
    _, routes = model.forward_with_routes(torch.tensor([prompt(10) + result.token_ids]))
    # Prompt rows come from the prefill worker, the rest from decode: no zero rows (the SGLang
    # PD regression #23885) and no duplicate experts within a row.
    np.testing.assert_array_equal(result.routed_experts, routes[0, :-1].numpy())
    assert all(len(set(row)) == len(row) for row in result.routed_experts.reshape(-1, 2).tolist())


def test_a_sessions_next_turn_reuses_its_kv_and_answers_as_without_reuse(checkpoints) -> None:
    model = load_hf_model(checkpoints["qwen3_moe-raw-topk-mixed-layers"])
    engine = DecodeEngine(model, max_batch=2, block_size=4)
    session = GenerateOptions(session_id="agent-1", return_routed_experts=True)
    engine.add_prompt("t1", prompt(9), GREEDY, session)
    first = run_to_completion(engine)["t1"]
    assert first.cached_tokens == 0 and engine.stats().sessions_parked == 1
    turn_two = prompt(9) + first.token_ids + [7, 8, 9]  # the tool's output appended
    start = len(prompt(9)) + len(first.token_ids) - 1
    engine.add_prompt("t2", turn_two, GREEDY, GenerateOptions(
        session_id="agent-1", return_routed_experts=True, routed_experts_start_len=start))
    second = run_to_completion(engine)["t2"]
    # Everything but the first turn's last token (never forwarded) was already in the pool.
    assert second.cached_tokens == start
    assert second.token_ids == greedy_reference(model, turn_two, GREEDY.max_new_tokens)
    _, routes = model.forward_with_routes(torch.tensor([turn_two + second.token_ids]))
    np.testing.assert_array_equal(second.routed_experts, routes[0, start:-1].numpy())
    stats = engine.stats()
    assert (stats.session_hits, stats.prefix_tokens_reused) == (1, start)


def test_a_turn_that_diverges_from_the_cached_history_reuses_only_the_common_prefix(checkpoints) -> None:
    model = load_hf_model(checkpoints["llama-untied"])
    engine = DecodeEngine(model, max_batch=1, block_size=4)
    engine.add_prompt("t1", prompt(10), GREEDY, GenerateOptions(session_id="s"))
    run_to_completion(engine)
    edited = prompt(6) + [1, 2, 3, 4, 5]  # the client rewrote history after token 6
    engine.add_prompt("t2", edited, GREEDY, GenerateOptions(session_id="s"))
    result = run_to_completion(engine)["t2"]
    assert result.cached_tokens == 6
    assert result.token_ids == greedy_reference(model, edited, GREEDY.max_new_tokens)


def test_parked_sessions_are_evicted_oldest_first_when_a_request_needs_their_blocks(checkpoints) -> None:
    model = load_hf_model(checkpoints["llama-untied"])
    # 8 blocks of 4 tokens; each request reserves 3 (8 prompt + 4 new tokens).
    engine = DecodeEngine(model, max_batch=4, block_size=4, num_blocks=8)
    budget = SamplingParams(temperature=0.0, max_new_tokens=4)
    for index in range(2):
        engine.add_prompt(f"s{index}", prompt(8, index), budget, GenerateOptions(session_id=f"s{index}"))
        run_to_completion(engine)
    assert engine.stats().sessions_parked == 2 and engine.pool.num_free() == 8 - 2 * 3
    assert engine.can_admit(8, budget)  # room needs one session's blocks: the oldest goes
    engine.add_prompt("new", prompt(8, 9), budget)
    assert "s0" not in engine.sessions and "s1" in engine.sessions
    assert engine.stats().session_evictions == 1
    run_to_completion(engine)
    # s0's next turn still answers correctly, computing everything again.
    again = prompt(8, 0) + [1, 2]
    engine.add_prompt("s0-again", again, budget, GenerateOptions(session_id="s0"))
    result = run_to_completion(engine)["s0-again"]
    assert result.cached_tokens == 0
    assert result.token_ids == greedy_reference(model, again, 4)


def test_requests_wait_for_kv_blocks_and_one_that_can_never_fit_is_refused(checkpoints) -> None:
    model = load_hf_model(checkpoints["llama-untied"])
    engine = DecodeEngine(model, max_batch=8, block_size=4, num_blocks=6)
    sampling = SamplingParams(temperature=0.0, max_new_tokens=8)  # 8 + 8 tokens: 4 blocks each
    with pytest.raises(KvCapacityError) as refused:
        engine.validate_request("huge", 8, SamplingParams(max_new_tokens=40))
    assert refused.value.blocks_needed == 12 and refused.value.blocks_total == 6

    async def both() -> list[GenerationResult]:
        loop = DecodeLoop(engine)
        loop.start()
        try:
            first = asyncio.create_task(loop.submit("a", prompt(8), sampling))
            await asyncio.sleep(0)
            second = asyncio.create_task(loop.submit("b", prompt(8, 1), sampling))
            await asyncio.sleep(0)
            assert loop.num_waiting() == 1  # two need 8 blocks; the pool has 6
            return await asyncio.gather(first, second)
        finally:
            await loop.stop()

    first, second = asyncio.run(both())
    assert second.token_ids == greedy_reference(model, prompt(8, 1), 8)
    assert engine.pool.num_free() == 6


def test_min_version_not_reached_is_a_retryable_error_and_bad_options_are_refused(checkpoints) -> None:
    model = load_hf_model(checkpoints["llama-untied"])
    engine = DecodeEngine(model, max_batch=2, version=3)
    with pytest.raises(VersionUnavailableError) as caught:
        engine.add_prompt("r", prompt(4), GREEDY, GenerateOptions(min_version=4))
    assert (caught.value.min_version, caught.value.current_version) == (4, 3)
    assert caught.value.retryable and engine.num_active() == 0
    engine.add_prompt("ok", prompt(4), GREEDY, GenerateOptions(min_version=3))
    with pytest.raises(InvalidRequestError) as dense:
        engine.add_prompt("d", prompt(4), GREEDY, GenerateOptions(return_routed_experts=True))
    assert dense.value.field == "return_routed_experts"
    with pytest.raises(InvalidRequestError) as start:
        engine.add_prompt("s", prompt(4), GREEDY, GenerateOptions(routed_experts_start_len=5))
    assert start.value.field == "routed_experts_start_len"


def test_weight_swap_replaces_storage_but_keeps_parameters_and_ties(checkpoints) -> None:
    model = load_hf_model(checkpoints["qwen2-tied"])
    parameters = dict(model.named_parameters())
    new = {name: tensor + 1.0 for name, tensor in model.state_dict().items()}
    engine = DecodeEngine(model, max_batch=1)
    assert engine.stage_weights(new, 1)
    engine.step()
    assert engine.current_version == 1
    assert all(p is parameters[name] for name, p in model.named_parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    torch.testing.assert_close(model.model.norm.weight, new["model.norm.weight"])


def test_local_engine_serves_the_model_directory_of_its_config(demo_model_dir) -> None:
    config = ModelConfig(path=str(demo_model_dir))
    tokenizer = ModelDirectory.load(demo_model_dir)
    ids = tokenizer.encode("<|im_start|>user\nmolar mass of H2O?<|im_end|>\n<|im_start|>assistant\n")

    async def go():
        async with LocalEngine(config, InferenceConfig(max_batch=2)) as engine:
            return engine, await engine.generate(ids, GREEDY, request_id="x")

    engine, result = asyncio.run(go())
    # The model and its tokenizer both come from model.path: the directory's end-of-turn ids.
    assert engine.decode_engine.end_of_turn_ids == tokenizer.end_of_turn_ids
    assert result.token_ids == greedy_reference(load_hf_model(demo_model_dir), ids, GREEDY.max_new_tokens,
                                                tokenizer.end_of_turn_ids)


def test_an_engine_given_no_tokenizer_stops_at_the_configs_eos_only(checkpoints) -> None:
    model = load_hf_model(checkpoints["llama-untied"])
    assert model.eos_token_id == 2  # transformers' LlamaConfig default
    prefill = PrefillEngine(model).prefill(prompt(4))
    engine = DecodeEngine(model, max_batch=2)
    for request_id, token in (("own-eos", 2), ("other", 257)):
        logits = torch.full_like(prefill.last_logits, -100.0)
        logits[token] = 100.0
        engine.add_prefilled(request_id, type(prefill)(prefill.input_ids, prefill.pages, logits, 0),
                             SamplingParams(temperature=0.0, max_new_tokens=3))
    done = run_to_completion(engine)
    assert done["own-eos"].finish_reason == "eos" and done["own-eos"].token_ids == [2]
    assert done["other"].token_ids[0] == 257 and done["other"].finish_reason != "eos"
