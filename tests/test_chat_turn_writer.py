"""Each family's turn writer (rollmesh.chat.turn_writer and the write_* next to each parser) reads
back through the family's own parser: content, reasoning, calls, ids and the argument form."""

from __future__ import annotations

import pytest

from rollmesh.chat.tool_calls import TOOL_PARSERS, ToolCall, make_call_id, parse_assistant_turn
from rollmesh.chat.turn_writer import ONE_CALL_PER_TURN, TOOL_WRITERS, write_assistant_turn

pytestmark = pytest.mark.unit

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
END_OF_TURN = {"hermes": "<|im_end|>", "llama3_json": "<|eot_id|>", "mistral": "</s>",
               "deepseek_v3": "<\uff5cend\u2581of\u2581sentence\uff5c>", "kimi_k2": "<|im_end|>", "gpt_oss": "<|return|>"}
REASONING = {"hermes": "qwen3", "deepseek_v3": "deepseek_r1", "gpt_oss": "gpt_oss"}


def calls_for(parser: str, count: int, *, as_string: bool) -> list[ToolCall]:
    style = TOOL_PARSERS[parser].call_id_style
    cities = ["Paris", "Tokyo \u6771\u4eac", 'Quote "q"']
    return [ToolCall(make_call_id(style, index, name="get_weather"), "get_weather", {"city": cities[index]},
                     index=index, arguments_were_string=as_string) for index in range(count)]


def test_every_tool_parser_has_a_writer():
    assert TOOL_WRITERS.keys() == TOOL_PARSERS.keys()


@pytest.mark.parametrize("as_string", [False, True], ids=["object", "string"])
@pytest.mark.parametrize("content", ["", "Let me check."], ids=["no-content", "content"])
@pytest.mark.parametrize(("parser", "count"), [
    (parser, count) for parser in sorted(TOOL_PARSERS) for count in (0, 1, 2)
    if count < 2 or parser not in ONE_CALL_PER_TURN   # harmony ends a turn at each call
])
def test_written_turn_parses_back(parser, count, content, as_string):
    if count == 0 and not content:
        content = "Sunny."
    calls = calls_for(parser, count, as_string=as_string)
    text = write_assistant_turn(tool_parser=parser, reasoning_parser=None, content=content, calls=calls,
                                end_of_turn=END_OF_TURN[parser])
    parsed = parse_assistant_turn(text, tool_parser=parser, tools=TOOLS)
    assert parsed.malformed == []
    assert parsed.tool_calls == calls
    assert parsed.content == content


def test_harmony_refuses_two_calls_in_one_turn():
    with pytest.raises(ValueError, match="one turn"):
        write_assistant_turn(tool_parser="gpt_oss", reasoning_parser="gpt_oss", content="",
                             calls=calls_for("gpt_oss", 2, as_string=False), end_of_turn="<|return|>")


def test_harmony_call_ends_with_call_token():
    text = write_assistant_turn(tool_parser="gpt_oss", reasoning_parser="gpt_oss", content="",
                                calls=calls_for("gpt_oss", 1, as_string=False), end_of_turn="<|return|>")
    assert text == '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>'


@pytest.mark.parametrize(("parser", "prompt_opened"), [
    (parser, opened) for parser in sorted(REASONING) for opened in (False, True)
    if not (opened and parser == "gpt_oss")   # harmony's prompt never opens reasoning
])
def test_reasoning_and_calls_parse_back(parser, prompt_opened):
    reasoning_parser = REASONING[parser]
    calls = calls_for(parser, 1, as_string=False)
    text = write_assistant_turn(tool_parser=parser, reasoning_parser=reasoning_parser, content="",
                                calls=calls, reasoning="Two cities.\nParis first.",
                                prompt_opened_reasoning=prompt_opened, end_of_turn=END_OF_TURN[parser])
    parsed = parse_assistant_turn(text, tool_parser=parser, reasoning_parser=reasoning_parser, tools=TOOLS,
                                  starts_in_reasoning=prompt_opened)
    assert parsed.reasoning == "Two cities.\nParis first."
    assert parsed.tool_calls == calls and parsed.content == ""


def test_qwen3_reasoning_is_written_as_qwen3_writes_it():
    text = write_assistant_turn(tool_parser="hermes", reasoning_parser="qwen3", content="Sunny.",
                                reasoning="Easy.", end_of_turn="<|im_end|>")
    assert text == "<think>\nEasy.\n</think>\n\nSunny.<|im_end|>"


def test_a_turn_the_model_cannot_write_is_refused():
    with pytest.raises(ValueError, match="tool format"):
        write_assistant_turn(tool_parser=None, reasoning_parser=None, content="",
                             calls=calls_for("hermes", 1, as_string=False), end_of_turn="<|im_end|>")
    with pytest.raises(ValueError, match="reasoning format"):
        write_assistant_turn(tool_parser="hermes", reasoning_parser=None, content="x", reasoning="r",
                             end_of_turn="<|im_end|>")
