"""Rollout events: the client-facing part of the contract (JSON on the wire).

Knows msgspec only. A client in any language publishes ``RolloutRequested`` as a JSON object on
``rl.<ns>.rollout.requested`` and reads ``RolloutProgressed`` / ``RolloutCompleted`` /
``RolloutFailed`` back.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from rollmesh.messages.base import SamplingParams, WireMessage
from rollmesh.messages.errors import MessageError
from rollmesh.messages.token_trace import TokenTrace, TokenTraceError

NonEmptyId = Annotated[str, Meta(min_length=1, max_length=200)]
Purpose = Literal["train", "eval"]
RolloutFinishReason = Literal["stop", "truncated"]


class RolloutRequested(WireMessage, frozen=True, tag="rollout.requested"):
    """Ask the mesh to run one agent rollout of a registered task."""

    rollout_id: NonEmptyId
    task: NonEmptyId
    # Task-specific input; the task plugin builds the prompt from it and verifies against it.
    task_input: dict[str, Any] = {}
    # Rollouts that share a group_id form one GRPO group.
    group_id: str = ""
    purpose: Purpose = "train"
    sampling: SamplingParams = SamplingParams()
    max_turns: Annotated[int, Meta(ge=1, le=1000)] = 4
    requested_at: float = 0.0


class RolloutProgressed(WireMessage, frozen=True, tag="rollout.progressed"):
    """A turn finished (ephemeral, core NATS)."""

    rollout_id: str
    turn: int
    num_tokens: int
    weight_version: int
    status: str = "running"
    # The rollout's trace (32 hex digits; its turns are traces of their own linking to it); ""
    # when tracing is off or the sender predates it.
    trace_id: str = ""


class TraceNotInlineError(MessageError, LookupError):
    """The message's TokenTrace is in the object store (``ref``): fetch it, don't read it inline."""

    def __init__(self, rollout_id: str, ref: str) -> None:
        super().__init__(f"the trajectory of {rollout_id!r} is stored at {ref!r}, not inline")
        self.rollout_id = rollout_id
        self.ref = ref


def _legacy_trace(rollout_id: str, tokens: list[int], loss_mask: list[int], logprobs: list[float],
                  versions: list[int]) -> TokenTrace:
    try:
        return TokenTrace(ids=list(tokens), loss_mask=list(loss_mask), logprobs=list(logprobs),
                          versions=list(versions))
    except TokenTraceError as exc:
        raise TokenTraceError(f"{rollout_id!r}: {exc.reason}", position=exc.position) from exc


class RolloutCompleted(WireMessage, frozen=True, tag="rollout.completed", omit_defaults=True):
    """A finished rollout with the exact tokens the model saw and produced.

    Its tokens are one ``TokenTrace`` per training sample. Most rollouts have one sample, read
    with ``token_trace()``: inline in ``trajectory`` when its JSON is at most
    ``rollout.inline_trajectory_bytes``, else in the JetStream object store at ``trajectory_ref``
    (stored before this message is published). A rollout run with ``rollout.history_rewrite =
    "split"`` whose template rewrote history has several samples: the first is ``trajectory`` /
    ``trajectory_ref`` as above, the later ones (each starting with a whole render of the
    conversation at its split) are ``split_samples`` inline, or, when the samples together are
    too large to inline, ``split_sample_refs`` (one stored object each, in order); read them all
    with ``token_traces()``. Every sample is trained with the rollout's reward; the rollout is
    one idempotency key. A reader that predates ``split_samples`` reads the first sample only.
    ``tokens``, ``loss_mask``, ``logprobs`` and ``versions`` are the flat fields of senders that
    predate TokenTrace: still read, never written. Defaults are omitted on the wire, so a reader
    that predates TokenTrace rejects a new message (its required ``tokens`` is missing) instead of
    training on nothing.
    """

    rollout_id: str
    task: str
    group_id: str
    purpose: Purpose
    reward: float
    turns: int
    tool_calls: int
    prompt_len: int
    # Deprecated: the flat token fields of older senders (read through token_trace()).
    tokens: list[int] = []
    loss_mask: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    text: str = ""
    duration_s: float = 0.0
    # Where the trajectory (a TokenTrace, msgpack) lives when it is too large to inline:
    # "<object-store bucket>/<object name>"; "" = inline.
    trajectory_ref: str = ""
    # MoE models: where the routed-expert rows of every position but the last are stored (one
    # object per turn, for routing replay); "" for dense models.
    routed_experts_ref: str = ""
    # The trainer trains on one key at most once, however often the message is delivered.
    idempotency_key: str = ""
    # Attempts this rollout took, and the infrastructure failures it survived on the way.
    attempts: int = 1
    infra_failures: int = 0
    # The trace of the attempt that finished it (as in RolloutProgressed).
    trace_id: str = ""
    # The rollout's tokens, when inline (see trajectory_ref).
    trajectory: TokenTrace | None = None
    # Its length (every sample together) and the weight version of its last generated token (-1:
    # none), known without fetching a stored trajectory.
    num_tokens: int = 0
    weight_version: int = -1
    # "stop": the last turn ended with an end-of-turn token; "truncated": it was cut by
    # max_new_tokens or the model's context, and no further turn ran (trainer.overlong).
    finish_reason: RolloutFinishReason = "stop"
    # Differences between the trajectory and a whole render of its conversation, by kind
    # ("special", "non_assistant", "assistant", "history_rewrite"; docs/multi-turn-tokens.md);
    # {} from older senders.
    tokenization_mismatches: dict[str, int] = {}
    # Tool calls the model wrote that could not run (bad JSON, unknown tool, schema mismatch);
    # each was answered with a tool result saying what was wrong.
    malformed_tool_calls: int = 0
    # history_rewrite = "split": the training samples after the first, in order, inline; or
    # where each is stored ("<bucket>/<object>") when the samples do not fit inline. [] = one sample.
    split_samples: list[TokenTrace] = []
    split_sample_refs: list[str] = []
    # Each named reward's own score, for logging: a stage's rewards by label ("math",
    # "exact_match"), a dict reward's keys as "<label>/<key>"; ``reward`` is their weighted total.
    # {} for a task whose reward is one float, and from older senders.
    reward_components: dict[str, float] = {}
    # The final answer the reward saw (RewardInput.final_text): the last turn's content when it
    # ended cleanly and called no tool, else "". Sent even when the trace is stored, for tables.
    final_text: str = ""
    # The sampling temperature its tokens were drawn at (RolloutRequested.sampling): the trainer
    # divides its logits by it, so its logprobs are of the distribution the behaviour logprobs
    # are of. 1.0 from older senders (and omitted on the wire at 1.0); 0 (greedy) trains at 1.
    temperature: Annotated[float, Meta(ge=0.0, le=10.0)] = 1.0

    def token_trace(self) -> TokenTrace:
        """The rollout's (first) sample, from ``trajectory`` or an older sender's flat fields;
        raises ``TraceNotInlineError`` when it is in the object store (``trajectory_ref``)."""
        if self.trajectory is not None:
            return self.trajectory
        if self.trajectory_ref:
            raise TraceNotInlineError(self.rollout_id, self.trajectory_ref)
        return _legacy_trace(self.rollout_id, self.tokens, self.loss_mask, self.logprobs, self.versions)

    def token_traces(self) -> list[TokenTrace]:
        """Every training sample of the rollout, in order (one unless split); raises
        ``TraceNotInlineError`` when one is in the object store."""
        return _all_traces(self)

    @property
    def num_samples(self) -> int:
        """How many training samples the rollout carries (known without fetching them)."""
        return 1 + max(len(self.split_samples), len(self.split_sample_refs))


FailureKind = Literal[
    "invalid_request",
    "unknown_task",
    "sandbox_error",
    "sandbox_timeout",
    "inference_error",
    "internal_error",
    # The trajectory differs from a whole render of its conversation in text the model did not
    # generate (rollout.strict_tokenization): a bug in appending. Masked, never retried.
    "tokenization_error",
    # The reward could not be computed (its worker process died, a reward function raised, a
    # reward server is down): not the model's fault, so retried like the infrastructure, then
    # masked; never a zero.
    "reward_error",
]


class RolloutFailed(WireMessage, frozen=True, tag="rollout.failed"):
    """A rollout that could not run or finish, for an infrastructure reason, never a zero reward."""

    rollout_id: str
    kind: FailureKind
    reason: str
    group_id: str = ""
    purpose: Purpose = "train"
    turns: int = 0
    idempotency_key: str = ""
    attempts: int = 1
    infra_failures: int = 0
    # The trace of the attempt that failed ("" when it failed before one began).
    trace_id: str = ""


# Failure kinds that are the infrastructure's fault, not the task's: retried up to a budget, and
# when the budget is spent, masked out of group statistics (never scored as a zero reward).
# A reward_error is retried too: a reward server that is down may be back, and a retry resumes
# after the last turn, so it only computes the reward again.
INFRA_FAILURE_KINDS: frozenset[str] = frozenset({"sandbox_error", "sandbox_timeout", "inference_error",
                                                 "reward_error"})


class SavedToolCall(msgspec.Struct, frozen=True, kw_only=True):
    """One tool call of a saved rollout and what the model was shown of its output."""

    name: str
    argument: str  # the arguments as JSON text (before chat messages: the call's raw argument)
    ok: bool
    output: str
    call_id: str = ""
    arguments: dict[str, Any] = {}


class RolloutState(WireMessage, frozen=True, tag="rollout.state"):
    """A rollout's resumable state: the value of its key in the rollout-state KV bucket.

    Written after every turn (and when the rollout ends), before the work queue is told the
    rollout is still in progress, so a worker that takes over resumes from the last saved turn.
    ``outcome`` is set once the rollout ended: a redelivered request then re-publishes it instead
    of running the rollout again. Its tokens are one ``TokenTrace`` per training sample, as in
    ``RolloutCompleted``: the first in ``trajectory`` (or, a long rollout, in the object store at
    ``trajectory_ref``), the later ones (``history_rewrite = "split"``) in ``split_samples`` or
    ``split_sample_refs``; the last sample is the one the next turn grows. The flat ``tokens``
    ... ``versions`` are those of states saved before TokenTrace: read, not written.
    """

    rollout_id: str
    request: RolloutRequested
    turn: int = 0  # turns completed
    # Deprecated: the flat token fields of states saved before TokenTrace.
    tokens: list[int] = []
    loss_mask: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    prompt_len: int = 0
    tool_calls: list[SavedToolCall] = []
    final_text: str = ""
    finished_with_eos: bool = False
    reward_so_far: float = 0.0
    # MoE models: where this rollout's routed-expert rows are stored, and how many positions
    # they cover so far (the next turn's rows start there); "" and 0 for dense models.
    routed_experts_ref: str = ""
    routed_experts_rows: int = 0
    lease_id: str = ""
    snapshot_id: str = ""  # the workspace after the last tool call, when snapshots are on
    attempts: int = 0  # times a worker started (or resumed) this rollout
    infra_failures: int = 0  # infrastructure failures so far, against rollout.infra_retries
    tool_wait_s: float = 0.0
    started_at: float = 0.0
    updated_at: float = 0.0
    outcome: RolloutCompleted | RolloutFailed | None = None
    trajectory: TokenTrace | None = None
    # "<object-store bucket>/<object name>" of the trajectory when too large for the KV value.
    trajectory_ref: str = ""
    # The conversation so far as chat messages (the task's, each assistant turn parsed from its
    # tokens, each tool result): with the trajectory, what rebuilds the token-exact ChatTrajectory
    # on resume. [] in states saved before chat messages (such a rollout starts over).
    messages: list[dict[str, Any]] = []
    # "" while the rollout runs; "stop" or "truncated" once its last turn ran.
    finish_reason: str = ""
    malformed_tool_calls: int = 0
    # history_rewrite = "split": the samples after the first, as in RolloutCompleted, and how
    # many of ``messages`` each sample covers ([trajectory, *split_samples] order; what checks
    # each against its render on resume). [] = one sample, covering every message.
    split_samples: list[TokenTrace] = []
    split_sample_refs: list[str] = []
    sample_message_counts: list[int] = []

    def token_trace(self) -> TokenTrace:
        """As ``RolloutCompleted.token_trace``: inline, legacy flat fields, or ``TraceNotInlineError``."""
        if self.trajectory is not None:
            return self.trajectory
        if self.trajectory_ref:
            raise TraceNotInlineError(self.rollout_id, self.trajectory_ref)
        return _legacy_trace(self.rollout_id, self.tokens, self.loss_mask, self.logprobs, self.versions)

    def token_traces(self) -> list[TokenTrace]:
        """As ``RolloutCompleted.token_traces``."""
        return _all_traces(self)


def _all_traces(message: RolloutCompleted | RolloutState) -> list[TokenTrace]:
    if message.split_sample_refs:
        raise TraceNotInlineError(message.rollout_id, message.split_sample_refs[0])
    return [message.token_trace(), *message.split_samples]
