"""Verification of a token-exact trajectory against a fresh whole render of its conversation.

The trajectory's ids (as sampled and appended) are compared with the template's rendering of the
whole conversation, tokenized at once, and every difference is classified:

- ``special``: a special token differs (a missing or extra end-of-turn, a rewritten marker);
- ``non_assistant``: text the model did not generate differs: a bug in appending or joining;
- ``assistant``: a difference inside generated text, expected: the sampled ids of the same text
  are not the tokenizer's canonical encoding (" 4" as one id or two), or the conversation's
  parsed assistant message renders differently from what was generated (JSON spacing, earlier
  reasoning dropped by a template that rewrites history).

A difference that a family's documented history rewrite explains (Qwen3 dropping earlier
``<think>`` blocks, gpt-oss writing ``<|end|>`` where the model sampled ``<|return|>``) keeps its
kind and names the rewrite in ``TokenDifference.rewrite``; ``TokenCheckReport.bugs`` counts only
``non_assistant`` differences that no rewrite explains.

Knows token ids, loss masks and the ``ChatTemplateTokenizer`` protocol; nothing of engines or the bus.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rollmesh.chat.turn_append import ChatTemplateTokenizer, ChatTrajectory, TemplateJoin

MISMATCH_KINDS: tuple[str, ...] = ("special", "non_assistant", "assistant")


@dataclass(frozen=True)
class TokenDifference:
    """One differing region: trajectory ids[trace_start:trace_end] vs render ids[render_start:render_end]."""

    kind: str
    trace_start: int
    trace_end: int
    render_start: int
    render_end: int
    rewrite: str = ""   # the documented history rewrite that explains it, if any


@dataclass
class TokenCheckReport:
    """Differences between a trajectory and the whole render, by kind and position."""

    trace_tokens: int
    render_tokens: int
    differences: list[TokenDifference] = field(default_factory=list)

    @property
    def counts(self) -> dict[str, int]:
        counts = dict.fromkeys(MISMATCH_KINDS, 0)
        for difference in self.differences:
            counts[difference.kind] += 1
        return counts

    @property
    def exact(self) -> bool:
        return not self.differences

    @property
    def bugs(self) -> int:
        """Differences in text the model did not generate that no documented rewrite explains."""
        return sum(1 for d in self.differences if d.kind == "non_assistant" and not d.rewrite)


@dataclass(frozen=True)
class DocumentedRewrite:
    """A family's history rewrite: the render drops, replaces or adds trajectory text in a known way.
    One of the shapes below is set."""

    name: str
    dropped_block: tuple[str, str] = ("", "")      # (open, close): the trajectory side is one such block
    replaced: tuple[str, str] = ("", "")           # (sampled, rendered): one text rendered as another
    added_empty_block: tuple[str, str] = ("", "")  # (open, close): the render adds an empty such block
    dropped_opened_block: tuple[str, str] = ("", "")  # (open, close): the trajectory side is open + text, no close
    inserted: str = ""                             # a pattern the render side matches where the trajectory has nothing
    dropped_system_prompt: bool = False            # the trajectory side is the conversation's system prompt

    def explains(self, trace_text: str, render_text: str, *, system_prompt: str = "") -> bool:
        if self.dropped_block[0]:
            return not render_text.strip() and _is_one_block(trace_text.strip(), *self.dropped_block)
        if self.added_empty_block[0]:
            opener, closer = self.added_empty_block
            return not trace_text.strip() and render_text.split() == [opener, closer]
        if self.dropped_opened_block[0]:
            opener, closer = self.dropped_opened_block
            dropped = trace_text.strip()
            return (not render_text.strip() and dropped.startswith(opener) and dropped.count(opener) == 1
                    and closer not in dropped)
        if self.inserted:
            return not trace_text and re.fullmatch(self.inserted, render_text) is not None
        if self.dropped_system_prompt:
            return (bool(system_prompt.strip()) and not render_text.strip()
                    and trace_text.strip() == system_prompt.strip())
        return (trace_text, render_text) == self.replaced


def _is_one_block(text: str, opener: str, closer: str) -> bool:
    return text.startswith(opener) and text.endswith(closer) and text.count(opener) == text.count(closer) == 1


_DROPS_EARLIER_REASONING = DocumentedRewrite("drops earlier reasoning", dropped_block=("<think>", "</think>"))
DOCUMENTED_REWRITES: dict[str, tuple[DocumentedRewrite, ...]] = {
    # Qwen3 renders <think> only for assistant turns after the last user query, and always one,
    # empty if need be, for the last turn.
    "qwen3": (_DROPS_EARLIER_REASONING,
              DocumentedRewrite("writes an empty reasoning block", added_empty_block=("<think>", "</think>"))),
    # DeepSeek V3.1 renders no reasoning in any assistant turn: a thinking turn's "<think>" (the
    # generation prompt's) and its reasoning are dropped, its "</think>" kept.
    "deepseek_v3": (_DROPS_EARLIER_REASONING,
                    DocumentedRewrite("drops reasoning after the prompt's <think>",
                                      dropped_opened_block=("<think>", "</think>"))),
    # gpt-oss samples <|return|> to end a final answer; its template writes an earlier one with
    # <|end|>. It samples a call's recipient after the channel ("<|channel|>commentary
    # to=functions.f"), since the generation prompt "<|start|>assistant" ends the role part, and its
    # template renders the recipient after the role ("<|start|>assistant to=functions.f<|channel|>...").
    "gpt_oss": (DocumentedRewrite("<|return|> rendered as <|end|>", replaced=("<|return|>", "<|end|>")),
                DocumentedRewrite("call recipient rendered after the role", inserted=r" to=functions\.[^\s<]+")),
    # Mistral's template writes the tools ([AVAILABLE_TOOLS]) only before the last user message and
    # the system prompt only into the last user message while it ends the conversation: earlier
    # copies, which the model saw, are dropped from a whole render.
    "mistral": (DocumentedRewrite("tools ride with the last user message",
                                  dropped_block=("[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]")),
                DocumentedRewrite("system prompt rides with the last user message", dropped_system_prompt=True)),
}


def compare_tokens(trace_ids: Sequence[int], loss_mask: Sequence[int], render_ids: Sequence[int],
                   special_ids: Collection[int], *, decode: Callable[[Sequence[int]], str] | None = None,
                   rewrites: Sequence[DocumentedRewrite] = (), system_prompt: str = "") -> TokenCheckReport:
    """Classify every difference between the trajectory's ids (with their loss mask: 1 = generated)
    and the render's ids; ``rewrites`` (with ``decode``) name the differences they explain
    (``system_prompt``: the conversation's, for a rewrite that drops it)."""
    if len(loss_mask) != len(trace_ids):
        raise ValueError(f"{len(trace_ids)} ids but {len(loss_mask)} loss-mask entries")
    special = frozenset(special_ids)
    report = TokenCheckReport(trace_tokens=len(trace_ids), render_tokens=len(render_ids))
    opcodes = aligned_opcodes(list(trace_ids), list(render_ids), special)
    for index, (tag, i1, i2, j1, j2) in enumerate(opcodes):
        if tag == "equal":
            continue
        if tag == "delete":
            i1, i2 = _slide_into_generated(trace_ids, loss_mask, i1, i2, opcodes, index)
        if any(t in special for t in trace_ids[i1:i2]) or any(t in special for t in render_ids[j1:j2]):
            kind = "special"
        elif _inside_generated(loss_mask, i1, i2):
            kind = "assistant"
        else:
            kind = "non_assistant"
        rewrite = ""
        if rewrites and decode is not None:
            trace_text, render_text = decode(trace_ids[i1:i2]), decode(render_ids[j1:j2])
            rewrite = next((r.name for r in rewrites
                            if r.explains(trace_text, render_text, system_prompt=system_prompt)), "")
        report.differences.append(TokenDifference(kind, i1, i2, j1, j2, rewrite))
    return report


def aligned_opcodes(a: list[int], b: list[int], special: frozenset[int]) -> list[tuple[str, int, int, int, int]]:
    """difflib-style opcodes turning ``a`` into ``b``, in time that stays near linear at 128K ids.

    A plain SequenceMatcher over two long token lists is quadratic in the frequent ids. Special
    tokens (turn markers) are aligned first; the ids between two aligned ones (a turn or less)
    are then diffed on their own, after their common prefix and suffix are set aside.
    """
    anchors_a = [i for i, t in enumerate(a) if t in special]
    anchors_b = [j for j, t in enumerate(b) if t in special]
    by_anchor = difflib.SequenceMatcher(a=[a[i] for i in anchors_a], b=[b[j] for j in anchors_b], autojunk=False)
    pairs = [(anchors_a[x + k], anchors_b[y + k])
             for x, y, size in by_anchor.get_matching_blocks() for k in range(size)]
    opcodes: list[tuple[str, int, int, int, int]] = []
    start_a = start_b = 0
    for at_a, at_b in [*pairs, (len(a), len(b))]:
        opcodes.extend(_segment_opcodes(a, b, start_a, at_a, start_b, at_b))
        if at_a < len(a):
            opcodes.append(("equal", at_a, at_a + 1, at_b, at_b + 1))
        start_a, start_b = at_a + 1, at_b + 1
    merged: list[tuple[str, int, int, int, int]] = []
    for opcode in opcodes:
        if merged and opcode[0] == merged[-1][0] == "equal":
            merged[-1] = ("equal", merged[-1][1], opcode[2], merged[-1][3], opcode[4])
        else:
            merged.append(opcode)
    return merged


def _segment_opcodes(a: list[int], b: list[int], a1: int, a2: int, b1: int, b2: int) -> list:
    prefix = 0
    while a1 + prefix < a2 and b1 + prefix < b2 and a[a1 + prefix] == b[b1 + prefix]:
        prefix += 1
    suffix = 0
    while a2 - suffix > a1 + prefix and b2 - suffix > b1 + prefix and a[a2 - suffix - 1] == b[b2 - suffix - 1]:
        suffix += 1
    opcodes = [("equal", a1, a1 + prefix, b1, b1 + prefix)] if prefix else []
    m1, m2, n1, n2 = a1 + prefix, a2 - suffix, b1 + prefix, b2 - suffix
    if m1 < m2 or n1 < n2:
        # autojunk off: its heuristic drops frequent ids (newlines, spaces) from matching.
        matcher = difflib.SequenceMatcher(a=a[m1:m2], b=b[n1:n2], autojunk=False)
        opcodes += [(tag, m1 + i1, m1 + i2, n1 + j1, n1 + j2) for tag, i1, i2, j1, j2 in matcher.get_opcodes()]
    if suffix:
        opcodes.append(("equal", a2 - suffix, a2, b2 - suffix, b2))
    return opcodes


def _slide_into_generated(ids: Sequence[int], loss_mask: Sequence[int], start: int, end: int,
                          opcodes: list, index: int) -> tuple[int, int]:
    """A deletion among repeated ids has several equally good places ("assistant\\n" + "\\n..."):
    slide it, within the matched blocks around it, to a place inside generated text if there is one."""
    before = opcodes[index - 1][2] - opcodes[index - 1][1] if index > 0 and opcodes[index - 1][0] == "equal" else 0
    after = (opcodes[index + 1][2] - opcodes[index + 1][1]
             if index + 1 < len(opcodes) and opcodes[index + 1][0] == "equal" else 0)
    candidates = [(start, end)]
    s, e = start, end
    while start - s < before and ids[s - 1] == ids[e - 1]:
        s, e = s - 1, e - 1
        candidates.append((s, e))
    s, e = start, end
    while e - end < after and ids[s] == ids[e]:
        s, e = s + 1, e + 1
        candidates.append((s, e))
    return next((c for c in candidates if _inside_generated(loss_mask, *c)), (start, end))


def _inside_generated(loss_mask: Sequence[int], start: int, end: int) -> bool:
    """Whether trajectory positions [start, end) lie inside generated text. An insertion
    (start == end) is inside when the ids on both sides of it were generated."""
    if start < end:
        return all(loss_mask[start:end])
    return 0 < start < len(loss_mask) and bool(loss_mask[start - 1]) and bool(loss_mask[start])


def render_conversation_ids(chat: ChatTemplateTokenizer, messages: Sequence[Mapping[str, Any]],
                            join: TemplateJoin) -> list[int]:
    """The whole conversation rendered and tokenized at once, shaped like a trajectory: with the
    generation prompt when it waits for the model, without the join text after a final generated turn."""
    ends_generated = bool(messages) and messages[-1].get("role") == "assistant"
    text = chat.render(messages, tools=join.tools, add_generation_prompt=not ends_generated,
                       template_kwargs=join.template_kwargs)
    if ends_generated and join.join_text and text.endswith(join.join_text):
        text = text[: -len(join.join_text)]
    return chat.encode(text)


def special_token_ids(tokenizer: Any) -> frozenset[int]:
    """The ids a transformers tokenizer marks special (its named ones and added tokens flagged
    special); plain added tokens such as Qwen's <think> or <tool_call> are text, not special."""
    ids = set(tokenizer.all_special_ids)
    ids.update(token_id for token_id, token in tokenizer.added_tokens_decoder.items() if token.special)
    return frozenset(ids)


def check_trajectory(trajectory: ChatTrajectory, special_ids: Collection[int]) -> list[TokenCheckReport]:
    """One report per training sample: each sample against the render of the messages it covers."""
    chat, join = trajectory.chat, trajectory.join
    rewrites = DOCUMENTED_REWRITES.get(join.family or "", ())
    first = trajectory.messages[0] if trajectory.messages else {}
    system_prompt = first.get("content") if first.get("role") == "system" else ""
    return [
        compare_tokens(sample.ids, sample.loss_mask,
                       render_conversation_ids(chat, trajectory.messages[: sample.message_count], join),
                       special_ids, decode=chat.decode, rewrites=rewrites,
                       system_prompt=system_prompt if isinstance(system_prompt, str) else "")
        for sample in trajectory.samples
    ]
