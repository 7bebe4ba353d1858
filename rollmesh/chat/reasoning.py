"""Reasoning parsers: split one assistant turn's text into reasoning and the rest.

- ``qwen3``: ``<think>...</think>`` then content. A template may put ``<think>`` in the prompt
  (Qwen3 thinking-2507, DeepSeek-R1 style), so the turn starts inside reasoning and shows only
  ``</think>``; ``starts_in_reasoning`` says so when the text cannot (a turn cut before ``</think>``).
- ``deepseek_r1``: the same tags; the turn is taken to start inside reasoning unless told otherwise
  (DeepSeek-V3.1's template opens ``<think>`` or closes ``</think>`` in the prompt:
  ``prompt_opens_reasoning`` reads which).
- ``gpt_oss``: harmony's analysis channel (``harmony.py``).
Upstream reference read, not copied: sgl-project/sglang python/sglang/srt/parser/reasoning_parser.py
(Qwen3Detector, DeepSeekR1Detector, GptOssDetector). Knows text, not tokenizers or tools.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from rollmesh.chat import harmony
from rollmesh.chat.errors import UnknownParserError

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


@dataclass(frozen=True)
class ReasoningSplit:
    """``reasoning`` is None when the turn has no reasoning block; ``rest`` is the other text."""

    reasoning: str | None
    rest: str


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    split: Callable[[str, bool], ReasoningSplit]
    starts_in_reasoning: bool  # the default when the caller does not know from the prompt


def _split_think_tags(text: str, starts_in_reasoning: bool) -> ReasoningSplit:
    open_at = text.find(THINK_OPEN)
    close_at = text.find(THINK_CLOSE)
    if open_at != -1 and (close_at == -1 or open_at < close_at):
        before = text[:open_at]
        inside_start = open_at + len(THINK_OPEN)
    elif close_at != -1 or starts_in_reasoning:
        before, inside_start = "", 0  # <think> was in the prompt
    else:
        return ReasoningSplit(reasoning=None, rest=text)
    close_at = text.find(THINK_CLOSE, inside_start)
    if close_at == -1:
        # Cut inside reasoning (max_new_tokens): all of it is reasoning, nothing is content.
        return ReasoningSplit(reasoning=text[inside_start:].strip(), rest=before)
    reasoning = text[inside_start:close_at].strip()
    return ReasoningSplit(reasoning=reasoning, rest=before + text[close_at + len(THINK_CLOSE) :])


def _split_harmony_analysis(text: str, _starts_in_reasoning: bool) -> ReasoningSplit:
    reasoning, rest = harmony.split_analysis(text)
    return ReasoningSplit(reasoning=reasoning, rest=rest)


REASONING_PARSERS: dict[str, ReasoningParser] = {
    "qwen3": ReasoningParser("qwen3", _split_think_tags, starts_in_reasoning=False),
    "deepseek_r1": ReasoningParser("deepseek_r1", _split_think_tags, starts_in_reasoning=True),
    "gpt_oss": ReasoningParser("gpt_oss", _split_harmony_analysis, starts_in_reasoning=False),
}


def split_reasoning(text: str, parser: str, *, starts_in_reasoning: bool | None = None) -> ReasoningSplit:
    """Split ``text`` with the named parser; ``starts_in_reasoning`` None = the parser's default."""
    spec = REASONING_PARSERS.get(parser)
    if spec is None:
        raise UnknownParserError(kind="reasoning", name=parser, known=tuple(REASONING_PARSERS))
    inside = spec.starts_in_reasoning if starts_in_reasoning is None else starts_in_reasoning
    return spec.split(text, inside)


def write_reasoning(parser: str, reasoning: str, *, prompt_opened: bool = False) -> str:
    """Reasoning as the model writes it before the rest of its turn (``split_reasoning`` reads it
    back): Qwen3's ``<think>\n...\n</think>\n\n``, DeepSeek-R1's ``<think>...</think>``, without the
    opening tag when the prompt already opened it; gpt-oss's analysis message."""
    if parser not in REASONING_PARSERS:
        raise UnknownParserError(kind="reasoning", name=parser, known=tuple(REASONING_PARSERS))
    if parser == "gpt_oss":
        return harmony.write_analysis(reasoning)
    opener = "" if prompt_opened else THINK_OPEN
    if parser == "qwen3":
        return f"{opener}\n{reasoning}\n{THINK_CLOSE}\n\n"
    return f"{opener}{reasoning}{THINK_CLOSE}"


def prompt_opens_reasoning(prompt_text: str) -> bool:
    """Whether a rendered prompt ends inside an open ``<think>`` block (the turn starts reasoning)."""
    tail = prompt_text.rstrip()
    return tail.endswith(THINK_OPEN)


def detect_reasoning_parser(chat_template: str) -> str | None:
    """The reasoning parser a chat template's markers call for, or None if it has no reasoning."""
    if "<|channel|>" in chat_template:
        return "gpt_oss"
    if THINK_OPEN in chat_template or THINK_CLOSE in chat_template:
        # DeepSeek templates open (or close) the block in the prompt: R1's rules.
        return "deepseek_r1" if "<｜Assistant｜>" in chat_template else "qwen3"
    return None
