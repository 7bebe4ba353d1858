"""The HTTP API's request and response bodies: OpenAI completions and SGLang-style /generate.

Knows pydantic only (FastAPI validates and documents these). These are the public HTTP API, not
the NATS wire contract, which lives in ``rollmesh.messages``. Requests are strict (no "0.5" for a
float, no true for an int) and ignore unknown fields, since OpenAI clients send many we don't use;
range checks live in ``generation_requests`` so that one place names the limits in its messages.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)


class _Response(BaseModel):
    model_config = ConfigDict(frozen=True)


# -- OpenAI /v1/completions -------------------------------------------------------------------


class CompletionRequest(_Request):
    model: str | None = None  # None: the one served model
    prompt: str
    max_tokens: int | None = 16
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    n: int = 1
    # OpenAI's "how many top alternatives"; we return the sampled token's logprob only.
    logprobs: int | None = None
    stream: bool = False


class CompletionLogprobs(_Response):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: None = None


class CompletionChoice(_Response):
    index: int
    text: str
    finish_reason: Literal["stop", "length", "abort"]
    logprobs: CompletionLogprobs | None
    # Not OpenAI: the weight version that produced each generated token.
    weight_versions: list[int]


class CompletionUsage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: CompletionUsage


# -- OpenAI /v1/chat/completions --------------------------------------------------------------


class ChatMessage(_Request):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str


class ChatCompletionRequest(_Request):
    model: str | None = None  # None: the one served model
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None  # OpenAI's newer name; wins over max_tokens
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False


class AssistantMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(_Response):
    index: int
    message: AssistantMessage
    finish_reason: Literal["stop", "length", "abort"]
    logprobs: None = None
    # Not OpenAI: the weight version that produced each generated token.
    weight_versions: list[int]


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: CompletionUsage


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "rollmesh"


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# -- SGLang-style /generate -------------------------------------------------------------------


class GenerateSamplingParams(_Request):
    temperature: float | None = None
    top_p: float | None = None
    max_new_tokens: int | None = None  # None: SGLang's default, clipped to the context
    stop: str | list[str] | None = None


class GenerateRequest(_Request):
    input_ids: list[int]
    sampling_params: GenerateSamplingParams = Field(default_factory=GenerateSamplingParams)
    return_logprob: bool = False
    stream: bool = False


class GenerateFinishReason(_Response):
    type: Literal["stop", "length", "abort"]
    # SGLang's fields: the EOS id or stop string that matched, or the length reached.
    matched: int | str | None = None
    length: int | None = None


class GenerateMetaInfo(_Response):
    id: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: GenerateFinishReason
    # [logprob, token_id, token_text]; SGLang puts text third when asked, we never do.
    output_token_logprobs: list[tuple[float | None, int, None]] | None = None
    # SGLang's label is the server's version at emission time; ours is the last token's.
    weight_version: int | None
    weight_versions: list[int]


class GenerateResponse(_Response):
    output_ids: list[int]
    text: str
    meta_info: GenerateMetaInfo


# -- errors -----------------------------------------------------------------------------------


class ErrorDetail(_Response):
    message: str
    type: str
    code: str | None = None
    param: str | None = None


class ErrorResponse(_Response):
    error: ErrorDetail
