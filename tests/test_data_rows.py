"""Field mapping of dataset rows for each stage kind, and the reason each bad row gives."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rollmesh.data import BadRowError, PromptRow, map_row
from rollmesh.run_config import FieldMap, StageKind

pytestmark = pytest.mark.unit

PATH = Path("data/train.jsonl")
TOOL = {"type": "function", "function": {"name": "python", "parameters": {"type": "object"}}}
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"}]


def mapped(raw: dict[str, Any], kind: StageKind = "rl", **fields: str) -> PromptRow:
    return map_row(raw, FieldMap(**fields), kind=kind, path=PATH, row=7)


def bad(raw: dict[str, Any], kind: StageKind = "rl", **fields: str) -> str:
    with pytest.raises(BadRowError) as caught:
        mapped(raw, kind, **fields)
    assert (caught.value.path, caught.value.row) == (PATH, 7)
    assert str(caught.value) == f"{PATH}:7: {caught.value.reason}"
    return caught.value.reason


def test_an_rl_prompt_string_is_one_user_message_with_its_answer() -> None:
    raw = {"question": "What is 2+3?", "solution": 5, "metadata": {"source": "gsm"}}
    row = mapped(raw, prompt="question", answer="solution")
    assert row.messages == [{"role": "user", "content": "What is 2+3?"}]
    assert (row.prompt_text, row.answer, row.tools) == ("What is 2+3?", "5", None)
    assert row.metadata == {"source": "gsm"}
    assert row.raw is raw


def test_an_rl_row_takes_messages_tools_and_the_label_when_no_answer() -> None:
    raw = {"messages": CHAT, "label": 0.5, "tools": [TOOL], "metadata": None}
    row = mapped(raw)
    assert row.messages == CHAT and row.prompt_text is None
    assert (row.answer, row.tools, row.metadata) == ("0.5", [TOOL], {})
    # The row's messages are copies: a loop appending turns leaves the raw row as read.
    row.messages[0]["content"] = "changed"
    assert raw["messages"][0]["content"] == "Be brief."


def test_messages_win_over_prompt_and_nulls_count_as_absent() -> None:
    assert mapped({"prompt": "p", "messages": CHAT}).messages == CHAT
    row = mapped({"prompt": "p", "messages": None, "answer": None, "label": "4", "tools": []})
    assert (row.messages, row.answer, row.tools) == ([{"role": "user", "content": "p"}], "4", None)


def test_an_sft_row_is_a_chat_with_an_assistant_message() -> None:
    chat = [*CHAT, {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]},
            {"role": "tool", "content": "2", "tool_call_id": "1"},
            {"role": "assistant", "content": [{"type": "text", "text": "2"}]}]
    row = mapped({"conversation": chat, "tools": [TOOL], "answer": ["ignored"]}, "sft",
                 messages="conversation")
    assert (row.messages, row.tools, row.answer) == (chat, [TOOL], None)


def test_a_midtrain_row_is_the_text_column_only() -> None:
    row = mapped({"text": "Once upon a time", "metadata": "not read"}, "midtrain", prompt="text")
    assert (row.prompt_text, row.messages, row.metadata) == ("Once upon a time", [], {})


@pytest.mark.parametrize(("kind", "raw", "fields", "reason"), [
    ("rl", {"prompt": "p"}, {"prompt": "question"},
     "no 'question' field (fields.prompt) and no 'messages' field (fields.messages)"),
    ("rl", {"question": ["a"]}, {"prompt": "question"}, "'question' is a list, not a string (fields.prompt)"),
    ("rl", {"prompt": "  "}, {}, "'prompt' is an empty string (fields.prompt)"),
    ("rl", {"messages": []}, {}, "'messages' is an empty list, not a list of chat messages"),
    ("rl", {"messages": "hi"}, {}, "'messages' is a string, not a list of chat messages"),
    ("rl", {"messages": [*CHAT, {"role": "assistant", "content": "2"}]}, {},
     "'messages' ends with an assistant message"),
    ("rl", {"messages": ["hi"]}, {}, "'messages'[0] is a string, not a message object"),
    ("rl", {"messages": [{"role": "bot", "content": "x"}]}, {},
     "'messages'[0]: role 'bot' is not one of system, user, assistant, tool"),
    ("rl", {"messages": [{"role": "user"}]}, {}, "'messages'[0]: a user message without content"),
    ("rl", {"messages": [{"role": "user", "content": 3}]}, {},
     "'messages'[0]: content is a number, not a string or a list of parts"),
    ("rl", {"messages": [{"role": "user", "content": ["x"]}]}, {},
     "'messages'[0]: content parts must be objects"),
    ("rl", {"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, {},
     "'messages'[0]: tool_calls must be a list of objects on an assistant message"),
    ("rl", {"prompt": "p", "answer": True}, {}, "'answer' is a boolean, not a string or a number (fields.answer)"),
    ("rl", {"prompt": "p", "gold": {"x": 1}}, {"label": "gold"},
     "'gold' is an object, not a string or a number (fields.label)"),
    ("rl", {"prompt": "p", "tools": {"a": 1}}, {}, "'tools' is an object, not a list of tool schemas"),
    ("rl", {"prompt": "p", "tools": [{"name": "f"}]}, {}, "'tools'[0] is not {\"type\": \"function\""),
    ("rl", {"prompt": "p", "tools": [{"type": "function", "function": {}}]}, {},
     "'tools'[0]: function.name must be a non-empty string"),
    ("rl", {"prompt": "p", "meta": [1]}, {"metadata": "meta"}, "'meta' is a list, not an object (fields.metadata)"),
    ("sft", {"prompt": "p"}, {}, "no 'messages' field (fields.messages): an sft row is a chat"),
    ("sft", {"messages": CHAT}, {}, "'messages' has no assistant message to train on"),
    ("sft", {"messages": [*CHAT, {"role": "assistant", "content": "2"}], "tools": "x"}, {},
     "'tools' is a string"),
    ("midtrain", {"content": "words"}, {"prompt": "text"}, "no 'text' field (fields.prompt)"),
    ("midtrain", {"text": 12}, {"prompt": "text"}, "'text' is a number, not a string (fields.prompt)"),
])
def test_a_bad_row_names_its_field_as_the_row_spells_it(
        kind: StageKind, raw: dict[str, Any], fields: dict[str, str], reason: str) -> None:
    assert bad(raw, kind, **fields).startswith(reason)


def test_an_unknown_kind_is_a_programming_error_not_a_bad_row() -> None:
    with pytest.raises(ValueError, match="unknown stage kind 'dpo'") as caught:
        mapped({"prompt": "p"}, "dpo")  # type: ignore[arg-type]
    assert not isinstance(caught.value, BadRowError)
