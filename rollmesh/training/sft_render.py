"""A supervised example's tokens and loss mask: chat data rendered whole by the model's own chat
template (never message by message), raw text tokenized as it is.

Knows ChatModel (the tokenizer and template); nothing of torch, NATS or Ray.

Which tokens a chat example trains (``loss_roles``, the assistant's by default) is found on the
rendered text, then mapped to tokens by their character offsets. A message's span is where the
template's rendering of the conversation up to it ends and where its rendering up to and
including it ends; for an assistant message the span starts after the generation prompt (the
header the model does not write) and ends with its end-of-turn token (what the template adds
after it, e.g. Qwen's ``\\n`` after ``<|im_end|>``, is not generated, so not trained: the same
tokens a rollout trains).

A template may render an earlier turn differently once later turns follow (Qwen 3 drops the
reasoning of turns before the last user message): then a prefix's rendering is not a prefix of
the whole one, and that message's span is found by locating its content in the whole text
instead. The consistency check compares the assistant spans with those the template itself marks
(``{% generation %}`` blocks, ``return_assistant_tokens_mask``) when it has them, else with the
located contents, and counts each example that disagrees (``SftExample.mismatches``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rollmesh.chat.chat_model import ChatModel


@dataclass(frozen=True)
class SftExample:
    ids: list[int]
    loss_mask: list[int]
    # Assistant tokens where the loss mask and the template's own spans disagree (0: consistent).
    mismatches: int = 0


def render_text_example(chat: ChatModel, text: str, *, max_len: int) -> SftExample:
    """Raw text (midtraining): every token trained, the first ``max_len`` kept."""
    ids = chat.encode(text)[:max_len]
    return SftExample(ids, [1] * len(ids))


def render_chat_example(chat: ChatModel, messages: Sequence[Mapping[str, Any]], *,
                        tools: Sequence[Mapping[str, Any]] | None = None,
                        loss_roles: Sequence[str] = ("assistant",)) -> SftExample:
    """The whole conversation, rendered and tokenized once, with the loss on ``loss_roles``."""
    messages = [_template_message(chat, message) for message in messages]
    text = chat.render(messages, tools=tools, add_generation_prompt=False)
    encoding = chat.directory.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(encoding["input_ids"]), _placed(encoding["offset_mapping"])
    spans: dict[str, list[tuple[int, int]]] = {}
    eot_texts = tuple(chat.decode([token]) for token in chat.end_of_turn_ids)
    for index, message in enumerate(messages):
        role = message.get("role", "")
        if role in loss_roles and (span := _message_span(chat, messages, index, tools, text, eot_texts)) is not None:
            spans.setdefault(role, []).append(span)
    eot = chat.end_of_turn_ids
    loss_mask = [0] * len(ids)
    for span in (span for role_spans in spans.values() for span in role_spans):  # each trimmed on its own
        loss_mask = [a | b for a, b in zip(loss_mask, _trimmed(ids, _token_mask(offsets, [span]), eot))]
    mismatches = 0
    if "assistant" in loss_roles:
        reference = _template_assistant_mask(chat, messages, tools)
        if reference is None:
            reference = _located_assistant_mask(messages, text, offsets, eot_texts)
        if reference is not None and len(reference) == len(ids):
            ours = _trimmed(ids, _token_mask(offsets, spans.get("assistant", [])), eot)
            mismatches = sum(1 for mine, theirs in zip(ours, reference) if mine != theirs)
    return SftExample(ids, loss_mask, mismatches)


def _template_message(chat: ChatModel, message: Mapping[str, Any]) -> dict[str, Any]:
    """``message`` with its tool calls' arguments in the form the template renders (an object
    for most, a JSON string for some): datasets in OpenAI's shape carry strings."""
    calls = message.get("tool_calls")
    if not calls:
        return dict(message)
    written = []
    for call in calls:
        function = dict(call.get("function") or {})
        arguments = function.get("arguments")
        if chat.arguments_as == "object" and isinstance(arguments, str):
            try:
                function["arguments"] = json.loads(arguments)
            except ValueError:
                pass  # the template renders it as it is; the row is what it is
        elif chat.arguments_as == "string" and not isinstance(arguments, str):
            function["arguments"] = json.dumps(arguments, ensure_ascii=False)
        written.append({**call, "function": function})
    return {**message, "tool_calls": written}


def _placed(offset_mapping: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """Offsets with each zero-width special token (some tokenizers give ``</s>`` (0, 0)) placed
    where the token before it ends, so it falls in the span it is rendered in."""
    placed: list[tuple[int, int]] = []
    for start, end in offset_mapping:
        if start == end == 0 and placed:
            start = end = placed[-1][1]
        placed.append((start, end))
    return placed


def _message_span(chat: ChatModel, messages: list[dict[str, Any]], index: int,
                  tools: Sequence[Mapping[str, Any]] | None, text: str,
                  eot_texts: tuple[str, ...]) -> tuple[int, int] | None:
    """Characters of ``text`` that message ``index`` trains, or None when it renders empty."""
    role = messages[index].get("role")
    before = chat.render(messages[:index], tools=tools, add_generation_prompt=role == "assistant") if index else ""
    through = chat.render(messages[: index + 1], tools=tools, add_generation_prompt=False)
    if text.startswith(through) and through.startswith(before):
        return (len(before), len(through)) if len(through) > len(before) else None
    return _located_span(messages, index, text, eot_texts)


def _located_span(messages: list[dict[str, Any]], index: int, text: str,
                  eot_texts: tuple[str, ...]) -> tuple[int, int] | None:
    """Where message ``index``'s content sits in ``text`` (after the earlier messages' contents),
    with the end-of-turn token that follows it."""
    cursor = 0
    for earlier in messages[:index]:
        content = earlier.get("content")
        if isinstance(content, str) and content and (found := text.find(content, cursor)) >= 0:
            cursor = found + len(content)
    content = messages[index].get("content")
    if not isinstance(content, str) or not content:
        return None
    found = text.find(content, cursor)
    if found < 0:
        return None
    end = found + len(content)
    rest = text[end:]
    gap = len(rest) - len(rest.lstrip())
    for eot in eot_texts:
        if eot and rest[gap:].startswith(eot):
            return found, end + gap + len(eot)
    return found, end


def _token_mask(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> list[int]:
    """1 for each token whose characters start inside a span."""
    return [1 if any(begin <= start < end for begin, end in spans) else 0 for start, _ in offsets]


def _trimmed(ids: Sequence[int], mask: list[int], end_of_turn: frozenset[int]) -> list[int]:
    """``mask`` with what follows the last end-of-turn token of each masked run dropped (the
    template inserts it; the model does not write it)."""
    index = 0
    while index < len(mask):
        if not mask[index]:
            index += 1
            continue
        run_end = index
        while run_end < len(mask) and mask[run_end]:
            run_end += 1
        last_end = max((j for j in range(index, run_end) if ids[j] in end_of_turn), default=None)
        if last_end is not None:
            for j in range(last_end + 1, run_end):
                mask[j] = 0
        index = run_end
    return mask


def _template_assistant_mask(chat: ChatModel, messages: list[dict[str, Any]],
                             tools: Sequence[Mapping[str, Any]] | None) -> list[int] | None:
    """The template's own assistant marks ({% generation %}), or None when it has none."""
    template = getattr(chat.directory.tokenizer, "chat_template", None) or ""
    if "{% generation %}" not in template and "{%- generation %}" not in template:
        return None
    try:
        rendered = chat.directory.tokenizer.apply_chat_template(
            messages, tools=list(tools) if tools else None, tokenize=True, return_dict=True,
            return_assistant_tokens_mask=True, **dict(chat.template_kwargs))
    except Exception:  # a template the check cannot run on: no reference, nothing to compare
        return None
    return list(rendered["assistant_masks"])


def _located_assistant_mask(messages: list[dict[str, Any]], text: str,
                            offsets: Sequence[tuple[int, int]], eot_texts: tuple[str, ...]) -> list[int] | None:
    """Each assistant content located in the whole text with its end-of-turn (``_located_span``);
    None when a turn has no plain content to find (tool calls render in the family's syntax)."""
    spans = []
    for index, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        if message.get("tool_calls") or (span := _located_span(messages, index, text, eot_texts)) is None:
            return None
        spans.append(span)
    return _token_mask(offsets, spans)
