"""Sampler and stop checks: behaviour logprobs under temperature/top-p, determinism, ids past the
tokenizer never drawn, stop tails in the demo model's tokenizer's text, every end-of-turn id."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from support.engine_models import model_tokenizer
from rollmesh.chat.model_dir import ModelDirectory
from rollmesh.engine.errors import InvalidRequestError
from rollmesh.engine.sampling import sample_tokens
from rollmesh.engine.stopping import StopChecker

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Tiny tensors on a shared 2-core machine: a second torch thread only spins."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])


def expected_distribution(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Straightforward per-row reference: scale, sort, keep the nucleus, renormalize."""
    probs = torch.softmax(logits / temperature, dim=-1)
    order = probs.argsort(descending=True)
    kept = torch.zeros_like(probs)
    mass = 0.0
    for token in order.tolist():
        if mass >= top_p:
            break
        kept[token] = probs[token]
        mass += float(probs[token])
    return kept / kept.sum()


def test_sampler_logprob_is_log_softmax_at_temperature_one_top_p_one() -> None:
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(1))
    tokens, logprobs = sample_tokens(
        logits, torch.ones(8), torch.ones(8), torch.Generator().manual_seed(0)
    )
    expected = torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None])[:, 0]
    torch.testing.assert_close(logprobs, expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    ("temperature", "top_p"), [(0.7, 1.0), (1.0, 0.8), (1.5, 0.6), (0.5, 0.95)]
)
def test_sampler_logprob_is_that_of_the_tempered_truncated_distribution(
    temperature: float, top_p: float
) -> None:
    expected = expected_distribution(LOGITS[0], temperature, top_p)
    draws = 20_000
    logits = LOGITS.expand(draws, -1)
    tokens, logprobs = sample_tokens(
        logits,
        torch.full((draws,), temperature),
        torch.full((draws,), top_p),
        torch.Generator().manual_seed(0),
    )
    torch.testing.assert_close(logprobs, expected[tokens].log(), atol=1e-5, rtol=0)
    frequencies = torch.bincount(tokens, minlength=5).float() / draws
    torch.testing.assert_close(frequencies, expected, atol=0.015, rtol=0)
    assert bool((expected[tokens] > 0).all()), "sampled a token outside the nucleus"


def test_sampler_mixes_greedy_and_sampled_rows_in_one_batch() -> None:
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(2))
    temperature = torch.tensor([0.0, 1.0, 0.0, 0.8, 0.0, 1.2])
    top_p = torch.tensor([1.0, 0.9, 0.5, 1.0, 0.3, 0.7])
    tokens, logprobs = sample_tokens(logits, temperature, top_p, torch.Generator().manual_seed(0))
    for row in (0, 2, 4):  # greedy rows report the model's own logprob of the argmax
        assert int(tokens[row]) == int(logits[row].argmax())
        expected = torch.log_softmax(logits[row], dim=-1)[tokens[row]]
        assert float(logprobs[row]) == pytest.approx(float(expected), abs=1e-6)
    for row in (1, 3, 5):
        dist = expected_distribution(logits[row], float(temperature[row]), float(top_p[row]))
        assert float(logprobs[row]) == pytest.approx(float(dist[tokens[row]].log()), abs=1e-5)


def test_sampler_is_deterministic_for_a_seeded_generator() -> None:
    logits = torch.randn(16, 100, generator=torch.Generator().manual_seed(3))
    args = (logits, torch.ones(16), torch.full((16,), 0.9))
    first = sample_tokens(*args, torch.Generator().manual_seed(7))
    second = sample_tokens(*args, torch.Generator().manual_seed(7))
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])


def test_sampler_never_draws_an_id_at_or_past_vocab_size() -> None:
    logits = torch.randn(64, 12, generator=torch.Generator().manual_seed(4))
    logits[:, 10:] += 50.0  # padded rows the model would rather say
    temperature = torch.tensor([0.0, 1.0, 2.0, 0.7] * 16)
    top_p = torch.tensor([1.0, 1.0, 0.9, 0.5] * 16)
    tokens, logprobs = sample_tokens(logits, temperature, top_p, torch.Generator().manual_seed(0),
                                     vocab_size=10)
    assert int(tokens.max()) < 10
    unmasked, _ = sample_tokens(logits, temperature, top_p, torch.Generator().manual_seed(0))
    assert int(unmasked.min()) >= 10  # without the bound the padded rows win: the test can fail
    # Logprobs are those of the distribution over the real ids: the padded rows had no mass.
    for row in range(0, 64, 4):  # greedy rows: the model's log_softmax over real ids
        expected = torch.log_softmax(logits[row, :10], dim=-1)[tokens[row]]
        assert float(logprobs[row]) == pytest.approx(float(expected), abs=1e-6)
    for row in range(1, 64, 4):  # temperature 1, no truncation: the same
        expected = torch.log_softmax(logits[row, :10], dim=-1)[tokens[row]]
        assert float(logprobs[row]) == pytest.approx(float(expected), abs=1e-6)


@pytest.fixture(scope="module")
def tokenizer(demo_model_dir: Path) -> ModelDirectory:
    return model_tokenizer(demo_model_dir)


def first_stop(checker: StopChecker, ids: list[int]) -> int:
    """The index of the token after which ``checker`` first says the sequence is done."""
    reasons = [checker.check(ids[: n + 1]) for n in range(len(ids))]
    first = next(n for n, reason in enumerate(reasons) if reason is not None)
    assert reasons[first] == "stop"
    return first


def test_stop_checker_finds_a_stop_string_when_its_last_byte_arrives(tokenizer) -> None:
    checker = StopChecker(stop=["</tool>", "é!"], max_new_tokens=100,
                          end_of_turn_ids=tokenizer.end_of_turn_ids, detokenizer=tokenizer)
    cases = (("call <tool>x</tool> more", "call <tool>x</tool>"), ("café!", "café!"))
    for text, stop_at in cases:
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids[: first_stop(checker, ids) + 1]) == stop_at


def test_stop_strings_match_special_tokens_as_the_tokenizer_spells_them(tokenizer) -> None:
    checker = StopChecker(stop=["<|im_start|>user"], max_new_tokens=100,
                          end_of_turn_ids=tokenizer.end_of_turn_ids, detokenizer=tokenizer)
    ids = tokenizer.encode("Done.\n<|im_start|>user\nmore")
    assert tokenizer.decode(ids[: first_stop(checker, ids) + 1]) == "Done.\n<|im_start|>user"


def test_stop_checker_reports_eos_for_every_end_of_turn_id_before_length(tokenizer) -> None:
    end_ids = sorted(tokenizer.end_of_turn_ids)
    assert len(end_ids) == 2  # <|im_end|> and <|endoftext|>
    checker = StopChecker(stop=[], max_new_tokens=2, end_of_turn_ids=end_ids, detokenizer=tokenizer)
    assert checker.check([65]) is None
    for end_id in end_ids:
        assert checker.check([65, end_id]) == "eos"
    assert checker.check([65, 66]) == "length"


def test_stop_checker_rejects_an_empty_stop_string_and_stop_strings_without_a_tokenizer(tokenizer) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        StopChecker(stop=[""], max_new_tokens=4, end_of_turn_ids=(), detokenizer=tokenizer)
    assert caught.value.field == "sampling.stop"
    with pytest.raises(InvalidRequestError) as no_text:
        StopChecker(stop=["x"], max_new_tokens=4, end_of_turn_ids=(), detokenizer=None, request_id="r")
    assert (no_text.value.field, no_text.value.request_id) == ("sampling.stop", "r")
