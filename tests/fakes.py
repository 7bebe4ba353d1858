"""Fakes for the true edges of the system, one class per edge; each says what it fakes.

Only edges are faked (a process we would spawn, the wall clock, the NATS bus, a model server's
generate and weight-swap calls); plain logic is always real.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollmesh.engine.protocols import DEFAULT_OPTIONS, GenerateOptions, GenerationResult
from rollmesh.messages import SamplingParams, Subject, WireMessage
from rollmesh.sandbox.backend_protocol import ExecResult

if TYPE_CHECKING:
    import torch


class FakeSandboxBackend:
    """Fakes a ``rollmesh.sandbox.SandboxBackend``: runs nothing.

    Each ``run`` records its call in ``calls`` and returns the next scripted outcome from
    ``outcomes`` (an ``ExecResult``, or an exception to raise); when none are left it returns an
    empty success.
    """

    name = "fake"
    isolated = True

    def __init__(self, outcomes: list[ExecResult | BaseException] | None = None) -> None:
        self.outcomes = list(outcomes or [])
        self.calls: list[dict[str, Any]] = []

    async def run(self, argv: list[str], *, workdir: Path, **limits: Any) -> ExecResult:
        self.calls.append({"argv": argv, "workdir": workdir, "workdir_existed": workdir.is_dir(), **limits})
        outcome = self.outcomes.pop(0) if self.outcomes else ExecResult(0, "", "", 0.0)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome


class ManualClock:
    """Fakes the wall clock (``time.time``): time moves only when a test calls ``advance``."""

    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class ScriptedEngine:
    """Fakes a ``rollmesh.engine.protocols.InferenceEngine``: samples nothing.

    Each ``generate`` records its call in ``calls`` (input ids, sampling, request id) and returns
    the next scripted outcome from ``outcomes`` (a ``GenerationResult``, or an exception to raise).
    Like a real engine it never returns more than ``sampling.max_new_tokens`` tokens: a longer
    scripted result is cut there with finish reason ``"length"``. Running out of outcomes raises
    ``AssertionError`` (the test scripted too few turns).
    """

    def __init__(self, outcomes: list[GenerationResult | BaseException]) -> None:
        self.outcomes = list(outcomes)
        self.calls: list[dict[str, Any]] = []

    async def generate(self, input_ids: list[int], sampling: SamplingParams, *,
                       request_id: str, options: GenerateOptions = DEFAULT_OPTIONS) -> GenerationResult:
        self.calls.append({"input_ids": list(input_ids), "sampling": sampling,
                           "request_id": request_id, "options": options})
        if not self.outcomes:
            raise AssertionError(f"ScriptedEngine: no outcome scripted for call {len(self.calls)}")
        outcome = self.outcomes.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        limit = sampling.max_new_tokens
        if len(outcome.token_ids) > limit:
            outcome = GenerationResult(outcome.token_ids[:limit], outcome.logprobs[:limit],
                                       outcome.versions[:limit], "length", len(input_ids), request_id)
        return outcome


class RecordingPublisher:
    """Fakes a ``rollmesh.ports.Publisher`` (the NATS bus): nothing leaves the process.

    ``publish`` checks the message against the subject's wire contract (encode + decode through the
    ``Subject``, so a wrong type or an invalid value fails as it would on the bus), records
    ``(subject, message)`` in ``published`` and, when the test closed a gate for that subject with
    ``hold``, waits until ``release``. ``request`` records ``(subject, message)`` in ``requests`` and
    answers with the next scripted reply for that subject from ``replies`` (a reply Struct, or an
    exception to raise, e.g. ``RequestTimeoutError`` for an unreachable responder); a subject with
    no scripted reply left gets ``default_replies[subject]``.
    """

    def __init__(self, replies: dict[Subject, list[WireMessage | BaseException]] | None = None,
                 default_replies: dict[Subject, WireMessage] | None = None) -> None:
        self.replies = {subject: list(queue) for subject, queue in (replies or {}).items()}
        self.default_replies = dict(default_replies or {})
        self.published: list[tuple[Subject, WireMessage]] = []
        self.requests: list[tuple[Subject, WireMessage]] = []
        self._gates: dict[str, asyncio.Event] = {}
        self._changed = asyncio.Condition()

    def messages(self, subject: Subject) -> list[Any]:
        """What was published on ``subject``, in order."""
        return [message for published_on, message in self.published if published_on is subject]

    def requested(self, subject: Subject) -> list[Any]:
        """What was requested on ``subject``, in order."""
        return [message for requested_on, message in self.requests if requested_on is subject]

    def hold(self, subject: Subject) -> None:
        """From now on, ``publish`` on ``subject`` records the message, then waits for ``release``."""
        self._gates[subject.template] = asyncio.Event()

    def release(self, subject: Subject) -> None:
        self._gates.pop(subject.template).set()

    async def wait_published(self, subject: Subject, count: int = 1) -> list[Any]:
        """Wait (no polling) until ``count`` messages were published on ``subject``."""
        async with self._changed:
            await self._changed.wait_for(lambda: len(self.messages(subject)) >= count)
        return self.messages(subject)

    async def publish(self, subject: Subject, message: WireMessage) -> None:
        subject.decode(subject.encode(message))
        self.published.append((subject, message))
        async with self._changed:
            self._changed.notify_all()
        gate = self._gates.get(subject.template)
        if gate is not None:
            await gate.wait()

    async def request(self, subject: Subject, message: WireMessage, timeout_s: float) -> WireMessage:
        subject.decode(subject.encode(message))
        self.requests.append((subject, message))
        queue = self.replies.get(subject)
        if queue:
            reply = queue.pop(0)
        elif subject in self.default_replies:
            reply = self.default_replies[subject]
        else:
            raise AssertionError(f"RecordingPublisher: no reply scripted for {subject.template}")
        if isinstance(reply, BaseException):
            raise reply
        return subject.decode_reply(subject.encode_reply(reply))


class ProgressRecorder:
    """Fakes JetStream's in-progress ack (``MessageContext._progress``): counts the calls."""

    def __init__(self) -> None:
        self.calls = 0

    async def __call__(self) -> None:
        self.calls += 1


class StagingEngine:
    """Fakes an inference engine seen as ``rollmesh.engine.weight_follower.StagesWeights``.

    ``stage_weights`` records ``(version, state_dict)`` in ``staged`` and answers ``accept``.
    ``wait_weights_activated`` sets the ``waiting`` event, then makes the staged version current
    and returns it: at once, or, after ``hold_activation()``, only when the test calls
    ``activate()`` (a decode step still running). ``in_flight`` is what ``num_active`` reports.
    """

    def __init__(self, current_version: int = 0, *, accept: bool = True, in_flight: int = 0) -> None:
        self._current = current_version
        self.accept = accept
        self.in_flight = in_flight
        self.staged: list[tuple[int, Mapping[str, torch.Tensor]]] = []
        self.waiting = asyncio.Event()
        self._step_boundary = asyncio.Event()
        self._step_boundary.set()

    @property
    def current_version(self) -> int:
        return self._current

    def stage_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> bool:
        self.staged.append((version, dict(state_dict)))
        return self.accept

    def hold_activation(self) -> None:
        self._step_boundary.clear()

    def activate(self) -> None:
        self._step_boundary.set()

    async def wait_weights_activated(self, version: int) -> int:
        self.waiting.set()
        await self._step_boundary.wait()
        self.waiting.clear()
        self._current = version
        return version

    def num_active(self) -> int:
        return self.in_flight
