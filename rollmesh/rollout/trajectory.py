"""A rollout's trajectory under construction: a token-exact ``ChatTrajectory`` plus the weight
version of every token, frozen into the ``TokenTrace`` the saved state, the completed message and
the trainer carry.

Knows ``rollmesh.chat``'s trajectory and the wire's TokenTrace; nothing of Ray, NATS or torch.
Generated ids are kept exactly as sampled with their behaviour logprob and version; what the
template writes around them (the first prompt, tool results, the next generation prompt) is forced:
loss mask 0, logprob 0.0, version ``NO_VERSION``. Text is only ever derived from ids.

With ``history_rewrite = "split"`` the ChatTrajectory may hold several training samples (a new
one starts where the template's whole render stops extending the current one); each becomes its
own TokenTrace, and the next prompt is always the last sample's ids.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

from rollmesh.chat import MISMATCH_KINDS, ChatModel, ChatTrajectory, TokenSample, check_trajectory
from rollmesh.chat.turn_append import HistoryRewrite
from rollmesh.messages import NO_VERSION, TokenTrace


# The kinds a rollout counts (RolloutCompleted.tokenization_mismatches and the metric
# rollmesh_tokenization_mismatches{kind}): the check's kinds, except that a difference a family's
# documented history rewrite explains (token_check.DOCUMENTED_REWRITES, the rules
# ``rollmesh check-template`` calls "expected") counts as ``history_rewrite``, never as the
# bug-class ``non_assistant``.
ROLLOUT_MISMATCH_KINDS: tuple[str, ...] = (*MISMATCH_KINDS, "history_rewrite")


class RolloutTrajectory:
    """One rollout's conversation and tokens; ``chat`` is the ChatTrajectory, ``versions`` the
    weight versions of each of its samples' tokens."""

    def __init__(self, chat: ChatTrajectory, versions: list[list[int]] | None = None) -> None:
        self.chat = chat
        self.versions = versions if versions is not None else [[NO_VERSION] * len(s.ids) for s in chat.samples]
        if [len(v) for v in self.versions] != [len(s.ids) for s in chat.samples]:
            raise ValueError(f"samples of {[len(s.ids) for s in chat.samples]} ids but "
                             f"{[len(v) for v in self.versions]} versions")

    @classmethod
    def start(cls, model: ChatModel, messages: Sequence[Mapping[str, Any]], *,
              tools: Sequence[Mapping[str, Any]] | None, history_rewrite: HistoryRewrite = "keep_sampled",
              ) -> RolloutTrajectory:
        """The first prompt rendered and tokenized once (raises ``TemplateRenderError``)."""
        return cls(model.new_trajectory(messages, tools=tools, history_rewrite=history_rewrite))

    @classmethod
    def resume(cls, model: ChatModel, messages: Sequence[Mapping[str, Any]], traces: Sequence[TokenTrace], *,
               tools: Sequence[Mapping[str, Any]] | None, history_rewrite: HistoryRewrite = "keep_sampled",
               message_counts: Sequence[int] = ()) -> RolloutTrajectory:
        """A saved rollout waiting for its next turn: ``messages`` (the whole conversation so far)
        and ``traces`` (its samples' tokens, the last generation prompt included) as they were
        saved, with the messages each sample covers (``message_counts``; not needed for one
        sample). The template's join is derived again from the opening messages; no token is
        re-encoded."""
        counts = list(message_counts) if len(traces) > 1 else [len(messages)]
        if len(counts) != len(traces):
            raise ValueError(f"{len(traces)} saved samples but {len(counts)} message counts")
        opening = 0
        while opening < len(messages) and messages[opening].get("role") != "assistant":
            opening += 1
        chat = model.new_trajectory(messages[:opening], tools=tools, history_rewrite=history_rewrite)
        chat.restore(messages, [TokenSample(ids=list(trace.ids), loss_mask=list(trace.loss_mask),
                                            logprobs=[p if m else None for p, m in zip(trace.logprobs, trace.loss_mask)],
                                            message_count=count)
                                for trace, count in zip(traces, counts)])
        return cls(chat, [list(trace.versions) for trace in traces])

    @property
    def ids(self) -> list[int]:
        """The next prompt: every token of the sample being grown."""
        return self.chat.sample.ids

    @property
    def messages(self) -> list[dict[str, Any]]:
        return [dict(message) for message in self.chat.messages]

    @property
    def message_counts(self) -> list[int]:
        """How many messages each sample covers."""
        return [sample.message_count for sample in self.chat.samples]

    def add_generated(self, ids: Sequence[int], logprobs: Sequence[float], versions: Sequence[int],
                      message: Mapping[str, Any], constrained: Sequence[bool] = ()) -> None:
        """A generated turn exactly as sampled, and the assistant message parsed from it;
        ``constrained``: per id, sampled under a grammar (trained with loss mask 0)."""
        if not len(ids) == len(logprobs) == len(versions):
            raise ValueError("generated tokens, logprobs and versions differ in length")
        if any(version < 0 for version in versions):
            raise ValueError(f"a generated token has no weight version (versions {sorted(set(versions))})")
        self.chat.add_generated(list(ids), list(logprobs), message, constrained)
        self.versions[-1].extend(versions)

    def append(self, new_messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """Tool results (or user turns) and the next generation prompt, forced; the appended ids
        (after a split: the new sample's whole prompt)."""
        samples = len(self.chat.samples)
        appended = self.chat.append(new_messages)
        if len(self.chat.samples) > samples:  # split: a new sample, its prompt a whole render
            self.versions.append([])
        self.versions[-1].extend([NO_VERSION] * (len(self.chat.sample.ids) - len(self.versions[-1])))
        return appended

    def trace(self, *, max_len: int | None = None) -> TokenTrace:
        """A checked, frozen copy of the last sample's tokens (the first ``max_len`` if given)."""
        return self.traces(max_len=max_len)[-1]

    def traces(self, *, max_len: int | None = None) -> list[TokenTrace]:
        """Every sample's tokens, checked and frozen, in order; ``max_len`` cuts the last one (the
        earlier ones were generated from, so they fit)."""
        traces = []
        for number, (sample, versions) in enumerate(zip(self.chat.samples, self.versions)):
            last = number == len(self.chat.samples) - 1
            end = len(sample.ids) if max_len is None or not last else min(max_len, len(sample.ids))
            traces.append(TokenTrace(ids=list(sample.ids[:end]), loss_mask=sample.training_mask()[:end],
                                     logprobs=[0.0 if p is None else p for p in sample.logprobs[:end]],
                                     versions=list(versions[:end])))
        return traces

    def check_tokens(self, special_ids: Collection[int]) -> tuple[dict[str, int], list[str]]:
        """Each sample's differences from a whole render of the messages it covers, by kind
        (``ROLLOUT_MISMATCH_KINDS``), and a description of each bug-class one (``non_assistant``
        that no documented rewrite of the model's family explains)."""
        counts = dict.fromkeys(ROLLOUT_MISMATCH_KINDS, 0)
        bugs: list[str] = []
        for number, (sample, report) in enumerate(zip(self.chat.samples, check_trajectory(self.chat, special_ids))):
            for difference in report.differences:
                counts["history_rewrite" if difference.rewrite else difference.kind] += 1
                if difference.kind == "non_assistant" and not difference.rewrite:
                    trace_text = self.chat.chat.decode(sample.ids[difference.trace_start:difference.trace_end])
                    where = f"sample {number}, token" if len(self.chat.samples) > 1 else "token"
                    bugs.append(f"at {where} {difference.trace_start}: {trace_text!r} where the render has "
                                f"{difference.render_end - difference.render_start} other token(s)")
        return counts, bugs

    def __len__(self) -> int:
        """The tokens of the sample being grown: the next prompt's length."""
        return len(self.chat.sample.ids)
