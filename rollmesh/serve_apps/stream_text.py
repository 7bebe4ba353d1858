"""Text deltas of a streamed answer, read token by token without ever taking back what was sent.

Knows the served model's tokenizer and parsers (``rollmesh.chat``) and the request's stop strings;
not Ray, not FastAPI, not the SSE shapes (``stream_events``).

- ``IncrementalDetokenizer`` turns ids into text deltas as they arrive and holds back a tail that
  decodes to U+FFFD (a multi-byte UTF-8 character split across tokens), as vLLM's incremental
  detokenizer does (vllm/transformers_utils/detokenizer_utils.py ``detokenize_incrementally``:
  a prefix window decoded twice). Written here because transformers v5 offers no public
  incremental detokenizer: its ``TextStreamer`` prints whole words to stdout or a queue from
  ``generate()``, which does not fit an engine that hands us ids.
- ``ChatDeltas`` re-reads the turn so far with the model's own reasoning and tool parsers after
  each piece, and sends only what extends what it already sent: ``reasoning_content`` and
  ``content`` grow, each tool call goes out once it is complete (its closing marker seen). Text
  that is or could become a tool-call marker, a reasoning tag or a stop string is held back, so
  markup is never streamed as content. The finished answer (``chat_requests.parse_answer``, the
  same reading as a non-streamed response) settles the rest. Re-reading costs O(turn length) per
  piece; the parsers are string scans, small next to a decode step.
- ``CompletionDeltas`` does the same for ``/v1/completions``' plain text (stop strings only).

gpt-oss (harmony) turns are read by the same parser (``rollmesh.chat.harmony``) on the part of the
turn whose channels are settled (``harmony_settled``): a message's channel and recipient are known
once its header reaches ``<|message|>``, so an analysis body streams as reasoning and a final (or
recipient-less commentary) body as content while it is sampled; a message with a recipient (a
call) is held until its end marker, then goes out whole like other families' calls.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rollmesh.chat import ChatModel, ParsedTurn, parse_assistant_turn, prompt_opens_reasoning
from rollmesh.chat.harmony import MESSAGE as HARMONY_MESSAGE, split_messages as harmony_messages
from rollmesh.chat.reasoning import THINK_CLOSE, THINK_OPEN
from rollmesh.chat.tool_format_deepseek import CALL_BEGIN as DEEPSEEK_CALL, CALLS_BEGIN as DEEPSEEK_CALLS
from rollmesh.chat.tool_format_hermes import OPEN as HERMES_OPEN
from rollmesh.chat.tool_format_kimi import SECTION_BEGIN as KIMI_SECTION
from rollmesh.chat.tool_format_llama3 import PYTHON_TAG
from rollmesh.chat.tool_format_mistral import TOOL_CALLS as MISTRAL_CALLS

# Where a family's tool calls begin: content stops streaming there until the parser has read the
# call (llama3_json may also write a bare JSON object: see ``_held_content``).
CALL_MARKERS: dict[str, tuple[str, ...]] = {
    "hermes": (HERMES_OPEN,),
    "mistral": (MISTRAL_CALLS,),
    "llama3_json": (PYTHON_TAG,),
    "deepseek_v3": (DEEPSEEK_CALLS, DEEPSEEK_CALL),
    "kimi_k2": (KIMI_SECTION,),
}
REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Text deltas of ids given a few at a time; their concatenation is the ids' decoded text."""

    def __init__(self, decode: Callable[[Sequence[int]], str]) -> None:
        self._decode = decode
        self.ids: list[int] = []
        self._prefix = 0  # decoding starts here, so that the first new id has context
        self._read = 0  # ids before it have been turned into text

    def push(self, ids: Sequence[int]) -> str:
        self.ids.extend(ids)
        return self._delta(final=False)

    def flush(self) -> str:
        """What is held back (an incomplete character stays as U+FFFD: the ids end there)."""
        return self._delta(final=True)

    def _delta(self, *, final: bool) -> str:
        before = self._decode(self.ids[self._prefix:self._read])
        text = self._decode(self.ids[self._prefix:])
        if len(text) <= len(before) or (text.endswith(REPLACEMENT) and not final):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return text[len(before):]


def safe_prefix(text: str, markers: Sequence[str]) -> str:
    """``text`` cut before the first of ``markers`` in it, and before a tail that could still
    become one."""
    cut = min((at for at in (text.find(marker) for marker in markers if marker) if at != -1),
              default=len(text))
    text = text[:cut]
    for marker in markers:
        for length in range(min(len(marker) - 1, len(text)), 0, -1):
            if text.endswith(marker[:length]):
                text = text[: len(text) - length]
                break
    return text


@dataclass
class ChatDelta:
    """What one piece adds: reasoning and content text, newly complete tool calls."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[Any] = field(default_factory=list)  # rollmesh.chat.ToolCall

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


class ChatDeltas:
    """The streamed state of one chat answer (``prompt``: ``chat_requests.ChatPrompt``)."""

    def __init__(self, prompt: Any) -> None:
        self.prompt = prompt
        chat: ChatModel = prompt.chat
        self._chat = chat
        self._text = ""
        self._detokenizer = IncrementalDetokenizer(chat.decode)  # specials kept: the parsers read them
        self._opened = prompt_opens_reasoning(chat.decode(list(prompt.input_ids)[-8:]))
        self._harmony = chat.tool_parser == "gpt_oss" or chat.reasoning_parser == "gpt_oss"
        self._tools = chat.toolset(prompt.tools)  # compiled once, not per piece
        # End-of-turn tokens need no holding: a special token decodes whole, and the parsers
        # strip it. Harmony's markup is special tokens too, read by ``harmony_settled``.
        tags = () if self._harmony else (THINK_OPEN, THINK_CLOSE)
        self._markers = (*CALL_MARKERS.get(chat.tool_parser or "", ()), *tags, *prompt.sampling.stop)
        self.sent_reasoning = ""
        self.sent_content = ""
        self.sent_calls = 0

    def push(self, token_ids: Sequence[int]) -> ChatDelta:
        self._text += self._detokenizer.push(token_ids)
        text = harmony_settled(self._text) if self._harmony else self._text
        parsed = parse_assistant_turn(
            text, tool_parser=self._chat.tool_parser, reasoning_parser=self._chat.reasoning_parser,
            tools=self._tools, first_call_index=self.prompt.first_call_index,
            starts_in_reasoning=self._opened)
        return self._advance(safe_prefix(parsed.reasoning or "", self._markers).rstrip(),
                             self._held_content(parsed), parsed.tool_calls)

    def finish(self, final: ParsedTurn) -> ChatDelta:
        """The rest of the answer as ``parse_answer`` reads the finished turn."""
        return self._advance(final.reasoning or "", final.content, final.tool_calls)

    def _held_content(self, parsed: ParsedTurn) -> str:
        content = parsed.content
        if self._chat.tool_parser == "llama3_json" and content.lstrip().startswith("{"):
            return ""  # maybe a bare JSON call: known only once it parses (or the turn ends)
        return safe_prefix(content, self._markers).rstrip()

    def _advance(self, reasoning: str, content: str, calls: list[Any]) -> ChatDelta:
        delta = ChatDelta()
        # Only text that extends what was sent goes out; a reading that does not (a parser that
        # changed its mind) waits for the next piece or the end.
        if reasoning.startswith(self.sent_reasoning):
            delta.reasoning = reasoning[len(self.sent_reasoning):]
            self.sent_reasoning = reasoning
        if content.startswith(self.sent_content):
            delta.content = content[len(self.sent_content):]
            self.sent_content = content
        delta.tool_calls = list(calls[self.sent_calls:])
        self.sent_calls = max(self.sent_calls, len(calls))
        return delta


def harmony_settled(text: str) -> str:
    """The part of a harmony turn so far whose reading cannot change: every message but the
    last, and the last one too once its header is complete (``<|message|>``: channel and
    recipient known) unless it is a call still short of its end marker. Text outside any header
    is held while it is last: a ``<|channel|>`` after it would make it part of a header."""
    messages = harmony_messages(text)
    if not messages:
        return text
    last = messages[-1]
    if HARMONY_MESSAGE in last.raw and (last.recipient is None or last.terminated):
        return text
    return text[:text.rfind(last.raw)]


class CompletionDeltas:
    """The streamed text of a ``/v1/completions`` answer: decoded without special tokens, held
    back where it could be the start of a stop string."""

    def __init__(self, chat: ChatModel, stops: Sequence[str]) -> None:
        self._detokenizer = IncrementalDetokenizer(
            lambda ids: chat.decode(ids, skip_special_tokens=True))
        self._stops = tuple(stops)
        self._text = ""
        self.sent = ""

    def push(self, token_ids: Sequence[int]) -> str:
        self._text += self._detokenizer.push(token_ids)
        return self._advance(safe_prefix(self._text, self._stops))

    def finish(self, final_text: str) -> str:
        return self._advance(final_text)

    def _advance(self, text: str) -> str:
        if not text.startswith(self.sent):
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta
