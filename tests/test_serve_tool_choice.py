"""The grammars of tool_choice "required" / a named function and response_format, per tool-call
family: whatever a model samples under them (here: random logits, masked as the engine masks them)
is read back by the family's own parser as calls to declared tools whose arguments match their
schemas. Bad choices and formats are 400s naming the parameter."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch

from rollmesh.chat import ChatModel
from rollmesh.engine.guided_decoding import GuidedDecoder, accept
from rollmesh.engine.protocols import GrammarSpec
from rollmesh.engine.sampling import sample_tokens
from rollmesh.serve_apps.chat_messages import template_tools
from rollmesh.serve_apps.errors import InvalidApiRequestError
from rollmesh.serve_apps.tool_choice import response_format_grammar, tool_choice_grammar

pytestmark = pytest.mark.unit

# Finite arguments, so random logits reach the end of a call within a few dozen tokens.
WEIGH = {"type": "function", "function": {"name": "weigh", "description": "weigh it", "parameters": {
    "type": "object", "properties": {"unit": {"enum": ["g", "kg"]}, "exact": {"type": "boolean"}},
    "required": ["unit", "exact"]}}}
CONVERT = {"type": "function", "function": {"name": "convert", "description": "convert it", "parameters": {
    "type": "object", "properties": {"to": {"enum": ["mol", "L"]}}, "required": ["to"]}}}
TOOLS = template_tools([WEIGH, CONVERT])
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
FAMILIES = ["qwen2_5", "qwen3", "llama3", "mistral", "deepseek_v3", "kimi_k2", "gpt_oss"]


def sample_under(grammar: GrammarSpec, chat: ChatModel, seed: int, max_tokens: int = 300) -> list[int]:
    """Ids drawn from random logits under ``grammar``'s mask until an end-of-turn id."""
    guided = GuidedDecoder(chat, vocab_size=chat.vocab_size, end_of_turn_ids=chat.end_of_turn_ids)
    matcher = guided.matcher(grammar)
    generator = torch.Generator().manual_seed(seed)
    ids: list[int] = []
    for _ in range(max_tokens):
        logits = torch.randn(1, chat.vocab_size, generator=generator)
        guided.mask(logits, [matcher])
        token = int(sample_tokens(logits, torch.tensor([1.0]), torch.tensor([1.0]), generator)[0][0])
        assert accept(matcher, token)
        ids.append(token)
        if token in chat.end_of_turn_ids:
            return ids
    raise AssertionError(f"no end of turn within {max_tokens} tokens: {chat.decode(ids)!r}")


@pytest.fixture(scope="module")
def chats(chat_model_dirs: dict[str, Path]) -> dict[str, ChatModel]:
    return {family: ChatModel.load(chat_model_dirs[family]) for family in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_a_forced_call_in_the_models_own_format_parses_and_matches_its_schema(chats, family) -> None:
    chat = chats[family]
    prompt = chat.encode(chat.render([{"role": "user", "content": "weigh it"}], tools=TOOLS,
                                     add_generation_prompt=True))
    cases = [("required", None), ({"type": "function", "function": {"name": "convert"}}, "convert")]
    for choice, only in cases:
        grammar = tool_choice_grammar(choice, TOOLS, chat)
        for seed in range(2):
            ids = sample_under(grammar, chat, seed)
            assert ids[-1] == grammar.end_ids[0]  # the turn ends as the template closes it
            parsed = chat.parse_turn(ids, tools=TOOLS, first_call_index=0, prompt_ids=prompt)
            assert parsed.tool_calls and not parsed.malformed, chat.decode(ids)
            if only or family == "gpt_oss":  # harmony: one call per turn
                assert len(parsed.tool_calls) == 1
            for call in parsed.tool_calls:
                assert call.name == only if only else call.name in SCHEMAS
                jsonschema.validate(call.arguments, SCHEMAS[call.name])


def test_markers_that_are_tokens_are_forced_as_those_tokens(chats) -> None:
    chat = chats["qwen3"]
    ids = sample_under(tool_choice_grammar("required", TOOLS, chat), chat, seed=0)
    assert ids[0] == chat.encode("<tool_call>")[0] and len(chat.encode("<tool_call>")) == 1


def test_response_format_json_schema_and_json_object_give_json(chats) -> None:
    chat = chats["qwen3"]
    schema = WEIGH["function"]["parameters"]
    grammar = response_format_grammar({"type": "json_schema", "json_schema": {"name": "w", "schema": schema}},
                                      chat)
    ids = sample_under(grammar, chat, 0)
    jsonschema.validate(json.loads(chat.decode(ids[:-1])), schema)
    assert chat.decode(ids[-1:]) == "<|im_end|>"  # the template's turn end, not <|endoftext|>
    assert response_format_grammar({"type": "text"}, chat) is None
    any_object = response_format_grammar({"type": "json_object"}, chat)
    assert json.loads(any_object.text)["format"]["json_schema"] == {"type": "object"}


@pytest.mark.parametrize(("choice", "code"), [
    ({"type": "function", "function": {"name": "nope"}}, "unknown_tool"),
    ({"type": "function"}, "invalid_value"),
    ("sometimes", "invalid_value"),
])
def test_a_bad_tool_choice_is_a_400_on_tool_choice(chats, choice, code) -> None:
    with pytest.raises(InvalidApiRequestError) as caught:
        tool_choice_grammar(choice, TOOLS, chats["qwen3"])
    assert caught.value.param == "tool_choice" and caught.value.code == code


def test_required_without_tools_is_a_400(chats) -> None:
    with pytest.raises(InvalidApiRequestError, match="at least one tool"):
        tool_choice_grammar("required", None, chats["qwen3"])


@pytest.mark.parametrize("response_format", [
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strng"}}},
    {"type": "json_schema", "json_schema": {"name": "x"}},
    {"type": "yaml"},
])
def test_a_bad_response_format_is_a_400_on_response_format(chats, response_format) -> None:
    with pytest.raises(InvalidApiRequestError) as caught:
        response_format_grammar(response_format, chats["qwen3"])
    assert caught.value.param.startswith("response_format")


def test_no_end_of_turn_id_is_allowed_inside_a_json_string(chats) -> None:
    """The ids the grammar does not end on are banned, not made plain text (which xgrammar's own
    stop-token override would let into a string)."""
    chat = chats["qwen3"]
    assert len(chat.end_of_turn_ids) > 1
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    grammar = response_format_grammar({"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}, chat)
    guided = GuidedDecoder(chat, vocab_size=chat.vocab_size, end_of_turn_ids=chat.end_of_turn_ids)
    constraint = guided.matcher(grammar)
    for token in chat.encode('{"a": "xy'):
        assert accept(constraint, token)
    logits = torch.zeros(1, chat.vocab_size)
    guided.mask(logits, [constraint])
    assert all(logits[0, end] == float("-inf") for end in chat.end_of_turn_ids)
    assert logits[0, chat.encode("<|im_start|>")[0]] == float("-inf")  # nor an added token
