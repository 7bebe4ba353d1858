"""OpenAI ``logprobs`` as plain logic: a chat completion's ``choices[].logprobs.content`` and a legacy
completion's ``tokens``/``token_logprobs``/``top_logprobs``/``text_offset`` carry the logprob the
engine sampled each generated token with (end of turn included), read by the ``openai`` package's
own types, with the top alternatives the engine returned when asked (OpenAI's caps: 20 and 5);
out-of-range counts are a 400. No Ray, no HTTP (the routes: test_serve_app.py; streamed logprobs:
test_serve_streaming.py).
"""

from __future__ import annotations

import math
from pathlib import Path

import openai.types as openai_types
import openai.types.chat as openai_chat
import pytest

from rollmesh.engine.protocols import GenerationResult
from rollmesh.serve_apps import InvalidApiRequestError, ServedModel
from rollmesh.serve_apps.chat_requests import chat_inputs, chat_response
from rollmesh.serve_apps.generation_requests import completion_inputs, completion_response
from rollmesh.serve_apps.http_shapes import ChatCompletionRequest, CompletionRequest
from support.serve_models import QUESTION, demo_served_model

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


@pytest.fixture(scope="module")
def served(demo_model_dir: Path) -> ServedModel:
    return demo_served_model(demo_model_dir)


def sampled(served: ServedModel, text: str) -> GenerationResult:
    """``text`` as if generated, each token with its own logprob (the last one -inf)."""
    ids = served.chat.encode(text)
    logprobs = [-0.25 * (i + 1) for i in range(len(ids) - 1)] + [-math.inf]
    return GenerationResult(ids, logprobs, [1] * len(ids), "eos", 7)


def chat_request(**fields: object) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [QUESTION], **fields})


def test_chat_logprobs_are_each_generated_tokens_sampled_logprob(served: ServedModel) -> None:
    result = sampled(served, "18 g/mol<|im_end|>")
    prompt = chat_inputs(chat_request(logprobs=True, top_logprobs=0), served)
    response = chat_response(result, prompt, request_id="c", created=1, served=served)
    parsed = openai_chat.ChatCompletion.model_validate(response.model_dump())
    content = parsed.choices[0].logprobs.content
    assert [entry.token for entry in content] == [
        served.chat.decode([token_id]) for token_id in result.token_ids]
    assert "".join(entry.token for entry in content) == "18 g/mol<|im_end|>"
    assert [entry.logprob for entry in content] == [*result.logprobs[:-1], -9999.0]
    assert all(entry.bytes == list(entry.token.encode()) for entry in content)
    assert all(entry.top_logprobs == [] for entry in content)


def test_chat_logprobs_are_left_out_unless_asked(served: ServedModel) -> None:
    result = sampled(served, "hi<|im_end|>")
    prompt = chat_inputs(chat_request(), served)
    response = chat_response(result, prompt, request_id="c", created=1, served=served)
    assert response.choices[0].logprobs is None
    assert response.model_dump()["choices"][0]["logprobs"] is None  # OpenAI sends null


def test_completion_logprobs_are_openais_legacy_shape(served: ServedModel) -> None:
    request = CompletionRequest(prompt="H2O", logprobs=0)
    _, sampling = completion_inputs(request, served)
    result = sampled(served, "18 g<|im_end|>")
    response = completion_response(result, request_id="c", created=1, served=served,
                                   sampling=sampling, with_logprobs=True)
    parsed = openai_types.Completion.model_validate(response.model_dump())
    logprobs = parsed.choices[0].logprobs
    tokens = [served.chat.decode([token_id]) for token_id in result.token_ids]
    assert logprobs.tokens == tokens
    assert logprobs.token_logprobs == [*result.logprobs[:-1], -9999.0]
    assert logprobs.top_logprobs == [{token: value} for token, value in
                                     zip(tokens, logprobs.token_logprobs, strict=True)]
    assert logprobs.text_offset == [len("".join(tokens[:i])) for i in range(len(tokens))]


def with_alternatives(served: ServedModel, result: GenerationResult, n: int) -> GenerationResult:
    """``result`` with n made-up alternatives per token, most likely first."""
    top = [[((token + k) % served.vocab_size, -0.5 * k - 0.1) for k in range(n)]
           for token in result.token_ids]
    return GenerationResult(result.token_ids, result.logprobs, result.versions,
                            result.finish_reason, result.prompt_len, top_logprobs=top)


def test_chat_top_logprobs_are_the_engines_alternatives_with_their_text_and_bytes(
    served: ServedModel,
) -> None:
    prompt = chat_inputs(chat_request(logprobs=True, top_logprobs=3), served)
    assert prompt.top_logprobs == 3
    result = with_alternatives(served, sampled(served, "18 g<|im_end|>"), 3)
    response = chat_response(result, prompt, request_id="c", created=1, served=served)
    content = openai_chat.ChatCompletion.model_validate(response.model_dump()).choices[0].logprobs.content
    for entry, alternatives in zip(content, result.top_logprobs, strict=True):
        texts = [served.chat.decode([token_id]) for token_id, _ in alternatives]
        assert [top.token for top in entry.top_logprobs] == texts
        assert [top.logprob for top in entry.top_logprobs] == [value for _, value in alternatives]
        assert [top.bytes for top in entry.top_logprobs] == [list(text.encode()) for text in texts]


def test_completion_top_logprobs_hold_the_alternatives_and_the_sampled_token(
    served: ServedModel,
) -> None:
    _, sampling = completion_inputs(CompletionRequest(prompt="H2O", logprobs=2), served)
    result = with_alternatives(served, sampled(served, "18 g"), 2)
    response = completion_response(result, request_id="c", created=1, served=served,
                                   sampling=sampling, with_logprobs=True)
    logprobs = openai_types.Completion.model_validate(response.model_dump()).choices[0].logprobs
    for token, entry, alternatives in zip(logprobs.tokens, logprobs.top_logprobs,
                                          result.top_logprobs, strict=True):
        expected = {served.chat.decode([token_id]): value for token_id, value in alternatives}
        assert {text: entry[text] for text in expected} == expected
        assert token in entry and len(entry) <= 3


@pytest.mark.parametrize(("fields", "code"), [
    ({"logprobs": True, "top_logprobs": 21}, "invalid_value"),
    ({"logprobs": True, "top_logprobs": -1}, "invalid_value"),
    ({"top_logprobs": 0}, "invalid_value"),  # OpenAI: top_logprobs needs logprobs
])
def test_chat_top_logprobs_openai_refuses_are_a_400(
    served: ServedModel, fields: dict, code: str,
) -> None:
    with pytest.raises(InvalidApiRequestError) as raised:
        chat_inputs(chat_request(**fields), served)
    assert (raised.value.status, raised.value.param, raised.value.code) == (
        400, "top_logprobs", code)


@pytest.mark.parametrize(("logprobs", "code"), [(6, "invalid_value"), (-1, "invalid_value")])
def test_completion_logprobs_outside_0_to_5_are_a_400(
    served: ServedModel, logprobs: int, code: str,
) -> None:
    with pytest.raises(InvalidApiRequestError) as raised:
        completion_inputs(CompletionRequest(prompt="a", logprobs=logprobs), served)
    assert (raised.value.param, raised.value.code) == ("logprobs", code)
    assert "logprobs" in raised.value.message

