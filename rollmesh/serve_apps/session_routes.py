"""The chat-session routes' handling: a turn of ``/v1/chat/completions`` with a ``session_id``
or of ``POST /v1/sessions/{id}/chat/completions`` (its session named by the path), answered whole
once kept or streamed as it is sampled (``ChatSessions``: what a turn keeps, and when).

Knows the HTTP shapes, ``ChatSessions``, ``RouterCalls`` and the chat answer writers
(``chat_requests``, ``stream_events``); of FastAPI only the StreamingResponse a stream is answered
with; not Ray, not the API key (the route checks it first), not where sessions are stored.
"""

from __future__ import annotations

import dataclasses
import time
import uuid

from fastapi.responses import StreamingResponse

from rollmesh.engine.protocols import GenerateOptions, GenerationResult
from rollmesh.serve_apps.chat_requests import ChatPrompt, chat_response
from rollmesh.serve_apps.chat_sessions import ChatSessions
from rollmesh.serve_apps.errors import InvalidApiRequestError
from rollmesh.serve_apps.generation_requests import ServedModel
from rollmesh.serve_apps.http_shapes import ChatCompletionRequest, ChatCompletionResponse
from rollmesh.serve_apps.router_calls import RouterCalls, chat_params
from rollmesh.serve_apps.stream_events import chat_events
from rollmesh.serve_apps.text_routes import event_stream


def path_session_request(session_id: str, body: ChatCompletionRequest) -> ChatCompletionRequest:
    """The body of a turn whose session is named by the path; a different ``session_id`` in the
    body is a 400."""
    if body.session_id not in (None, session_id):
        raise InvalidApiRequestError("session_id differs from the session in the path",
                                     code="invalid_value", param="session_id")
    return body.model_copy(update={"session_id": session_id})


async def answer_session_turn(
    body: ChatCompletionRequest, served: ServedModel, calls: RouterCalls, sessions: ChatSessions
) -> ChatCompletionResponse | StreamingResponse:
    """A chat session's turn (``chat_sessions``): kept before it is answered, or, streamed,
    sent token by token and kept when the engine finishes it."""
    request_id = f"chatcmpl-{uuid.uuid4().hex}"

    def chat_options(prompt: ChatPrompt, options: GenerateOptions) -> GenerateOptions:
        return dataclasses.replace(options, top_logprobs=prompt.top_logprobs,
                                   grammar=prompt.grammar)

    if body.stream:
        async def stream(prompt: ChatPrompt, options: GenerateOptions):
            return await calls.stream(prompt.input_ids, prompt.sampling, request_id,
                                      chat_options(prompt, options), chat_params(body),
                                      operation="chat")

        prompt, pieces = await sessions.stream_turn(body, stream)
        return event_stream(chat_events(
            pieces, prompt, request_id=request_id, created=int(time.time()),
            served=served, routed_experts_dtype=body.routed_experts_dtype,
            include_usage=bool(body.stream_options and body.stream_options.include_usage)))

    async def generate(prompt: ChatPrompt, options: GenerateOptions) -> GenerationResult:
        return await calls.generate(prompt.input_ids, prompt.sampling, request_id,
                                    chat_options(prompt, options), chat_params(body),
                                    operation="chat")

    prompt, result = await sessions.turn(body, generate)
    return chat_response(result, prompt, request_id=request_id, created=int(time.time()),
                         served=served, routed_experts_dtype=body.routed_experts_dtype)
