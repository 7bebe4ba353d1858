"""The Server-Sent Events of streamed OpenAI answers, written as the decode loop's tokens arrive.

Knows the HTTP shapes, the chat and completion readers (``chat_requests``, ``generation_requests``)
and ``stream_text``; not Ray, not FastAPI. Input: the engine's pieces in order
(``rollmesh.engine.token_stream``: ``TokenDelta``s, then the whole ``GenerationResult``), from
``InferenceRouter.generate_stream``. Output: OpenAI's events, ``data: {chunk}\\n\\n`` each, then
``data: [DONE]\\n\\n``.

- Chat: the role first; then per piece a delta with the ``reasoning_content`` and ``content`` the
  piece settled (``stream_text.ChatDeltas``: call markup is held back, never sent as content) and
  each tool call once it is complete, in OpenAI's ``delta.tool_calls`` (whole, with its index); the
  last chunk has the finish reason ("tool_calls" when the turn called tools), routed experts,
  when asked for, as its choice's ``rollmesh`` object, and with a grammar (``tool_choice``
  "required" / named, ``response_format``) the choice's ``constrained`` flags, one per token.
- Completions: the text per piece, held back where a stop string may be starting.
- ``logprobs`` ride on the chunk of the piece whose tokens they are (so a chunk may carry logprobs
  and an empty delta: text and tokens do not line up one to one).
- ``stream_options.include_usage``: one more chunk before ``[DONE]`` with empty ``choices`` and
  the usage, as OpenAI sends it.
- An error after the stream has started (a worker died) is one ``data: {"error": {...}}`` event
  in OpenAI's error shape, then ``[DONE]`` (the status line was already sent).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import structlog

from rollmesh.engine.protocols import GenerationResult
from rollmesh.engine.token_stream import TokenDelta
from rollmesh.messages.base import SamplingParams
from rollmesh.serve_apps.chat_requests import ChatPrompt, parse_answer, response_call
from rollmesh.serve_apps.errors import ApiError
from rollmesh.serve_apps.generate_extensions import encode_routed_experts
from rollmesh.serve_apps.generation_requests import (
    ServedModel,
    openai_finish_reason,
    openai_text,
    openai_usage,
)
from rollmesh.serve_apps.http_shapes import RoutedExpertsDtype
from rollmesh.serve_apps.openai_logprobs import chat_logprobs, completion_logprobs
from rollmesh.serve_apps.stream_text import ChatDelta, ChatDeltas, CompletionDeltas

Piece = TokenDelta | GenerationResult
DONE = "data: [DONE]\n\n"

_log = structlog.get_logger("rollmesh.serve")


async def whole(result: GenerationResult) -> AsyncIterator[Piece]:
    """A finished result as a stream of one piece and the result (an engine that cannot stream)."""
    yield TokenDelta(result.request_id, 0, list(result.token_ids), list(result.logprobs),
                     list(result.versions), result.top_logprobs)
    yield result


async def chat_events(
    pieces: AsyncIterator[Piece], prompt: ChatPrompt, *, request_id: str, created: int,
    served: ServedModel, routed_experts_dtype: RoutedExpertsDtype = "compact",
    include_usage: bool = False,
) -> AsyncIterator[str]:
    """``chat.completion.chunk`` events of ``pieces``."""
    def chunk(delta: dict, finish_reason: str | None = None, logprobs: dict | None = None,
              **extension: object) -> str:
        return _event({"id": request_id, "object": "chat.completion.chunk", "created": created,
                       "model": served.name, "choices": [
                           {"index": 0, "delta": delta, "logprobs": logprobs,
                            "finish_reason": finish_reason, **extension}]})

    deltas = ChatDeltas(prompt)
    try:
        yield chunk({"role": "assistant", "content": ""})
        async for piece in pieces:
            if isinstance(piece, GenerationResult):
                result = piece
                break
            delta = deltas.push(piece.token_ids)
            logprobs = chat_logprobs(piece, prompt.chat).model_dump() if prompt.with_logprobs else None
            if delta or logprobs is not None:
                yield chunk(_delta_fields(delta, first_call=deltas.sent_calls - len(delta.tool_calls)),
                            logprobs=logprobs)
        else:
            raise ApiError("the engine's stream ended without a result", code="engine_error")
    except ApiError as error:
        yield _event(error.to_response().model_dump())
        yield DONE
        return
    finally:
        # Events closed early (the client left) close their pieces now, not when collected: that
        # aborts the request, and a chat session's pieces free the session (chat_sessions).
        await _close(pieces)
    final = parse_answer(result, prompt)
    rest = deltas.finish(final)
    if final.content != deltas.sent_content or (final.reasoning or "") != deltas.sent_reasoning:
        # A parser re-read an earlier part differently at the end: what was sent stands.
        _log.warning("stream_text_diverged", request_id=request_id)
    if rest:
        yield chunk(_delta_fields(rest, first_call=deltas.sent_calls - len(rest.tool_calls)))
    finish_reason = "tool_calls" if final.tool_calls else openai_finish_reason(result)
    # The grammar's per-token flags (docs/guided-decoding.md), whole, beside the finish reason.
    flags = {"constrained": list(result.constrained)} if prompt.grammar is not None else {}
    yield chunk({}, finish_reason, **_extension(result, routed_experts_dtype), **flags)
    if include_usage:
        yield _usage_event(result, request_id=request_id, created=created, served=served,
                           kind="chat.completion.chunk")
    yield DONE


async def completion_events(
    pieces: AsyncIterator[Piece], *, request_id: str, created: int, served: ServedModel,
    sampling: SamplingParams, routed_experts_dtype: RoutedExpertsDtype = "compact",
    with_logprobs: bool = False, include_usage: bool = False,
) -> AsyncIterator[str]:
    """``text_completion`` events of ``pieces``."""
    def chunk(text: str, finish_reason: str | None = None, logprobs: dict | None = None,
              **extension: object) -> str:
        return _event({"id": request_id, "object": "text_completion", "created": created,
                       "model": served.name, "choices": [
                           {"index": 0, "text": text, "logprobs": logprobs,
                            "finish_reason": finish_reason, **extension}]})

    deltas = CompletionDeltas(served.chat, sampling.stop)
    offset = 0  # text_offset of the next token (OpenAI's: the tokens' text lengths summed)
    try:
        async for piece in pieces:
            if isinstance(piece, GenerationResult):
                result = piece
                break
            text = deltas.push(piece.token_ids)
            logprobs = None
            if with_logprobs:
                shaped = completion_logprobs(piece, served.chat, text_offset=offset)
                offset += sum(len(token) for token in shaped.tokens)
                logprobs = shaped.model_dump()
            if text or logprobs is not None:
                yield chunk(text, logprobs=logprobs)
        else:
            raise ApiError("the engine's stream ended without a result", code="engine_error")
    except ApiError as error:
        yield _event(error.to_response().model_dump())
        yield DONE
        return
    final_text = openai_text(result, served, sampling)
    rest = deltas.finish(final_text)
    if deltas.sent != final_text:  # the whole decode differs from the pieces': what was sent stands
        _log.warning("stream_text_diverged", request_id=request_id)
    yield chunk(rest, openai_finish_reason(result), **_extension(result, routed_experts_dtype))
    if include_usage:
        yield _usage_event(result, request_id=request_id, created=created, served=served,
                           kind="text_completion")
    yield DONE


def _delta_fields(delta: ChatDelta, *, first_call: int) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    if delta.reasoning:
        fields["reasoning_content"] = delta.reasoning
    if delta.content:
        fields["content"] = delta.content
    if delta.tool_calls:
        fields["tool_calls"] = [{"index": first_call + offset, **response_call(call).model_dump()}
                                for offset, call in enumerate(delta.tool_calls)]
    return fields


def _usage_event(result: GenerationResult, *, request_id: str, created: int,
                 served: ServedModel, kind: str) -> str:
    return _event({"id": request_id, "object": kind, "created": created, "model": served.name,
                   "choices": [], "usage": openai_usage(result).model_dump()})


def _extension(result: GenerationResult, routed_experts_dtype: RoutedExpertsDtype) -> dict:
    routed = encode_routed_experts(result, routed_experts_dtype)
    return {} if routed is None else {"rollmesh": routed.model_dump()}


async def _close(pieces: AsyncIterator[Piece]) -> None:
    close = getattr(pieces, "aclose", None)  # an async generator's; a plain iterator has none
    if close is not None:
        await close()


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


async def started(
    pieces: AsyncIterator[Piece], error_of: Callable[[BaseException], ApiError],
) -> AsyncIterator[Piece]:
    """``pieces`` once its first piece has come: what the engine refuses before generating
    (bad input, no such weight version) is raised here as ``error_of`` maps it, so it is answered
    with its own status instead of a 200 stream; a later error reaches ``chat_events`` /
    ``completion_events`` as an ApiError."""
    try:
        first = await anext(pieces)
    except StopAsyncIteration:
        raise ApiError("the engine's stream ended without a result", code="engine_error") from None
    except ApiError:
        await pieces.aclose()
        raise
    except Exception as exc:  # noqa: BLE001 - mapped, as the non-streamed route maps it
        await pieces.aclose()
        raise error_of(exc) from exc
    return _relay(first, pieces, error_of)


async def _relay(first: Piece, pieces: AsyncIterator[Piece],
                 error_of: Callable[[BaseException], ApiError]) -> AsyncIterator[Piece]:
    try:
        yield first
        async for piece in pieces:
            yield piece
    except ApiError:
        raise
    except Exception as exc:  # noqa: BLE001 - an error event, not a broken connection
        raise error_of(exc) from exc
    finally:
        await pieces.aclose()  # early (the client went away): aborts the request
