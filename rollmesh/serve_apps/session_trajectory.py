"""A chat session's token-exact trajectory: ``rollmesh.chat``'s ``ChatTrajectory`` plus the weight
version of every token, restored from the session store at each turn without re-encoding a token.

Knows ``rollmesh.chat`` and the wire's TokenTrace; not Ray, the store or HTTP. It is what the
rollout's ``RolloutTrajectory`` does for one sample (``history_rewrite = "keep_sampled"``, the only
mode sessions have: a harness's client sent the history it wants, and the model saw exactly the
tokens kept), on ``ChatTrajectory``'s public API alone, so the rollout's own bookkeeping (split
samples, saved rollout state) stays the rollout's. Generated ids keep their logprob and version
(loss mask 1); everything else is forced: loss mask 0, logprob 0.0, version ``NO_VERSION``.

Tokens sampled under a grammar (``GenerationResult.constrained``: ``tool_choice`` "required" or a
named function) were not the policy's free choice: the trace a client trains on gives them loss
mask 0 (``TokenSample.training_mask``, keeping their logprob and version). The ``ChatTrajectory``
still counts them as generated, so the check against a whole render classifies their differences
as the model's (``assistant``); their positions are stored apart (``constrained``) to survive a
resume.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

from rollmesh.chat import MISMATCH_KINDS, ChatModel, ChatTrajectory, TokenSample, check_trajectory
from rollmesh.messages.token_trace import NO_VERSION, TokenTrace


class SessionTrajectory:
    """One session's conversation and tokens (one sample)."""

    def __init__(self, chat: ChatTrajectory, versions: list[int] | None = None) -> None:
        self.chat = chat
        self.versions = versions if versions is not None else [NO_VERSION] * len(chat.sample.ids)
        if len(self.versions) != len(chat.sample.ids):
            raise ValueError(f"{len(chat.sample.ids)} ids but {len(self.versions)} versions")

    @classmethod
    def start(cls, model: ChatModel, messages: Sequence[Mapping[str, Any]], *,
              tools: Sequence[Mapping[str, Any]] | None) -> SessionTrajectory:
        """The first prompt rendered and tokenized once (raises ``TemplateRenderError``)."""
        return cls(model.new_trajectory(messages, tools=tools))

    @classmethod
    def resume(cls, model: ChatModel, messages: Sequence[Mapping[str, Any]], trace: TokenTrace, *,
               tools: Sequence[Mapping[str, Any]] | None, constrained: Sequence[int] = ()) -> SessionTrajectory:
        """``messages`` and ``trace`` as stored, ending in a generation prompt: the template's join
        is derived again from the opening messages (rendering them, never the history); no token
        is re-encoded. ``trace`` is ``trace(for_training=False)``'s. Its next call is
        ``add_generated``."""
        opening = 0
        while opening < len(messages) and messages[opening].get("role") != "assistant":
            opening += 1
        chat = model.new_trajectory(messages[:opening], tools=tools)
        chat.messages = list(messages)
        chat.samples = [TokenSample(ids=list(trace.ids), loss_mask=list(trace.loss_mask),
                                    logprobs=[p if m else None for p, m in zip(trace.logprobs, trace.loss_mask)],
                                    message_count=len(messages), constrained=list(constrained))]
        return cls(chat, list(trace.versions))

    @property
    def ids(self) -> list[int]:
        """The next prompt: every token so far."""
        return self.chat.sample.ids

    @property
    def constrained(self) -> list[int]:
        """Positions of the tokens sampled under a grammar."""
        return list(self.chat.sample.constrained)

    @property
    def messages(self) -> list[dict[str, Any]]:
        return [dict(message) for message in self.chat.messages]

    def add_generated(self, ids: Sequence[int], logprobs: Sequence[float], versions: Sequence[int],
                      message: Mapping[str, Any], constrained: Sequence[bool] = ()) -> None:
        """A generated turn exactly as sampled, and the assistant message parsed from it;
        ``constrained``: per token, whether a grammar restricted it (empty: none was)."""
        if not len(ids) == len(logprobs) == len(versions):
            raise ValueError("generated tokens, logprobs and versions differ in length")
        self.chat.add_generated(list(ids), list(logprobs), message, constrained)
        self.versions.extend(versions)

    def append(self, new_messages: Sequence[Mapping[str, Any]]) -> None:
        """New messages and the next generation prompt, forced (raises ``TruncatedTurnError``
        after a turn with no end of turn)."""
        self.chat.append(new_messages)
        self.versions.extend([NO_VERSION] * (len(self.chat.sample.ids) - len(self.versions)))

    def trace(self, *, for_training: bool = True) -> TokenTrace:
        """The tokens; ``for_training``: tokens sampled under a grammar get loss mask 0 (else
        every generated token has 1, as stored)."""
        sample = self.chat.sample
        loss_mask = sample.training_mask() if for_training else list(sample.loss_mask)
        return TokenTrace(ids=list(sample.ids), loss_mask=loss_mask,
                          logprobs=[0.0 if p is None else p for p in sample.logprobs],
                          versions=list(self.versions))

    def check_tokens(self, special_ids: Collection[int]) -> tuple[dict[str, int], list[str]]:
        """Differences from a whole render of the conversation by kind (``MISMATCH_KINDS``), and
        a description of each in text the model did not generate that no documented rewrite
        explains (a bug). Raises ``ChatError`` when the template will not render it whole."""
        counts = dict.fromkeys(MISMATCH_KINDS, 0)
        bugs: list[str] = []
        for report in check_trajectory(self.chat, special_ids):
            for kind, count in report.counts.items():
                counts[kind] += count
            for difference in report.differences:
                if difference.kind == "non_assistant" and not difference.rewrite:
                    text = self.chat.chat.decode(self.ids[difference.trace_start:difference.trace_end])
                    bugs.append(f"at token {difference.trace_start}: {text!r} where the render has "
                                f"{difference.render_end - difference.render_start} other token(s)")
        return counts, bugs

    def __len__(self) -> int:
        return len(self.chat.sample.ids)
