"""Chat completions and streamed answers as plain logic: the chat template, the chat request's
checks, and the Server-Sent Events of a finished generation. No Ray, no HTTP."""

from __future__ import annotations

import json

import pytest

from rollmesh.engine.protocols import GenerationResult
from rollmesh.engine.tokenizer import BOS_ID
from rollmesh.messages.base import SamplingParams
from rollmesh.serve_apps import InvalidApiRequestError, ServedModel, render_chat
from rollmesh.serve_apps.chat_requests import (
    chat_inputs,
    chat_response,
    chat_stream_events,
    completion_stream_events,
)
from rollmesh.serve_apps.http_shapes import ChatCompletionRequest, ChatMessage

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

SERVED = ServedModel(name="rollmesh-tiny", max_seq_len=64, vocab_size=260)


def chat(*messages: tuple[str, str], **fields: object) -> ChatCompletionRequest:
    return ChatCompletionRequest(
        messages=[ChatMessage(role=role, content=content) for role, content in messages], **fields)


def test_chat_template_is_one_line_per_message_then_the_assistant_prefix() -> None:
    request = chat(("system", "be brief"), ("user", "hi"))
    assert render_chat(request.messages) == "system: be brief\nuser: hi\nassistant: "
    input_ids, _ = chat_inputs(request, SERVED)
    assert input_ids == [BOS_ID, *render_chat(request.messages).encode()]


def test_chat_max_completion_tokens_wins_and_the_default_is_the_context() -> None:
    assert chat_inputs(chat(("user", "a")), SERVED)[1].max_new_tokens == SERVED.max_seq_len
    request = chat(("user", "a"), max_tokens=9, max_completion_tokens=3)
    assert chat_inputs(request, SERVED)[1].max_new_tokens == 3


@pytest.mark.parametrize(("request_fields", "param"), [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": "x" * 80}]}, "messages"),
    ({"messages": [{"role": "user", "content": "a"}], "n": 2}, "n"),
    ({"messages": [{"role": "user", "content": "a"}], "max_completion_tokens": 65},
     "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "a"}], "temperature": -1.0}, "temperature"),
])
def test_bad_chat_requests_name_their_parameter(request_fields: dict, param: str) -> None:
    with pytest.raises(InvalidApiRequestError) as raised:
        chat_inputs(ChatCompletionRequest.model_validate(request_fields), SERVED)
    assert raised.value.param == param


def test_chat_response_cuts_the_stop_string_like_completions() -> None:
    result = GenerationResult(list(b"ok\n"), [-0.1] * 3, [2] * 3, "stop", 10)
    sampling = SamplingParams(max_new_tokens=8, stop=["\n"])
    response = chat_response(result, request_id="chatcmpl-1", created=1, served=SERVED,
                             sampling=sampling)
    (choice,) = response.choices
    assert choice.message.content == "ok"
    assert choice.finish_reason == "stop"
    assert choice.weight_versions == [2, 2, 2]
    assert response.usage.total_tokens == 13


def decode_events(events: list[str]) -> list[dict]:
    assert all(event.startswith("data: ") and event.endswith("\n\n") for event in events)
    assert events[-1] == "data: [DONE]\n\n"
    return [json.loads(event[len("data: "):]) for event in events[:-1]]


def test_chat_stream_sends_the_role_then_the_text_in_pieces_then_the_finish_reason() -> None:
    text = "hello there"
    result = GenerationResult(list(text.encode()), [0.0] * len(text), [0] * len(text), "length", 4)
    chunks = decode_events(list(chat_stream_events(
        result, request_id="chatcmpl-2", created=5, served=SERVED,
        sampling=SamplingParams(max_new_tokens=len(text)))))
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == text
    assert len(chunks) > 3  # the text came in more than one piece
    assert [c["choices"][0]["finish_reason"] for c in chunks][-2:] == [None, "length"]
    assert {(c["id"], c["object"], c["model"]) for c in chunks} == {
        ("chatcmpl-2", "chat.completion.chunk", "rollmesh-tiny")}


def test_completion_stream_ends_with_an_empty_chunk_that_carries_the_finish_reason() -> None:
    result = GenerationResult([], [], [], "eos", 3)
    chunks = decode_events(list(completion_stream_events(
        result, request_id="cmpl-3", created=5, served=SERVED, sampling=SamplingParams())))
    assert [(c["choices"][0]["text"], c["choices"][0]["finish_reason"]) for c in chunks] == [
        ("", "stop")]
    assert chunks[0]["object"] == "text_completion"
