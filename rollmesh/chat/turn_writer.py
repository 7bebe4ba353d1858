"""The text a model of each family writes for one assistant turn: the inverse of
``tool_calls.parse_assistant_turn``, to simulate generation (``rollmesh check-template``, tests).

A turn is its reasoning (the family's markers), its content and calls (the family's tool-call
syntax, one ``write_*`` next to each format's parser) and the token that ends it. It is what the
model samples, not the template's rendering of an assistant message: the two differ where the
template re-renders a turn (JSON spacing, dropped reasoning, a call's id), which is what a check
against a whole render has to see. Knows text formats only; not tokenizers or templates.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from rollmesh.chat.errors import UnknownParserError
from rollmesh.chat.harmony import write_gpt_oss
from rollmesh.chat.reasoning import write_reasoning
from rollmesh.chat.tool_calls import TOOL_PARSERS, ToolCall
from rollmesh.chat.tool_format_deepseek import write_deepseek_v3
from rollmesh.chat.tool_format_hermes import write_hermes
from rollmesh.chat.tool_format_kimi import write_kimi_k2
from rollmesh.chat.tool_format_llama3 import write_llama3_json
from rollmesh.chat.tool_format_mistral import write_mistral

TOOL_WRITERS: dict[str, Callable[[str, Sequence[ToolCall]], str]] = {
    "hermes": write_hermes,
    "llama3_json": write_llama3_json,
    "mistral": write_mistral,
    "deepseek_v3": write_deepseek_v3,
    "kimi_k2": write_kimi_k2,
    "gpt_oss": write_gpt_oss,
}
assert TOOL_WRITERS.keys() == TOOL_PARSERS.keys(), "every tool parser has its writer"

# Formats whose turn ends at each call: one call per turn, so parallel calls cannot be written.
ONE_CALL_PER_TURN = frozenset({"gpt_oss"})
# gpt-oss ends a turn with <|call|> after a call, <|return|> (its eos) after a final answer.
_CALL_END_OF_TURN = {"gpt_oss": "<|call|>"}


def write_assistant_turn(*, tool_parser: str | None, reasoning_parser: str | None, content: str,
                         calls: Sequence[ToolCall] = (), reasoning: str | None = None,
                         prompt_opened_reasoning: bool = False, end_of_turn: str) -> str:
    """The turn's whole text, ``end_of_turn`` (the model's eos text) included.

    ``prompt_opened_reasoning``: the prompt ends inside an open ``<think>`` (DeepSeek's thinking
    mode), so the turn starts in its reasoning. Reasoning with no reasoning parser, or calls with
    no tool parser, is a ValueError: that model cannot write them.
    """
    if tool_parser is not None and tool_parser not in TOOL_WRITERS:
        raise UnknownParserError(kind="tool", name=tool_parser, known=tuple(TOOL_WRITERS))
    if calls and tool_parser is None:
        raise ValueError("a turn with tool calls needs a tool format")
    text = ""
    if reasoning is not None:
        if reasoning_parser is None:
            raise ValueError("a turn with reasoning needs a reasoning format")
        text = write_reasoning(reasoning_parser, reasoning, prompt_opened=prompt_opened_reasoning)
    if tool_parser is not None:
        text += TOOL_WRITERS[tool_parser](content, list(calls))
    elif reasoning_parser == "gpt_oss":
        text += write_gpt_oss(content, [])   # harmony: even a plain answer is a channel message
    else:
        text += content
    if calls and tool_parser in _CALL_END_OF_TURN:
        return text + _CALL_END_OF_TURN[tool_parser]
    return text + end_of_turn
