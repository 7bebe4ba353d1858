"""Streamed answers as plain logic: text deltas decoded token by token never split a UTF-8
character, content and reasoning stream as the tokens arrive while tool-call markup and a stop
string's start are held back, a tool call goes out once complete, each chunk carries its own
tokens' logprobs, usage comes last when asked, a mid-stream error is an error event, a gpt-oss
(harmony) turn streams by channel with its call held until ``<|call|>``, and the official
``openai`` client reads the stream (over ASGI, no Ray). The routes: test_serve_app.py.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import openai
import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from rollmesh.chat import ChatModel, ToolCall
from rollmesh.engine.protocols import GenerationResult
from rollmesh.engine.token_stream import TokenDelta
from rollmesh.messages.base import SamplingParams
from rollmesh.serve_apps import ServedModel
from rollmesh.serve_apps.chat_requests import chat_inputs, chat_response
from rollmesh.serve_apps.errors import EngineUnavailableError
from rollmesh.serve_apps.generation_requests import completion_inputs, openai_text
from rollmesh.serve_apps.http_shapes import ChatCompletionRequest, CompletionRequest
from rollmesh.serve_apps.stream_events import chat_events, completion_events
from rollmesh.serve_apps.stream_text import IncrementalDetokenizer, harmony_settled, safe_prefix
from support.serve_models import CALC, QUESTION, demo_served_model

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


@pytest.fixture(scope="module")
def served(demo_model_dir: Path) -> ServedModel:
    return demo_served_model(demo_model_dir)


def generated(served: ServedModel, text: str, finish_reason: str = "eos") -> GenerationResult:
    ids = served.chat.encode(text)
    top = [[(token, -0.1), ((token + 1) % served.vocab_size, -2.5)] for token in ids]
    return GenerationResult(ids, [-0.1] * len(ids), [2] * len(ids), finish_reason, 10,
                            request_id="r", top_logprobs=top)


class Pieces:
    """``result`` as the engine streams it: one token per piece, then the result; ``consumed``
    counts the pieces taken so far (what a chunk was written after)."""

    def __init__(self, result: GenerationResult, fail_after: int | None = None) -> None:
        self.result = result
        self.fail_after = fail_after
        self.consumed = 0

    async def __aiter__(self) -> AsyncIterator[TokenDelta | GenerationResult]:
        for start, token in enumerate(self.result.token_ids):
            if start == self.fail_after:
                raise EngineUnavailableError("a worker died", code="worker_unavailable")
            self.consumed += 1
            yield TokenDelta("r", start, [token], [self.result.logprobs[start]], [2],
                             [self.result.top_logprobs[start]])
        self.consumed += 1
        yield self.result


async def collect(events: AsyncIterator[str], pieces: Pieces | None = None) -> list[tuple[dict, int]]:
    """(chunk, pieces consumed when it was written) per event, [DONE] checked and left out."""
    out, done = [], False
    async for event in events:
        assert event.startswith("data: ") and event.endswith("\n\n") and not done
        if event == "data: [DONE]\n\n":
            done = True
            continue
        out.append((json.loads(event[len("data: "):]), pieces.consumed if pieces else 0))
    assert done
    return out


def chat(*messages: dict, **fields: object) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": list(messages), **fields})


def deltas(chunks: list[tuple[dict, int]], field: str) -> list[str]:
    return [c["choices"][0]["delta"][field] for c, _ in chunks
            if c["choices"] and field in c["choices"][0]["delta"]]


def test_incremental_detokenizing_holds_back_a_split_character(served: ServedModel) -> None:
    text = "H₂O ≈ 18 g/mol ✓ é"
    ids = served.chat.encode(text)
    split = [token for token in ids if "\ufffd" in served.chat.decode([token])]
    assert split, "the text must have a character spread over several tokens"
    detokenizer = IncrementalDetokenizer(served.chat.decode)
    pieces = [detokenizer.push([token]) for token in ids]
    assert "" in pieces and not any("\ufffd" in piece for piece in pieces)
    assert "".join(pieces) + detokenizer.flush() == text


def test_safe_prefix_stops_before_a_marker_and_a_tail_that_may_become_one() -> None:
    assert safe_prefix("Sure <tool_call>{", ["<tool_call>"]) == "Sure "
    assert safe_prefix("Sure <tool_", ["<tool_call>"]) == "Sure "
    assert safe_prefix("a < b", ["<tool_call>"]) == "a < b"


async def test_chat_content_streams_as_tokens_arrive(served: ServedModel) -> None:
    text = "hello there, water is 18"
    prompt = chat_inputs(chat(QUESTION), served)
    pieces = Pieces(generated(served, text + "<|im_end|>"))
    chunks = await collect(chat_events(aiter(pieces), prompt, request_id="chatcmpl-2", created=5,
                                       served=served), pieces)
    assert chunks[0][0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = [(c["choices"][0]["delta"]["content"], consumed) for c, consumed in chunks[1:]
               if c["choices"][0]["delta"].get("content")]
    assert "".join(piece for piece, _ in content) == text
    # Text went out while tokens were still coming, not after the end.
    assert len(content) > 3 and content[0][1] < len(pieces.result.token_ids) // 2
    assert chunks[-1][0]["choices"][0]["finish_reason"] == "stop"
    assert {(c["id"], c["object"], c["model"]) for c, _ in chunks} == {
        ("chatcmpl-2", "chat.completion.chunk", "demo")}


async def test_a_streamed_tool_call_is_sent_once_complete_and_its_markup_never_as_content(
    served: ServedModel,
) -> None:
    prompt = chat_inputs(chat(QUESTION, tools=[CALC]), served)
    turn = served.chat.write_turn(content="Checking.", calls=[ToolCall("x", "calc", {"formula": "H2O"})])
    pieces = Pieces(generated(served, turn))
    chunks = await collect(chat_events(aiter(pieces), prompt, request_id="c", created=1,
                                       served=served), pieces)
    assert "".join(deltas(chunks, "content")) == "Checking."
    assert not any("<" in piece for piece in deltas(chunks, "content"))
    calls = [(call, consumed) for c, consumed in chunks
             for call in c["choices"][0]["delta"].get("tool_calls") or ()]
    ((call, consumed),) = calls
    assert (call["index"], call["id"], call["function"]["name"]) == (0, "call_0", "calc")
    assert json.loads(call["function"]["arguments"]) == {"formula": "H2O"}
    assert consumed < len(pieces.result.token_ids)  # before the end of the turn was sampled
    assert chunks[-1][0]["choices"][0]["finish_reason"] == "tool_calls"


async def test_reasoning_streams_as_reasoning_content(chat_model_dirs: dict[str, Path]) -> None:
    chat_model = ChatModel.load(chat_model_dirs["qwen3"])
    served = ServedModel(name="q", max_seq_len=4096, vocab_size=chat_model.vocab_size, chat=chat_model)
    prompt = chat_inputs(chat(QUESTION), served)
    pieces = Pieces(generated(served, "<think>\nwater: 2 H and 1 O\n</think>\n\nAbout 18.<|im_end|>"))
    chunks = await collect(chat_events(aiter(pieces), prompt, request_id="c", created=1,
                                       served=served), pieces)
    reasoning = deltas(chunks, "reasoning_content")
    assert "".join(reasoning) == "water: 2 H and 1 O" and len(reasoning) > 1
    assert "".join(deltas(chunks, "content")) == "About 18."
    assert not any("think>" in piece for piece in reasoning + deltas(chunks, "content"))


async def test_streamed_chat_logprobs_are_each_pieces_own_and_add_up_to_the_whole(
    served: ServedModel,
) -> None:
    prompt = chat_inputs(chat(QUESTION, logprobs=True, top_logprobs=2), served)
    result = generated(served, "18 g/mol<|im_end|>")
    pieces = Pieces(result)
    chunks = await collect(chat_events(aiter(pieces), prompt, request_id="c", created=1,
                                       served=served), pieces)
    streamed = [entry for c, _ in chunks if c["choices"] and c["choices"][0]["logprobs"]
                for entry in c["choices"][0]["logprobs"]["content"]]
    whole = chat_response(result, prompt, request_id="c", created=1, served=served)
    assert streamed == whole.model_dump()["choices"][0]["logprobs"]["content"]
    assert all(len(entry["top_logprobs"]) == 2 for entry in streamed)


async def test_completion_stream_holds_back_a_stop_strings_start_and_ends_with_usage(
    served: ServedModel,
) -> None:
    request = CompletionRequest(prompt="H2O", stop=["world"], logprobs=0,
                                stream_options={"include_usage": True})
    _, sampling = completion_inputs(request, served)
    result = generated(served, "hello wide world", "stop")
    pieces = Pieces(result)
    chunks = await collect(completion_events(
        aiter(pieces), request_id="cmpl-3", created=5, served=served, sampling=sampling,
        with_logprobs=True, include_usage=True), pieces)
    texts = [c["choices"][0]["text"] for c, _ in chunks if c["choices"]]
    assert "".join(texts) == openai_text(result, served, sampling) == "hello wide "
    assert len(texts) > 2  # in pieces; a leaked "wor" would show in the join above
    streamed = [t for c, _ in chunks if c["choices"] and c["choices"][0]["logprobs"]
                for t in c["choices"][0]["logprobs"]["tokens"]]
    offsets = [o for c, _ in chunks if c["choices"] and c["choices"][0]["logprobs"]
               for o in c["choices"][0]["logprobs"]["text_offset"]]
    assert offsets == [len("".join(streamed[:i])) for i in range(len(streamed))]
    *_, (last_choice, _), (usage, _) = chunks
    assert last_choice["choices"][0]["finish_reason"] == "stop"
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == len(result.token_ids)


async def test_an_error_after_the_stream_started_is_an_error_event(served: ServedModel) -> None:
    prompt = chat_inputs(chat(QUESTION), served)
    pieces = Pieces(generated(served, "hello there"), fail_after=3)
    chunks = await collect(chat_events(aiter(pieces), prompt, request_id="c", created=1,
                                       served=served))
    assert chunks[-1][0]["error"]["code"] == "worker_unavailable"


async def test_the_openai_client_reads_streamed_content_and_a_tool_call(served: ServedModel) -> None:
    turn = served.chat.write_turn(content="Let me compute that.",
                                  calls=[ToolCall("x", "calc", {"formula": "H2O"})])
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def completions(body: ChatCompletionRequest) -> StreamingResponse:
        prompt = chat_inputs(body, served)
        return StreamingResponse(chat_events(aiter(Pieces(generated(served, turn))), prompt,
                                             request_id="chatcmpl-x", created=1, served=served),
                                 media_type="text/event-stream")

    transport = httpx.ASGITransport(app=app)
    async with openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused", max_retries=0,
                                  http_client=httpx.AsyncClient(transport=transport)) as client:
        stream = await client.chat.completions.create(
            model="demo", messages=[QUESTION], tools=[CALC], stream=True)
        chunks = [chunk async for chunk in stream]
    content = [c.choices[0].delta.content for c in chunks if c.choices[0].delta.content]
    assert len(content) > 2 and "".join(content) == "Let me compute that."
    (call,) = [call for c in chunks for call in c.choices[0].delta.tool_calls or ()]
    assert call.function.name == "calc" and json.loads(call.function.arguments) == {"formula": "H2O"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


async def test_chat_content_stops_before_a_stop_string_even_while_it_is_incomplete(
    served: ServedModel,
) -> None:
    prompt = chat_inputs(chat(QUESTION, stop=["STOP"]), served)
    pieces = Pieces(generated(served, "water is 18 STOP", "stop"))
    chunks = await collect(chat_events(aiter(pieces), prompt, request_id="c", created=1,
                                       served=served), pieces)
    content = deltas(chunks, "content")
    whole = chat_response(pieces.result, prompt, request_id="c", created=1, served=served)
    assert "".join(content) == whole.choices[0].message.content == "water is 18 "
    assert len(content) > 1 and not any("S" in piece for piece in content)


@pytest.fixture(scope="module")
def harmony_served(chat_model_dirs: dict[str, Path]) -> ServedModel:
    chat_model = ChatModel.load(chat_model_dirs["gpt_oss"])
    return ServedModel(name="g", max_seq_len=4096, vocab_size=chat_model.vocab_size, chat=chat_model)


async def test_a_harmony_turn_streams_analysis_as_reasoning_and_final_as_content(
    harmony_served: ServedModel,
) -> None:
    served = harmony_served
    prompt = chat_inputs(chat(QUESTION), served)
    pieces = Pieces(generated(served, served.chat.write_turn(content="About 18 g/mol.",
                                                             reasoning="water: 2 H and 1 O")))
    chunks = await collect(chat_events(aiter(pieces), prompt, request_id="c", created=1,
                                       served=served), pieces)
    reasoning = [(c["choices"][0]["delta"]["reasoning_content"], consumed) for c, consumed in chunks
                 if c["choices"][0]["delta"].get("reasoning_content")]
    content = [(c["choices"][0]["delta"]["content"], consumed) for c, consumed in chunks
               if c["choices"][0]["delta"].get("content")]
    whole = chat_response(pieces.result, prompt, request_id="c", created=1, served=served).choices[0].message
    assert "".join(text for text, _ in reasoning) == whole.reasoning_content == "water: 2 H and 1 O"
    assert "".join(text for text, _ in content) == whole.content == "About 18 g/mol."
    # Each channel went out while its message was being sampled, reasoning first.
    assert len(reasoning) > 1 and len(content) > 1
    assert reasoning[-1][1] < content[0][1] < len(pieces.result.token_ids)
    assert not any("<|" in text for text, _ in reasoning + content)


async def test_a_harmony_call_is_held_until_its_end_marker_and_its_preamble_streams(
    harmony_served: ServedModel,
) -> None:
    served = harmony_served
    prompt = chat_inputs(chat(QUESTION, tools=[CALC]), served)
    turn = served.chat.write_turn(content="Checking.", reasoning="use calc",
                                  calls=[ToolCall("x", "calc", {"formula": "H2O"})])
    pieces = Pieces(generated(served, turn))
    chunks = await collect(chat_events(aiter(pieces), prompt, request_id="c", created=1,
                                       served=served), pieces)
    assert "".join(deltas(chunks, "reasoning_content")) == "use calc"
    content = deltas(chunks, "content")
    assert "".join(content) == "Checking." and len(content) > 1
    calls = [(call, consumed) for c, consumed in chunks
             for call in c["choices"][0]["delta"].get("tool_calls") or ()]
    ((call, consumed),) = calls
    assert (call["index"], call["function"]["name"]) == (0, "calc")
    assert json.loads(call["function"]["arguments"]) == {"formula": "H2O"}
    # Sent on the piece that brought <|call|> (the turn's last token), not a piece earlier.
    assert consumed == len(pieces.result.token_ids)
    assert chunks[-1][0]["choices"][0]["finish_reason"] == "tool_calls"


def test_harmony_settled_holds_a_header_a_call_and_bare_text_until_they_are_read() -> None:
    analysis = "<|channel|>analysis<|message|>think"
    assert harmony_settled(analysis) == analysis
    assert harmony_settled(analysis + "<|end|><|start|>assistant<|channel|>fin") == analysis + "<|end|>"
    call = "<|start|>assistant<|channel|>commentary to=functions.calc <|constrain|>json<|message|>{\"formula\""
    assert harmony_settled(analysis + "<|end|>" + call) == analysis + "<|end|>"
    assert harmony_settled(analysis + "<|end|>" + call + "}<|call|>") == analysis + "<|end|>" + call + "}<|call|>"
    assert harmony_settled("stray text") == ""
