"""gpt-oss's harmony format, parsed directly: channels (analysis, commentary, final) and tool calls.

The generation prompt ends with ``<|start|>assistant``, so a turn reads like
``<|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>commentary to=functions.f
<|constrain|>json<|message|>{...}<|call|>`` or ends in ``<|channel|>final<|message|>...<|return|>``.
The recipient (``to=functions.NAME``) may sit in the role part or after the channel, as the template
(ggml-org/llama.cpp models/templates/openai-gpt-oss-120b.jinja) and the model write it.
analysis = reasoning, final (and commentary without a recipient, the preamble) = content.
Hand-rolled because ``openai-harmony`` downloads its encoding at run time, which fails offline and
in sandboxes. Upstream references read, not copied: sgl-project/sglang
python/sglang/srt/parser/harmony_parser.py and function_call/gpt_oss_detector.py, vllm-project/vllm
vllm/tool_parsers/openai_tool_parser.py. Knows the text format only.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rollmesh.chat.tool_syntax import (
    CallCandidate,
    TurnSyntax,
    arguments_json,
    call_with_json_arguments,
    join_content,
)

if TYPE_CHECKING:
    from rollmesh.chat.tool_calls import ToolCall

START = "<|start|>"
CHANNEL = "<|channel|>"
MESSAGE = "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
FUNCTIONS_PREFIX = "functions."
_RECIPIENT = re.compile(r"\bto=(\S+?)(?=<\||\s|$)")
_CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")


@dataclass(frozen=True)
class HarmonyMessage:
    raw: str
    channel: str | None
    recipient: str | None
    body: str
    terminated: bool


def split_messages(text: str) -> list[HarmonyMessage]:
    """Every message in the turn, in order; text before the first header is a channel-less body."""
    messages: list[HarmonyMessage] = []
    pos = 0
    while pos < len(text):
        header_end = text.find(MESSAGE, pos)
        next_start = text.find(START, pos + 1) if text.startswith(START, pos) else text.find(START, pos)
        if header_end == -1 or (next_start != -1 and next_start < header_end):
            # No header before the next message: bare text (or a cut header) outside any message.
            stop = next_start if next_start != -1 else len(text)
            segment = text[pos:stop]
            if START in segment or CHANNEL in segment:
                # A header the turn ended in (or that never got its body): no content, maybe a cut call.
                messages.append(_message(segment, header=segment, body="", terminated=False))
            elif segment.strip():
                messages.append(_message(segment, header="", body=segment, terminated=True))
            pos = stop
            continue
        header = text[pos:header_end]
        body_start = header_end + len(MESSAGE)
        body_end, end_marker = _body_end(text, body_start)
        raw_end = body_end + len(end_marker)
        body = text[body_start:body_end]
        messages.append(_message(text[pos:raw_end], header=header, body=body, terminated=bool(end_marker)))
        pos = raw_end
    return messages


def _body_end(text: str, start: int) -> tuple[int, str]:
    found = [(text.find(marker, start), marker) for marker in ENDS + (START,)]
    hits = [(at, marker) for at, marker in found if at != -1]
    if not hits:
        return len(text), ""
    at, marker = min(hits)
    # A new <|start|> ends a body that lacked its end marker; it belongs to the next message.
    return at, "" if marker == START else marker


def _message(raw: str, *, header: str, body: str, terminated: bool) -> HarmonyMessage:
    channel = _CHANNEL_NAME.search(header)
    recipient = _RECIPIENT.search(header)
    return HarmonyMessage(
        raw=raw,
        channel=channel.group(1) if channel else None,
        recipient=recipient.group(1) if recipient else None,
        body=body,
        terminated=terminated,
    )


def split_analysis(text: str) -> tuple[str | None, str]:
    """(reasoning from analysis messages without a recipient, the rest of the turn's raw text)."""
    reasoning: list[str] = []
    rest: list[str] = []
    for message in split_messages(text):
        if message.channel == "analysis" and message.recipient is None:
            reasoning.append(message.body.strip())
        else:
            rest.append(message.raw)
    return ("\n".join(reasoning) if reasoning else None), "".join(rest)


def split_gpt_oss(text: str) -> TurnSyntax:
    content: list[str] = []
    reasoning: list[str] = []
    candidates: list[CallCandidate] = []
    for message in split_messages(text):
        if message.recipient is not None:
            candidates.append(_call(message))
        elif message.channel == "analysis":
            reasoning.append(message.body.strip())
        else:
            content.append(message.body)
    joined_reasoning = "\n".join(reasoning) if reasoning else None
    return TurnSyntax(content=join_content(content), candidates=candidates, reasoning=joined_reasoning)


def write_gpt_oss(content: str, calls: Sequence[ToolCall]) -> str:
    """A turn after the generation prompt's ``<|start|>assistant``, up to its last message's end
    marker (the caller adds <|call|> or <|return|>): a final answer, or a preamble (commentary)
    and a call. A call ends the turn, so harmony has one call per turn (split_gpt_oss reads it back)."""
    if not calls:
        return f"{CHANNEL}final{MESSAGE}{content}"
    if len(calls) > 1:
        raise ValueError(f"harmony ends a turn at each call's <|call|>: {len(calls)} calls cannot be one turn")
    [call] = calls
    preamble = f"{CHANNEL}commentary{MESSAGE}{content}<|end|>{START}assistant" if content else ""
    arguments = arguments_json(call.arguments, as_string=call.arguments_were_string)
    return f"{preamble}{CHANNEL}commentary to={FUNCTIONS_PREFIX}{call.name} <|constrain|>json{MESSAGE}{arguments}"


def write_analysis(reasoning: str) -> str:
    """Reasoning as an analysis message, then the header of the turn's next message."""
    return f"{CHANNEL}analysis{MESSAGE}{reasoning}<|end|>{START}assistant"


def _call(message: HarmonyMessage) -> CallCandidate:
    recipient = message.recipient or ""
    # Only the "functions" namespace holds declared tools; built-ins (browser.*, python) are not.
    name = recipient[len(FUNCTIONS_PREFIX) :] if recipient.startswith(FUNCTIONS_PREFIX) else recipient
    if not message.terminated:
        cut = "the turn ended inside the call (no <|call|>)"
        return CallCandidate(raw=message.raw, name=name, syntax_error=cut, truncated=True)
    if not message.body.strip():
        return CallCandidate(raw=message.raw, name=name, arguments={})
    return call_with_json_arguments(message.raw, name, message.body)
