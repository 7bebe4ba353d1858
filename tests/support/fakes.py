"""Fakes for the true edges of the system, one class per edge; each says what it fakes.

Only edges are faked (a sandbox runtime we would spawn, the wall clock, the NATS bus, a model
server's generate and weight-swap calls); plain logic is always real.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import tarfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollmesh.engine.protocols import DEFAULT_OPTIONS, GenerateOptions, GenerationResult
from rollmesh.messages import SamplingParams, Subject, WireMessage
from rollmesh.sandbox.errors import (
    ChecksumMismatchError,
    SandboxDiedError,
    TransferError,
    UnsafeArchiveError,
    WorkspacePathError,
)
from rollmesh.sandbox.sandbox_protocol import ExecOutcome, FileTransfer, SandboxInfo, SandboxLimits

if TYPE_CHECKING:
    import torch


class FakeSandbox:
    """Fakes one live ``rollmesh.sandbox.Sandbox`` (the runtime edge): no process, no isolation.

    The workspace is the dict ``files`` (relative path -> bytes); tars in and out are real tars of
    it. A command answers with the backend's next scripted outcome (an ``ExecOutcome``, an
    exception to raise, or a function of ``(sandbox, argv, shell, stdin)``), else by a few
    built-ins: ``echo WORDS``, ``cat`` (stdin), ``cat FILE``, ``exit N``; anything else exits 0
    silently. Output is handed to ``on_output`` line by line before the outcome is returned.
    ``die()`` makes it behave as a sandbox whose guest is gone.
    """

    def __init__(self, backend: FakeSandboxBackend, sandbox_id: str, limits: SandboxLimits,
                 network: bool) -> None:
        self.info = SandboxInfo(sandbox_id, backend.name, backend.isolated, limits)
        self.network = network
        self.files: dict[str, bytes] = {}
        self.execs: list[dict[str, Any]] = []
        self.destroyed = False
        self.dead = False
        self._backend = backend

    def die(self) -> None:
        self.dead = True

    def alive(self) -> bool:
        return not self.dead and not self.destroyed

    async def destroy(self) -> None:
        self.destroyed = True

    async def exec(self, argv: list[str] | None = None, *, shell: str | None = None, stdin: bytes = b"",
                   timeout_s: float | None = None, env: dict[str, str] | None = None,
                   cwd: str | None = None, on_output: Any = None, key: str = "") -> ExecOutcome:
        self._check_alive()
        self.execs.append({"argv": argv, "shell": shell, "stdin": stdin, "timeout_s": timeout_s,
                           "env": env, "cwd": cwd})
        if cwd is not None:
            _workspace_path(cwd)
        backend = self._backend
        if backend.exec_gate is not None:
            backend.execs_waiting += 1
            try:
                await backend.exec_gate.wait()
            finally:
                backend.execs_waiting -= 1
        self._check_alive()
        outcome = backend.outcomes.pop(0) if backend.outcomes else self._builtin
        if isinstance(outcome, BaseException):
            raise outcome
        if callable(outcome):
            outcome = outcome(self, argv, shell, stdin)
        if on_output is not None:
            for stream, data in (("stdout", outcome.stdout), ("stderr", outcome.stderr)):
                for line in data.splitlines(keepends=True):
                    await on_output(stream, line)
        return outcome

    def _builtin(self, sandbox: FakeSandbox, argv: list[str] | None, shell: str | None,
                 stdin: bytes) -> ExecOutcome:
        words = argv or (shell or "").split()
        stdout, stderr, code = b"", b"", 0
        if words[:1] == ["echo"]:
            stdout = (" ".join(words[1:]) + "\n").encode()
        elif words == ["cat"]:
            stdout = stdin
        elif words[:1] == ["cat"]:
            if words[1] in self.files:
                stdout = self.files[words[1]]
            else:
                stderr, code = f"cat: {words[1]}: No such file or directory\n".encode(), 1
        elif words[:1] == ["exit"]:
            code = int(words[1])
        return ExecOutcome("exit", code, None, False, stdout, stderr, 0.01)

    async def put_file(self, path: str, data: bytes, *, mode: int = 0o644,
                       expected_sha256: str | None = None, verify: bool = True) -> FileTransfer:
        self._check_alive()
        name = _workspace_path(path)
        stored = self._checked(FileTransfer(name, len(data), self._stored_sha(data)), expected_sha256)
        self.files[name] = bytes(data)
        return stored

    def _checked(self, stored: FileTransfer, expected_sha256: str | None) -> FileTransfer:
        # As the real guest: bytes whose digest is not the sender's never land.
        if expected_sha256 is not None and stored.sha256 != expected_sha256:
            raise ChecksumMismatchError(f"arrived with sha256 {stored.sha256}", path=stored.path)
        return stored

    async def get_file(self, path: str, *, verify: bool = True) -> tuple[bytes, FileTransfer]:
        self._check_alive()
        name = _workspace_path(path)
        if name not in self.files:
            raise TransferError("no such file", path=name, reason="missing")
        data = self.files[name]
        return data, FileTransfer(name, len(data), hashlib.sha256(data).hexdigest())

    async def put_tar(self, path: str, tar_bytes: bytes, *, expected_sha256: str | None = None,
                      verify: bool = True) -> FileTransfer:
        self._check_alive()
        base = _workspace_path(path)
        with tarfile.open(fileobj=io.BytesIO(tar_bytes)) as archive:
            for member in archive.getmembers():
                if member.name.startswith("/") or ".." in Path(member.name).parts or member.issym():
                    raise UnsafeArchiveError("member outside the workspace", member=member.name)
                if member.isfile():
                    name = str(Path(base) / member.name) if base != "." else str(Path(member.name))
                    self.files[str(Path(name))] = archive.extractfile(member).read()  # type: ignore[union-attr]
        return self._checked(FileTransfer(base, len(tar_bytes), self._stored_sha(tar_bytes)), expected_sha256)

    async def get_tar(self, path: str, *, verify: bool = True) -> tuple[bytes, FileTransfer]:
        self._check_alive()
        base = _workspace_path(path)
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as archive:
            for name in sorted(self.files):
                if base != "." and not name.startswith(base + "/"):
                    continue
                info = tarfile.TarInfo(name if base == "." else name[len(base) + 1:])
                info.size = len(self.files[name])
                archive.addfile(info, io.BytesIO(self.files[name]))
        data = buffer.getvalue()
        return data, FileTransfer(base, len(data), hashlib.sha256(data).hexdigest())

    def _stored_sha(self, data: bytes) -> str:
        # ``corrupt_stores``: the sandbox stores other bytes than it was given.
        return hashlib.sha256(data + (b"!" if self._backend.corrupt_stores else b"")).hexdigest()

    def _check_alive(self) -> None:
        if not self.alive():
            raise SandboxDiedError("sandbox is gone", sandbox_id=self.info.sandbox_id, reason="fake death")


def _workspace_path(path: str) -> str:
    if path.startswith("/") or ".." in Path(path).parts:
        raise WorkspacePathError("path leaves the workspace", path=path)
    return str(Path(path))


class FakeSandboxBackend:
    """Fakes a ``rollmesh.sandbox.SandboxBackend`` (the runtime edge): creates ``FakeSandbox``es.

    ``created`` lists every sandbox made, in order. ``create_failures`` are raised by the next
    creates; with ``create_gate`` set, creates wait for it; with a ``clock``, each create
    advances it by ``create_s`` (a measurable creation latency). ``outcomes`` scripts the next
    execs of any of its sandboxes; with ``exec_gate`` set, execs wait for it (``execs_waiting``
    counts them). ``corrupt_stores`` makes sandboxes report the sha256 of other bytes than they
    were given.
    """

    name = "fake"
    isolated = True

    def __init__(self, outcomes: list[Any] | None = None, *, clock: ManualClock | None = None,
                 create_s: float = 0.0) -> None:
        self.outcomes = list(outcomes or [])
        self.clock = clock
        self.create_s = create_s
        self.created: list[FakeSandbox] = []
        self.create_failures: list[BaseException] = []
        self.create_gate: asyncio.Event | None = None
        self.creates_waiting = 0
        self.exec_gate: asyncio.Event | None = None
        self.execs_waiting = 0
        self.corrupt_stores = False

    async def create(self, sandbox_id: str, limits: SandboxLimits, *, network: bool = False,
                     profile: str = "default") -> FakeSandbox:
        if self.create_gate is not None:
            self.creates_waiting += 1
            try:
                await self.create_gate.wait()
            finally:
                self.creates_waiting -= 1
        if self.create_failures:
            raise self.create_failures.pop(0)
        if self.clock is not None:
            self.clock.advance(self.create_s)
        sandbox = FakeSandbox(self, sandbox_id, limits, network)
        self.created.append(sandbox)
        return sandbox

    def self_test(self) -> None:
        pass

    def live(self) -> list[FakeSandbox]:
        return [sandbox for sandbox in self.created if not sandbox.destroyed]


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
    the next scripted outcome from ``outcomes`` (a ``GenerationResult``, an exception to raise, or
    ``NEVER_ANSWERS``: a call that waits until it is cancelled, as one whose reply was lost between
    actors does; its request id then goes into ``cancelled``).
    Like a real engine it never returns more than ``sampling.max_new_tokens`` tokens: a longer
    scripted result is cut there with finish reason ``"length"``. Running out of outcomes raises
    ``AssertionError`` (the test scripted too few turns).
    """

    NEVER_ANSWERS = object()

    def __init__(self, outcomes: list[GenerationResult | BaseException | object]) -> None:
        self.outcomes = list(outcomes)
        self.calls: list[dict[str, Any]] = []
        self.cancelled: list[str] = []

    async def generate(self, input_ids: list[int], sampling: SamplingParams, *,
                       request_id: str, options: GenerateOptions = DEFAULT_OPTIONS) -> GenerationResult:
        self.calls.append({"input_ids": list(input_ids), "sampling": sampling,
                           "request_id": request_id, "options": options})
        if not self.outcomes:
            raise AssertionError(f"ScriptedEngine: no outcome scripted for call {len(self.calls)}")
        outcome = self.outcomes.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        if outcome is self.NEVER_ANSWERS:
            try:
                await asyncio.Event().wait()  # nothing sets it
            except asyncio.CancelledError:
                self.cancelled.append(request_id)
                raise
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
