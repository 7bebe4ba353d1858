"""A rollout's trajectory under construction: a token-exact ``ChatTrajectory`` plus the weight
version of every token, frozen into the ``TokenTrace`` the saved state, the completed message and
the trainer carry.

Knows ``rollmesh.chat``'s trajectory and the wire's TokenTrace; nothing of Ray, NATS or torch.
Generated ids are kept exactly as sampled with their behaviour logprob and version; what the
template writes around them (the first prompt, tool results, the next generation prompt) is forced:
loss mask 0, logprob 0.0, version ``NO_VERSION``. Text is only ever derived from ids.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

from rollmesh.chat import MISMATCH_KINDS, ChatModel, ChatTrajectory, TokenSample, check_trajectory
from rollmesh.chat.turn_append import HistoryRewrite
from rollmesh.messages import NO_VERSION, TokenTrace


class RolloutTrajectory:
    """One rollout's conversation and tokens; ``chat`` is the ChatTrajectory (one sample: the
    rollout path runs ``history_rewrite = "keep_sampled"`` only)."""

    def __init__(self, chat: ChatTrajectory, versions: list[int] | None = None) -> None:
        self.chat = chat
        self.versions = versions if versions is not None else [NO_VERSION] * len(chat.sample.ids)
        if len(self.versions) != len(chat.sample.ids):
            raise ValueError(f"{len(chat.sample.ids)} ids but {len(self.versions)} versions")

    @classmethod
    def start(cls, model: ChatModel, messages: Sequence[Mapping[str, Any]], *,
              tools: Sequence[Mapping[str, Any]] | None, history_rewrite: HistoryRewrite = "keep_sampled",
              ) -> RolloutTrajectory:
        """The first prompt rendered and tokenized once (raises ``TemplateRenderError``)."""
        return cls(model.new_trajectory(messages, tools=tools, history_rewrite=history_rewrite))

    @classmethod
    def resume(cls, model: ChatModel, messages: Sequence[Mapping[str, Any]], trace: TokenTrace, *,
               tools: Sequence[Mapping[str, Any]] | None, history_rewrite: HistoryRewrite = "keep_sampled",
               ) -> RolloutTrajectory:
        """A saved rollout waiting for its next turn: ``messages`` (the whole conversation so far)
        and ``trace`` (its tokens, the last generation prompt included) as they were saved. The
        template's join is derived again from the opening messages; no token is re-encoded."""
        opening = 0
        while opening < len(messages) and messages[opening].get("role") != "assistant":
            opening += 1
        chat = model.new_trajectory(messages[:opening], tools=tools, history_rewrite=history_rewrite)
        chat.messages = list(messages)
        chat.samples = [TokenSample(ids=list(trace.ids), loss_mask=list(trace.loss_mask),
                                    logprobs=[p if m else None for p, m in zip(trace.logprobs, trace.loss_mask)],
                                    message_count=len(messages))]
        return cls(chat, list(trace.versions))

    @property
    def ids(self) -> list[int]:
        """The next prompt: every token so far."""
        return self.chat.sample.ids

    @property
    def messages(self) -> list[dict[str, Any]]:
        return [dict(message) for message in self.chat.messages]

    def add_generated(self, ids: Sequence[int], logprobs: Sequence[float], versions: Sequence[int],
                      message: Mapping[str, Any]) -> None:
        """A generated turn exactly as sampled, and the assistant message parsed from it."""
        if not len(ids) == len(logprobs) == len(versions):
            raise ValueError("generated tokens, logprobs and versions differ in length")
        if any(version < 0 for version in versions):
            raise ValueError(f"a generated token has no weight version (versions {sorted(set(versions))})")
        self.chat.add_generated(list(ids), list(logprobs), message)
        self.versions.extend(versions)

    def append(self, new_messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """Tool results (or user turns) and the next generation prompt, forced; the appended ids."""
        before = len(self.chat.sample.ids)
        appended = self.chat.append(new_messages)
        self.versions.extend([NO_VERSION] * (len(self.chat.sample.ids) - before))
        return appended

    def trace(self, *, max_len: int | None = None) -> TokenTrace:
        """A checked, frozen copy of the tokens (the first ``max_len`` of them if given)."""
        sample = self.chat.sample
        end = len(sample.ids) if max_len is None else min(max_len, len(sample.ids))
        return TokenTrace(ids=list(sample.ids[:end]), loss_mask=list(sample.loss_mask[:end]),
                          logprobs=[0.0 if p is None else p for p in sample.logprobs[:end]],
                          versions=list(self.versions[:end]))

    def check_tokens(self, special_ids: Collection[int]) -> tuple[dict[str, int], list[str]]:
        """Differences from a whole render of the conversation, by kind (``MISMATCH_KINDS``), and
        a description of each bug-class one (``non_assistant`` that no documented rewrite explains)."""
        counts = dict.fromkeys(MISMATCH_KINDS, 0)
        bugs: list[str] = []
        for sample, report in zip(self.chat.samples, check_trajectory(self.chat, special_ids)):
            for kind, count in report.counts.items():
                counts[kind] += count
            for difference in report.differences:
                if difference.kind == "non_assistant" and not difference.rewrite:
                    trace_text = self.chat.chat.decode(sample.ids[difference.trace_start:difference.trace_end])
                    bugs.append(f"at token {difference.trace_start}: {trace_text!r} where the render has "
                                f"{difference.render_end - difference.render_start} other token(s)")
        return counts, bugs

    def __len__(self) -> int:
        return len(self.chat.sample.ids)
