"""The HTTP API's request and response bodies: OpenAI completions, SGLang-style /generate, vLLM's
/tokenize and /detokenize, and the weight and cache admin endpoints.

Knows pydantic only (FastAPI validates and documents these). These are the public HTTP API, not
the NATS wire contract, which lives in ``rollmesh.messages``. Requests are strict (no "0.5" for a
float, no true for an int) and ignore unknown fields, since OpenAI clients send many we don't use;
range checks live in ``generation_requests`` so that one place names the limits in its messages.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)


class _Response(BaseModel):
    model_config = ConfigDict(frozen=True)


RoutedExpertsDtype = Literal["compact", "int32"]


class EngineOptionFields(_Request):
    """rollmesh's fields on every generate route (an OpenAI client sends them in ``extra_body``).

    - ``session_id``: turns of one multi-turn conversation share it; the next turn reuses the
      session's KV (its prompt must extend the previous turn's prompt and output). On
      ``/v1/chat/completions`` it also makes the conversation a chat session whose trajectory the
      server keeps token-exact (``chat_sessions``).
    - ``min_weight_version``: the oldest weight version allowed to produce tokens; while the
      engine is older the request fails with 503 ``version_unavailable`` and ``Retry-After``.
    - ``return_routed_experts`` / ``routed_experts_start_len``: MoE models only; the routed
      expert ids of positions ``[start_len, seqlen - 1)`` as SGLang slices them.
    - ``routed_experts_dtype``: "compact" (uint8 up to 256 experts, else uint16) or "int32"
      (SGLang's own encoding, for clients written against SGLang).
    """

    session_id: str | None = None
    min_weight_version: int | None = None
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    routed_experts_dtype: RoutedExpertsDtype = "compact"


class RoutedExperts(_Response):
    """Routed expert ids: base64 of a C-order array of ``routed_experts_shape`` = [rows, MoE
    layers, top_k] in ``routed_experts_dtype`` (little-endian), one row per position from
    ``routed_experts_start_len`` to ``seqlen - 2``. On OpenAI choices this is the ``rollmesh``
    object; /generate puts the same four fields in ``meta_info``."""

    routed_experts: str
    routed_experts_dtype: Literal["uint8", "uint16", "int32"]
    routed_experts_shape: list[int]
    routed_experts_start_len: int


# -- OpenAI /v1/completions -------------------------------------------------------------------


class StreamOptions(_Request):
    """OpenAI's ``stream_options``: ``include_usage`` adds a last chunk with the usage."""

    include_usage: bool = False


class CompletionRequest(EngineOptionFields):
    model: str | None = None  # None: the one served model
    prompt: str
    max_tokens: int | None = 16
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    n: int = 1
    # OpenAI's "how many top alternatives" (0 to 5) with each token's logprob (``openai_logprobs``).
    logprobs: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None


class CompletionLogprobs(_Response):
    """OpenAI's legacy completions logprobs: one entry per generated token."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(_Response):
    index: int
    text: str
    finish_reason: Literal["stop", "length", "abort"]
    logprobs: CompletionLogprobs | None
    # Not OpenAI: the weight version that produced each generated token.
    weight_versions: list[int]
    # Not OpenAI: routed experts, when asked for (``return_routed_experts``).
    rollmesh: RoutedExperts | None = None


class PromptTokensDetails(_Response):
    # Prompt tokens whose KV was reused from the session (``session_id``) instead of computed.
    cached_tokens: int


class CompletionUsage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: CompletionUsage


# -- OpenAI /v1/chat/completions --------------------------------------------------------------


class ToolCallFunction(_Request):
    name: str
    # A JSON string as OpenAI sends it; an object is accepted too (templates differ in which
    # form they render, and ``chat_requests`` hands each template its own).
    arguments: str | dict[str, Any]


class MessageToolCall(_Request):
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Request):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    # None only on an assistant message with tool_calls (the ``openai`` client sends that).
    content: str | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # assistant
    tool_call_id: str | None = None  # tool: the call it answers
    reasoning_content: str | None = None  # assistant: earlier reasoning, for templates that show it


class ChatCompletionRequest(EngineOptionFields):
    model: str | None = None  # None: the one served model
    messages: list[ChatMessage]
    # OpenAI function schemas, checked by rollmesh.chat.ToolSet and passed to the chat template.
    tools: list[dict[str, Any]] | None = None
    # "auto" (the default), "none", "required" (one or more calls) or a named function
    # ({"type": "function", "function": {"name": ...}}); the last two by guided decoding.
    tool_choice: str | dict[str, Any] | None = None
    # OpenAI's: {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema":
    # {"name": ..., "schema": {...}}}; the JSON ones by guided decoding (``tool_choice.py``).
    response_format: dict[str, Any] | None = None
    # OpenAI's: false makes tool_choice "required" exactly one call (default: one or more).
    parallel_tool_calls: bool | None = None
    # The chat template's own extra arguments for this request (e.g. enable_thinking), on top of
    # the model's configured ones (model.chat_template_kwargs).
    chat_template_kwargs: dict[str, Any] | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None  # OpenAI's newer name; wins over max_tokens
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    # OpenAI's: the logprob of each generated token, and how many alternatives with it (0 to 20).
    logprobs: bool = False
    top_logprobs: int | None = None


class ResponseFunction(_Response):
    name: str
    arguments: str  # JSON text, as OpenAI returns it


class ResponseToolCall(_Response):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunction


class AssistantMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None
    # Present (not None) only when the model called tools, as OpenAI does.
    tool_calls: list[ResponseToolCall] | None = None
    # The reasoning of a model with a reasoning parser (vLLM's and SGLang's field).
    reasoning_content: str | None = None


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(_Response):
    """One generated token in OpenAI's chat ``logprobs.content``."""

    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Response):
    content: list[TokenLogprob] | None
    refusal: list[TokenLogprob] | None = None


class ChatChoice(_Response):
    index: int
    message: AssistantMessage
    finish_reason: Literal["stop", "length", "tool_calls", "abort"]
    logprobs: ChatLogprobs | None = None
    # Not OpenAI: the weight version that produced each generated token.
    weight_versions: list[int]
    # Not OpenAI: routed experts, when asked for (``return_routed_experts``).
    rollmesh: RoutedExperts | None = None
    # Not OpenAI: with tool_choice "required" / a named function or a JSON response_format, one
    # flag per generated token, true where the grammar restricted the choice: its logprob is that
    # of the masked distribution, and a trainer should not train on it (loss mask 0).
    constrained: list[bool] | None = None


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


# -- chat sessions (``chat_sessions``) ----------------------------------------------------------


class SessionTokenTrace(_Response):
    """``rollmesh.messages.TokenTrace`` in JSON: one entry per token in four equal-length lists
    (loss mask 1 = generated and trained; version -1 and logprob 0.0 = not generated)."""

    ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    versions: list[int]


class SessionTrajectoryResponse(_Response):
    """``GET /v1/sessions/{id}/trajectory``: a chat session's tokens and what checks them."""

    id: str
    object: Literal["chat.session.trajectory"] = "chat.session.trajectory"
    model: str
    turns: int
    prompt_len: int  # tokens of the first prompt
    # "truncated": the last turn has no end of turn (max_tokens or a stop string); no turn follows.
    finish_reason: Literal["stop", "truncated"]
    token_trace: SessionTokenTrace
    messages: list[dict[str, Any]]  # the conversation in OpenAI form, the last answer included
    # Differences from a whole render of the conversation by kind ("special", "non_assistant",
    # "assistant"; rollmesh.chat.check_trajectory); None when the template would not render it.
    tokenization_mismatches: dict[str, int] | None
    # Each difference in text the model did not generate that no documented rewrite explains.
    tokenization_bugs: list[str]


class SessionDeletedResponse(_Response):
    id: str
    object: Literal["chat.session.deleted"] = "chat.session.deleted"
    deleted: bool = True


# -- vLLM's /tokenize and /detokenize -----------------------------------------------------------


class TokenizeRequest(_Request):
    """vLLM's TokenizeCompletionRequest (``prompt``) and TokenizeChatRequest (``messages``) in one
    body: exactly one of the two. ``add_special_tokens`` defaults as vLLM's: True for a prompt,
    False for messages (a rendered template holds its own)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(_Response):
    prompt: str


# -- SGLang-style /generate -------------------------------------------------------------------


class GenerateSamplingParams(_Request):
    temperature: float | None = None
    top_p: float | None = None
    max_new_tokens: int | None = None  # None: SGLang's default, clipped to the context
    stop: str | list[str] | None = None
    # SGLang's grammars, at most one (guided decoding; docs/guided-decoding.md): a JSON schema, an
    # xgrammar EBNF with a root rule, or an xgrammar structural tag, each as JSON or EBNF text.
    json_schema: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None


class GenerateRequest(EngineOptionFields):
    input_ids: list[int]
    sampling_params: GenerateSamplingParams = Field(default_factory=GenerateSamplingParams)
    return_logprob: bool = False
    stream: bool = False
    # SGLang's request id: echoed as meta_info.id (one made up when absent). Not a session.
    rid: str | None = None


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
    cached_tokens: int = 0
    # With return_routed_experts only; see RoutedExperts.
    routed_experts: str | None = None
    routed_experts_dtype: Literal["uint8", "uint16", "int32"] | None = None
    routed_experts_shape: list[int] | None = None
    routed_experts_start_len: int | None = None
    # Not SGLang's: with a grammar, one flag per output token, true where it restricted the choice.
    constrained: list[bool] | None = None


class GenerateResponse(_Response):
    output_ids: list[int]
    text: str
    meta_info: GenerateMetaInfo


# -- admin: weights and cache ----------------------------------------------------------------


class UpdateWeightsFromDiskRequest(_Request):
    """SGLang's body: ``model_path`` is a file written by ``rollmesh.engine.weights.save_weights``
    (one safetensors file, not a checkpoint directory). ``weight_version`` may be an int or, as
    SGLang sends it, a string of one; absent means one past the newest active version."""

    model_path: str
    weight_version: int | str | None = None


class UpdateWeightsFromDiskResponse(_Response):
    success: bool = True
    message: str
    weight_version: int


class WorkerWeights(_Response):
    name: str
    role: Literal["prefill", "decode"]
    current_version: int
    staged_version: int | None


class WeightVersionsResponse(_Response):
    # The version every worker has reached: min_weight_version up to it is served at once.
    weight_version: int
    workers: list[WorkerWeights]


class FlushCacheResponse(_Response):
    success: bool = True
    message: str
    kv_blocks_freed: int


# -- errors -----------------------------------------------------------------------------------


class ErrorDetail(_Response):
    message: str
    type: str
    code: str | None = None
    param: str | None = None


class ErrorResponse(_Response):
    error: ErrorDetail
