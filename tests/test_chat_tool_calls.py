"""Tool-call parsers on turns as the models write them: the real templates' own rendering of
assistant tool calls (tests/data/chat_templates, rendered by transformers' Jinja renderer) and
outputs quoted from the upstream parsers' tests (vLLM tests/tool_parsers, SGLang's detectors)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jinja2.exceptions import TemplateError
from transformers import AutoTokenizer
from transformers.utils.chat_template_utils import render_jinja_template

from rollmesh.chat.errors import InvalidToolDeclarationError, UnknownParserError
from rollmesh.chat.reasoning import REASONING_PARSERS
from rollmesh.chat.tool_calls import (
    TOOL_PARSERS,
    ToolCall,
    conform_call_id,
    detect_tool_parser,
    make_call_id,
    parse_assistant_turn,
    parse_tool_calls,
)
from rollmesh.chat.tool_schemas import ToolSet

pytestmark = pytest.mark.unit

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "description": "Time now", "parameters": {"type": "object", "properties": {}}},
}
TOOLS = [WEATHER, TIME]
MISTRAL_TOKENS = {"bos_token": "<s>", "eos_token": "</s>"}


def template(family: str) -> str:
    return (TEMPLATES / f"{family}.jinja").read_text()


def rendered_assistant_turn(family: str, tool_calls: list[dict], **template_kwargs) -> str:
    """What the template writes for an assistant turn: the whole render minus the prompt before it."""
    user = [{"role": "user", "content": "What is the weather?"}]
    content = None if family == "deepseek_v3" else ""  # DeepSeek's template tests `content is none`
    assistant = {"role": "assistant", "content": content, "tool_calls": tool_calls}
    chat_template = template(family)
    prompt, _ = render_jinja_template(
        [user], tools=TOOLS, chat_template=chat_template, add_generation_prompt=True, **template_kwargs
    )
    whole, _ = render_jinja_template([user + [assistant]], tools=TOOLS, chat_template=chat_template, **template_kwargs)
    assert whole[0].startswith(prompt[0])
    return whole[0][len(prompt[0]) :]


def openai_calls(cities: list[str], *, arguments_as_string: bool, ids: list[str]) -> list[dict]:
    def arguments(city: str) -> str | dict:
        return json.dumps({"city": city}) if arguments_as_string else {"city": city}

    return [
        {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": arguments(city)}}
        for city, call_id in zip(cities, ids, strict=True)
    ]


def hermes(*calls: dict) -> str:
    return "".join(f"<tool_call>\n{json.dumps(call)}\n</tool_call>" for call in calls)


# family, tool parser, reasoning parser, cities, arguments given as a string, template kwargs
RENDERED = [
    ("qwen2_5", "hermes", None, ["Paris", "Rome"], True, {}),
    ("qwen3", "hermes", "qwen3", ["Paris", "Rome"], False, {}),
    ("llama3", "llama3_json", None, ["Paris"], False, {"date_string": "26 Jul 2024"}),
    ("mistral", "mistral", None, ["Paris", "Rome"], True, MISTRAL_TOKENS),
    ("deepseek_v3", "deepseek_v3", "deepseek_r1", ["Paris", "Rome"], True, {"bos_token": "<｜begin▁of▁sentence｜>"}),
    ("kimi_k2", "kimi_k2", None, ["Paris", "Rome"], False, {}),
    ("gpt_oss", "gpt_oss", "gpt_oss", ["Paris"], False, {}),
]


@pytest.mark.parametrize(
    ("family", "parser", "reasoning_parser", "cities", "as_string", "kwargs"), RENDERED, ids=[r[0] for r in RENDERED]
)
def test_template_rendered_tool_calls_parse_back_to_the_same_calls(
    family, parser, reasoning_parser, cities, as_string, kwargs
):
    style = TOOL_PARSERS[parser].call_id_style
    ids = [make_call_id(style, index, name="get_weather") for index in range(len(cities))]
    turn = rendered_assistant_turn(family, openai_calls(cities, arguments_as_string=as_string, ids=ids), **kwargs)

    parsed = parse_assistant_turn(
        turn, tool_parser=parser, reasoning_parser=reasoning_parser, tools=TOOLS, starts_in_reasoning=False
    )

    assert parsed.malformed == []
    assert [(call.name, call.arguments) for call in parsed.tool_calls] == [
        ("get_weather", {"city": city}) for city in cities
    ]
    assert [call.id for call in parsed.tool_calls] == ids
    assert parsed.content == ""


@pytest.mark.parametrize(
    ("family", "parser", "reasoning_parser", "cities", "as_string", "kwargs"), RENDERED, ids=[r[0] for r in RENDERED]
)
def test_turn_decoded_from_its_ids_with_special_tokens_kept_parses_to_the_same_calls(
    chat_model_dirs, family, parser, reasoning_parser, cities, as_string, kwargs
):
    # The family's tokenizer (tests/support/chat_models.py): the turn's ids as if sampled, decoded as the
    # rollout will decode them, special tokens kept.
    tokenizer = AutoTokenizer.from_pretrained(chat_model_dirs[family])
    style = TOOL_PARSERS[parser].call_id_style
    ids = [make_call_id(style, index, name="get_weather") for index in range(len(cities))]
    turn = rendered_assistant_turn(family, openai_calls(cities, arguments_as_string=as_string, ids=ids), **kwargs)
    sampled = tokenizer.encode(turn, add_special_tokens=False)

    text = tokenizer.decode(sampled, skip_special_tokens=False)
    parsed = parse_assistant_turn(
        text, tool_parser=parser, reasoning_parser=reasoning_parser, tools=TOOLS, starts_in_reasoning=False
    )

    assert [(call.id, call.name, call.arguments) for call in parsed.tool_calls] == [
        (call_id, "get_weather", {"city": city}) for call_id, city in zip(ids, cities, strict=True)
    ]
    assert parsed.malformed == []


def test_kimi_calls_are_lost_when_special_tokens_are_skipped_in_decoding(chat_model_dirs):
    tokenizer = AutoTokenizer.from_pretrained(chat_model_dirs["kimi_k2"])
    turn = rendered_assistant_turn("kimi_k2", openai_calls(["Paris"], arguments_as_string=False, ids=["x"]))
    sampled = tokenizer.encode(turn, add_special_tokens=False)

    kept = parse_tool_calls(tokenizer.decode(sampled, skip_special_tokens=False), "kimi_k2", TOOLS)
    skipped = parse_tool_calls(tokenizer.decode(sampled, skip_special_tokens=True), "kimi_k2", TOOLS)

    assert [call.id for call in kept.tool_calls] == ["functions.get_weather:0"]
    assert skipped.tool_calls == [] and skipped.malformed == []


def test_qwen2_5_template_writes_string_arguments_that_are_decoded_once_and_recorded():
    turn = rendered_assistant_turn("qwen2_5", openai_calls(["Paris"], arguments_as_string=True, ids=["call_0"]))
    assert '"arguments": "{\\"city\\": \\"Paris\\"}"' in turn  # the template's own double encoding

    (call,) = parse_tool_calls(turn, "hermes", TOOLS).tool_calls

    assert call.arguments == {"city": "Paris"}
    assert call.arguments_were_string


def test_hermes_several_calls_with_content_before_and_after():
    calls = hermes(
        {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}},
        {"name": "get_time", "arguments": {}},
    )
    parsed = parse_tool_calls(f"I will look both up.\n{calls}\nThen I will answer.<|im_end|>", "hermes", TOOLS)

    assert parsed.content == "I will look both up.\nThen I will answer."
    assert [(c.id, c.name, c.arguments, c.index) for c in parsed.tool_calls] == [
        ("call_0", "get_weather", {"city": "Paris", "unit": "celsius"}, 0),
        ("call_1", "get_time", {}, 1),
    ]


def test_hermes_closing_tag_inside_an_argument_does_not_cut_the_call():
    text = hermes({"name": "get_weather", "arguments": {"city": "a </tool_call> b"}})
    (call,) = parse_tool_calls(text, "hermes", TOOLS).tool_calls
    assert call.arguments == {"city": "a </tool_call> b"}


def test_hermes_unclosed_tool_call_is_reported_as_truncated_not_raised():
    cut = '<tool_call>\n{"name": "get_time", "argu'
    parsed = parse_tool_calls(hermes({"name": "get_weather", "arguments": {"city": "Paris"}}) + cut, "hermes", TOOLS)

    assert [call.name for call in parsed.tool_calls] == ["get_weather"]
    (bad,) = parsed.malformed
    assert (bad.kind, bad.id, bad.index, bad.raw) == ("truncated", "call_1", 1, cut)


def test_hermes_call_complete_but_closing_tag_missing_is_truncated():
    parsed = parse_tool_calls('<tool_call>\n{"name": "get_time", "arguments": {}}\n', "hermes", TOOLS)
    assert parsed.tool_calls == [] and parsed.malformed[0].kind == "truncated"


def test_malformed_json_is_reported_and_later_calls_still_parse():
    broken = '<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>'
    parsed = parse_tool_calls(broken + hermes({"name": "get_time", "arguments": {}}), "hermes", TOOLS)

    (bad,) = parsed.malformed
    assert (bad.kind, bad.raw) == ("bad_json", broken)
    assert "invalid JSON" in bad.reason
    assert [(call.id, call.name) for call in parsed.tool_calls] == [("call_1", "get_time")]


def test_unknown_tool_is_malformed_and_names_the_declared_tools():
    (bad,) = parse_tool_calls(hermes({"name": "rm_rf", "arguments": {}}), "hermes", TOOLS).malformed
    assert (bad.kind, bad.name) == ("unknown_tool", "rm_rf")
    assert "get_weather" in bad.reason and "get_time" in bad.reason


@pytest.mark.parametrize(
    ("arguments", "expected_in_reason"),
    [
        ({}, "'city' is a required property"),
        ({"city": 3}, "city: 3 is not of type 'string'"),
        ({"city": "Paris", "unit": "kelvin"}, "unit"),
    ],
)
def test_arguments_that_do_not_match_the_schema_are_malformed(arguments, expected_in_reason):
    (bad,) = parse_tool_calls(hermes({"name": "get_weather", "arguments": arguments}), "hermes", TOOLS).malformed
    assert bad.kind == "schema_mismatch"
    assert expected_in_reason in bad.reason


def test_arguments_as_a_string_are_decoded_exactly_once():
    once = json.dumps({"city": "Paris"})
    ok = parse_tool_calls(hermes({"name": "get_weather", "arguments": once}), "hermes", TOOLS)
    double = parse_tool_calls(hermes({"name": "get_weather", "arguments": json.dumps(once)}), "hermes", TOOLS)
    not_json = parse_tool_calls(hermes({"name": "get_weather", "arguments": "Paris"}), "hermes", TOOLS)

    assert ok.tool_calls[0].arguments == {"city": "Paris"} and ok.tool_calls[0].arguments_were_string
    assert double.malformed[0].kind == "bad_arguments" and "got str" in double.malformed[0].reason
    assert not_json.malformed[0].kind == "bad_arguments"


def test_llama3_python_tag_calls_separated_by_semicolons():
    # vLLM tests/tool_parsers/test_llama3_json_tool_parser.py and SGLang's llama32 detector.
    text = (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        '{"name": "get_time", "parameters": {}}<|eom_id|>'
    )
    parsed = parse_tool_calls(text, "llama3_json", TOOLS)
    assert [(c.id, c.name, c.arguments) for c in parsed.tool_calls] == [
        ("call_0", "get_weather", {"city": "Paris"}),
        ("call_1", "get_time", {}),
    ]
    assert parsed.content == "" and parsed.malformed == []


def test_llama3_text_and_json_answers_without_a_name_stay_content():
    prose = parse_tool_calls("The weather is fine.<|eot_id|>", "llama3_json", TOOLS)
    answer = parse_tool_calls('{"temperature": 21}<|eot_id|>', "llama3_json", TOOLS)
    assert (prose.content, prose.tool_calls) == ("The weather is fine.", [])
    assert (answer.content, answer.tool_calls, answer.malformed) == ('{"temperature": 21}', [], [])


def test_llama3_truncated_call_is_malformed():
    (bad,) = parse_tool_calls('{"name": "get_weather", "parameters": {"ci', "llama3_json", TOOLS).malformed
    assert bad.kind == "truncated"


def test_mistral_array_form_keeps_valid_ids_and_replaces_invalid_ones():
    # vLLM tests/tool_parsers/test_mistral_tool_parser.py (pre-v11 tokenizer output).
    text = (
        'Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "San Francisco", "unit": "celsius"}, '
        '"id": "abc123XYZ"}, {"name": "get_time", "arguments": {}, "id": "call_7"}]</s>'
    )
    parsed = parse_tool_calls(text, "mistral", TOOLS, first_call_index=4)

    assert parsed.content == "Sure."
    assert [(c.id, c.name) for c in parsed.tool_calls] == [
        ("abc123XYZ", "get_weather"),
        (make_call_id("mistral", 5, name="get_time"), "get_time"),
    ]


@pytest.mark.parametrize(
    "text",
    [
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}',  # Small 3.2, Magistral
        '[TOOL_CALLS]get_weather{"city": "Paris"}[TOOL_CALLS]get_time{}',  # tokenizer v11
    ],
)
def test_mistral_named_forms(text):
    parsed = parse_tool_calls(text + "</s>", "mistral", TOOLS)
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert all(len(c.id) == 9 and c.id.isalnum() for c in parsed.tool_calls)


def test_mistral_truncated_array_is_malformed():
    text = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Par'
    (bad,) = parse_tool_calls(text, "mistral", TOOLS).malformed
    assert bad.kind == "truncated"


def test_deepseek_v3_fenced_form_with_content_before():
    # SGLang python/sglang/srt/function_call/deepseekv3_detector.py's example output.
    text = (
        "Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
        '{"city": "Tokyo"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n'
        '{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>'
    )
    parsed = parse_tool_calls(text, "deepseek_v3", TOOLS)
    assert parsed.content == "Checking."
    assert [c.arguments["city"] for c in parsed.tool_calls] == ["Tokyo", "Paris"]


def test_deepseek_truncated_call_is_malformed():
    text = '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Pa'
    parsed = parse_tool_calls(text, "deepseek_v3", TOOLS)
    assert parsed.tool_calls == [] and parsed.malformed[0].kind == "truncated"


def test_kimi_ids_are_returned_unchanged():
    # vLLM tests/tool_parsers/test_kimi_k2_tool_parser.py writes spaces between the tokens.
    text = (
        "I'll help you check the weather. <|tool_calls_section_begin|> <|tool_call_begin|> "
        'functions.get_weather:7 <|tool_call_argument_begin|> {"city": "Beijing"} <|tool_call_end|> '
        "<|tool_call_begin|> functions.get_time:8 <|tool_call_argument_begin|> {} <|tool_call_end|> "
        "<|tool_calls_section_end|><|im_end|>"
    )
    parsed = parse_tool_calls(text, "kimi_k2", TOOLS, first_call_index=0)
    assert parsed.content == "I'll help you check the weather."
    assert [(c.id, c.name) for c in parsed.tool_calls] == [
        ("functions.get_weather:7", "get_weather"),
        ("functions.get_time:8", "get_time"),
    ]


def test_kimi_call_id_without_an_index_is_malformed():
    text = (
        "<|tool_calls_section_begin|><|tool_call_begin|>get_weather<|tool_call_argument_begin|>"
        '{"city": "X"}<|tool_call_end|><|tool_calls_section_end|>'
    )
    (bad,) = parse_tool_calls(text, "kimi_k2", TOOLS).malformed
    assert bad.kind == "bad_json" and "functions.NAME:INDEX" in bad.reason


def test_harmony_channels_reasoning_calls_and_final_content():
    # The message stream openai-harmony renders (vLLM tests/tool_parsers/test_openai_tool_parser.py),
    # with the recipient after the channel and, as the template writes it, in the role part.
    text = (
        "<|channel|>analysis<|message|>User asks for Tokyo. We need get_weather.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        '{"city": "Tokyo"}<|call|>'
        "<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{}<|call|>"
        "<|start|>assistant<|channel|>final<|message|>This will get the weather.<|return|>"
    )
    parsed = parse_assistant_turn(text, tool_parser="gpt_oss", reasoning_parser="gpt_oss", tools=TOOLS)

    assert parsed.reasoning == "User asks for Tokyo. We need get_weather."
    assert parsed.content == "This will get the weather."
    assert [(c.id, c.name, c.arguments) for c in parsed.tool_calls] == [
        ("call_0", "get_weather", {"city": "Tokyo"}),
        ("call_1", "get_time", {}),
    ]


def test_harmony_builtin_recipient_is_an_unknown_tool_and_a_cut_call_is_truncated():
    text = (
        '<|channel|>analysis to=browser.search <|constrain|>json<|message|>{"query": "x"}<|call|>'
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        '{"city": "To'
    )
    kinds = [(bad.name, bad.kind) for bad in parse_tool_calls(text, "gpt_oss", TOOLS).malformed]
    assert kinds == [("browser.search", "unknown_tool"), ("get_weather", "truncated")]


def test_calls_written_inside_reasoning_are_thoughts_not_calls():
    thought = hermes({"name": "get_time", "arguments": {}})
    text = f"<think>\nMaybe {thought}?\n</think>\n\nIt is noon.<|im_end|>"
    parsed = parse_assistant_turn(text, tool_parser="hermes", reasoning_parser="qwen3", tools=TOOLS)
    assert (parsed.tool_calls, parsed.malformed, parsed.content) == ([], [], "It is noon.")
    assert "<tool_call>" in (parsed.reasoning or "")


def test_mistral_ids_are_nine_alphanumerics_unique_and_accepted_by_its_template():
    ids = [make_call_id("mistral", index, name="get_weather") for index in range(0, 36**5, 36**3 + 7)]
    assert len(set(ids)) == len(ids)
    assert all(len(call_id) == 9 and call_id.isalnum() for call_id in ids)
    ours = openai_calls(["Paris"], arguments_as_string=True, ids=[ids[-1]])
    assert rendered_assistant_turn("mistral", ours, **MISTRAL_TOKENS).startswith("[TOOL_CALLS]")
    with pytest.raises(TemplateError, match="length 9"):
        openai_style = openai_calls(["Paris"], arguments_as_string=True, ids=["call_0"])
        rendered_assistant_turn("mistral", openai_style, **MISTRAL_TOKENS)


def test_conform_call_id_keeps_what_the_template_accepts():
    assert conform_call_id("mistral", "abcdefghi", 3, name="f") == "abcdefghi"
    assert conform_call_id("mistral", "call_3", 3, name="f") == make_call_id("mistral", 3, name="f")
    assert conform_call_id("kimi", "functions.f:2", 9, name="f") == "functions.f:2"
    assert conform_call_id("kimi", None, 9, name="f") == "functions.f:9"
    assert conform_call_id("openai", None, 4, name="f") == "call_4"


def test_tool_call_to_openai_writes_arguments_in_the_asked_form():
    call = ToolCall(id="call_0", name="get_weather", arguments={"city": "Paris"})
    assert call.to_openai()["function"]["arguments"] == '{"city": "Paris"}'
    assert call.to_openai(arguments_as="object")["function"]["arguments"] == {"city": "Paris"}


def test_bad_tool_declarations_and_unknown_parsers_are_typed_errors():
    with pytest.raises(InvalidToolDeclarationError) as missing_name:
        ToolSet.from_openai([{"type": "function", "function": {"parameters": {}}}])
    assert missing_name.value.tool_index == 0
    with pytest.raises(InvalidToolDeclarationError) as bad_schema:
        ToolSet.from_openai([{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}])
    assert bad_schema.value.name == "f"
    with pytest.raises(UnknownParserError) as unknown:
        parse_tool_calls("", "qwen_xml", TOOLS)
    assert unknown.value.name == "qwen_xml" and "hermes" in unknown.value.known


@pytest.mark.parametrize(
    ("family", "expected"),
    [
        ("qwen2_5", "hermes"),
        ("qwen3", "hermes"),
        ("llama3", "llama3_json"),
        ("mistral", "mistral"),
        ("deepseek_v3", "deepseek_v3"),
        ("kimi_k2", "kimi_k2"),
        ("gpt_oss", "gpt_oss"),
    ],
)
def test_tool_parser_is_detected_from_the_real_template(family, expected):
    assert detect_tool_parser(template(family)) == expected


def test_template_without_tool_markers_has_no_tool_parser():
    assert detect_tool_parser("{% for m in messages %}{{ m.content }}{% endfor %}") is None


# Pieces of every format, shuffled into turns no model should write but a sampler can.
FORMAT_PIECES = [
    *("<tool_call>", "</tool_call>", "<|python_tag|>", ";", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"),
    *("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>", "\n```json\n"),
    *("<|tool_calls_section_begin|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"),
    *("functions.get_weather:0", "<|start|>", "assistant", " to=functions.get_weather", "<|channel|>"),
    *("analysis", "commentary", "final", "<|constrain|>", "json", "<|message|>", "<|end|>", "<|call|>"),
    *("<think>", "</think>", '{"name": "get_weather", "arguments": {"city": "P"}}', '"{\\"city\\": 1}"'),
    *('{"name": "get_time", "parameters": ', '{"city": "x"}', "[", "]", "{", "}", '"', "\\", " ", "\n"),
]


@settings(max_examples=300, deadline=None)
@given(
    text=st.lists(st.sampled_from(FORMAT_PIECES), max_size=25).map("".join),
    tool_parser=st.sampled_from([*TOOL_PARSERS, None]),
    reasoning_parser=st.sampled_from([*REASONING_PARSERS, None]),
    starts_in_reasoning=st.sampled_from([None, True, False]),
)
def test_any_text_parses_without_raising_and_every_call_keeps_its_place(
    text, tool_parser, reasoning_parser, starts_in_reasoning
):
    parsed = parse_assistant_turn(
        text,
        tool_parser=tool_parser,
        reasoning_parser=reasoning_parser,
        tools=TOOLS,
        starts_in_reasoning=starts_in_reasoning,
    )
    places = sorted([call.index for call in parsed.tool_calls] + [bad.index for bad in parsed.malformed])
    assert places == list(range(len(places)))
