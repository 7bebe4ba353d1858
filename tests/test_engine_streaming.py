"""Per-token streaming out of the decode loop and top-N logprobs: tokens reach a stream's consumer
while the sequence is still decoding, in order and without gaps; closing the stream aborts the
request; the top alternatives are those of the distribution each token was sampled from."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from support.engine_models import EngineModels, babbling_model, model_tokenizer, prefer_tokens
from rollmesh.config import InferenceConfig, ModelConfig
from rollmesh.engine.errors import InvalidRequestError
from rollmesh.engine.local_engine import LocalEngine
from rollmesh.engine.protocols import GenerateOptions, GenerationResult
from rollmesh.engine.sampling import sample_tokens
from rollmesh.engine.token_stream import TokenDelta
from rollmesh.messages.base import SamplingParams

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6)
PROMPT = [(5 * i) % 256 for i in range(5)]


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def engine(demo_model_dir: Path) -> LocalEngine:
    """A babbling demo model that never ends its turn: generations run to their budget."""
    tokenizer = model_tokenizer(demo_model_dir)
    model = prefer_tokens(babbling_model(demo_model_dir), sorted(tokenizer.end_of_turn_ids), by=-100.0)
    return LocalEngine(ModelConfig(path=str(demo_model_dir)), InferenceConfig(max_batch=4),
                       model=model, tokenizer=tokenizer)


# -- the sampler's alternatives -----------------------------------------------------------------


def reference_logprobs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """log of the tempered, nucleus-truncated, renormalised distribution, computed row by row."""
    probs = torch.softmax(logits / temperature, dim=-1)
    order = probs.argsort(descending=True)
    kept, mass = torch.zeros_like(probs), 0.0
    for token in order.tolist():
        if mass >= top_p:
            break
        kept[token] = probs[token]
        mass += float(probs[token])
    return (kept / kept.sum()).log()


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 1.0), (1.3, 0.6)])
def test_top_alternatives_are_the_sampled_distributions_most_likely_tokens_sorted(
    temperature: float, top_p: float,
) -> None:
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(3))
    rows = len(logits)
    chosen, logprobs, (top_ids, top_values) = sample_tokens(
        logits, torch.full((rows,), temperature), torch.full((rows,), top_p),
        torch.Generator().manual_seed(0), top_n=5)
    assert top_ids.shape == top_values.shape == (rows, 5)
    for row in range(rows):
        expected = reference_logprobs(logits[row], temperature, top_p)
        values = top_values[row]
        assert torch.all(values[:-1] >= values[1:])  # most likely first
        torch.testing.assert_close(values, expected[top_ids[row]], atol=1e-5, rtol=0)
        torch.testing.assert_close(values, expected.sort(descending=True).values[:5],
                                   atol=1e-5, rtol=0)
        assert float(logprobs[row]) == pytest.approx(float(expected[chosen[row]]), abs=1e-5)


def test_greedy_alternatives_are_the_models_log_softmax_and_none_are_past_the_tokenizer() -> None:
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(4))
    logits[:, 25:] += 50  # padded rows the sampler must never offer
    chosen, _, (top_ids, top_values) = sample_tokens(
        logits, torch.zeros(2), torch.ones(2), vocab_size=25, top_n=3)
    expected = torch.log_softmax(logits[:, :25], dim=-1).topk(3)
    assert torch.equal(top_ids, expected.indices)
    torch.testing.assert_close(top_values, expected.values)
    assert torch.equal(chosen, top_ids[:, 0])


def test_without_top_n_the_sampler_returns_the_token_and_its_logprob_only() -> None:
    result = sample_tokens(torch.randn(2, 10), torch.ones(2), torch.ones(2))
    assert len(result) == 2


# -- the engine ---------------------------------------------------------------------------------


async def test_greedy_top_logprobs_match_a_log_softmax_of_the_full_forward(
    demo_model_dir: Path,
) -> None:
    demo = EngineModels(demo_model_dir)
    model = demo.model()
    async with LocalEngine(ModelConfig(path=str(demo_model_dir)), InferenceConfig(max_batch=2),
                           model=model, tokenizer=demo.tokenizer) as engine:
        result = await engine.generate(PROMPT, GREEDY, request_id="top",
                                       options=GenerateOptions(top_logprobs=4))
        plain = await engine.generate(PROMPT, GREEDY, request_id="plain")
    assert plain.top_logprobs is None and plain.token_ids == result.token_ids
    assert len(result.top_logprobs) == len(result.token_ids)
    ids = PROMPT + result.token_ids
    with torch.no_grad():
        logits = model(torch.tensor([ids]))[0, len(PROMPT) - 1:-1]
    vocab = demo.tokenizer.vocab_size
    expected = torch.log_softmax(logits[:, :vocab].float(), dim=-1).topk(4)
    for position, alternatives in enumerate(result.top_logprobs):
        assert [token for token, _ in alternatives] == expected.indices[position].tolist()
        assert [value for _, value in alternatives] == pytest.approx(
            expected.values[position].tolist(), abs=1e-4)
        assert alternatives[0][0] == result.token_ids[position]  # greedy: the most likely


async def test_top_logprobs_past_openais_cap_are_refused(engine: LocalEngine) -> None:
    async with engine:
        with pytest.raises(InvalidRequestError) as refused:
            await engine.generate(PROMPT, GREEDY, request_id="x",
                                  options=GenerateOptions(top_logprobs=21))
    assert refused.value.field == "top_logprobs"


# -- streaming ----------------------------------------------------------------------------------


async def test_streamed_tokens_arrive_while_the_sequence_is_still_decoding(engine: LocalEngine) -> None:
    async with engine:
        pieces, active_at_piece = [], []
        async for piece in engine.generate_stream(PROMPT, GREEDY, request_id="s",
                                                  options=GenerateOptions(top_logprobs=2)):
            pieces.append(piece)
            active_at_piece.append(engine.stats().active)
        whole = await engine.generate(PROMPT, GREEDY, request_id="whole")
    *deltas, final = pieces
    assert isinstance(final, GenerationResult) and final.finish_reason == "length"
    assert all(isinstance(delta, TokenDelta) for delta in deltas)
    # The first tokens came out while the request was still in the batch, one step at a time.
    assert active_at_piece[0] == 1 and len(deltas) >= 2
    starts = [delta.start for delta in deltas]
    assert starts == [sum(len(d.token_ids) for d in deltas[:i]) for i in range(len(deltas))]
    assert [t for d in deltas for t in d.token_ids] == final.token_ids == whole.token_ids
    assert [v for d in deltas for v in d.logprobs] == final.logprobs
    assert [a for d in deltas for a in d.top_logprobs] == final.top_logprobs


async def test_closing_a_stream_early_aborts_its_request(engine: LocalEngine) -> None:
    async with engine:
        sampling = SamplingParams(temperature=1.0, max_new_tokens=100)
        stream = engine.generate_stream(PROMPT, sampling, request_id="gone")
        first = await anext(stream)
        assert isinstance(first, TokenDelta) and engine.stats().active == 1
        await stream.aclose()
        assert engine.stats().active == 0
        again = await engine.generate(PROMPT, GREEDY, request_id="gone")  # the id is free again
        assert again.finish_reason == "length"


async def test_a_bad_streamed_request_raises_before_any_piece(engine: LocalEngine) -> None:
    async with engine:
        with pytest.raises(InvalidRequestError):
            async for _ in engine.generate_stream([], GREEDY, request_id="empty"):
                pytest.fail("a piece of a request that was refused")
