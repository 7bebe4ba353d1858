"""Token-exact multi-turn appending ("token in, token out").

A conversation's tokens grow turn by turn and are never re-encoded: the first prompt is rendered
and tokenized once; each generated turn is kept exactly as sampled (loss mask 1, its logprobs);
each later turn appends only the template's rendering of the new messages plus the generation
prompt, tokenized on its own (loss mask 0, no logprob). Knows chat templates and token ids through
the small ``ChatTemplateTokenizer`` protocol; knows nothing of engines, the bus or Ray.

How a later turn is rendered without rendering the history. The template is asked for a fixed
stand-in conversation, ``[user, assistant(STAND_IN_MARKER, the real turn's tool calls)]``, after the
conversation's system message if it has one (Mistral's template writes the system prompt into the
last user message, so a new user turn carries it), followed by the new messages, with the
generation prompt. Everything the template writes after the
stand-in assistant's end-of-turn token is the text to append: the join text (what the template
writes after an assistant's end of turn, "\\n" for Qwen), the new messages and the generation
prompt. Its cost depends on the new messages only, never on the history. It is tokenized on its
own, which is exact because it follows a special token, where a tokenizer never merges across.

Templates that rewrite history (Qwen3 drops earlier ``<think>`` blocks once a new user query comes)
make a whole render of turn N+1 stop being an extension of turn N. ``history_rewrite`` says what
to do then:

- ``"keep_sampled"`` (default): the tokens stay as sampled and seen; the model's next turn is
  generated on its own earlier reasoning, and training sees exactly what the model saw and
  generated (on-policy, one sample per rollout), at the price of a context that differs from what
  the template would show a deployed model.
- ``"split"``: as prime-rl does, when the template's whole render of the conversation (with the
  new messages and the generation prompt) is not the current sample's text followed by the
  appended text, a new training sample starts with that whole render as its prompt (mask 0) and
  the model generates on the rewritten history, as a deployed model would see it. Earlier samples
  are kept and trained as they were. Detecting the break renders the whole conversation as text
  on every append (tokenizing it only when a split happens), so this mode's append cost grows
  with the history; extension is judged on text, because re-tokenized assistant text is expected
  and the sampled ids are kept anyway.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from rollmesh.chat.errors import AppendError, AppendOrderError, JoinDerivationError, TruncatedTurnError

HistoryRewrite = Literal["keep_sampled", "split"]
HISTORY_REWRITES: tuple[str, ...] = ("keep_sampled", "split")

# Content of the stand-in assistant message: plain text no template transforms and no
# conversation holds, found once in the stand-in render.
STAND_IN_MARKER = "rollmesh stand-in assistant turn 7f3a"
STAND_IN_USER = {"role": "user", "content": "rollmesh stand-in user turn"}


class ChatTemplateTokenizer(Protocol):
    """What appending needs from a model: its chat template and its tokenizer.

    ``rollmesh.chat.ModelDirectory`` is one. ``encode`` tokenizes text in which special tokens are
    written out, adding nothing (no BOS); ``decode`` keeps special tokens and cleans nothing up,
    so decode(ids) is the text those ids are; ``end_of_turn_ids`` are the ids that end a
    generated turn.
    """

    @property
    def end_of_turn_ids(self) -> frozenset[int]: ...

    def render(self, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping[str, Any]] | None = None,
               add_generation_prompt: bool, template_kwargs: Mapping[str, Any] | None = None) -> str: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...   # special tokens kept


@dataclass(frozen=True)
class FamilyJoinRule:
    """A family whose join cannot be derived from its end-of-turn ids alone, and why."""

    family: str
    rendered_end_texts: tuple[str, ...]   # texts that end a rendered assistant message besides the end-of-turn ids
    why: str


JOIN_RULES: dict[str, FamilyJoinRule] = {
    "gpt_oss": FamilyJoinRule(
        family="gpt_oss", rendered_end_texts=("<|end|>",),
        why=("gpt-oss samples <|return|> after a final answer and <|call|> after a tool call, but its "
             "template writes an earlier final answer as ending in <|end|>, which is not an "
             "end-of-turn id (the model writes it between channels inside one turn). The join is "
             "what follows <|end|> in the render; the sampled <|return|> is kept as sampled."),
    ),
}


@dataclass
class TokenSample:
    """One training sample's tokens: ids, loss mask (1 = generated), logprobs (None = not generated).

    ``constrained`` holds the positions of generated tokens sampled under a grammar (guided
    decoding). They stay 1 in ``loss_mask``, which says what the model generated (the token check
    reads it so), and ``training_mask`` gives them 0: they were not the policy's free choice.
    """

    ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    message_count: int = 0   # messages of the conversation this sample's tokens cover
    constrained: list[int] = field(default_factory=list)

    def extend(self, ids: Sequence[int], mask: int, logprobs: Sequence[float | None] | None = None) -> None:
        self.ids.extend(ids)
        self.loss_mask.extend([mask] * len(ids))
        self.logprobs.extend(logprobs if logprobs is not None else [None] * len(ids))

    def training_mask(self) -> list[int]:
        """The loss mask to train with: ``loss_mask`` with constrained tokens at 0."""
        mask = list(self.loss_mask)
        for position in self.constrained:
            mask[position] = 0
        return mask


class TemplateJoin:
    """The template's text after a generated turn, derived once per (template, tools, kwargs)."""

    def __init__(self, chat: ChatTemplateTokenizer, *, tools: Sequence[Mapping[str, Any]] | None = None,
                 template_kwargs: Mapping[str, Any] | None = None, family: str | None = None,
                 system_message: Mapping[str, Any] | None = None) -> None:
        self.chat = chat
        self.tools = list(tools) if tools else None
        self.system_message = dict(system_message) if system_message else None
        self.template_kwargs = dict(template_kwargs or {})
        self.family = family
        self.rule = JOIN_RULES.get(family) if family else None
        end_texts = {chat.decode([token_id]) for token_id in chat.end_of_turn_ids}
        if self.rule:
            end_texts.update(self.rule.rendered_end_texts)
        self.end_texts = tuple(sorted(end_texts, key=len, reverse=True))
        # What the template writes after an assistant message's end of turn when it is the last one
        # ("\n" for Qwen, "" for Llama 3): the whole-render check trims it from a finished conversation.
        self.join_text = self._text_after_stand_in([], add_generation_prompt=False)

    def appended_text(self, new_messages: Sequence[Mapping[str, Any]],
                      previous_assistant: Mapping[str, Any] | None = None) -> str:
        """Join text + the new messages + the generation prompt, as the template writes them."""
        return self._text_after_stand_in(new_messages, add_generation_prompt=True,
                                         previous_assistant=previous_assistant)

    def _text_after_stand_in(self, new_messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool,
                             previous_assistant: Mapping[str, Any] | None = None) -> str:
        stand_in: dict[str, Any] = {"role": "assistant", "content": STAND_IN_MARKER}
        if previous_assistant and previous_assistant.get("tool_calls"):
            # Some templates pair tool results with the calls before them (ids, names, counts), and
            # some write no content beside calls (Llama 3, Mistral): the marker goes in the arguments too.
            stand_in["tool_calls"] = [_stand_in_call(call) for call in previous_assistant["tool_calls"]]
        lead = [self.system_message] if self.system_message else []
        rendered = self.chat.render([*lead, STAND_IN_USER, stand_in, *new_messages], tools=self.tools,
                                    add_generation_prompt=add_generation_prompt, template_kwargs=self.template_kwargs)
        marker_at = rendered.rfind(STAND_IN_MARKER)
        if marker_at < 0:
            raise JoinDerivationError(reason="the template did not render the stand-in assistant's content",
                                      end_texts=self.end_texts)
        after_marker = marker_at + len(STAND_IN_MARKER)
        found = [(rendered.find(text, after_marker), text) for text in self.end_texts]
        found = [(at, text) for at, text in found if at >= 0]
        if not found:
            raise JoinDerivationError(reason="no end-of-turn token after the stand-in assistant message; "
                                             "the family needs a join rule (JOIN_RULES)",
                                      end_texts=self.end_texts)
        at, text = min(found)
        return rendered[at + len(text):]


def _stand_in_call(call: Mapping[str, Any]) -> dict[str, Any]:
    """A tool call like ``call`` (id, name, arguments held as a string or an object, as the
    template expects them) whose arguments carry the marker instead of the call's own."""
    function = dict(call.get("function") or call)
    marked = {"marker": STAND_IN_MARKER}
    function["arguments"] = json.dumps(marked) if isinstance(function.get("arguments"), str) else marked
    return {**call, "function": function} if "function" in call else function


class ChatTrajectory:
    """One rollout's conversation and its token-exact samples, grown turn by turn."""

    def __init__(self, chat: ChatTemplateTokenizer, messages: Sequence[Mapping[str, Any]], *,
                 tools: Sequence[Mapping[str, Any]] | None = None,
                 template_kwargs: Mapping[str, Any] | None = None, family: str | None = None,
                 history_rewrite: HistoryRewrite = "keep_sampled", join: TemplateJoin | None = None) -> None:
        if history_rewrite not in HISTORY_REWRITES:
            raise ValueError(f"history_rewrite must be one of {HISTORY_REWRITES}, not {history_rewrite!r}")
        self.chat = chat
        self.history_rewrite = history_rewrite
        system_message = messages[0] if messages and messages[0].get("role") == "system" else None
        self.join = join or TemplateJoin(chat, tools=tools, template_kwargs=template_kwargs, family=family,
                                         system_message=system_message)
        self.messages: list[Mapping[str, Any]] = list(messages)
        # The first prompt: rendered once, tokenized once.
        prompt_text = self._render_whole(self.messages)
        self.samples: list[TokenSample] = [TokenSample(message_count=len(self.messages))]
        self.samples[0].extend(chat.encode(prompt_text), 0)
        self._sample_text: list[str] = [prompt_text] if history_rewrite == "split" else []
        self._last_turn_ended: bool | None = None   # None: no generated turn since the last prompt
        self._turns = 0

    @property
    def sample(self) -> TokenSample:
        """The sample being grown: its ids are the next prompt."""
        return self.samples[-1]

    def prompt_ids(self) -> list[int]:
        return list(self.sample.ids)

    def fork(self) -> ChatTrajectory:
        """An independent copy (same model and join): to branch a rollout, or to measure an append."""
        twin = copy.copy(self)
        twin.messages = list(self.messages)
        twin.samples = [TokenSample(list(s.ids), list(s.loss_mask), list(s.logprobs), s.message_count,
                                    list(s.constrained)) for s in self.samples]
        twin._sample_text = list(self._sample_text)
        return twin

    def restore(self, messages: Sequence[Mapping[str, Any]], samples: Sequence[TokenSample]) -> None:
        """Take a saved conversation and its samples (the last one ending in a generation prompt)
        as this trajectory's own: resuming a rollout re-encodes nothing. The current sample's text
        is its ids decoded (exact: decoding keeps special tokens and cleans nothing up)."""
        self.messages = list(messages)
        self.samples = list(samples)
        self._sample_text = [self.chat.decode(self.sample.ids)] if self.history_rewrite == "split" else []
        self._last_turn_ended = None

    def add_generated(self, ids: Sequence[int], logprobs: Sequence[float], message: Mapping[str, Any],
                      constrained: Sequence[bool] = ()) -> None:
        """Record a generated turn exactly as sampled and the assistant message parsed from it;
        ``constrained`` (``GenerationResult.constrained``: one flag per id, or empty for none) marks
        the ids a grammar restricted, which ``TokenSample.training_mask`` leaves out."""
        if self._last_turn_ended is not None:
            raise AppendOrderError(turn=self._turns, reason="a generated turn must follow a prompt")
        if len(logprobs) != len(ids):
            raise AppendError(f"turn {self._turns}: {len(ids)} generated ids but {len(logprobs)} logprobs",
                              turn=self._turns)
        if constrained and len(constrained) != len(ids):
            raise AppendError(f"turn {self._turns}: {len(ids)} generated ids but {len(constrained)} "
                              "constrained flags", turn=self._turns)
        start = len(self.sample.ids)
        self.sample.constrained.extend(start + offset for offset, flag in enumerate(constrained) if flag)
        self.sample.extend(list(ids), 1, list(logprobs))
        self.messages.append(message)
        self.sample.message_count = len(self.messages)
        self._last_turn_ended = bool(ids) and ids[-1] in self.chat.end_of_turn_ids
        self._turns += 1
        if self.history_rewrite == "split":
            self._sample_text.append(self.chat.decode(ids))

    def append(self, new_messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """Append the new messages (tool results, user turns) and the generation prompt; returns
        the appended ids (or, after a split, the new sample's whole prompt)."""
        if self._last_turn_ended is None:
            raise AppendOrderError(turn=self._turns, reason="new messages must follow a generated turn")
        if not self._last_turn_ended:
            last_id = self.sample.ids[-1] if self.sample.ids else None
            raise TruncatedTurnError(turn=self._turns, last_id=last_id)
        if not new_messages:
            raise AppendOrderError(turn=self._turns, reason="no new messages to append")
        previous_assistant = self.messages[-1]
        text = self.join.appended_text(new_messages, previous_assistant)
        self.messages.extend(new_messages)
        self._last_turn_ended = None
        if self.history_rewrite == "split":
            whole = self._render_whole(self.messages)
            if whole != "".join(self._sample_text) + text:
                return self._start_sample(whole)
            self._sample_text.append(text)
        ids = self.chat.encode(text)
        self.sample.extend(ids, 0)
        self.sample.message_count = len(self.messages)
        return ids

    def _start_sample(self, whole: str) -> list[int]:
        sample = TokenSample(message_count=len(self.messages))
        sample.extend(self.chat.encode(whole), 0)
        self.samples.append(sample)
        self._sample_text = [whole]
        return list(sample.ids)

    def _render_whole(self, messages: Sequence[Mapping[str, Any]]) -> str:
        return self.chat.render(messages, tools=self.join.tools, add_generation_prompt=True,
                                template_kwargs=self.join.template_kwargs)
