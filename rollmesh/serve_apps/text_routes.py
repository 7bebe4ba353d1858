"""The text routes' handling: OpenAI ``/v1/completions`` and ``/v1/chat/completions`` (answered
whole, or as Server-Sent Events with ``stream``) and SGLang-style ``/generate``, from a checked
body to the answer. A chat request with a ``session_id`` is a chat session's turn, not handled
here (``session_routes``).

Knows the HTTP shapes, the request readers (``chat_requests``, ``generation_requests``,
``generate_extensions``, ``tool_choice``), ``stream_events`` and ``RouterCalls``; of FastAPI only
the StreamingResponse a stream is answered with; not Ray (``router_calls`` maps its errors), not
the API key (the route checks it first).
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any

from fastapi.responses import StreamingResponse

from rollmesh.serve_apps.chat_requests import chat_inputs, chat_response
from rollmesh.serve_apps.generate_extensions import generate_options
from rollmesh.serve_apps.generation_requests import (
    ServedModel,
    completion_inputs,
    completion_response,
    generate_inputs,
    generate_request_id,
    generate_response,
)
from rollmesh.serve_apps.http_shapes import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    GenerateRequest,
    GenerateResponse,
)
from rollmesh.serve_apps.router_calls import (
    COMPLETION_PARAMS,
    GENERATE_PARAMS,
    RouterCalls,
    chat_params,
)
from rollmesh.serve_apps.stream_events import chat_events, completion_events
from rollmesh.serve_apps.tool_choice import generate_grammar


def event_stream(events: Any) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


async def answer_completion(
    body: CompletionRequest, served: ServedModel, calls: RouterCalls
) -> CompletionResponse | StreamingResponse:
    input_ids, sampling = completion_inputs(body, served)
    options = dataclasses.replace(
        generate_options(body, prompt_len=len(input_ids), served=served),
        top_logprobs=body.logprobs or 0)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    if body.stream:
        pieces = await calls.stream(input_ids, sampling, request_id, options, COMPLETION_PARAMS)
        return event_stream(completion_events(
            pieces, request_id=request_id, created=int(time.time()), served=served,
            sampling=sampling, routed_experts_dtype=body.routed_experts_dtype,
            with_logprobs=body.logprobs is not None,
            include_usage=bool(body.stream_options and body.stream_options.include_usage)))
    result = await calls.generate(input_ids, sampling, request_id, options, COMPLETION_PARAMS)
    return completion_response(
        result, request_id=request_id, created=int(time.time()), served=served,
        sampling=sampling, with_logprobs=body.logprobs is not None,
        routed_experts_dtype=body.routed_experts_dtype,
    )


async def answer_chat(
    body: ChatCompletionRequest, served: ServedModel, calls: RouterCalls
) -> ChatCompletionResponse | StreamingResponse:
    prompt = chat_inputs(body, served)
    options = dataclasses.replace(
        generate_options(body, prompt_len=len(prompt.input_ids), served=served),
        top_logprobs=prompt.top_logprobs, grammar=prompt.grammar)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    if body.stream:
        pieces = await calls.stream(prompt.input_ids, prompt.sampling, request_id,
                                    options, chat_params(body), operation="chat")
        return event_stream(chat_events(
            pieces, prompt, request_id=request_id, created=int(time.time()),
            served=served, routed_experts_dtype=body.routed_experts_dtype,
            include_usage=bool(body.stream_options and body.stream_options.include_usage)))
    result = await calls.generate(prompt.input_ids, prompt.sampling, request_id, options,
                                  chat_params(body), operation="chat")
    return chat_response(
        result, prompt, request_id=request_id, created=int(time.time()), served=served,
        routed_experts_dtype=body.routed_experts_dtype,
    )


async def answer_generate(
    body: GenerateRequest, served: ServedModel, calls: RouterCalls
) -> GenerateResponse:
    input_ids, sampling = generate_inputs(body, served)
    options = dataclasses.replace(
        generate_options(body, prompt_len=len(input_ids), served=served),
        grammar=generate_grammar(body.sampling_params))
    request_id = generate_request_id(body)
    result = await calls.generate(input_ids, sampling, request_id, options, GENERATE_PARAMS)
    return generate_response(
        result, request_id=request_id, served=served, sampling=sampling,
        return_logprob=body.return_logprob, routed_experts_dtype=body.routed_experts_dtype,
    )
