"""Chat completions as plain logic, in the served model's own tokenizer, chat template and tool-call
format: the prompt is the template's render encoded once, tools and per-request template kwargs
reach the template, the official client's ``content: null`` assistant turns are normalised, the
answer's Hermes calls come back as OpenAI ``tool_calls`` (also as the ``openai`` package's own types
read them), a template's refusal is an OpenAI-shaped 400. No Ray, no HTTP. (Streamed answers:
test_serve_streaming.py.)

The demo model (ChatML, Hermes calls) is the served model; the real Qwen3 and Mistral templates
(tests/support/chat_models.py) show what the demo's does not: reasoning, a vendor template's refusal
(Mistral's strict alternation of roles), call ids the template needs in its own form.
"""

from __future__ import annotations

import json
from pathlib import Path

import openai.types.chat as openai_chat
import pytest

from rollmesh.chat import ChatModel, ToolCall
from rollmesh.engine.protocols import GenerationResult
from rollmesh.serve_apps import InvalidApiRequestError, ServedModel
from rollmesh.serve_apps.chat_requests import chat_inputs, chat_response
from rollmesh.serve_apps.http_shapes import ChatCompletionRequest
from support.serve_models import CALC, QUESTION, demo_served_model

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


@pytest.fixture(scope="module")
def served(demo_model_dir: Path) -> ServedModel:
    return demo_served_model(demo_model_dir)


def served_by(path: Path) -> ServedModel:
    chat = ChatModel.load(path)
    return ServedModel(name=path.name, max_seq_len=4096, vocab_size=chat.vocab_size, chat=chat)


def chat(*messages: dict, **fields: object) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": list(messages), **fields})


def generated(served: ServedModel, text: str, finish_reason: str = "eos") -> GenerationResult:
    """A turn the engine generated: ``text`` as the model writes it, encoded once as if sampled."""
    ids = served.chat.encode(text)
    return GenerationResult(ids, [-0.1] * len(ids), [2] * len(ids), finish_reason, 10)


def test_the_prompt_is_the_models_template_rendered_and_encoded_once(served: ServedModel) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    prompt = chat_inputs(chat(*messages), served)
    rendered = served.chat.render(messages, add_generation_prompt=True)
    assert rendered == "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert prompt.input_ids == served.chat.encode(rendered)
    assert served.chat.decode(prompt.input_ids) == rendered
    assert prompt.tools is None and prompt.chat.tool_parser is None  # no tools: no calls are read


def test_tools_reach_the_template_and_a_hermes_call_comes_back_as_openai_tool_calls(
    served: ServedModel,
) -> None:
    request = chat(QUESTION, tools=[CALC])
    prompt = chat_inputs(request, served)
    assert prompt.input_ids == served.chat.encode(
        served.chat.render([QUESTION], tools=[CALC], add_generation_prompt=True))
    assert "Tools: calc(formula)" in served.chat.decode(prompt.input_ids)

    turn = served.chat.write_turn(content="", calls=[ToolCall("x", "calc", {"formula": "H2O"})])
    assert turn == '<tool_call>\n{"name": "calc", "arguments": {"formula": "H2O"}}\n</tool_call><|im_end|>'
    response = chat_response(generated(served, turn), prompt, request_id="chatcmpl-1", created=1,
                             served=served)
    (choice,) = response.choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert (call.id, call.type, call.function.name) == ("call_0", "function", "calc")
    assert json.loads(call.function.arguments) == {"formula": "H2O"}

    # The official client's own types read the answer as a tool call.
    parsed = openai_chat.ChatCompletion.model_validate(response.model_dump())
    assert parsed.choices[0].message.tool_calls[0].function.name == "calc"
    assert parsed.choices[0].finish_reason == "tool_calls"


def test_text_beside_a_call_is_content_without_the_markup_and_a_bad_call_stays_in_it(
    served: ServedModel,
) -> None:
    prompt = chat_inputs(chat(QUESTION, tools=[CALC]), served)
    text = 'Let me check.\n<tool_call>\n{"name": "calc", "arguments": {"formula": "H2O"}}\n</tool_call><|im_end|>'
    (choice,) = chat_response(generated(served, text), prompt, request_id="c", created=1,
                              served=served).choices
    assert choice.message.content == "Let me check."
    assert [c.function.name for c in choice.message.tool_calls] == ["calc"]

    unknown = '<tool_call>\n{"name": "weather", "arguments": {}}\n</tool_call><|im_end|>'
    (choice,) = chat_response(generated(served, unknown), prompt, request_id="c", created=1,
                              served=served).choices
    assert choice.message.tool_calls is None
    assert choice.finish_reason == "stop"
    assert '"name": "weather"' in choice.message.content


def test_without_tools_call_markup_is_plain_content(served: ServedModel) -> None:
    prompt = chat_inputs(chat(QUESTION), served)
    text = '<tool_call>\n{"name": "calc", "arguments": {"formula": "H2O"}}\n</tool_call><|im_end|>'
    (choice,) = chat_response(generated(served, text), prompt, request_id="c", created=1,
                              served=served).choices
    assert choice.message.tool_calls is None
    assert choice.message.content == text.removesuffix("<|im_end|>")


def test_an_assistant_turn_with_content_null_and_tool_calls_is_rendered_as_the_template_expects(
    served: ServedModel,
) -> None:
    # What the openai client sends back after a tool call: content null, arguments a JSON string.
    history = [
        QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_0", "type": "function",
             "function": {"name": "calc", "arguments": '{"formula": "H2O"}'}}]},
        {"role": "tool", "tool_call_id": "call_0", "content": "18.015"},
    ]
    prompt = chat_inputs(chat(*history, tools=[CALC]), served)
    expected = [QUESTION, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_0", "type": "function",
         "function": {"name": "calc", "arguments": {"formula": "H2O"}}}]},
        {"role": "tool", "tool_call_id": "call_0", "content": "18.015"}]
    rendered = served.chat.render(expected, tools=[CALC], add_generation_prompt=True)
    assert '{"name": "calc", "arguments": {"formula": "H2O"}}' in rendered
    assert prompt.input_ids == served.chat.encode(rendered)
    assert prompt.first_call_index == 1  # the next call's id is not the earlier one's

    turn = served.chat.write_turn(content="", calls=[ToolCall("x", "calc", {"formula": "NaCl"})])
    (call,) = chat_response(generated(served, turn), prompt, request_id="c", created=1,
                            served=served).choices[0].message.tool_calls
    assert call.id == "call_1"


def test_call_ids_the_template_would_refuse_are_replaced_and_their_results_follow(
    chat_model_dirs: dict[str, Path],
) -> None:
    served = served_by(chat_model_dirs["mistral"])
    history = [
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_abc", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_abc", "content": "sunny"},
    ]
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}
    text = served.chat.decode(chat_inputs(chat(*history, tools=[weather]), served).input_ids)
    assert "call_abc" not in text
    (renamed,) = {part[:9] for part in text.split('"id": "')[1:]}
    assert len(renamed) == 9 and renamed.isalnum()
    assert f'"call_id": "{renamed}"' in text
    # A later request that no longer declares the tools still carries the calls in the history.
    assert served.chat.decode(chat_inputs(chat(*history), served).input_ids).count(renamed) == 2


def test_a_template_refusal_is_an_openai_shaped_400(chat_model_dirs: dict[str, Path]) -> None:
    served = served_by(chat_model_dirs["mistral"])
    with pytest.raises(InvalidApiRequestError) as raised:
        chat_inputs(chat({"role": "user", "content": "one"}, {"role": "user", "content": "two"}), served)
    error = raised.value
    assert error.status == 400
    assert "conversation roles must alternate user/assistant" in error.message
    assert error.to_response().model_dump() == {"error": {
        "message": error.message, "type": "invalid_request_error", "code": "invalid_messages",
        "param": "messages"}}


@pytest.mark.parametrize(("fields", "param", "code"), [
    ({"messages": []}, "messages", "invalid_value"),
    ({"messages": [{"role": "user", "content": "7" * 300}]}, "messages", "prompt_too_long"),
    ({"n": 2}, "n", "unsupported_value"),
    ({"max_completion_tokens": 257}, "max_completion_tokens", "invalid_value"),
    ({"temperature": -1.0}, "temperature", "invalid_value"),
    ({"messages": [{"role": "user", "content": None}]}, "messages.0.content", "invalid_value"),
    ({"messages": [{"role": "assistant", "content": None}]}, "messages.0.content", "invalid_value"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "function": {"name": "calc", "arguments": "{not json"}}]}]},
     "messages.0.tool_calls.0.function.arguments", "invalid_value"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "function": {"name": "calc", "arguments": "[1]"}}]}]},
     "messages.0.tool_calls.0.function.arguments", "invalid_value"),
    ({"tools": [CALC, {"type": "function", "function": {"description": "nameless"}}]}, "tools.1",
     "invalid_value"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]},
     "tools.0", "invalid_value"),
    ({"tools": [CALC], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "unknown_tool"),
    ({"tool_choice": "required"}, "tool_choice", "invalid_value"),  # no tools to call
    ({"tool_choice": "sometimes"}, "tool_choice", "invalid_value"),
    ({"tools": [CALC], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format", "invalid_value"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
     "response_format.json_schema.schema", "invalid_value"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs",
     "invalid_value"),
])
def test_bad_chat_requests_name_their_parameter(
    served: ServedModel, fields: dict, param: str, code: str,
) -> None:
    with pytest.raises(InvalidApiRequestError) as raised:
        chat_inputs(chat(**{"messages": [QUESTION], **fields}), served)
    assert (raised.value.status, raised.value.param, raised.value.code) == (400, param, code)


def test_tool_choice_none_leaves_the_tools_out_and_reads_no_calls(served: ServedModel) -> None:
    prompt = chat_inputs(chat(QUESTION, tools=[CALC], tool_choice="none"), served)
    assert prompt.tools is None
    assert "Tools:" not in served.chat.decode(prompt.input_ids)


def test_a_function_without_parameters_takes_none(served: ServedModel) -> None:
    now = {"type": "function", "function": {"name": "now"}}
    prompt = chat_inputs(chat(QUESTION, tools=[now]), served)
    assert "Tools: now()" in served.chat.decode(prompt.input_ids)


def test_request_template_kwargs_reach_the_template_and_reasoning_comes_back(
    chat_model_dirs: dict[str, Path],
) -> None:
    served = served_by(chat_model_dirs["qwen3"])
    assert served.chat.reasoning_parser == "qwen3"
    thinking = chat_inputs(chat(QUESTION), served)
    quiet = chat_inputs(chat(QUESTION, chat_template_kwargs={"enable_thinking": False}), served)
    assert quiet.input_ids == served.chat.encode(served.chat.render(
        [QUESTION], add_generation_prompt=True).__add__("<think>\n\n</think>\n\n"))
    assert quiet.input_ids != thinking.input_ids

    answer = generated(served, "<think>\nwater: 2 H and 1 O\n</think>\n\nAbout 18.<|im_end|>")
    message = chat_response(answer, thinking, request_id="c", created=1, served=served).choices[0].message
    assert (message.reasoning_content, message.content) == ("water: 2 H and 1 O", "About 18.")


def test_chat_max_completion_tokens_wins_and_the_default_is_the_context(served: ServedModel) -> None:
    assert chat_inputs(chat(QUESTION), served).sampling.max_new_tokens == served.max_seq_len
    prompt = chat_inputs(chat(QUESTION, max_tokens=9, max_completion_tokens=3), served)
    assert prompt.sampling.max_new_tokens == 3


def test_chat_response_cuts_the_stop_string_like_completions(served: ServedModel) -> None:
    prompt = chat_inputs(chat(QUESTION, stop=["\n"], max_tokens=8), served)
    result = generated(served, "ok\nmore", finish_reason="stop")
    response = chat_response(result, prompt, request_id="chatcmpl-1", created=1, served=served)
    (choice,) = response.choices
    assert choice.message.content == "ok"
    assert choice.finish_reason == "stop"
    assert choice.weight_versions == [2] * len(result.token_ids)
    assert response.usage.total_tokens == 10 + len(result.token_ids)


def test_tool_choice_required_and_response_format_become_the_requests_grammar(served: ServedModel) -> None:
    """The grammar itself (what it lets a model write) is tested in test_serve_tool_choice.py."""
    assert chat_inputs(chat(QUESTION, tools=[CALC]), served).grammar is None  # "auto"
    required = chat_inputs(chat(QUESTION, tools=[CALC], tool_choice="required"), served)
    named = chat_inputs(chat(QUESTION, tools=[CALC], tool_choice={
        "type": "function", "function": {"name": "calc"}}), served)
    as_json = chat_inputs(chat(QUESTION, response_format={"type": "json_object"}), served)
    for prompt in (required, named, as_json):
        assert prompt.grammar.kind == "structural_tag"
        assert prompt.grammar.end_ids == tuple(served.chat.encode("<|im_end|>"))
    assert required.tools and required.chat.tool_parser == "hermes"  # the calls are read back
    assert required.grammar != named.grammar


def test_a_constrained_answer_says_which_tokens_the_grammar_restricted(served: ServedModel) -> None:
    prompt = chat_inputs(chat(QUESTION, tools=[CALC], tool_choice="required"), served)
    text = '<tool_call>\n{"name": "calc", "arguments": {"formula": "H2O"}}\n</tool_call><|im_end|>'
    ids = served.chat.encode(text)
    flags = [True] * (len(ids) - 3) + [False, True, True]
    result = GenerationResult(ids, [-0.1] * len(ids), [2] * len(ids), "eos", 10, constrained=flags)
    (choice,) = chat_response(result, prompt, request_id="c", created=1, served=served).choices
    assert choice.constrained == flags and choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls[0].function.arguments == '{"formula": "H2O"}'
    free = chat_inputs(chat(QUESTION, tools=[CALC]), served)
    assert chat_response(result, free, request_id="c", created=1, served=served).choices[0].constrained is None
