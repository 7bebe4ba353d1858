"""Prefill + continuous-batching decode: exactness against the full forward, batching, weight
swaps that keep requests, stop conditions, aborts."""

from __future__ import annotations

import pytest
import torch

from rollmesh.config import ModelConfig
from rollmesh.engine.decode import DecodeEngine, FinishedSequence
from rollmesh.engine.errors import StaleWeightsError, WeightsMismatchError
from rollmesh.engine.model import TinyDecoder, build_model
from rollmesh.engine.kv_pages import KvBlockPool, PagedAttention
from rollmesh.engine.prefill import PrefillEngine, PrefillResult, run_prefill
from rollmesh.engine.tokenizer import EOS_ID
from rollmesh.messages.base import SamplingParams

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Tiny tensors on a shared 2-core machine: a second torch thread only spins."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=16)


def small_model(seed: int = 0) -> TinyDecoder:
    model = build_model(ModelConfig(d_model=64, n_layers=2, n_heads=4, max_seq_len=64, seed=seed))
    # The init's small weights make a model that repeats its input; larger ones make it babble
    # diverse tokens with clear greedy margins (float noise between the batched and single-row
    # paths cannot flip a token), which is what comparisons of token streams need.
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 2:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    return model


def prompt(length: int, offset: int = 0) -> list[int]:
    return [(offset + 7 * i) % 256 for i in range(length)]


@torch.no_grad()
def greedy_by_full_forward(
    model: TinyDecoder, ids: list[int], n: int
) -> tuple[list[int], list[float]]:
    ids, tokens, logprobs = list(ids), [], []
    for _ in range(n):
        logits = model(torch.tensor([ids]))[0, -1]
        token = int(logits.argmax())
        tokens.append(token)
        logprobs.append(float(torch.log_softmax(logits, dim=-1)[token]))
        ids.append(token)
        if token == EOS_ID:
            break
    return tokens, logprobs


def run_to_completion(engine: DecodeEngine) -> dict[str, FinishedSequence]:
    done: dict[str, FinishedSequence] = {}
    while engine.has_work():
        done.update((s.request_id, s) for s in engine.step())
    return done


def run_alone(model: TinyDecoder, ids: list[int], sampling: SamplingParams) -> FinishedSequence:
    engine = DecodeEngine(model, max_batch=1)
    engine.add_prefilled("alone", PrefillEngine(model).prefill(ids), sampling)
    return run_to_completion(engine)["alone"]


def test_greedy_decode_matches_full_forward_recomputed_each_step() -> None:
    model = small_model()
    ids = prompt(5)
    result = run_alone(model, ids, GREEDY)
    tokens, logprobs = greedy_by_full_forward(model, ids, GREEDY.max_new_tokens)
    assert len(set(tokens)) > 4  # a model that babbles, so the comparison means something
    assert result.token_ids == tokens
    assert result.logprobs == pytest.approx(logprobs, abs=1e-4)
    assert result.finish_reason == ("eos" if tokens[-1] == EOS_ID else "length")
    assert result.versions == [0] * len(tokens)
    assert result.prompt_len == 5


def test_generation_stops_at_the_context_limit_with_finish_reason_length() -> None:
    model = small_model()
    ids = prompt(60)  # max_seq_len 64: four generated tokens fit
    result = run_alone(model, ids, SamplingParams(temperature=0.0, max_new_tokens=100))
    assert result.finish_reason == "length"
    assert len(result.token_ids) == 4
    assert result.token_ids == greedy_by_full_forward(model, ids, 4)[0]


def test_requests_joining_at_different_steps_match_their_single_runs() -> None:
    model = small_model()
    prefill = PrefillEngine(model)
    engine = DecodeEngine(model, max_batch=4)
    # (step at which it arrives, prompt length, max_new_tokens)
    plan = {"a": (0, 3, 12), "b": (0, 17, 4), "c": (2, 9, 20), "d": (5, 30, 7), "e": (6, 1, 9)}
    done: dict[str, FinishedSequence] = {}
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
        alone = run_alone(model, prompt(length, ord(request_id)), sampling)
        assert done[request_id].token_ids == alone.token_ids, request_id
        assert done[request_id].logprobs == pytest.approx(alone.logprobs, abs=1e-4)
        assert done[request_id].finish_reason == alone.finish_reason
    assert engine.num_active() == 0


def test_decode_keeps_requests_across_weight_swap_and_versions_both() -> None:
    model = small_model(seed=0)
    new_weights = small_model(seed=1).state_dict()
    engine = DecodeEngine(model, max_batch=2)
    prefill = PrefillEngine(small_model(seed=0))
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
    reference = small_model(seed=0)
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
    assert tokens != run_alone(small_model(seed=0), prompt(6), sampling).token_ids


def test_stage_weights_ignores_redelivery_and_rejects_stale_or_misfit_weights() -> None:
    engine = DecodeEngine(small_model(), max_batch=1)
    weights = small_model(seed=1).state_dict()
    assert engine.stage_weights(weights, 2)
    assert not engine.stage_weights(weights, 2)  # redelivered
    assert not engine.stage_weights(weights, 1)  # superseded by the staged 2
    engine.step()
    assert engine.current_version == 2 and engine.pop_activation() == 2
    assert engine.pop_activation() is None
    with pytest.raises(StaleWeightsError):
        engine.stage_weights(weights, 1)
    with pytest.raises(WeightsMismatchError):
        engine.stage_weights({k: v for k, v in weights.items() if k != "ln_f.weight"}, 3)
    with pytest.raises(WeightsMismatchError):
        engine.stage_weights({**weights, "ln_f.weight": torch.ones(3)}, 3)
    assert engine.stats().staged_version is None


class LetterDetokenizer:
    """One letter per token, so a stop string's position in the output is easy to predict."""

    eos_id = EOS_ID

    def decode(self, ids) -> str:
        return "".join(chr(ord("a") + i % 26) for i in ids)


def test_stop_string_ends_generation_and_is_kept_in_the_output() -> None:
    model = small_model()
    letters = LetterDetokenizer()
    free = run_alone(model, prompt(4), SamplingParams(temperature=0.0, max_new_tokens=30))
    text = letters.decode(free.token_ids)
    stop = text[8:11]
    end = text.index(stop) + len(stop)
    engine = DecodeEngine(model, max_batch=2, tokenizer=letters)
    sampling = SamplingParams(temperature=0.0, max_new_tokens=30, stop=["zzzzzzzz", stop])
    engine.add_prefilled("s", PrefillEngine(model).prefill(prompt(4)), sampling)
    result = run_to_completion(engine)["s"]
    assert result.finish_reason == "stop"
    assert result.token_ids == free.token_ids[:end]


def test_a_request_whose_first_token_ends_it_is_reported_by_the_next_step() -> None:
    model = small_model()
    engine = DecodeEngine(model, max_batch=1)
    good = PrefillEngine(model).prefill(prompt(3))
    logits = torch.zeros(model.shape.vocab_size)
    logits[EOS_ID] = 100.0
    engine.add_prefilled("eos", PrefillResult(good.input_ids, good.pages, logits, 7), GREEDY)
    assert engine.num_active() == 0 and engine.has_work()
    [finished] = engine.step()
    assert (finished.token_ids, finished.finish_reason, finished.versions) == ([EOS_ID], "eos", [7])
    assert not engine.has_work()


def test_abort_frees_the_slot_and_the_others_continue_unchanged() -> None:
    model = small_model()
    prefill = PrefillEngine(model)
    engine = DecodeEngine(model, max_batch=3)
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
            alone = run_alone(model, prompt(4 + 5 * index, index), sampling)
            assert done[request_id].token_ids == alone.token_ids


def test_sampled_decode_reports_behaviour_logprobs_and_is_seeded() -> None:
    model = small_model()
    sampling = SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=12)
    results = []
    for _ in range(2):
        engine = DecodeEngine(model, max_batch=1, seed=3)
        engine.add_prefilled("r", PrefillEngine(model).prefill(prompt(5)), sampling)
        results.append(run_to_completion(engine)["r"])
    assert results[0] == results[1]
    assert all(lp <= 0.0 for lp in results[0].logprobs)
