"""Chat sessions for outside agent harnesses: ``/v1/chat/completions`` with a ``session_id`` keeps
that conversation's trajectory token-exact across turns, as the rollout loop keeps a rollout's.

Knows the HTTP shapes, ``chat_requests``, ``rollmesh.chat`` (through ``session_trajectory``: the
same token-exact trajectory a rollout builds) and the session store seam; not Ray, not FastAPI. A client that runs its own agent loop names a session (``extra_body={"session_id": ...}``
with the ``openai`` client) and sends each turn the whole conversation, as OpenAI's API wants:

- The first turn renders its messages with the model's template and tokenizes them once, as any
  chat request. Each later turn's ``messages`` must be the session's messages, the assistant
  message the server returned (as the client echoes it), then new ones (``session_history``);
  only the new messages are rendered and appended, joined by the family's rules (``ChatTrajectory``
  via ``SessionTrajectory``; history is kept as sampled, ``keep_sampled``). The engine's prompt is the trajectory's ids, never a fresh render,
  and the engine's session KV (``GenerateOptions.session_id``: the same id) is reused.
- Every generated id is kept exactly as sampled, with its logprob and weight version (loss mask 1,
  or 0 when it was sampled under a grammar: ``tool_choice`` "required" or a named function); what
  the template writes around it has loss mask 0 (``TokenTrace``).
- ``tools`` and ``chat_template_kwargs`` are fixed by the first turn (a later turn must send the
  same: they shaped the tokens already there); ``tool_choice`` "none" on a later turn only stops
  calls from being read.
- A turn cut by ``max_tokens`` (or a stop string) has no end of turn: the session can hold no more
  turns after it (``TruncatedTurnError``, a 400 ``session_truncated``); its trajectory stays
  readable, ending in the truncated turn.
- A second request on a session while a turn is in flight gets a 409 ``session_busy``; the turn's
  session is taken (leased) for its whole duration, so two turns can never interleave.
- A streamed turn (``stream_turn``) goes out token by token like any chat answer and holds the
  lease while it streams. It is kept when the engine's finished sequence arrives, before the
  last chunk is sent (a lease lost meanwhile is the stream's error event); a stream that fails
  or that the client leaves first (its request is aborted) leaves the session as it was.

``GET /v1/sessions/{id}/trajectory`` answers the tokens as a ``TokenTrace`` (ids, loss mask,
logprobs, versions), the messages in OpenAI form, and the check of the tokens against a whole
render of the conversation (``tokenization_mismatches`` by kind, and the differences in text the
model did not generate, which would be bugs); ``DELETE /v1/sessions/{id}`` forgets a session.
Where sessions live, and their bounds: ``session_store``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from rollmesh.chat import ChatError, TemplateRenderError, TruncatedTurnError
from rollmesh.chat.token_check import special_token_ids
from rollmesh.engine.protocols import GenerateOptions, GenerationResult
from rollmesh.engine.token_stream import TokenDelta
from rollmesh.serve_apps.chat_messages import template_messages
from rollmesh.serve_apps.chat_requests import ChatPrompt, chat_settings, parse_answer, request_chat
from rollmesh.serve_apps.errors import (
    EngineUnavailableError,
    InvalidApiRequestError,
    SessionConflictError,
    SessionNotFoundError,
)
from rollmesh.serve_apps.generate_extensions import MAX_ID_CHARS, generate_options
from rollmesh.serve_apps.generation_requests import ServedModel, check_prompt_length
from rollmesh.serve_apps.http_shapes import (
    ChatCompletionRequest,
    SessionDeletedResponse,
    SessionTokenTrace,
    SessionTrajectoryResponse,
)
from rollmesh.serve_apps.session_history import SessionHistoryError, new_messages
from rollmesh.serve_apps.session_store import PendingTurn, SessionLease, SessionRecord, SessionStoreClient
from rollmesh.serve_apps.session_trajectory import SessionTrajectory

GenerateTurn = Callable[[ChatPrompt, GenerateOptions], Awaitable[GenerationResult]]
Piece = TokenDelta | GenerationResult
# The engine's pieces of one turn, once the first has come (``stream_events.started``).
StreamTurn = Callable[[ChatPrompt, GenerateOptions], Awaitable[AsyncGenerator[Piece, None]]]


@dataclass
class _OpenTurn:
    """A turn between its lease and its end: what it prompts the engine with."""

    request: ChatCompletionRequest
    lease: SessionLease
    trajectory: SessionTrajectory
    prompt: ChatPrompt
    options: GenerateOptions


class ChatSessions:
    """A replica's view of the sessions: its served model and the shared store."""

    def __init__(self, served: ServedModel, store: SessionStoreClient) -> None:
        self.served = served
        self.store = store
        self.special_ids = special_token_ids(served.chat.directory.tokenizer)

    async def turn(self, request: ChatCompletionRequest, generate: GenerateTurn,
                   ) -> tuple[ChatPrompt, GenerationResult]:
        """One turn of ``request.session_id``: its prompt (the trajectory's ids) and what the
        engine generated, kept in the session before this returns."""
        turn = await self._open(request)
        try:
            result = await generate(turn.prompt, turn.options)
        except BaseException:
            await self._release(turn)
            raise
        await self._keep(turn, result)
        return turn.prompt, result

    async def stream_turn(self, request: ChatCompletionRequest, stream: StreamTurn,
                          ) -> tuple[ChatPrompt, AsyncGenerator[Piece, None]]:
        """One turn of ``request.session_id``, streamed: its prompt and the engine's pieces. The
        session stays leased while they are read; the turn is kept when the finished sequence
        arrives, before it is passed on; pieces that end any other way (the engine failed, the
        client left and the pieces were closed) leave the session as it was."""
        turn = await self._open(request)
        try:
            pieces = await stream(turn.prompt, turn.options)
        except BaseException:  # refused before its first token: a plain failed turn
            await self._release(turn)
            raise
        return turn.prompt, self._kept_when_finished(turn, pieces)

    async def _open(self, request: ChatCompletionRequest) -> _OpenTurn:
        """The session leased to this turn, with the turn's prompt (released again if it cannot
        be made)."""
        session_id = request.session_id or ""
        if not 1 <= len(session_id) <= MAX_ID_CHARS:
            raise InvalidApiRequestError(
                f"session_id must be 1 to {MAX_ID_CHARS} characters (got {len(session_id)})",
                code="invalid_value", param="session_id")
        settings = chat_settings(request, self.served)  # a bad request never takes the session
        lease = await self.store.begin(session_id)
        if lease.status == "busy":
            raise SessionConflictError(session_id, "a turn of this session is still in flight; send "
                                       "the next one after its answer")
        if lease.status == "full":
            raise EngineUnavailableError("every chat session this server keeps is in flight "
                                         "(serve.max_sessions); retry later", code="sessions_full",
                                         param="session_id", retry_after_s=1)
        try:
            added = self._added_messages(request, lease.record)
            trajectory = _trajectory(session_id, settings, lease.record, added)
            check_prompt_length(len(trajectory), self.served, param="messages")
            prompt = dataclasses.replace(settings, input_ids=list(trajectory.ids))
            options = generate_options(request, prompt_len=len(prompt.input_ids), served=self.served)
        except BaseException:
            await self.store.release(session_id, lease.lease_id)
            raise
        return _OpenTurn(request, lease, trajectory, prompt, options)

    async def _keep(self, turn: _OpenTurn, result: GenerationResult) -> None:
        """The generated turn stored and the session freed (a lease lost meanwhile: 409)."""
        session_id = turn.request.session_id or ""
        try:
            record = self._record(turn.request, turn.lease.record, turn.trajectory, turn.prompt, result)
        except BaseException:
            await self._release(turn)
            raise
        if not await self.store.commit(session_id, turn.lease.lease_id, record):
            raise SessionConflictError(session_id, "it was deleted or expired while this turn ran; "
                                       "the turn was not kept")

    async def _release(self, turn: _OpenTurn) -> None:
        """The session freed unchanged. Shielded: a client that leaves cancels the task that runs
        this, and the lease must still go (else the session stays busy until its TTL)."""
        await asyncio.shield(self.store.release(turn.request.session_id or "", turn.lease.lease_id))

    async def _kept_when_finished(self, turn: _OpenTurn, pieces: AsyncGenerator[Piece, None],
                                  ) -> AsyncGenerator[Piece, None]:
        kept = False
        try:
            async for piece in pieces:
                if isinstance(piece, GenerationResult):
                    kept = True  # committed or lost: either way no longer this turn's to release
                    await self._keep(turn, piece)
                yield piece
        finally:
            try:
                await pieces.aclose()  # first: a turn left early is aborted before the lease goes
            finally:
                if not kept:
                    await self._release(turn)

    async def trajectory(self, session_id: str) -> SessionTrajectoryResponse:
        """The session's tokens, messages and token check (module docstring)."""
        record = await self.store.get(session_id)
        if record is None:
            raise SessionNotFoundError(session_id, "never made, expired or deleted")
        chat = request_chat(self.served.chat, record.template_kwargs,
                            with_tools=record.render_tools is not None)
        trajectory = SessionTrajectory.resume(chat, record.template_messages, record.trace,
                                              tools=record.render_tools, constrained=record.constrained)
        add_generated_turn(trajectory, record.pending)
        try:
            mismatches, bugs = trajectory.check_tokens(self.special_ids)
        except ChatError as exc:  # the template will not render the conversation whole
            mismatches, bugs = None, [f"the conversation could not be rendered whole: {exc}"]
        trace = trajectory.trace()
        ended = bool(record.pending.ids) and record.pending.ids[-1] in self.served.chat.end_of_turn_ids
        return SessionTrajectoryResponse(
            id=session_id, model=self.served.name, turns=record.turns, prompt_len=record.prompt_len,
            finish_reason="stop" if ended else "truncated",
            token_trace=SessionTokenTrace(ids=trace.ids, loss_mask=trace.loss_mask,
                                          logprobs=trace.logprobs, versions=trace.versions),
            messages=record.messages, tokenization_mismatches=mismatches, tokenization_bugs=bugs)

    async def delete(self, session_id: str) -> SessionDeletedResponse:
        if not await self.store.delete(session_id):
            raise SessionNotFoundError(session_id, "never made, expired or deleted")
        return SessionDeletedResponse(id=session_id)

    def _added_messages(self, request: ChatCompletionRequest,
                        held: SessionRecord | None) -> list[dict[str, Any]]:
        """The request's messages that are new to the session, in the form the template takes
        (a new session's: all of them); checked to extend the held conversation."""
        rendered = template_messages(request.messages, self.served.chat)
        if held is None:
            return rendered
        if _session_settings(request) != held.settings:
            raise InvalidApiRequestError(
                "tools and chat_template_kwargs must be those of the session's first turn: they "
                "shaped the tokens it holds", code="session_settings_mismatch", param="tools")
        try:
            new_messages(held.messages, request.messages)
        except SessionHistoryError as exc:
            raise InvalidApiRequestError(
                f"the messages do not extend chat session {request.session_id!r}: {exc}",
                code="session_history_mismatch", param=f"messages.{exc.index}") from exc
        return rendered[len(held.messages):]

    def _record(self, request: ChatCompletionRequest, held: SessionRecord | None,
                trajectory: SessionTrajectory, prompt: ChatPrompt, result: GenerationResult) -> SessionRecord:
        """The session after this turn: the generated turn kept apart until the next one
        (``PendingTurn``), and the conversation as the client now holds it."""
        parsed = parse_answer(result, prompt)
        calls = [{"id": call.id, "type": "function", "function": {
            "name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)}}
            for call in parsed.tool_calls]
        answer: dict[str, Any] = {"role": "assistant", "content": parsed.content or (None if calls else "")}
        if calls:
            answer["tool_calls"] = calls
        if parsed.reasoning is not None:
            answer["reasoning_content"] = parsed.reasoning
        return SessionRecord(
            session_id=request.session_id or "", settings=_session_settings(request),
            render_tools=held.render_tools if held else prompt.tools,
            template_kwargs=dict(request.chat_template_kwargs or {}),
            # The server's own record of the history (the client's echo only matched it), the new ones.
            messages=[*(held.messages if held else []),
                      *(message.model_dump(exclude_none=True)
                        for message in request.messages[len(held.messages) if held else 0:]), answer],
            template_messages=trajectory.messages, trace=trajectory.trace(for_training=False),
            constrained=list(trajectory.constrained),
            pending=PendingTurn(list(result.token_ids), list(result.logprobs), list(result.versions),
                                prompt.chat.assistant_message(parsed), list(result.constrained)),
            prompt_len=held.prompt_len if held else len(trajectory), turns=(held.turns if held else 0) + 1)


def add_generated_turn(trajectory: SessionTrajectory, turn: PendingTurn) -> None:
    """The one place a session's generated turn joins its trajectory, with the engine's
    per-token grammar flags (``GenerationResult.constrained``: such tokens train with mask 0)."""
    trajectory.add_generated(turn.ids, turn.logprobs, turn.versions, turn.message, turn.constrained)


def _trajectory(session_id: str, settings: ChatPrompt, held: SessionRecord | None,
                added: list[dict[str, Any]]) -> SessionTrajectory:
    """The session's trajectory with this turn's prompt: a new session's first prompt rendered and
    tokenized once, or the held tokens with the last answer and the new messages appended."""
    try:
        if held is None:
            return SessionTrajectory.start(settings.chat, added, tools=settings.tools)
        trajectory = SessionTrajectory.resume(settings.chat, held.template_messages, held.trace,
                                              tools=held.render_tools, constrained=held.constrained)
        add_generated_turn(trajectory, held.pending)
        trajectory.append(added)
        return trajectory
    except TruncatedTurnError as exc:
        raise InvalidApiRequestError(
            f"chat session {session_id!r} ended in a turn cut by max_tokens (or a stop string), "
            "with no end of turn: no turn can follow it; start a new session",
            code="session_truncated", param="session_id") from exc
    except TemplateRenderError as exc:
        said = exc.template_message or exc.reason
        raise InvalidApiRequestError(f"the model's chat template refused the messages: {said}",
                                     code="invalid_messages", param="messages") from exc
    except ChatError as exc:
        raise InvalidApiRequestError(f"the messages cannot be appended to the session: {exc}",
                                     code="invalid_messages", param="messages") from exc


def _session_settings(request: ChatCompletionRequest) -> str:
    return json.dumps({"tools": request.tools or None,
                       "chat_template_kwargs": request.chat_template_kwargs or {}}, sort_keys=True)
