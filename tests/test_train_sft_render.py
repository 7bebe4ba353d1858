"""Supervised examples rendered whole by each family's real chat template: which tokens train
(loss_roles), the end-of-turn kept and what the template adds after it left out, tool calls in the
family's own form, the consistency check against the template's own assistant spans, and raw text
for midtraining."""

from __future__ import annotations

import pytest

from rollmesh.chat.chat_model import ChatModel
from rollmesh.training.sft_render import render_chat_example, render_text_example

pytestmark = pytest.mark.unit

CONVERSATION = [
    {"role": "system", "content": "You add."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "5"},
    {"role": "user", "content": "And 4 + 4?"},
    {"role": "assistant", "content": "It is 8."},
]
# Families whose rendering of a conversation's first turns is a prefix of the whole one's.
PREFIX_STABLE = ("qwen2_5", "llama3", "mistral", "deepseek_v3", "kimi_k2")


@pytest.fixture(scope="module")
def chats(chat_model_dirs) -> dict[str, ChatModel]:
    return {family: ChatModel.load(path) for family, path in chat_model_dirs.items()}


def trained_text(chat: ChatModel, ids: list[int], mask: list[int]) -> str:
    return chat.decode([token for token, keep in zip(ids, mask) if keep])


@pytest.mark.parametrize("family", PREFIX_STABLE)
def test_the_loss_is_on_each_assistant_turn_and_its_end_of_turn_only(chats, family):
    chat = chats[family]
    example = render_chat_example(chat, CONVERSATION)
    eot = chat.decode([next(token for token in example.ids if token in chat.end_of_turn_ids)])
    assert trained_text(chat, example.ids, example.loss_mask) == f"5{eot}It is 8.{eot}"
    assert example.mismatches == 0
    # Rendered whole: the ids are the tokenization of the template's text of the conversation.
    assert example.ids == chat.encode(chat.render(CONVERSATION, add_generation_prompt=False))


def test_what_the_template_adds_after_an_end_of_turn_is_not_trained(chats):
    chat = chats["qwen2_5"]  # Qwen writes "\n" after <|im_end|>: the model never samples it
    example = render_chat_example(chat, CONVERSATION, loss_roles=["user", "assistant"])
    trained = trained_text(chat, example.ids, example.loss_mask)
    assert "<|im_end|>\n" not in trained and trained.count("<|im_end|>") == 4
    assert "What is 2 + 3?" in trained and "You add." not in trained


def test_a_template_that_rewrites_earlier_turns_is_reported_as_a_mismatch(chats):
    # Qwen 3 renders the last turn with an empty <think> block the earlier one loses: its
    # training mask follows the whole rendering, and the check says it differs from a plain span.
    example = render_chat_example(chats["qwen3"], CONVERSATION)
    assert trained_text(chats["qwen3"], example.ids, example.loss_mask).endswith("It is 8.<|im_end|>")
    assert example.mismatches > 0


def test_a_tool_call_with_openai_string_arguments_renders_in_the_familys_form(chats):
    chat = chats["qwen2_5"]
    messages = [
        {"role": "user", "content": "Mass of NaCl?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "molar_mass", "arguments": '{"formula": "NaCl"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "58.44"},
        {"role": "assistant", "content": "58.44 g/mol"},
    ]
    tools = [{"type": "function", "function": {"name": "molar_mass", "description": "molar mass",
                                               "parameters": {"type": "object", "properties": {
                                                   "formula": {"type": "string"}}}}}]
    example = render_chat_example(chat, messages, tools=tools)
    trained = trained_text(chat, example.ids, example.loss_mask)
    assert '"formula": "NaCl"' in trained and "58.44 g/mol<|im_end|>" in trained
    assert "58.44<|im_end|>" not in trained.replace("58.44 g/mol<|im_end|>", "")  # the tool result is not


def test_midtraining_text_trains_every_token_and_is_cut_to_the_row(chats):
    chat = chats["llama3"]
    example = render_text_example(chat, "one two three four five six", max_len=3)
    assert len(example.ids) == 3 and example.loss_mask == [1, 1, 1]
    assert example.ids == chat.encode("one two three four five six")[:3]
