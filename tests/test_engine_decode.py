"""Prefill + continuous-batching decode on the demo model directory: exactness against the full
forward, batching, weight swaps that keep requests, stop conditions (any of the model's
end-of-turn ids, stop strings in its tokenizer's text), ids past the tokenizer never sampled,
aborts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from support.chat_models import build_model_dir
from support.engine_models import EngineModels, model_tokenizer, prefer_tokens
from rollmesh.engine.decode import DecodeEngine
from rollmesh.engine.errors import StaleWeightsError, WeightsMismatchError
from rollmesh.engine.kv_pages import KvBlockPool, PagedAttention
from rollmesh.engine.models import CausalLM, load_hf_model
from rollmesh.engine.prefill import PrefillEngine, PrefillResult, run_prefill
from rollmesh.engine.protocols import GenerateOptions, GenerationResult
from rollmesh.messages.base import SamplingParams

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Tiny tensors on a shared 2-core machine: a second torch thread only spins."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def demo(demo_model_dir: Path) -> EngineModels:
    return EngineModels(demo_model_dir)


GREEDY = SamplingParams(temperature=0.0, max_new_tokens=16)


def prompt(length: int, offset: int = 0) -> list[int]:
    return [(offset + 7 * i) % 256 for i in range(length)]


@torch.no_grad()
def greedy_by_full_forward(
    model: CausalLM, ids: list[int], n: int, end_ids: frozenset[int]
) -> tuple[list[int], list[float]]:
    ids, tokens, logprobs = list(ids), [], []
    for _ in range(n):
        logits = model(torch.tensor([ids]))[0, -1]
        token = int(logits.argmax())
        tokens.append(token)
        logprobs.append(float(torch.log_softmax(logits, dim=-1)[token]))
        ids.append(token)
        if token in end_ids:
            break
    return tokens, logprobs


def run_to_completion(engine: DecodeEngine) -> dict[str, GenerationResult]:
    done: dict[str, GenerationResult] = {}
    while engine.has_work():
        done.update((s.request_id, s) for s in engine.step())
    return done


def run_alone(demo: EngineModels, model: CausalLM, ids: list[int], sampling: SamplingParams) -> GenerationResult:
    engine = demo.engine(model, max_batch=1)
    engine.add_prefilled("alone", PrefillEngine(model).prefill(ids), sampling)
    return run_to_completion(engine)["alone"]


def test_greedy_decode_matches_full_forward_recomputed_each_step(demo) -> None:
    model = demo.model()
    ids = prompt(5)
    result = run_alone(demo, model, ids, GREEDY)
    end_ids = demo.tokenizer.end_of_turn_ids
    tokens, logprobs = greedy_by_full_forward(model, ids, GREEDY.max_new_tokens, end_ids)
    assert len(set(tokens)) > 4  # a model that babbles, so the comparison means something
    assert result.token_ids == tokens
    assert result.logprobs == pytest.approx(logprobs, abs=1e-4)
    assert result.finish_reason == ("eos" if tokens[-1] in end_ids else "length")
    assert result.versions == [0] * len(tokens)
    assert result.prompt_len == 5


def test_generation_stops_at_the_context_limit_with_finish_reason_length(demo) -> None:
    model = demo.model()
    ids = prompt(model.max_seq_len - 4)  # four generated tokens fit
    result = run_alone(demo, model, ids, SamplingParams(temperature=0.0, max_new_tokens=100))
    assert result.finish_reason == "length"
    assert len(result.token_ids) == 4
    assert result.token_ids == greedy_by_full_forward(model, ids, 4, demo.tokenizer.end_of_turn_ids)[0]


def test_requests_joining_at_different_steps_match_their_single_runs(demo) -> None:
    model = demo.model()
    prefill = PrefillEngine(model)
    engine = demo.engine(model, max_batch=4)
    # (step at which it arrives, prompt length, max_new_tokens)
    plan = {"a": (0, 3, 12), "b": (0, 17, 4), "c": (2, 9, 20), "d": (5, 30, 7), "e": (6, 1, 9)}
    done: dict[str, GenerationResult] = {}
    step = 0
    while step < 7 or engine.has_work():
        for request_id, (arrival, length, max_new) in plan.items():
            if arrival == step:
                sampling = SamplingParams(temperature=0.0, max_new_tokens=max_new)
                ids = prompt(length, ord(request_id))
                engine.add_prefilled(request_id, prefill.prefill(ids), sampling)
        done.update((s.request_id, s) for s in engine.step())
        step += 1
    assert set(done) == set(plan)
    for request_id, (_, length, max_new) in plan.items():
        sampling = SamplingParams(temperature=0.0, max_new_tokens=max_new)
        alone = run_alone(demo, model, prompt(length, ord(request_id)), sampling)
        assert done[request_id].token_ids == alone.token_ids, request_id
        assert done[request_id].logprobs == pytest.approx(alone.logprobs, abs=1e-4)
        assert done[request_id].finish_reason == alone.finish_reason
    assert engine.num_active() == 0


def test_decode_keeps_requests_across_weight_swap_and_versions_both(demo) -> None:
    model = demo.model(seed=0)
    new_weights = demo.model(seed=1).state_dict()
    engine = demo.engine(model, max_batch=2)
    prefill = PrefillEngine(demo.model(seed=0))
    sampling = SamplingParams(temperature=0.0, max_new_tokens=20)
    engine.add_prefilled("long", prefill.prefill(prompt(6)), sampling)
    engine.add_prefilled("other", prefill.prefill(prompt(11, 3)), sampling)
    for _ in range(5):
        assert engine.step() == []
    assert engine.stage_weights(new_weights, version=1)
    assert engine.current_version == 0  # staging alone swaps nothing
    done = run_to_completion(engine)
    assert engine.current_version == 1 and engine.pop_activation() == 1
    for sequence in done.values():
        assert sequence.finish_reason == "length" and len(sequence.token_ids) == 20
        assert sequence.versions == [0] * 6 + [1] * 14  # first token + 5 steps at version 0
    # Reference, one sequence by hand: old KV and old tokens, new weights from the sixth decode
    # step on.
    reference = demo.model(seed=0)
    pool = KvBlockPool(reference.kv_layout(), num_blocks=4, block_size=16)
    blocks = pool.allocate(2)
    logits, _ = run_prefill(reference, pool, blocks, prompt(6), 0)
    tokens = [int(logits.argmax())]
    for i in range(19):
        if i == 5:
            reference.load_state_dict(new_weights)
        paged = PagedAttention(pool, [blocks], [6 + i], 1)
        with torch.no_grad():
            logits, _ = reference.forward_paged(torch.tensor([[tokens[-1]]]), paged)
        tokens.append(int(logits[0, 0].argmax()))
    assert done["long"].token_ids == tokens
    assert tokens != run_alone(demo, demo.model(seed=0), prompt(6), sampling).token_ids


def test_stage_weights_ignores_redelivery_and_rejects_stale_or_misfit_weights(demo) -> None:
    engine = demo.engine(demo.model(), max_batch=1)
    weights = demo.model(seed=1).state_dict()
    assert engine.stage_weights(weights, 2)
    assert not engine.stage_weights(weights, 2)  # redelivered
    assert not engine.stage_weights(weights, 1)  # superseded by the staged 2
    engine.step()
    assert engine.current_version == 2 and engine.pop_activation() == 2
    assert engine.pop_activation() is None
    with pytest.raises(StaleWeightsError):
        engine.stage_weights(weights, 1)
    with pytest.raises(WeightsMismatchError):
        engine.stage_weights({k: v for k, v in weights.items() if k != "model.norm.weight"}, 3)
    with pytest.raises(WeightsMismatchError):
        engine.stage_weights({**weights, "model.norm.weight": torch.ones(3)}, 3)
    assert engine.stats().staged_version is None


def test_stop_string_in_the_tokenizers_text_ends_generation_and_is_kept(demo) -> None:
    model = demo.model()
    tokenizer = demo.tokenizer
    free = run_alone(demo, model, prompt(4), SamplingParams(temperature=0.0, max_new_tokens=30))
    assert len(free.token_ids) > 11
    # A stop string made of the text of generated tokens 8-10, so it first appears there (or
    # earlier, if those characters occur before: the engine must stop at the first appearance).
    stop = tokenizer.decode(free.token_ids[8:11])
    end = next(n for n in range(1, 12) if stop in tokenizer.decode(free.token_ids[:n]))
    engine = demo.engine(model, max_batch=2)
    sampling = SamplingParams(temperature=0.0, max_new_tokens=30, stop=["zzzzzzzz", stop])
    engine.add_prefilled("s", PrefillEngine(model).prefill(prompt(4)), sampling)
    result = run_to_completion(engine)["s"]
    assert result.finish_reason == "stop"
    assert result.token_ids == free.token_ids[:end]


def test_a_stop_string_spanning_a_special_token_matches_in_the_text_with_specials_kept(demo) -> None:
    model = demo.model()
    tokenizer = demo.tokenizer
    [im_start] = tokenizer.encode("<|im_start|>")
    engine = demo.engine(prefer_tokens(model, [im_start], from_call=3), max_batch=1)
    sampling = SamplingParams(temperature=0.0, max_new_tokens=30, stop=["<|im_start|><|im_start|>"])
    engine.add_prompt("s", prompt(4), sampling)
    result = run_to_completion(engine)["s"]
    # The prefill and two decode steps choose freely; from the third step on <|im_start|> wins.
    assert result.token_ids[3:] == [im_start, im_start] and im_start not in result.token_ids[:3]
    assert result.finish_reason == "stop"


@pytest.mark.parametrize("end_token", ["<|im_end|>", "<|endoftext|>"])
def test_every_end_of_turn_id_of_the_model_ends_a_generation_with_eos(demo, end_token: str) -> None:
    [end_id] = demo.tokenizer.encode(end_token)
    assert end_id in demo.tokenizer.end_of_turn_ids and len(demo.tokenizer.end_of_turn_ids) == 2
    engine = demo.engine(prefer_tokens(demo.model(), [end_id], from_call=4), max_batch=1)
    engine.add_prompt("r", prompt(4), SamplingParams(temperature=0.0, max_new_tokens=30))
    result = run_to_completion(engine)["r"]
    assert result.finish_reason == "eos"
    assert result.token_ids[-1] == end_id and len(result.token_ids) == 5


@pytest.fixture(scope="module")
def llama3_dir(tmp_path_factory) -> Path:
    """A Llama 3 family directory (its tokenizer and template, a tiny random Llama)."""
    return build_model_dir("llama3", tmp_path_factory.mktemp("llama3") / "llama3", with_weights=True)


@pytest.mark.parametrize("end_token", ["<|eot_id|>", "<|eom_id|>"])
def test_a_llama3_turn_ends_at_eot_or_eom(llama3_dir: Path, end_token: str) -> None:
    directory = llama3_dir
    tokenizer = model_tokenizer(directory)
    [end_id] = tokenizer.encode(end_token)
    assert end_id in tokenizer.end_of_turn_ids
    model = prefer_tokens(load_hf_model(directory), [end_id], from_call=2)
    engine = DecodeEngine(model, max_batch=1, tokenizer=tokenizer)
    engine.add_prompt("r", tokenizer.encode("Hello there"), SamplingParams(temperature=0.0, max_new_tokens=30))
    result = run_to_completion(engine)["r"]
    assert (result.finish_reason, len(result.token_ids), result.token_ids[-1]) == ("eos", 3, end_id)


def test_ids_past_the_tokenizer_are_never_sampled(chat_model_dir_with_weights: Path) -> None:
    tokenizer = model_tokenizer(chat_model_dir_with_weights)
    model = load_hf_model(chat_model_dir_with_weights)
    real = tokenizer.vocab_size
    assert model.vocab_size > real  # Qwen-style padding: the embedding has rows past the tokenizer
    prefer_tokens(model, slice(real, None))  # a model that would rather say a padded id
    sampling = {"greedy": SamplingParams(temperature=0.0, max_new_tokens=6),
                "sampled": SamplingParams(temperature=1.0, max_new_tokens=6)}
    masked = DecodeEngine(model, max_batch=2, tokenizer=tokenizer)
    bare = DecodeEngine(model, max_batch=2)  # no tokenizer: every embedding row may come out
    ids = tokenizer.encode("Hello there")
    for engine in (masked, bare):
        for request_id, params in sampling.items():
            engine.add_prompt(request_id, ids, params)
    done, unmasked = run_to_completion(masked), run_to_completion(bare)
    assert all(token >= real for token in unmasked["greedy"].token_ids)  # the test can fail
    for request_id in sampling:
        assert done[request_id].token_ids and all(t < real for t in done[request_id].token_ids)
    # The greedy logprob is over the real tokens only: the padded rows had no mass.
    with torch.no_grad():
        logits = model(torch.tensor([ids]))[0, -1, :real]
    first = done["greedy"].token_ids[0]
    assert first == int(logits.argmax())
    assert done["greedy"].logprobs[0] == pytest.approx(float(torch.log_softmax(logits, -1)[first]), abs=1e-5)


def test_a_request_whose_first_token_ends_it_is_reported_by_the_next_step(demo) -> None:
    model = demo.model()
    engine = demo.engine(model, max_batch=1)
    [end_id] = demo.tokenizer.encode("<|im_end|>")
    good = PrefillEngine(model).prefill(prompt(3))
    logits = torch.zeros(model.vocab_size)
    logits[end_id] = 100.0
    engine.add_prefilled("eos", PrefillResult(good.input_ids, good.pages, logits, 7), GREEDY)
    assert engine.num_active() == 0 and engine.has_work()
    [finished] = engine.step()
    assert (finished.token_ids, finished.finish_reason, finished.versions) == ([end_id], "eos", [7])
    assert not engine.has_work()


def test_a_turn_whose_first_token_cannot_be_sampled_gives_back_its_blocks_and_its_sessions(demo) -> None:
    model = demo.model()
    context_blocks = -(-model.max_seq_len // 8)
    engine = demo.engine(model, max_batch=2, block_size=8, num_blocks=context_blocks)  # one context
    session = GenerateOptions(session_id="agent")
    engine.add_prompt("agent/1", prompt(20), GREEDY, session)
    first = run_to_completion(engine)["agent/1"]
    sample = engine.sampler.sample

    def nan_logits(*args, **kwargs):  # what torch.multinomial says of NaN probabilities
        raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")

    engine.sampler.sample = nan_logits
    with pytest.raises(RuntimeError, match="nan"):  # turn 2 takes the session's parked KV, then fails
        engine.add_prompt("agent/2", [*prompt(20), *first.token_ids, 5, 6], GREEDY, session)
    engine.sampler.sample = sample
    # Nothing of it stays: every block is free again, so a request needing the whole pool is
    # admitted (a leaked block would keep it waiting for room that never comes).
    assert engine.pool.num_free() == context_blocks and engine.num_active() == 0 and not engine.has_work()
    whole_context = SamplingParams(temperature=0.0, max_new_tokens=model.max_seq_len - 20)
    assert engine.can_admit(20, whole_context)
    engine.add_prompt("whole", prompt(20, offset=3), whole_context)
    assert run_to_completion(engine)["whole"].request_id == "whole"


def test_abort_frees_the_slot_and_the_others_continue_unchanged(demo) -> None:
    model = demo.model()
    prefill = PrefillEngine(model)
    engine = demo.engine(model, max_batch=3)
    sampling = SamplingParams(temperature=0.0, max_new_tokens=10)
    for index, request_id in enumerate("xyz"):
        engine.add_prefilled(request_id, prefill.prefill(prompt(4 + 5 * index, index)), sampling)
    engine.step()
    engine.step()
    aborted = engine.abort("x")
    assert aborted is not None and aborted.finish_reason == "abort" and len(aborted.token_ids) == 3
    assert engine.abort("x") is None
    assert engine.num_active() == 2
    done = run_to_completion(engine)
    for index, request_id in enumerate("xyz"):
        if request_id != "x":
            alone = run_alone(demo, model, prompt(4 + 5 * index, index), sampling)
            assert done[request_id].token_ids == alone.token_ids


def test_sampled_decode_reports_behaviour_logprobs_and_is_seeded(demo) -> None:
    model = demo.model()
    sampling = SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=12)
    results = []
    for _ in range(2):
        engine = demo.engine(model, max_batch=1, seed=3)
        engine.add_prefilled("r", PrefillEngine(model).prefill(prompt(5)), sampling)
        results.append(run_to_completion(engine)["r"])
    assert results[0] == results[1]
    assert all(lp <= 0.0 for lp in results[0].logprobs)


@pytest.mark.parametrize("module", ["rollmesh.engine", "rollmesh.engine.decode", "rollmesh.engine.decode_state"])
def test_finished_sequence_is_a_deprecated_name_of_generation_result(module: str) -> None:
    """The engine reports GenerationResult itself; the old FinishedSequence name still imports,
    with a DeprecationWarning, for one release."""
    import importlib

    with pytest.warns(DeprecationWarning, match="FinishedSequence"):
        alias = getattr(importlib.import_module(module), "FinishedSequence")
    assert alias is GenerationResult
