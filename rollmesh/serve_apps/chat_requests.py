"""OpenAI chat completions over the byte tokenizer, and the Server-Sent Events of streamed answers.

Knows the HTTP shapes, the byte tokenizer and ``generation_requests``' checks; not Ray, not
FastAPI. The chat template (the tiny model has none of its own) is plain text, BOS first:

    <bos>system: You are terse.\\n
    user: Hi!\\n
    assistant:<space>

one ``"{role}: {content}\\n"`` line per message, then ``"assistant: "`` for the model to continue.
No stop string is added: pass ``stop=["\\n"]`` to end the reply at the end of its line.

Streaming (``"stream": true``) sends the finished text as chunks after generation, because the
engine returns whole sequences today; token-by-token streaming from the decode loop comes later.
The events are OpenAI's: ``data: {chunk}\\n\\n`` per chunk, then ``data: [DONE]\\n\\n``. Routed
experts, when asked for, ride on the last chunk's choice as its ``rollmesh`` object.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

from rollmesh.engine.protocols import GenerationResult
from rollmesh.engine.tokenizer import ByteTokenizer
from rollmesh.messages.base import SamplingParams
from rollmesh.serve_apps.errors import InvalidApiRequestError
from rollmesh.serve_apps.generate_extensions import encode_routed_experts
from rollmesh.serve_apps.generation_requests import (
    ServedModel,
    check_max_tokens,
    check_model,
    check_prompt_length,
    openai_finish_reason,
    openai_sampling_params,
    openai_text,
    openai_usage,
)
from rollmesh.serve_apps.http_shapes import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    RoutedExpertsDtype,
)

ASSISTANT_PREFIX = "assistant: "
# Characters per streamed chunk: small enough that a client sees text arrive in pieces.
STREAM_CHUNK_CHARS = 4


def render_chat(messages: list[ChatMessage]) -> str:
    """The prompt text of the chat template (the module docstring shows it); BOS is added when
    encoding."""
    return "".join(f"{m.role}: {m.content}\n" for m in messages) + ASSISTANT_PREFIX


def chat_inputs(
    request: ChatCompletionRequest, served: ServedModel
) -> tuple[list[int], SamplingParams]:
    """The templated prompt's token ids (BOS first) and sampling params."""
    check_model(request.model, served)
    if not request.messages:
        raise InvalidApiRequestError("messages is empty", code="invalid_value", param="messages")
    if request.n != 1:
        raise InvalidApiRequestError(
            f"n must be 1 (got {request.n}): one choice per request is supported",
            code="unsupported_value", param="n",
        )
    param = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
    max_tokens = request.max_completion_tokens or request.max_tokens
    if max_tokens is None:  # OpenAI's default is "what fits"; the tiny context decides
        max_tokens = served.max_seq_len
    check_max_tokens(max_tokens, served, param=param)
    input_ids = ByteTokenizer(served.vocab_size).encode(render_chat(request.messages), bos=True)
    check_prompt_length(len(input_ids), served, param="messages")
    sampling = openai_sampling_params(
        temperature=request.temperature, top_p=request.top_p, max_new_tokens=max_tokens,
        stop=request.stop, names={"max_new_tokens": param},
    )
    return input_ids, sampling


def chat_response(
    result: GenerationResult,
    *,
    request_id: str,
    created: int,
    served: ServedModel,
    sampling: SamplingParams,
    routed_experts_dtype: RoutedExpertsDtype = "compact",
) -> ChatCompletionResponse:
    return ChatCompletionResponse(
        id=request_id,
        created=created,
        model=served.name,
        choices=[
            ChatChoice(
                index=0,
                message=AssistantMessage(content=openai_text(result, served, sampling)),
                finish_reason=openai_finish_reason(result),
                weight_versions=list(result.versions),
                rollmesh=encode_routed_experts(result, routed_experts_dtype),
            )
        ],
        usage=openai_usage(result),
    )


# -- Server-Sent Events -----------------------------------------------------------------------


def completion_stream_events(
    result: GenerationResult, *, request_id: str, created: int, served: ServedModel,
    sampling: SamplingParams, routed_experts_dtype: RoutedExpertsDtype = "compact",
) -> Iterator[str]:
    """``text_completion`` chunks of the finished text, the last with the finish reason."""
    def chunk(text: str, finish_reason: str | None, **extension: object) -> dict:
        return {"id": request_id, "object": "text_completion", "created": created,
                "model": served.name, "choices": [
                    {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
                     **extension}]}

    for piece in _pieces(openai_text(result, served, sampling)):
        yield _event(chunk(piece, None))
    yield _event(chunk("", openai_finish_reason(result),
                       **_extension(result, routed_experts_dtype)))
    yield _DONE


def chat_stream_events(
    result: GenerationResult, *, request_id: str, created: int, served: ServedModel,
    sampling: SamplingParams, routed_experts_dtype: RoutedExpertsDtype = "compact",
) -> Iterator[str]:
    """``chat.completion.chunk`` deltas: the role first, then the text, then the finish reason."""
    def chunk(delta: dict, finish_reason: str | None, **extension: object) -> dict:
        return {"id": request_id, "object": "chat.completion.chunk", "created": created,
                "model": served.name, "choices": [
                    {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason,
                     **extension}]}

    yield _event(chunk({"role": "assistant", "content": ""}, None))
    for piece in _pieces(openai_text(result, served, sampling)):
        yield _event(chunk({"content": piece}, None))
    yield _event(chunk({}, openai_finish_reason(result),
                       **_extension(result, routed_experts_dtype)))
    yield _DONE


_DONE = "data: [DONE]\n\n"


def _extension(result: GenerationResult, routed_experts_dtype: RoutedExpertsDtype) -> dict:
    routed = encode_routed_experts(result, routed_experts_dtype)
    return {} if routed is None else {"rollmesh": routed.model_dump()}


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def _pieces(text: str) -> Iterator[str]:
    for start in range(0, len(text), STREAM_CHUNK_CHARS):
        yield text[start:start + STREAM_CHUNK_CHARS]
